"""quantize_kv_cache (--kv-cache int8): per-channel scales from calibration, an int8 cache in every
attention path of the runtime (ONNX Runtime's one-row sessions and decode graph on the int8 node, chunks
in float32 over a dequantized scratch, the numpy kernel) and in the interpreter."""

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


@pytest.mark.parametrize("rotary_dim,scaling", [(16, 1.0), (8, 1.0), (0, 1.0), (16, 3.0)])
def test_key_bounds_hold_after_rotary_at_every_position(rotary_dim, scaling):
    """No rotation takes a key whose channels are within the calibration maxima past the key bound,
    also with tables scaled by an attention factor (YaRN); the bound is tight (a pair at its maxima
    reaches it at some angle)."""
    from llmc.passes.quantize_kv_cache import key_bounds
    from llmc.runtime import kernels

    kv, d = 2, 16
    rng = np.random.default_rng(0)
    absmax = rng.uniform(0.5, 4.0, kv * d).astype(np.float32)
    bound = key_bounds(absmax, kv, d, rotary_dim, scaling)
    n = 4000
    k = (absmax * rng.choice([-1.0, 1.0], (n, kv * d))).astype(np.float32)  # every channel at its maximum
    if rotary_dim:
        inv_freq = (1.0 / 10000 ** (np.arange(0, rotary_dim, 2) / rotary_dim)).astype(np.float32)
        cos, sin = kernels.rotary_table(rng.integers(0, 10**6, n), inv_freq, scaling)  # positions far apart: every angle
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
    from llmc.errors import CompileError, PipelineError

    with pytest.raises(PipelineError, match="quantize_kv_cache needs CalibrationStats"):
        compile_model(str(model_dirs("llama")), tmp_path / "b", chunk=CHUNK, max_context=MAX_CONTEXT,
                      pipeline="dce,select_logit_rows,quantize_kv_cache,chunk_static_graphs")
    assert not (tmp_path / "b").exists()
    with pytest.raises(CompileError, match="assume_kv_cache is for `llmc plan` only"):
        compile_model(str(model_dirs("llama")), tmp_path / "d", chunk=CHUNK, max_context=MAX_CONTEXT,
                      pipeline="dce,select_logit_rows,assume_kv_cache,chunk_static_graphs")
    assert not (tmp_path / "d").exists()
    with pytest.raises(CompileError, match="KV cache format"):
        compile_model(str(model_dirs("llama")), tmp_path / "c", kv_cache="fp8")


def test_ort_int8_cache_matches_numpy_kernel_and_saturates():
    """An int8 cache through ONNX Runtime (chunks over the float32 scratch, one row on the int8 node) stores
    the numpy kernel's codes, saturating past the scale's range, and attends to the same numbers."""
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
    # chunks attend with the float32 kernel over a dequantized scratch (the int8 one is 4-5x slower for many
    # rows); one row uses the int8 node
    assert (kvh, d) in attn._scratch
    assert {key[5] for key in attn._sessions} == {False, True}


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
    r = CliRunner().invoke(cli, ["bench", str(out), "--prompt-len", "12", "--new-tokens", "3", "--repeat", "1", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["kv_cache"] == "int8" and json.loads(r.output)["kv_cache_bytes"] == kv["bytes_per_position"] * MAX_CONTEXT
    prompt = " ".join(calib_words.read_text().split()[:6])  # words the tiny tokenizer knows
    r = CliRunner().invoke(cli, ["run", str(out), "--prompt", prompt, "--max-new-tokens", "4", "--no-eos", "--json"])
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.output)["token_ids"]) == 4


def test_yarn_attention_factor_scales_the_key_bound(tmp_path, calib_words):
    """YaRN multiplies the rotary tables by its attention factor (3 here): the key scales carry it, so
    rotated keys do not saturate (without it 17-23% of the key codes sat at +/-127)."""
    import transformers as T

    from conftest import COMMON, make_tokenizer, hf_logits
    from llmc.compile import compile_model
    from llmc.runtime import Session

    import torch

    torch.manual_seed(0)
    rope = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128, "attention_factor": 3.0, "rope_theta": 10000.0}
    model = T.AutoModelForCausalLM.from_config(T.LlamaConfig(**COMMON, rope_parameters=rope))
    src = tmp_path / "yarn"
    model.save_pretrained(src)
    make_tokenizer().save_pretrained(src)
    out = tmp_path / "b"
    compile_model(str(src), out, chunk=CHUNK, max_context=MAX_CONTEXT, kv_cache="int8", calib_file=str(calib_words), calib_tokens=256)
    m = json.loads((out / "manifest.json").read_text())
    assert next(s for s in m["program"] if s.get("op") == "RotaryTable")["attrs"]["scaling"] == pytest.approx(3.0)
    report = json.loads((out / "report.json").read_text())["kv_cache"]
    assert report["dtype"] == "int8" and len(report["layers"]) == COMMON["num_hidden_layers"]
    ids = _ids(2 * CHUNK + 4)
    s = Session(out, "cpu")
    s.reset()
    got = s.prefill(ids, all_logits=True)
    codes = np.concatenate([s.cache.k[layer][:, : len(ids)].ravel() for layer in s.cache.k])
    assert np.mean(np.abs(codes.astype(int)) >= 127) < 0.01
    ref = hf_logits(src, ids)
    # the factor sharpens the scores 9x, which amplifies the cache's rounding: this seed's logits stay within
    # 16% of the largest one (another init gave 69%; saturation 0.08%, 20% with the bound unscaled)
    assert np.abs(got - ref).max() < 0.25 * np.abs(ref).max()


def test_old_onnxruntime_is_refused_with_the_fix():
    from types import SimpleNamespace

    from llmc.runtime.errors import BundleError
    from llmc.runtime.ort_attention import check_int8_cache_support

    with pytest.raises(BundleError, match="int8 KV cache.*onnxruntime 1.26.0") as e:
        check_int8_cache_support(SimpleNamespace(__version__="1.26.0"), "b")
    assert "onnxruntime>=1.27" in e.value.hint
    check_int8_cache_support(SimpleNamespace(__version__="1.32.0"), "b")
    check_int8_cache_support(SimpleNamespace(__version__="1.27rc1"), "b")


def test_int8_chunks_of_layers_sharing_a_cache_shape_but_not_heads_or_scale():
    """The float32 scratch is shared by the layers of one cache shape; each chunk session (heads, scale)
    binds it itself, and chunks issued across layers in any order give the numpy kernel's numbers."""
    import onnxruntime as ort

    from llmc.runtime import kernels
    from llmc.runtime.ort_attention import OrtAttention

    kvh, d, cap = 2, 16, 32
    layers = {0: (4, 0.25), 1: (8, 0.25), 2: (4, 0.1)}  # layer -> (heads, scale)
    rng = np.random.default_rng(2)
    scales = {l: (rng.uniform(0.01, 0.03, (kvh, d)).astype(np.float32), rng.uniform(0.01, 0.03, (kvh, d)).astype(np.float32)) for l in layers}
    shapes = {l: (kvh, d) for l in layers}
    ref, cache = kernels.KVCache(shapes, cap, scales), kernels.KVCache(shapes, cap, scales)
    attn = OrtAttention(ort, cache, threads=2)
    inv_freq = (1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    for start, rows, n in [(0, 8, 8), (8, 8, 8), (16, 8, 5)]:
        for layer in (2, 0, 1):
            h, scale = layers[layer]
            q, k, v = (rng.standard_normal((rows, f)).astype(np.float32) for f in (h * d, kvh * d, kvh * d))
            cos, sin = kernels.rotary_table(np.arange(start, start + rows), inv_freq, 1.0)
            kw = dict(layer=layer, start=start, n=n, num_heads=h, num_kv_heads=kvh, head_dim=d, scale=scale, rotary_dim=d, sliding_window=0)
            np.testing.assert_allclose(attn(q, k, v, cos, sin, **kw), kernels.attention(q, k, v, cos, sin, cache=ref, **kw), atol=1e-5)
    assert len(attn._scratch) == 1 and len(attn._scratch_bound) == 3


def test_int8_cache_switches_decode_to_all_threads_where_float32_does():
    """The one-thread cutoff of one-row attention counts float32 bytes for an int8 cache too:
    ONNX Runtime dequantizes before its matmuls, so the work per position does not shrink."""
    import onnxruntime as ort

    from llmc.runtime import kernels
    from llmc.runtime.ort_attention import ONE_THREAD_KV_BYTES, OrtAttention

    h, kvh, d, cap = 4, 2, 16, 32
    cutoffs = []
    for scales in (None, {0: (np.full((kvh, d), 0.02, np.float32), np.full((kvh, d), 0.02, np.float32))}):
        attn = OrtAttention(ort, kernels.KVCache({0: (kvh, d)}, cap, scales), threads=2)
        x = np.zeros((1, h * d), np.float32)
        kv = np.zeros((1, kvh * d), np.float32)
        attn(x, kv, kv, None, None, layer=0, start=0, n=1, num_heads=h, num_kv_heads=kvh, head_dim=d, scale=0.25, rotary_dim=0, sliding_window=0)
        cutoffs.append(attn._one[0]._one_thread_len)
    assert cutoffs[0] == cutoffs[1] == ONE_THREAD_KV_BYTES // (2 * kvh * d * 4)


def test_int8_cache_prefills_outside_the_decode_graph(int8_bundles):
    """A decode graph over int8 caches gets no chunk instance (ONNX Runtime's int8-cache kernel is several times
    slower for a chunk than attending over a dequantized copy, as the runtime's chunk attention does); the
    float32 twin prefills in it."""
    from llmc.runtime import Session

    b = int8_bundles("llama")
    for fmt, want in (("int8", {"1"}), ("float32", {"1", str(CHUNK)})):
        m = json.loads((b[fmt] / "manifest.json").read_text())
        assert set(m["graphs"][m["decode_graph"]]["instances"]) == want, fmt
    assert Session(b["int8"], "cpu").prefill_path == "chunk program" and Session(b["float32"], "cpu").prefill_path == "graph"
