"""quantize_kv_cache (--kv-cache int8): per-channel scales from calibration, an int8 cache in every
attention path of the runtime (ONNX Runtime's chunk and one-row sessions, the decode graph, the numpy
kernel) and in the interpreter."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import CHUNK, MAX_CONTEXT, hf_logits


def _ids(n: int, seed: int = 5) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(4, 120, size=n)]


@pytest.fixture(scope="module")
def int8_bundles(tmp_path_factory, model_dirs, calib_words):
    """family -> (int8-cache bundle, float32-cache bundle), cpu target, chunk 8, context 64."""
    from llmc.compile import compile_model

    root = tmp_path_factory.mktemp("kv8")
    made = {}

    def get(family: str, **kw):
        key = (family, tuple(sorted(kw.items())))
        if key not in made:
            out = {}
            for fmt in ("int8", "float32"):
                out[fmt] = root / f"{family}-{fmt}-{len(made)}"
                compile_model(str(model_dirs(family)), out[fmt], chunk=CHUNK, max_context=MAX_CONTEXT, kv_cache=fmt,
                              calib_file=str(calib_words), calib_tokens=256, **kw)
            made[key] = out
        return made[key]

    return get


@pytest.mark.parametrize("rotary_dim", [16, 8, 0])
def test_key_bounds_hold_after_rotary_at_every_position(rotary_dim):
    """No rotation takes a key whose channels are within the calibration maxima past the key bound;
    the bound is tight (a pair at its maxima reaches it at some angle)."""
    from llmc.passes.quantize_kv_cache import key_bounds
    from llmc.runtime import kernels

    kv, d = 2, 16
    rng = np.random.default_rng(0)
    absmax = rng.uniform(0.5, 4.0, kv * d).astype(np.float32)
    bound = key_bounds(absmax, kv, d, rotary_dim)
    n = 4000
    k = (absmax * rng.choice([-1.0, 1.0], (n, kv * d))).astype(np.float32)  # every channel at its maximum
    if rotary_dim:
        inv_freq = (1.0 / 10000 ** (np.arange(0, rotary_dim, 2) / rotary_dim)).astype(np.float32)
        cos, sin = kernels.rotary_table(rng.integers(0, 10**6, n), inv_freq, 1.0)  # positions far apart: every angle
        k = kernels._rope(k.reshape(n, kv, d), cos, sin, rotary_dim).reshape(n, kv * d)
    assert np.all(np.abs(k) <= bound * (1 + 1e-5))
    np.testing.assert_allclose(np.abs(k).max(axis=0), bound, rtol=0.02)  # reached (to the positions' angles)
    if rotary_dim < d:
        np.testing.assert_array_equal(bound.reshape(kv, d)[:, rotary_dim:], absmax.reshape(kv, d)[:, rotary_dim:])


def test_pipeline_gains_calibration_and_the_pass():
    from llmc.compile import with_kv_cache
    from llmc.passes import DEFAULT_PIPELINES

    def names(p):
        return with_kv_cache(DEFAULT_PIPELINES[p].split(","))

    assert names("cpu")[:5] == ["dce", "select_logit_rows", "calibrate", "quantize_kv_cache", "fuse_sibling_linears"]
    assert names("cpu-int4")[2:5] == ["calibrate", "quantize_kv_cache", "quantize_int4"]
    npu = names("npu")
    assert npu.count("calibrate") == 1 and npu[npu.index("calibrate") + 1] == "quantize_kv_cache"
    assert with_kv_cache(["dce", "calibrate", "quantize_kv_cache"]) == ["dce", "calibrate", "quantize_kv_cache"]


def test_pass_needs_calibration_of_the_attention_inputs(model_dirs, tmp_path):
    from llmc.compile import compile_model
    from llmc.errors import CompileError, PassError

    with pytest.raises(PassError, match="quantize_kv_cache needs CalibrationStats"):
        compile_model(str(model_dirs("llama")), tmp_path / "b", chunk=CHUNK, max_context=MAX_CONTEXT,
                      pipeline="dce,select_logit_rows,quantize_kv_cache,chunk_static_graphs")
    assert not (tmp_path / "b").exists()
    with pytest.raises(CompileError, match="KV cache format"):
        compile_model(str(model_dirs("llama")), tmp_path / "c", kv_cache="fp8")


def test_ort_int8_cache_matches_numpy_kernel_and_saturates():
    """ONNX Runtime's int8 cache (chunk and one-row sessions) stores the numpy kernel's codes, saturating
    past the scale's range, and attends to the same numbers."""
    import onnxruntime as ort

    from llmc.runtime import kernels
    from llmc.runtime.ort_attention import OrtAttention

    h, kvh, d, cap = 4, 2, 16, 32
    rng = np.random.default_rng(1)
    scales = {0: (rng.uniform(0.01, 0.03, (kvh, d)).astype(np.float32), rng.uniform(0.01, 0.03, (kvh, d)).astype(np.float32))}
    ref, cache = kernels.KVCache({0: (kvh, d)}, cap, scales), kernels.KVCache({0: (kvh, d)}, cap, scales)
    assert cache.k[0].dtype == np.int8 and cache.nbytes == 2 * kvh * cap * d
    attn = OrtAttention(ort, cache, threads=2)
    inv_freq = (1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    start = 0
    for rows, n in [(8, 8), (8, 5), (1, 1), (1, 1), (8, 8)]:
        q, k, v = (rng.standard_normal((rows, f)).astype(np.float32) for f in (h * d, kvh * d, kvh * d))
        k[0, 3] = 50.0  # far past 127 codes: saturates
        cos, sin = kernels.rotary_table(np.arange(start, start + rows), inv_freq, 1.0)
        kw = dict(layer=0, start=start, n=n, num_heads=h, num_kv_heads=kvh, head_dim=d, scale=0.25, rotary_dim=d, sliding_window=0)
        want = kernels.attention(q, k, v, cos, sin, cache=ref, **kw)
        got = attn(q, k, v, cos, sin, **kw)
        np.testing.assert_allclose(got[:n], want[:n], atol=2e-3)
        codes, ref_codes = cache.k[0][:, : start + n].astype(int), ref.k[0][:, : start + n].astype(int)
        assert np.abs(codes - ref_codes).max() <= 1  # rounding of rotated keys may differ by one code
        np.testing.assert_array_equal(cache.v[0][:, : start + n], ref.v[0][:, : start + n])
        start += n
    assert cache.k[0].max() == 127 and ref.k[0].max() == 127


@pytest.mark.parametrize("family", ["llama", "mistral", "phi"])
def test_int8_cache_bundle_matches_interpreter_and_stays_near_hf(int8_bundles, model_dirs, calib_words, family):
    """Prefill over several chunks and decode through the decode graph (llama; mistral's sliding window
    attends in numpy; phi rotates 8 of 16 dims with RotaryEmbedding) with int8 caches give the interpreter's
    logits (the same quantization in numpy) and stay close to HF eager's float32 ones."""
    from llmc.interpreter import Interpreter
    from llmc.runtime import Session

    from test_quantization import _ctx, _run

    b = int8_bundles(family)["int8"]
    m = json.loads((b / "manifest.json").read_text())
    assert "calibrate,quantize_kv_cache" in m["pipeline"]
    attn = [s for s in m["program"] if s.get("op") == "Attention"]
    assert attn and all(set(s["weights"]) == {"k_scale", "v_scale"} for s in attn)
    ids = _ids(2 * CHUNK + 7)
    prompt = 2 * CHUNK + 3
    s = Session(b, "cpu")
    s.reset()
    got = [s.prefill(ids[:prompt])]
    assert all(a.dtype == np.int8 for a in list(s.cache.k.values()) + list(s.cache.v.values()))
    got += [s.decode(t) for t in ids[prompt:-1]]
    assert s.decode_path == "graph"
    g, ctx = _ctx(model_dirs(family), calib_file=str(calib_words))
    _run(g, ctx, "dce,select_logit_rows,calibrate,quantize_kv_cache")
    ref = Interpreter(g).run(ids[:-1], select_rows=np.arange(len(ids) - 1))[prompt - 1 :]
    hf = hf_logits(model_dirs(family), ids[:-1])[prompt - 1 :]
    for a, r, h in zip(got, ref, hf):
        np.testing.assert_allclose(a, r, atol=2e-3 * np.abs(r).max())
        # the tiny random model amplifies the cache's rounding: 7% of the largest logit (llama); scales 64x too
        # small (saturation) give 236%. The real model's perplexity is in test_smollm2.
        assert np.abs(a - h).max() < 0.15 * np.abs(h).max()


def test_cli_compiles_and_inspects_an_int8_cache(model_dirs, calib_words, tmp_path):
    from click.testing import CliRunner

    from llmc.cli import cli

    out = tmp_path / "b"
    r = CliRunner().invoke(cli, ["compile", str(model_dirs("qwen2")), "-o", str(out), "--chunk", str(CHUNK), "--max-context", str(MAX_CONTEXT),
                                 "--kv-cache", "int8", "--calib", str(calib_words), "--calib-tokens", "256", "--no-cache", "--quiet"])
    assert r.exit_code == 0, r.output
    assert "calibrate,quantize_kv_cache" in r.output
    r = CliRunner().invoke(cli, ["inspect", str(out), "--json"])
    assert r.exit_code == 0, r.output
    kv = json.loads(r.output)["kv_cache"]
    m = json.loads((out / "manifest.json").read_text())
    layers = [s["attrs"] for s in m["program"] if s.get("op") == "Attention"]
    assert kv["dtype"] == "int8" and kv["bytes_per_position"] == sum(2 * a["num_kv_heads"] * a["head_dim"] for a in layers)
    prompt = " ".join(calib_words.read_text().split()[:6])  # words the tiny tokenizer knows
    r = CliRunner().invoke(cli, ["run", str(out), "--prompt", prompt, "--max-new-tokens", "4", "--no-eos", "--json"])
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.output)["token_ids"]) == 4
