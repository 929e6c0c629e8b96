"""float16_kv_cache (--kv-cache float16): every layer's cache holds halves, in the decode graph's native attention
(one row and chunks), in the chunk program's numpy attention and in the interpreter; the compile refuses what cannot
run it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import CHUNK, MAX_CONTEXT


def _ids(n: int, seed: int = 9) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(4, 120, size=n)]


def test_pass_marks_every_attention_and_refuses_an_int8_cache(model_dirs):
    from llmc.errors import CompileError
    from llmc.ops import kv_cache_itemsize

    from test_quantization import _ctx, _run

    g, ctx = _ctx(model_dirs("llama"))
    _run(g, ctx, "float16_kv_cache")
    attn = g.find("Attention")
    assert attn and all(n.attrs["kv_dtype"] == "float16" and kv_cache_itemsize(n) == 2 for n in attn)
    g, ctx = _ctx(model_dirs("llama"))
    _run(g, ctx, "assume_kv_cache")  # int8 scales on every node
    with pytest.raises(CompileError, match="already has an int8 KV cache"):
        _run(g, ctx, "float16_kv_cache")


@pytest.mark.parametrize("family", ["llama", "phi"])
def test_float16_cache_bundle_matches_the_interpreter_and_the_float32_bundle(model_dirs, tmp_path, native_kernels, family):
    """A float16-cache bundle's caches are float16 and its decode graph attends with DecodeAttentionFloat16 (llama: its
    chunk instance too, so the prompt prefills through it; phi rotates 8 of 16 dims with RotaryEmbedding, so its prompt
    prefills through the chunk program, whose numpy attention reads the same cache). Its logits are the interpreter's
    (the same halves in numpy) and close to the float32-cache bundle's."""
    from llmc.compile import compile_model
    from llmc.interpreter import Interpreter
    from llmc.runtime import Session

    from test_native import _nodes, _ops
    from test_quantization import _ctx, _run

    out = {}
    for fmt in ("float16", "float32"):
        out[fmt] = tmp_path / fmt
        compile_model(str(model_dirs(family)), out[fmt], target="cpu", chunk=CHUNK, max_context=MAX_CONTEXT, kv_cache=fmt, cpu_kernels="native")
    m = json.loads((out["float16"] / "manifest.json").read_text())
    assert m["pipeline"].startswith("float16_kv_cache,")
    ops = _ops(out["float16"])
    assert "DecodeAttentionFloat16" in ops[f"{m['decode_graph']}.r1"] and "DecodeAttention" not in ops[f"{m['decode_graph']}.r1"]
    # a float32 program's attention multiplies in float32 (no bf16 attribute: that is the W8A8 programs'), in every instance
    instances = [f"{m['decode_graph']}.r{i['rows']}" for i in m["graphs"][m["decode_graph"]]["instances"].values()]
    assert not any(a.name == "bf16" for g in instances for n in _nodes(out["float16"], g) for a in n.attribute)
    assert not m["graphs"][m["decode_graph"]].get("bf16_attention")
    chunked = f"{m['decode_graph']}.r{CHUNK}" in ops
    assert chunked == (family == "llama")
    ids = _ids(2 * CHUNK + 7)
    prompt = 2 * CHUNK + 3
    logits = {}
    for fmt, bundle in out.items():
        s = Session(bundle, "cpu")
        s.reset()
        logits[fmt] = [s.prefill(ids[:prompt])]
        logits[fmt] += [s.decode(t) for t in ids[prompt:-1]]
        assert s.decode_path == "graph" and s.prefill_path == ("graph" if chunked else "chunk program")
        assert {a.dtype for a in [*s.cache.k.values(), *s.cache.v.values()]} == {np.dtype(fmt)}
    g, ctx = _ctx(model_dirs(family))
    _run(g, ctx, "float16_kv_cache,dce,select_logit_rows")
    ref = Interpreter(g).run(ids[:-1], select_rows=np.arange(len(ids) - 1))[prompt - 1 :]
    for a, r, f in zip(logits["float16"], ref, logits["float32"]):
        np.testing.assert_allclose(a.reshape(-1), r, atol=2e-3 * np.abs(r).max())
        np.testing.assert_allclose(a.reshape(-1), f.reshape(-1), atol=3e-2 * np.abs(f).max())


def test_float16_cache_is_refused_without_native_kernels_or_with_a_memory_budget(model_dirs, tmp_path):
    from click.testing import CliRunner

    from llmc.cli import cli

    base = ["compile", str(model_dirs("llama")), "--chunk", str(CHUNK), "--max-context", str(MAX_CONTEXT), "--kv-cache", "float16", "--quiet"]
    r = CliRunner().invoke(cli, [*base, "-o", str(tmp_path / "a")])
    assert r.exit_code == 2 and "--kv-cache float16 needs --cpu-kernels native" in r.output, r.output
    r = CliRunner().invoke(cli, [*base, "-o", str(tmp_path / "b"), "--cpu-kernels", "native", "--memory-budget", "50%"])
    assert r.exit_code == 2 and "does not combine with --memory-budget" in r.output, r.output
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_cli_compiles_inspects_benches_and_plans_a_float16_cache(model_dirs, tmp_path, native_kernels):
    from click.testing import CliRunner

    from llmc.cli import cli

    out = tmp_path / "b"
    r = CliRunner().invoke(cli, ["compile", str(model_dirs("qwen2")), "-o", str(out), "--chunk", str(CHUNK), "--max-context", str(MAX_CONTEXT),
                                 "--kv-cache", "float16", "--cpu-kernels", "native", "--quiet"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["inspect", str(out), "--json"])
    assert r.exit_code == 0, r.output
    kv = json.loads(r.output)["kv_cache"]
    layers = [s["attrs"] for s in json.loads((out / "manifest.json").read_text())["program"] if s.get("op") == "Attention"]
    assert kv["dtype"] == "float16" and kv["bytes_per_position"] == sum(2 * 2 * a["num_kv_heads"] * a["head_dim"] for a in layers)
    r = CliRunner().invoke(cli, ["bench", str(out), "--prompt-len", "12", "--new-tokens", "3", "--repeat", "1", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["kv_cache"] == "float16" and json.loads(r.output)["kv_cache_bytes"] == kv["bytes_per_position"] * MAX_CONTEXT
    # a cache type from a newer llmc (its manifest signed as that llmc would) is refused by name (exit 5), not bound to
    # graphs of another type
    from llmc.runtime.manifest import manifest_digest

    m = json.loads((out / "manifest.json").read_text())
    for s in m["program"]:
        if s.get("op") == "Attention":
            s["attrs"]["kv_dtype"] = "bfloat16"
    m["manifest_sha256"] = manifest_digest(m)
    (out / "manifest.json").write_text(json.dumps(m))
    r = CliRunner().invoke(cli, ["run", str(out), "--prompt-ids", "5,6,7", "--max-new-tokens", "2", "--provider", "cpu"])
    assert r.exit_code == 5 and "bfloat16, which this runtime does not know" in r.output, r.output
    plans = {}
    for fmt in ("float32", "float16"):
        r = CliRunner().invoke(cli, ["plan", str(model_dirs("qwen2")), "--prompt-len", "48", "--kv-cache", fmt, "--json"])
        assert r.exit_code == 0, r.output
        plans[fmt] = json.loads(r.output)
    assert plans["float16"]["memory"]["kv_cache_bytes"] * 2 == plans["float32"]["memory"]["kv_cache_bytes"] > 0
    # planned as the compile it stands for (--cpu-kernels native): one decode graph a token, with half the cache's bytes
    assert "fuse_decode_graph" in plans["float16"]["pipeline"]
    assert plans["float16"]["decode"]["tok_s"] >= plans["float32"]["decode"]["tok_s"]
    r = CliRunner().invoke(cli, ["plan", str(model_dirs("qwen2")), "--prompt-len", "48", "--kv-cache", "float16", "--memory-budget", "50%"])
    assert r.exit_code == 2 and "does not combine with --memory-budget" in r.output, r.output


def test_a_layer_cache_has_one_type(model_dirs):
    """quantize_kv_cache after float16_kv_cache (a hand-written --pipeline) is refused by name, as the other order is."""
    from llmc.errors import CompileError

    from test_quantization import _ctx, _run

    g, ctx = _ctx(model_dirs("llama"))
    _run(g, ctx, "float16_kv_cache,calibrate")
    with pytest.raises(CompileError, match="already has a float16 KV cache"):
        _run(g, ctx, "quantize_kv_cache")


def test_auto_cache_is_float16_for_native_npu_bundles_only():
    """--kv-cache auto (the default) stands for float16 where llmc's native attention reads an already quantized model's
    cache (npu, native kernels, the default pipeline, no memory budget), else float32."""
    from llmc.compile import resolve_kv_cache

    assert resolve_kv_cache("auto", "npu", "native", None, None) == "float16"
    assert resolve_kv_cache("auto", "npu", "onnx", None, None) == "float32"
    assert resolve_kv_cache("auto", "cpu", "native", None, None) == "float32"  # the float32 path stays exact to HF eager
    assert resolve_kv_cache("auto", "npu", "native", "calibrate,quantize", None) == "float32"  # a --pipeline runs what it names
    assert resolve_kv_cache("auto", "npu", "native", None, "50%") == "float32"  # float16 would be refused
    assert resolve_kv_cache("auto", "npu", "native", None, None, soc="8gen3") == "float32"  # the QNN prompt's CPU attention
    for fmt in ("float32", "int8", "float16"):
        assert resolve_kv_cache(fmt, "npu", "native", None, None) == fmt


def test_default_native_npu_bundle_has_a_float16_cache(model_dirs, calib_words, tmp_path, native_kernels):
    """`llmc compile --target npu --cpu-kernels native` without --kv-cache writes a float16 cache (float16_kv_cache
    first in the pipeline, DecodeAttentionFloat16 in the decode graph) that decodes; --kv-cache float32 keeps the
    float32 one, and so do a memory-budgeted compile and a model whose attention the native op does not take at every
    row count (phi's partial rotary)."""
    from click.testing import CliRunner

    from llmc.cli import cli
    from llmc.runtime import Session

    from test_native import _ops

    base = ["--target", "npu", "--cpu-kernels", "native", "--chunk", str(CHUNK),
            "--max-context", str(MAX_CONTEXT), "--calib", str(calib_words), "--calib-tokens", "256", "--quiet"]
    cases = (("llama", [], "float16"), ("llama", ["--kv-cache", "float32"], "float32"), ("llama", ["--memory-budget", "90%"], "float32"),
             ("phi", [], "float32"))
    for i, (family, extra, fmt) in enumerate(cases):
        out = tmp_path / str(i)
        r = CliRunner().invoke(cli, ["compile", str(model_dirs(family)), *base, *extra, "-o", str(out)])
        assert r.exit_code == 0, r.output
        m = json.loads((out / "manifest.json").read_text())
        assert m["pipeline"].startswith("float16_kv_cache,") == (not extra), (family, extra, m["pipeline"])
        if "--memory-budget" in extra:
            continue
        ops = _ops(out)[f"{m['decode_graph']}.r1"]
        assert ("DecodeAttentionFloat16" in ops) == (fmt == "float16") and ("DecodeAttention" in ops) == (fmt == "float32")
        s = Session(out, "cpu")
        s.prefill(_ids(CHUNK + 3))
        assert np.isfinite(s.decode(5)).all()
        assert {a.dtype for a in [*s.cache.k.values(), *s.cache.v.values()]} == {np.dtype(fmt)}


def test_auto_keeps_float32_where_native_attention_would_not_read_the_halves(model_dirs):
    """Run for --kv-cache auto, float16_kv_cache leaves every cache float32 when some layer's attention is not one the
    decode graph's native op takes at one row and at chunk rows (phi rotates 8 of its 16 dims, so its prompt attends
    outside the decode graph; llama's is taken); asked for explicitly, it marks them all."""
    from test_quantization import _ctx, _run

    for family, kept in (("phi", True), ("llama", False)):
        g, ctx = _ctx(model_dirs(family), cpu_kernels="native", kv_cache_auto=True)
        _run(g, ctx, "float16_kv_cache")
        assert all(("kv_dtype" not in n.attrs) == kept for n in g.find("Attention")), family
    g, ctx = _ctx(model_dirs("phi"), cpu_kernels="native")
    _run(g, ctx, "float16_kv_cache")
    assert all(n.attrs["kv_dtype"] == "float16" for n in g.find("Attention"))
