"""QNN backend: fully quantized HTP graphs, weight-shared context binaries, and the
runtime on the QNN HTP backend (the x86_64 simulator here)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import CHUNK, MAX_CONTEXT

pytest.importorskip("onnxruntime_qnn", reason="onnxruntime-qnn is not installed (pip install 'llmc[qnn]')")


def test_manifest_records_qnn(qnn_bundle):
    from llmc.runtime import load_manifest

    m = load_manifest(qnn_bundle)
    q = m["qnn"]
    assert q["soc"] == "8gen3" and q["htp_arch"] == "v75" and q["soc_model"] == 57
    assert set(q["versions"]) == {"onnxruntime", "onnxruntime_qnn"}
    assert set(q["graphs"]) == {st["name"] for st in m["program"] if st["kind"] == "graph"}  # not the CPU decode program's
    assert len(q["binaries"]) == 1 and len(q["binaries"][0]["files"]) == 1  # few binaries: one for this model
    binary = q["binaries"][0]["files"][0]
    for name, inst in q["graphs"].items():
        for rows, e in inst.items():
            assert e["binary"] == binary  # prefill and decode instances in the same context
            assert (qnn_bundle / e["context"]).is_file() and (qnn_bundle / e["qdq"]).is_file()
    assert "x86_64" in q["x86_64_route"]


def test_weights_stored_once_in_context(qnn_bundle, tmp_path):
    """The shared binary holds each weight once: adding the decode instances of every
    subgraph costs far less than their weights again."""
    from llmc.runtime import load_manifest

    m = load_manifest(qnn_bundle)
    shared = m["qnn"]["binaries"][0]["bytes"]
    int8 = sum(w["nbytes"] for n, w in m["weights"].items() if n.endswith(".q8"))
    assert shared < 2 * int8 + 900_000  # graph overhead, not a second weight copy
    r = json.loads((qnn_bundle / "report.json").read_text())
    assert r["summary"]["int8_weight_bytes"] == int8


def test_every_op_on_htp(qnn_bundle):
    """Each fully quantized graph loads with CPU fallback disabled (the session fails otherwise)."""
    from llmc.runtime import Session

    s = Session(qnn_bundle, provider="qnn")  # creates every session up front, where the placement puts it
    assert s.provider == "qnn"
    placement = s.manifest["placement"]
    for (graph, rows, on_npu), (sess, prefix) in s._sessions.items():
        phase = "decode" if rows == 1 and graph != "head" else "prefill"
        assert on_npu == (placement[phase][graph] == "npu") and bool(prefix) == on_npu
    assert any(on_npu for _, _, on_npu in s._sessions)
    for (_, _, on_npu), (sess, _) in s._sessions.items():  # the HTP's sessions start no intra-op workers
        so = sess.get_session_options()
        assert not on_npu or (so.intra_op_num_threads == 1 and so.get_session_config_entry("session.intra_op.allow_spinning") == "0")
    for graph, instances in s.manifest["qnn"]["graphs"].items():  # every QNN instance, whatever the placement
        for rows in instances:
            assert s._session(graph, int(rows), "npu")[1]


def test_qnn_matches_cpu_provider(qnn_bundle):
    from llmc.runtime import Session

    q, c = Session(qnn_bundle, provider="qnn"), Session(qnn_bundle, provider="cpu")
    ids = [int(t) for t in np.random.default_rng(2).integers(4, 100, size=CHUNK)]
    q.reset(), c.reset()
    lq, lc = q.prefill(ids, all_logits=True), c.prefill(ids, all_logits=True)
    assert np.abs(lq - lc).max() <= 0.08 * np.abs(lc).max()  # 8-bit arithmetic
    # greedy agreement over 16 generated tokens per prompt, teacher-forced (each position
    # judged on the reference's prefix, so one near-tie in a random model does not cascade)
    from llmc.runtime.evaluate import agreement

    # 8 prompts (128 tokens): with 3 a single near-tie of the random model moved the rate by 2 points
    prompts = [[int(t) for t in np.random.default_rng(seed).integers(4, 100, size=5)] for seed in range(8)]
    assert agreement(q, c, prompts, new_tokens=16).teacher_forced >= 0.9


def test_verify_qnn_graph_by_graph(qnn_bundle):
    from llmc.backends.qnn_verify import verify_qnn
    from llmc.runtime import load_manifest

    r = verify_qnn(qnn_bundle, prompts=2)
    q = load_manifest(qnn_bundle)["qnn"]
    assert {(c.graph, str(c.rows)) for c in r.instances} == {(g, rows) for g, by in q["graphs"].items() for rows in by}  # every instance ran
    # measured: at most 1.8% of an output's largest magnitude on the HTP, 1.4% from the 16-bit activations; logits 2-3%
    assert r.ok and 0 < r.worst.htp <= 0.05 and all(0 < c.qdq <= 0.05 for c in r.instances if c.graph != "block08")
    assert len(r.logits_gap) == 2 and max(r.logits_gap) <= 0.08


def test_cli_verify(qnn_bundle, tmp_path):
    import shutil

    from click.testing import CliRunner

    from llmc.cli import cli

    r = CliRunner().invoke(cli, ["verify", str(qnn_bundle)])
    assert r.exit_code == 0 and "ok" in r.output, r.output
    r = CliRunner().invoke(cli, ["verify", str(qnn_bundle), "--qnn", "--prompts", "1", "--tolerance", "0.0001", "--json"])
    assert r.exit_code == 12 and "over --tolerance" in r.output, r.output  # a real difference, named by graph
    res = json.loads(r.output.strip().splitlines()[0])
    assert not res["qnn"]["ok"] and res["qnn"]["instances"]
    b = tmp_path / "b"
    shutil.copytree(qnn_bundle, b)
    ctx = next((b / "qnn" / "ctx").rglob("*.bin"))
    data = bytearray(ctx.read_bytes())
    data[len(data) // 2] ^= 0xFF
    ctx.write_bytes(bytes(data))
    r = CliRunner().invoke(cli, ["verify", str(b)])
    assert r.exit_code == 5 and "does not match its SHA-256" in r.output


def test_plain_smoothed_w8a8_on_htp(model_dirs, tmp_path, calib_words):
    """--no-shadow (plain W8A8, smoothed by default): every Linear on the HTP with no CPU correction,
    the smoothing factors folded into the weights the context binaries hold; the HTP agrees with the
    CPU provider on the same bundle."""
    from llmc.compile import compile_model
    from llmc.runtime import Session, load_manifest

    out = tmp_path / "plain"
    compile_model(str(model_dirs("llama")), out, target="npu", soc="8gen3", chunk=CHUNK, max_context=MAX_CONTEXT, calib_tokens=512,
                  calib_file=str(calib_words), placement="npu", shadow=False)
    m = load_manifest(out)
    assert "smooth_activations" in m["pipeline"] and not any(st["kind"] == "op" and "shadow" in st["name"] for st in m["program"])
    assert json.loads((out / "report.json").read_text())["smoothing"]["alpha"] == pytest.approx(0.8)
    q, c = Session(out, provider="qnn"), Session(out, provider="cpu")
    ids = [int(t) for t in np.random.default_rng(3).integers(4, 100, size=CHUNK + 3)]
    q.reset(), c.reset()
    lq, lc = q.prefill(ids, all_logits=True), c.prefill(ids, all_logits=True)
    # 8-bit inputs at the calibration maximum and 16-bit tensors everywhere else: measured 10% of the
    # largest logit at most and 7% on average (the shadow bundle: 5% and 3%)
    assert np.abs(lq - lc).max() <= 0.15 * np.abs(lc).max()
    from llmc.runtime.evaluate import agreement

    prompts = [[int(t) for t in np.random.default_rng(seed).integers(4, 100, size=5)] for seed in range(8)]
    assert agreement(q, c, prompts, new_tokens=16).teacher_forced >= 0.85  # measured 0.89


def test_auto_and_explicit_providers(qnn_bundle, bundles):
    from llmc.runtime import ProviderError, Session

    assert Session(qnn_bundle, provider="auto", lazy=True).provider == "qnn"
    assert Session(bundles("llama"), provider="auto", lazy=True).provider == "cpu"
    with pytest.raises(ProviderError, match="no QNN artifacts"):
        Session(bundles("llama"), provider="qnn")
    from click.testing import CliRunner

    from llmc.cli import cli

    r = CliRunner().invoke(cli, ["run", str(bundles("llama")), "--provider", "qnn", "--prompt-ids", "5"])
    assert r.exit_code == 10 and "no QNN artifacts" in r.output, r.output  # its own code: not "the bundle cannot be written" (7)


def test_without_soc_qnn_part_is_skipped_and_said(model_dirs, tmp_path):
    from click.testing import CliRunner

    from llmc.cli import cli
    from llmc.runtime import load_manifest

    r = CliRunner().invoke(cli, ["compile", str(model_dirs("llama")), "--target", "npu", "-o", str(tmp_path / "b"),
                                 "--chunk", str(CHUNK), "--max-context", str(MAX_CONTEXT), "--calib-tokens", "256", "--no-cache"])
    assert r.exit_code == 0, r.output
    assert "QNN part skipped: no --soc given" in r.output
    assert "no --soc" in load_manifest(tmp_path / "b")["qnn"]["skipped"]


def test_cli_run_on_qnn(qnn_bundle):
    from click.testing import CliRunner

    from llmc.cli import cli

    r = CliRunner().invoke(cli, ["run", str(qnn_bundle), "--prompt", "the cat saw", "--provider", "qnn", "--max-new-tokens", "4", "--no-eos", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output.strip().splitlines()[-1])
    assert res["provider"] == "qnn" and len(res["token_ids"]) == 4


def _llmc_process(*args: str):
    """``llmc ARGS`` in a new process: native libraries' output reaches the real stdout there."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "llmc.cli", *args], capture_output=True, text=True, timeout=300)


def test_json_stdout_is_clean_and_counts_graphs_per_provider(qnn_bundle):
    r = _llmc_process("run", str(qnn_bundle), "--prompt-ids", "5,7,9", "--provider", "qnn", "--max-new-tokens", "3", "--no-eos", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)  # the whole of stdout: the QNN libraries' "# LIBNATIVE" line goes to stderr
    assert res["provider"] == "qnn" and res["requested_provider"] == "qnn"
    assert res["graphs"]["prefill"]["qnn"] > 0 and res["graphs"]["decode"]["qnn"] > 0
    assert res["graphs"]["prefill"]["cpu"] == 0  # placement npu: every graph of the chunk program on the HTP
    text = _llmc_process("run", str(qnn_bundle), "--prompt-ids", "5,7,9", "--provider", "qnn", "--max-new-tokens", "3", "--no-eos")
    assert text.returncode == 0 and "LIBNATIVE" not in text.stdout


def test_qnn_provider_with_a_cpu_plan_says_so(qnn_bundle, tmp_path):
    import shutil

    from conftest import write_manifest
    from llmc.runtime import Session, load_manifest

    b = tmp_path / "cpu-plan"
    shutil.copytree(qnn_bundle, b)
    m = load_manifest(b)
    for phase in ("prefill", "decode"):
        m["placement"][phase] = {name: "cpu" for name in m["placement"][phase]}
    write_manifest(b, m)
    sess = Session(b, provider="qnn")
    assert sess.provider == "qnn" and sess.npu_graphs_planned == {"prefill": 0, "decode": 0}
    sess.generate([5, 7, 9], 3, stop_at_eos=False)
    assert sess.provider_used == "cpu" and sess.graphs_run()["prefill"]["qnn"] == 0 and sess.graphs_run()["decode"]["cpu"] > 0
    r = _llmc_process("run", str(b), "--prompt-ids", "5,7,9", "--provider", "qnn", "--max-new-tokens", "3", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["provider"] == "cpu" and res["requested_provider"] == "qnn" and res["graphs"]["prefill"]["qnn"] == 0
    assert "places no graph on the NPU" in r.stderr


@pytest.mark.parametrize("family", ["qwen2", "gemma", "phi3"])
def test_other_families_on_htp(family, model_dirs, tmp_path, calib_words):
    """Projection biases (Qwen2), GELU-tanh, (1 + w) norms and scaled embeddings (Gemma),
    fused projections split by Slice (Phi-3) all run on the HTP without CPU fallback."""
    from llmc.compile import compile_model
    from llmc.runtime import Session

    out = tmp_path / family
    compile_model(str(model_dirs(family)), out, target="npu", soc="8gen2", chunk=CHUNK, max_context=MAX_CONTEXT, calib_tokens=512,
                  calib_file=str(calib_words), placement="npu")
    q, c = Session(out, provider="qnn"), Session(out, provider="cpu")
    ids = [int(t) for t in np.random.default_rng(4).integers(4, 100, size=CHUNK)]
    q.reset(), c.reset()
    lq, lc = q.prefill(ids, all_logits=True), c.prefill(ids, all_logits=True)
    assert np.abs(lq - lc).max() <= 0.08 * np.abs(lc).max()
    assert (lq.argmax(-1) == lc.argmax(-1)).mean() >= 0.75


def test_contexts_shard_by_layers(model_dirs, tmp_path, calib_words):
    """A context budget smaller than the model splits the binaries in layer order."""
    from llmc.compile import compile_model
    from llmc.runtime import Session, load_manifest

    out = tmp_path / "sharded"
    compile_model(str(model_dirs("llama")), out, target="npu", soc="8elite", chunk=CHUNK, max_context=MAX_CONTEXT, calib_tokens=256,
                  calib_file=str(calib_words), qnn_shard_bytes=40_000, placement="npu")
    m = load_manifest(out)
    q = m["qnn"]
    assert q["htp_arch"] == "v79" and len(q["binaries"]) > 1
    order = [s["name"] for s in m["program"] if s["kind"] == "graph"]
    seen = [g.split(".r")[0] for b in q["binaries"] for g in b["graphs"]]
    assert [n for i, n in enumerate(seen) if n not in seen[:i]] == order  # shards follow the program
    for b in q["binaries"]:
        assert len(b["files"]) == 1
        per_graph = {g.split(".r")[0] for g in b["graphs"]}
        for name in per_graph:  # both instances of a subgraph stay in one context
            assert {f"{name}.r{r}" for r in m["graphs"][name]["instances"]} <= set(b["graphs"])
    s = Session(out, provider="qnn")
    assert len(s.generate([5, 6, 7], 3, stop_at_eos=False).token_ids) == 3


def test_contexts_shard_by_graph_count(model_dirs, tmp_path, calib_words):
    """Few weights but many graphs: the graph cap splits the contexts (host memory of their preparation)."""
    from llmc.compile import compile_model
    from llmc.runtime import load_manifest

    out = tmp_path / "capped"
    compile_model(str(model_dirs("llama")), out, target="npu", soc="8gen3", chunk=CHUNK, max_context=MAX_CONTEXT, calib_tokens=256,
                  calib_file=str(calib_words), qnn_shard_graphs=4)
    m = load_manifest(out)
    sizes = [len(b["graphs"]) for b in m["qnn"]["binaries"]]
    assert len(sizes) > 1 and max(sizes) <= 4
    assert sum(sizes) == sum(len(g["instances"]) for n, g in m["graphs"].items() if n in m["qnn"]["graphs"])


def test_shard_process_reports_rejected_graphs_and_crashes(tmp_path):
    """Shards are prepared in child processes; a graph the HTP rejects and a child that dies both become named errors."""
    import onnx
    from onnx import TensorProto, helper

    from llmc.backends.qnn_backend import QnnBackendError, _run_shard_process

    (tmp_path / "qnn" / "ctx" / "shard00").mkdir(parents=True)
    g = helper.make_graph([helper.make_node("NonZero", ["x"], ["y"])], "nz", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.INT64, [2, "n"])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.save(model, tmp_path / "qnn" / "nz.r1.onnx")
    items = [("nz", 1, "qnn/nz.r1.onnx", "qnn/ctx/shard00/nz.r1_ctx.onnx", [])]
    with pytest.raises(QnnBackendError, match="QNN HTP cannot take subgraph nz \\(rows 1\\) for 8gen3") as e:
        _run_shard_process(tmp_path, {}, "8gen3", 0, items)
    assert "qnn/nz.r1.onnx" in e.value.hint
    lost = {"w": {"file": "weights/weights.bin", "offset": 0, "nbytes": 4, "dtype": "float32", "shape": [1]}}  # no such file
    with pytest.raises(QnnBackendError, match="shard 0 \\(1 graphs\\) failed with exit code 1: ") as e:
        _run_shard_process(tmp_path, lost, "8gen3", 0, items)
    assert "--qnn-shard-mb" in e.value.hint
    assert not list((tmp_path / "qnn").glob(".shard*.json"))  # job files are removed
