"""The llmc command line: commands, JSON output, errors and exit codes."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

from click.testing import CliRunner

from conftest import CHUNK, write_manifest

from llmc.cli import cli


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_compile_run_inspect(model_dirs, tmp_path):
    out = tmp_path / "bundle"
    r = invoke("compile", model_dirs("llama"), "--target", "cpu", "-o", out, "--chunk", CHUNK, "--max-context", 48,
               "--time-passes", "--dump-ir", tmp_path / "ir")
    assert r.exit_code == 0, r.output
    assert "wrote" in r.output and "] emit" in r.output and "chunk_static_graphs" in r.output
    assert re.search(r"peak RSS [1-9]\d* MB", r.output)
    assert (tmp_path / "ir" / "04-chunk_static_graphs.ir").is_file()

    r = invoke("run", out, "--prompt", "the quick brown fox", "--max-new-tokens", 5, "--no-eos", "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert len(res["token_ids"]) == 5 and res["finish_reason"] == "length"
    assert set(res["timings"]) >= {"ttft_s", "prefill_tok_s", "decode_tok_s", "peak_rss_mb"}

    r = invoke("run", out, "--prompt", "the quick brown fox", "--max-new-tokens", 5, "--no-eos")
    assert r.exit_code == 0 and "prefill" in r.output

    r = invoke("inspect", out)
    assert r.exit_code == 0 and "block00" in r.output and "head" in r.output and "stored once" in r.output
    r = invoke("inspect", out, "--json")
    assert json.loads(r.output)["chunk"] == CHUNK


def test_custom_pipeline_and_bad_pipeline(model_dirs, tmp_path):
    r = invoke("compile", model_dirs("llama"), "-o", tmp_path / "b", "--chunk", CHUNK, "--max-context", 32,
               "--pipeline", "select_logit_rows,chunk_static_graphs", "--quiet")
    assert r.exit_code == 0, r.output
    r = invoke("compile", model_dirs("llama"), "-o", tmp_path / "c", "--pipeline", "dce,frobnicate")
    assert r.exit_code == 2 and "unknown pass 'frobnicate'" in r.output and "hint:" in r.output
    assert not (tmp_path / "c").exists()


def test_sampling_flags(bundles):
    b = bundles("llama")
    a = json.loads(invoke("run", b, "--prompt", "the cat", "--temperature", "0.8", "--seed", 3, "--no-eos", "--json").output)
    c = json.loads(invoke("run", b, "--prompt", "the cat", "--temperature", "0.8", "--seed", 3, "--no-eos", "--json").output)
    assert a["token_ids"] == c["token_ids"]
    r = invoke("run", b, "--prompt", "the cat", "--greedy", "--temperature", "0.8", "--top-p", "0.5")
    assert r.exit_code == 2 and "--greedy conflicts with --temperature, --top-p" in r.output, r.output


def test_sampling_options_imply_sampling_and_a_full_context_is_said(bundles):
    """--top-k and --top-p switch sampling on as --temperature does; --seed alone warns that greedy
    decoding ignores it; text mode says when generation stopped at the max context."""
    b = bundles("llama")
    greedy = json.loads(invoke("run", b, "--prompt-ids", "5,6,7", "--max-new-tokens", 12, "--no-eos", "--json").output)["token_ids"]
    seen = {tuple(json.loads(invoke("run", b, "--prompt-ids", "5,6,7", "--max-new-tokens", 12, "--no-eos", "--json", "--top-k", 50,
                                    "--seed", seed).output)["token_ids"]) for seed in range(4)}
    assert len(seen) > 1 or seen != {tuple(greedy)}  # sampled: the seeds differ, or at least one run leaves the greedy path
    r = invoke("run", b, "--prompt-ids", "5,6,7", "--max-new-tokens", 3, "--seed", 1)
    assert r.exit_code == 0 and "--seed has no effect with greedy decoding" in r.output
    ctx = json.loads((b / "manifest.json").read_text())["max_context"]
    r = invoke("run", b, "--prompt-ids", ",".join(["5"] * (ctx - 2)), "--max-new-tokens", 10, "--no-eos")
    assert r.exit_code == 0 and f"stopped: the context is full ({ctx} tokens" in r.output and "3 generated" in r.output  # the last one is not fed


def test_eval_input_errors(bundles, tmp_path):
    """eval names bad inputs: text too short to score, a file that is not UTF-8, a --window past the max
    context (used, with a warning), agreement with a bundle of another vocabulary."""
    b = bundles("llama")
    (tmp_path / "one.txt").write_text("the")
    r = invoke("eval", b, "--text", tmp_path / "one.txt")
    assert r.exit_code == 2 and "perplexity needs at least two" in r.output, r.output
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    r = invoke("eval", b, "--text", tmp_path / "latin1.txt")
    assert r.exit_code == 2 and "is not UTF-8 text" in r.output, r.output
    r = invoke("eval", b, "--against", b, "--prompts", tmp_path / "latin1.txt")
    assert r.exit_code == 2 and "--prompts" in r.output and "is not UTF-8 text" in r.output, r.output
    (tmp_path / "t.txt").write_text("the cat sat on the mat and the dog sat on the log " * 3)
    r = invoke("eval", b, "--text", tmp_path / "t.txt", "--window", 100000)
    assert r.exit_code == 0 and "--window 100000 is longer than the bundle's max context" in r.output
    (tmp_path / "p.txt").write_text("the cat\n")
    other = tmp_path / "other"  # as a bundle of a model with a larger vocabulary would say
    shutil.copytree(b, other)
    m = json.loads((other / "manifest.json").read_text())
    m["model"]["vocab_size"] += 100
    write_manifest(other, m)
    r = invoke("eval", b, "--against", other, "--prompts", tmp_path / "p.txt")
    assert r.exit_code == 2 and "agreement compares bundles of the same model" in r.output, r.output


def test_passes_and_ops_listing():
    r = invoke("passes")
    assert r.exit_code == 0 and "chunk_static_graphs" in r.output and "default pipeline of `llmc compile --target cpu`" in r.output
    r = invoke("ops")
    assert r.exit_code == 0 and "Attention" in r.output and "dynamic" in r.output


def test_errors_have_messages_and_exit_codes(bundles, tmp_path):
    r = invoke("compile", tmp_path / "nope", "-o", tmp_path / "o")
    assert r.exit_code == 3 and "not found" in r.output
    (tmp_path / "empty").mkdir()
    r = invoke("compile", tmp_path / "empty", "-o", tmp_path / "o")
    assert r.exit_code == 3 and "config.json" in r.output
    r = invoke("compile", "someorg/not-cached-model", "-o", tmp_path / "o")
    assert r.exit_code == 3 and "never downloads" in r.output
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    r = invoke("compile", bad, "-o", tmp_path / "o")
    assert r.exit_code == 3 and "bad.gguf is not a GGUF file" in r.output and "hint:" in r.output, r.output
    assert "whole model into memory" not in r.output
    assert not (tmp_path / "o").exists()

    long_prompt = " ".join(["cat"] * 100)
    r = invoke("run", bundles("llama"), "--prompt", long_prompt)
    assert r.exit_code == 6 and "--max-context" in r.output
    r = invoke("run", bundles("llama"), "--prompt", "caf\udce9")  # a non-UTF-8 argument, as Python's surrogateescape keeps it
    assert r.exit_code == 6 and "the text is not valid UTF-8 (character 3)" in r.output, r.output
    notok = tmp_path / "no-tokenizer"  # as a bundle of a model without tokenizer files
    shutil.copytree(bundles("llama"), notok)
    m = json.loads((notok / "manifest.json").read_text())
    m["tokenizer"] = {"eos_token_ids": m["tokenizer"]["eos_token_ids"]}
    write_manifest(notok, m)
    (tmp_path / "t.txt").write_text("the cat sat on the mat")
    r = invoke("eval", notok, "--text", tmp_path / "t.txt")
    assert r.exit_code == 2 and "has no tokenizer, so --text cannot be tokenized" in r.output, r.output
    r = invoke("run", notok, "--prompt", "the cat")
    assert r.exit_code == 6 and "has no tokenizer" in r.output and "--prompt-ids" in r.output, r.output

    d = tmp_path / "tampered"
    shutil.copytree(bundles("llama"), d)
    (d / "graphs" / "block00.r1.onnx").write_bytes(b"junk")
    r = invoke("run", d, "--prompt", "the cat")
    assert r.exit_code == 5 and "block00.r1.onnx" in r.output
    r = invoke("run", tmp_path / "missing", "--prompt", "x")
    assert r.exit_code == 5 and "does not exist" in r.output


def test_bad_configs_are_named_errors(tmp_path):
    """Configs transformers rejects, or that no decoder can have, are named model errors for compile
    and plan (exit 3 or 4), not tracebacks or a misleading trace failure."""
    from conftest import COMMON

    base = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **COMMON}
    cases = {"hidden": ({"hidden_size": 66}, 3, "not a multiple of the number of attention heads"),
             "kv-heads": ({"num_key_value_heads": 3}, 4, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
             "no-layers": ({"num_hidden_layers": 0}, 4, "needs at least one layer"),
             "no-heads": ({"num_attention_heads": 0}, 3, "a size or head count in it is zero"),  # transformers divides by it
             "no-kv-heads": ({"num_key_value_heads": 0}, 4, "num_key_value_heads 0; attention needs at least one head")}
    for name, (edit, code, message) in cases.items():
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**base, **edit}))
        for args in (("compile", d, "-o", tmp_path / f"out-{name}"), ("plan", d / "config.json")):
            r = invoke(*args)
            assert r.exit_code == code and message in r.output and "hint:" in r.output, (name, args[0], r.output)
    (tmp_path / "list.json").write_text("[1, 2]")
    r = invoke("plan", tmp_path / "list.json")
    assert r.exit_code == 3 and "a JSON list, not an object" in r.output, r.output
    from conftest import smollm2_available

    if smollm2_available():  # a GGUF file cut short: its magic bytes are right, its metadata is not all there
        from llmc.model_source import bundled_model_path

        head = bundled_model_path("smollm2-135m").open("rb").read(4096)
        (tmp_path / "cut.gguf").write_bytes(head)
        for args in (("compile", tmp_path / "cut.gguf", "-o", tmp_path / "out-cut", "--no-cache"), ("plan", tmp_path / "cut.gguf")):
            r = invoke(*args)
            assert r.exit_code == 3 and "truncated or corrupt" in r.output, (args[0], r.output)


def test_options_are_checked_before_the_slow_stages(model_dirs, tmp_path, caplog):
    """Options nothing in the compile reads, an unreadable --memory-budget, a missing --calib file and
    directories that cannot be made are refused before loading the model (usage errors, nothing written)."""
    m = model_dirs("llama")
    (tmp_path / "file").write_text("")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait ".encode("latin-1") * 50)
    cut = ["--pipeline", "dce,select_logit_rows,chunk_static_graphs"]
    cases = [
        (["--no-shadow"], "--no-shadow has no effect here: the pipeline has no extract_shadow_outliers pass"),
        (["--weight-granularity", "tensor"], "--weight-granularity has no effect here"),
        (["--weight-bits", "7"], "--weight-bits has no effect here: the pipeline has no quantize pass"),
        (["--target", "npu", "--weight-bits", "7", "--memory-budget", "50%"], "--weight-bits 7 gains nothing under --memory-budget"),
        (["--calib-tokens", "64"], "--calib-tokens has no effect here: the pipeline has no calibrate pass"),
        (["--target", "npu", "--calib", str(tmp_path / "nope.txt")], "no such file"),
        (["--memory-budget", "300Mbytes"], "cannot read the size '300Mbytes'"),
        (["--prefetch-depth", "1"], "--prefetch-depth applies to bundles compiled with --memory-budget"),
        (["--mlir-dialect", "linalg"], "apply to --target mlir"),
        (["--target", "npu", "--qnn-shard-mb", "64"], "apply to the QNN context binaries"),
        (["--cache-dir", str(tmp_path / "file" / "cache"), "--target", "npu"], "cannot use the cache directory"),
        (["--dump-ir", str(tmp_path / "file" / "ir")], "cannot create"),
        (["--pipeline", ""], "--pipeline is empty"),
        (["--memory-budget", "50%", *cut], "--memory-budget has no effect here: the pipeline has no plan_offload pass"),
        (["--placement", "cpu", *cut], "--placement has no effect here: the pipeline has no place pass"),
        (["--profile", "8elite", *cut], "--profile has no effect here"),
        (["--prompt-len", "20", *cut], "--prompt-len has no effect here: the pipeline has no schedule pass"),
        (["--prompt-len", "100"], "--prompt-len 100 is longer than --max-context 32"),
        (["--target", "npu", "--calib", str(tmp_path / "latin1.txt")], "is not UTF-8 text (byte 3)"),
    ]
    for args, message in cases:
        r = invoke("compile", m, "-o", tmp_path / "o", "--chunk", CHUNK, "--max-context", 32, *args)
        assert r.exit_code == 2 and message in r.output, (args, r.output)
        assert "[1/6] load" not in r.output and not (tmp_path / "o").exists(), (args, r.output)
    # accepted: the cache by $LLMC_CACHE_DIR unusable (a warning, then no cache), --calib read by calibrate_ranges
    # alone, --qnn-shard-mb with --soc when the QNN part is skipped
    r = CliRunner().invoke(cli, ["compile", str(m), "-o", str(tmp_path / "ok1"), "--chunk", str(CHUNK), "--max-context", "32", "--target", "npu",
                                 "--calib-tokens", "64", "--quiet"], env={"LLMC_CACHE_DIR": str(tmp_path / "file" / "cache")})
    assert r.exit_code == 0 and "compiling without a cache" in caplog.text, r.output
    words = tmp_path / "words.txt"
    words.write_text("the cat sat on the mat " * 40)
    r = invoke("compile", m, "-o", tmp_path / "ok2", "--chunk", CHUNK, "--max-context", 32, "--calib", words, "--quiet",
               "--pipeline", "dce,select_logit_rows,calibrate_ranges,chunk_static_graphs")
    assert r.exit_code == 0, r.output
    import llmc.runtime.qnn as qnn
    from llmc.passes import DEFAULT_PIPELINES

    real = qnn.qnn_available
    qnn.qnn_available = lambda: "onnxruntime-qnn is not installed"
    try:
        r = invoke("compile", m, "-o", tmp_path / "ok3", "--chunk", CHUNK, "--max-context", 32, "--target", "npu", "--soc", "8gen3",
                   "--qnn-shard-mb", 64, "--calib", words, "--calib-tokens", 64, "--quiet")
        assert r.exit_code == 0 and "QNN part skipped: onnxruntime-qnn is not installed" in r.output, r.output
        qnn.qnn_available = lambda: None  # as if it were installed: the QNN part needs calibrate_ranges
        no_ranges = ",".join(p for p in DEFAULT_PIPELINES["npu-qnn"].split(",") if p != "calibrate_ranges")
        r = invoke("compile", m, "-o", tmp_path / "o", "--target", "npu", "--soc", "8gen3", "--pipeline", no_ranges)
        assert r.exit_code == 2 and "need the ranges of calibrate_ranges" in r.output and "[1/6] load" not in r.output, r.output
    finally:
        qnn.qnn_available = real
    r = invoke("plan", m, "--profile", "9gen9")
    assert r.exit_code == 2 and "unknown device profile '9gen9'" in r.output, r.output
    caplog.clear()
    r = invoke("plan", m, "--memory-budget", "abc")
    assert r.exit_code == 2 and "cannot read the size 'abc'" in r.output and "failed after" not in caplog.text, r.output
    r = invoke("profile-host", "-o", tmp_path / "file" / "host.json")
    assert r.exit_code == 2 and "cannot write" in r.output and "measuring" not in r.output, r.output


def test_console_script_entry_point():
    exe = shutil.which("llmc") or str((__import__("pathlib").Path(sys.executable).parent / "llmc"))
    out = subprocess.run([exe, "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for cmd in ("compile", "run", "inspect", "passes"):
        assert cmd in out.stdout


def test_bench_json(bundles):
    r = invoke("bench", bundles("llama"), "--prompt-len", 20, "--new-tokens", 4, "--repeat", 2, "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert res["prompt_tokens"] == 20 and res["repeat"] == 2 and res["decode_path"] == res["prefill_path"] == "graph"
    assert res["kv_cache"] == "float32" and res["kv_cache_bytes"] == 2 * 2 * 2 * 16 * 4 * 64  # K, V x layers x kv heads x head dim x 4 B x context
    assert res["int8_kernels"] is None  # a float bundle
    for k in ("ttft_s", "prefill_tok_s", "decode_tok_s"):
        f = res[k]
        assert f["min"] <= f["median"] <= f["max"] and f["median"] > 0
    r = invoke("bench", bundles("llama"), "--prompt-len", 10, "--new-tokens", 2, "--repeat", 1)
    assert r.exit_code == 0 and "prefill  one call of the decode graph's chunk instance per chunk" in r.output, r.output
    r = invoke("bench", bundles("llama"), "--prompt-len", 100)
    assert r.exit_code == 2 and "max context" in r.output


def test_bench_prompt_is_natural_text_or_the_users(bundles, tmp_path):
    """The prompt is the first tokens of CPython's LICENSE.txt by default (a W8A8 shadow bundle's prefill speed
    depends on the text), or of --prompt-file, repeated when the text is shorter; the report names it."""
    from llmc.runtime import Session
    from llmc.runtime.bench import bench_prompt, default_text

    name, body = default_text()
    r = invoke("bench", bundles("llama"), "--prompt-len", 12, "--new-tokens", 2, "--repeat", 1, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["prompt"] == f"the first 12 tokens of {name}"
    s = Session(bundles("llama"))
    assert bench_prompt(s, 12).ids == s.encode(body)[:12]
    f = tmp_path / "words.txt"
    f.write_text("the cat sat on the mat", encoding="utf-8")  # 6 tokens: two copies make 12
    p = bench_prompt(s, 12, (str(f), f.read_text()))
    assert p.ids == s.encode("the cat sat on the mat the cat sat on the mat") and p.source == f"the first 12 tokens of {f} (2 copies)"
    r = invoke("bench", bundles("llama"), "--prompt-len", 12, "--new-tokens", 2, "--repeat", 1, "--prompt-file", str(f))
    assert r.exit_code == 0 and f"prompt   the first 12 tokens of --prompt-file {f} (" in r.output, r.output
    f.write_text("  \n", encoding="utf-8")
    r = invoke("bench", bundles("llama"), "--prompt-len", 12, "--prompt-file", str(f))
    assert r.exit_code == 2 and "has no text" in r.output, r.output


def test_bench_without_a_tokenizer(bundles, tmp_path):
    """A bundle without a tokenizer benches on random ids and says so; it cannot take --prompt-file."""
    import shutil

    from conftest import write_manifest

    d = tmp_path / "no-tokenizer"
    shutil.copytree(bundles("llama"), d)
    m = json.loads((d / "manifest.json").read_text())
    m["tokenizer"] = {"eos_token_ids": m["tokenizer"]["eos_token_ids"]}
    write_manifest(d, m)
    r = invoke("bench", d, "--prompt-len", 12, "--new-tokens", 2, "--repeat", 1, "--json")
    assert r.exit_code == 0 and json.loads(r.output)["prompt"] == "random token ids (the bundle has no tokenizer)", r.output
    f = tmp_path / "words.txt"
    f.write_text("the cat", encoding="utf-8")
    r = invoke("bench", d, "--prompt-len", 12, "--prompt-file", str(f))
    assert r.exit_code == 2 and "has no tokenizer, so --prompt-file cannot be tokenized" in r.output, r.output


def test_bench_prompt_without_a_default_text(bundles, monkeypatch):
    """A Python with neither LICENSE.txt nor pydoc_data: random ids, and the report says why."""
    from llmc.runtime import Session, bench as B

    monkeypatch.setattr(B, "default_text", lambda: None)
    p = B.bench_prompt(Session(bundles("llama")), 12)
    assert len(p.ids) == 12 and p.source == "random token ids (this Python has neither LICENSE.txt nor pydoc_data)"


def test_dump_ir_replaces_an_earlier_dump(model_dirs, tmp_path):
    d = tmp_path / "ir"
    for pipeline in (None, "dce,select_logit_rows,chunk_static_graphs"):
        args = ["--pipeline", pipeline] if pipeline else []
        r = invoke("compile", model_dirs("llama"), "-o", tmp_path / "b", "--chunk", CHUNK, "--max-context", 32, "--dump-ir", d, "--quiet", *args)
        assert r.exit_code == 0, r.output
    assert sorted(p.name for p in d.iterdir()) == ["00-input.ir", "01-dce.ir", "02-select_logit_rows.ir", "03-chunk_static_graphs.ir"]


def test_a_broken_calibration_cache_costs_only_time(model_dirs, tmp_path, caplog):
    """A corrupt cache entry is calibrated again and replaced; a cache that cannot be written is a warning."""
    import logging

    caplog.set_level(logging.WARNING)
    m, cache = model_dirs("llama"), tmp_path / "cache"
    words = tmp_path / "words.txt"
    words.write_text("the cat sat on the mat " * 40)
    common = ["--target", "npu", "--chunk", CHUNK, "--max-context", 32, "--calib", words, "--calib-tokens", 64, "--quiet"]
    assert invoke("compile", m, "-o", tmp_path / "a", "--cache-dir", cache, *common).exit_code == 0
    (entry,) = (cache / "calibration").glob("*.npz")
    entry.write_bytes(b"PK\x03\x04garbage")
    r = invoke("compile", m, "-o", tmp_path / "b", "--cache-dir", cache, *common)
    assert r.exit_code == 0 and "ignoring the unreadable calibration cache" in caplog.text, r.output
    assert entry.stat().st_size > 100 and not list((cache / "calibration").glob("*.tmp.npz"))  # replaced
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "calibration").write_text("")  # a file where the directory should be
    caplog.clear()
    r = invoke("compile", m, "-o", tmp_path / "c", "--cache-dir", blocked, *common)
    assert r.exit_code == 0 and "could not cache the calibration" in caplog.text, r.output
