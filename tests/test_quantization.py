"""The quantized npu path: calibration, shadow plan, quantize rewrite, shadow kernel, end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import CHUNK, MAX_CONTEXT

CALIB = ("the cat saw a dog and the quick brown fox jumps over the lazy dog . " * 40).strip()


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("calib") / "calib.txt"
    p.write_text(CALIB)
    return p


def _ctx(model_dir, **kw):
    import torch
    import transformers as T

    from llmc.lift import lift, trace
    from llmc.pass_manager import CompileOptions, ModelInputs, PassContext

    m = T.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    tok = T.AutoTokenizer.from_pretrained(model_dir)
    g = lift(trace(m, CHUNK), m)
    opts = CompileOptions(target="npu", chunk=CHUNK, max_context=MAX_CONTEXT, calib_tokens=256, **kw)
    return g, PassContext(opts, ModelInputs(lambda t: tok(t)["input_ids"], "test-" + str(model_dir)))


def _run(g, ctx, pipeline):
    from llmc.pass_manager import parse_pipeline, run_pipeline
    from llmc.passes import REGISTRY

    run_pipeline(g, parse_pipeline(pipeline, REGISTRY), ctx)


@pytest.mark.parametrize("T_", [16, 200])
@pytest.mark.parametrize("zero_point", [0, 128])
def test_shadow_kernel_restores_float_matmul(T_, zero_point):
    """clip(x) @ W (the NPU part) + the shadow correction: exactly x @ W for the rows whose outliers are in hot
    channels (their float rows), and x @ W less the codes' rounding of the cold outliers' rows otherwise; 200 rows
    run in four blocks of 50, each over its own channels (17 only in the third, 30 only in the last). The codes
    are int8, or uint8 + 128 (a memory-budgeted bundle's)."""
    from llmc.passes.quantize import quantize_weight
    from llmc.runtime import kernels

    rng = np.random.default_rng(0)
    K, N = 32, 24
    x = rng.standard_normal((T_, K)).astype(np.float32)
    planted = [(1, 3, 40.0), (5, 3, -25.0), (T_ // 2 + 1, 17, 60.0), (T_ - 1, 30, -80.0)]
    for r, c, val in planted:
        x[r, c] = val
    W1 = rng.standard_normal((N, K)).astype(np.float32)  # two Linears reading x (like gate/up)
    W2 = rng.standard_normal((N // 2, K)).astype(np.float32)
    Wcat = np.concatenate([W1, W2])
    codes, scale = quantize_weight(Wcat, per_channel=True, offset=zero_point)
    deq = (codes.astype(np.float32) - zero_point) * scale
    lo, hi = -4.0, 4.0
    ys_npu = [np.clip(x, lo, hi) @ W1.T, np.clip(x, lo, hi) @ W2.T]
    hot = [3]  # channel 3 exact (its float row less the codes'), 17 and 30 from the codes
    pos = np.full(K, -1)
    pos[hot] = 0
    hot_delta = Wcat[:, hot].T - deq[hot]
    args = (hot_delta, codes, scale, zero_point, pos, lo, hi)
    ys, count = kernels.shadow_outliers(x, ys_npu, [N, N // 2], *args, T_)
    delta = x - np.clip(x, lo, hi)
    given = deq.copy()
    given[hot] = Wcat[:, hot].T
    want = np.clip(x, lo, hi) @ Wcat.T + delta @ given
    np.testing.assert_allclose(np.concatenate(ys, axis=1), want, rtol=1e-5, atol=1e-4)
    for r in (1, 5):  # hot outliers only: the float result
        np.testing.assert_allclose(ys[0][r], (x @ W1.T)[r], rtol=1e-5, atol=1e-4)
    cold = T_ - 1  # a cold outlier: the codes' rounding of its row, far below the clip's error
    err = np.abs(ys[0][cold] - (x @ W1.T)[cold]).max()
    assert 0 < err < 0.05 * np.abs(ys_npu[0][cold] - (x @ W1.T)[cold]).max()
    assert count == len(planted)
    # padded rows (beyond n) are left alone
    ys2, count2 = kernels.shadow_outliers(x, ys_npu, [N, N // 2], *args, 4)
    np.testing.assert_allclose(ys2[0][:4], (x @ W1.T)[:4], rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(ys2[0][4:], ys_npu[0][4:])
    assert count2 == 1
    # the rows SelectRows kept (the LM head's input): fewer than the chunk's n
    ys3, count3 = kernels.shadow_outliers(x[1:2], [y[1:2] for y in ys_npu], [N, N // 2], *args, T_)
    np.testing.assert_allclose(ys3[0], (x @ W1.T)[1:2], rtol=1e-5, atol=1e-4)
    assert count3 == 1


def test_calibration_stats_and_cache(model_dirs, calib_file, tmp_path, monkeypatch):
    from llmc.analyses import CalibrationStats
    from llmc.passes.calibrate import Calibrate

    g, ctx = _ctx(model_dirs("llama"), calib_file=str(calib_file), cache_dir=str(tmp_path))
    _run(g, ctx, "calibrate")
    st = ctx.get(CalibrationStats)
    linear_inputs = {n.inputs[0].name for n in g.nodes if n.op == "Linear"}
    attention_kv = {v.name for n in g.find("Attention") for v in n.inputs[1:3]}  # for quantize_kv_cache
    assert set(st.inputs) == linear_inputs | attention_kv
    assert st.inputs["model.layers.0.self_attn.k_proj"].channel_absmax.shape == (g.find("Attention")[0].inputs[1].shape[-1],)
    assert st.tokens == 256 and st.corpus == str(calib_file)
    s = st.inputs["model.layers.0.input_layernorm"]
    assert s.count == 256 * 64
    assert 0 < s.percentile(50) <= s.percentile(99) <= s.percentile(99.99) <= s.absmax
    assert s.channel_absmax.max() == pytest.approx(s.absmax)
    assert s.channel_counts_above(0.0).sum() == s.count
    # a second compile reads the cache instead of running the model
    monkeypatch.setattr(Calibrate, "_collect", lambda *a: (_ for _ in ()).throw(AssertionError("recalibrated")))
    g2, ctx2 = _ctx(model_dirs("llama"), calib_file=str(calib_file), cache_dir=str(tmp_path), clip_percentile=95.0)
    _run(g2, ctx2, "calibrate")
    st2 = ctx2.get(CalibrationStats)
    assert st2.inputs["model.layers.0.input_layernorm"].absmax == pytest.approx(s.absmax)
    np.testing.assert_array_equal(st2.inputs["model.layers.0.input_layernorm"].hist, s.hist)


def test_calibration_bins_match_edges():
    """The bit-table binning puts every value where searching the bin edges would."""
    from llmc.analyses import channel_edges, hist_edges
    from llmc.passes.calibrate import _Accumulator

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((96, 48)) * np.exp2(rng.uniform(-30, 24, (96, 48)))).astype(np.float32)
    edges, ch_edges = hist_edges(), channel_edges()
    flat = x.reshape(-1)
    flat[:4] = [0.0, -0.0, np.inf, -np.inf]
    flat[50:53] = np.array([0x7FC00000, 0xFFC00000, 0x7F800001], np.uint32).view(np.float32)  # quiet and signalling NaN: bin 0
    flat[100 : 100 + len(edges) - 1] = edges[1:]  # exactly on each edge
    flat[1000 : 1000 + len(edges) - 1] = -np.nextafter(edges[1:].astype(np.float32), np.float32(0))  # just below each edge
    acc = _Accumulator(48)
    acc.add(x[:50])
    acc.add(x[50:])
    a = np.abs(np.where(np.isnan(x), np.float32(0), x).astype(np.float64))
    fine = np.searchsorted(edges, a, side="right") - 1
    coarse = np.searchsorted(ch_edges, a, side="right") - 1
    np.testing.assert_array_equal(acc.hist, np.bincount(fine.ravel(), minlength=len(edges)))
    for c in range(48):
        np.testing.assert_array_equal(acc.channel_hist[c], np.bincount(coarse[:, c], minlength=len(ch_edges)))
    np.testing.assert_array_equal(acc.channel_absmax, a.max(axis=0).astype(np.float32))
    assert acc.absmax == np.inf and acc.count == x.size
    after_nan = _Accumulator(2)  # a NaN neither sticks in the maxima nor stops them from growing
    after_nan.add(np.array([[1.0, np.nan]], np.float32))
    after_nan.add(np.array([[100.0, 3.0]], np.float32))
    assert after_nan.absmax == 100.0 and after_nan.channel_absmax.tolist() == [100.0, 3.0]
    # edges are 16 per octave to within the 12-bit grid, and powers of two are exact
    assert np.all(np.abs(edges[1:] / np.exp2(np.arange(len(edges) - 1) / 16 - 24) - 1) < 2.0**-12)
    assert edges[1 + 16 * 24] == 1.0 and ch_edges[1 + 2 * 4] == 1.0


def test_shadow_plan_decisions(model_dirs, calib_file):
    from llmc.analyses import CalibrationStats, ShadowPlan

    g, ctx = _ctx(model_dirs("llama"), calib_file=str(calib_file), shadow_keep=0.5, clip_percentile=99.0, pruned_percentile=None, hot_budget=0.05)
    _run(g, ctx, "calibrate,extract_shadow_outliers")
    plan, st = ctx.get(ShadowPlan), ctx.get(CalibrationStats)
    kept = [q for q in plan.inputs.values() if q.shadow]
    pruned = [q for q in plan.inputs.values() if not q.shadow]
    assert len(kept) == round(0.5 * len(plan.inputs))
    assert min(q.importance for q in kept) >= max(q.importance for q in pruned)
    for q in kept:
        assert q.clip == pytest.approx(st.inputs[q.value].percentile(99.0))
        assert q.hi == pytest.approx(q.clip) and q.lo == pytest.approx(-q.clip * 128 / 127)
    for q in pruned:
        assert q.clip == pytest.approx(st.inputs[q.value].absmax) and q.hot_channels == ()
    int8_bytes = sum(n.weights["weight"].shape[0] * n.weights["weight"].shape[1] for n in g.nodes if n.op == "Linear")
    readers = {}
    for n in g.nodes:
        if n.op == "Linear":
            readers[n.inputs[0].name] = readers.get(n.inputs[0].name, 0) + 4 * n.weights["weight"].shape[0]
    resident = sum(len(q.hot_channels) * readers[q.value] for q in kept)
    assert 0 < resident <= 0.05 * int8_bytes

    g, ctx = _ctx(model_dirs("llama"), calib_file=str(calib_file), shadow=False)
    _run(g, ctx, "calibrate,extract_shadow_outliers")
    assert not any(q.shadow for q in ctx.get(ShadowPlan).inputs.values())


def test_quantize_rewrites_only_linears(model_dirs, calib_file):
    from llmc.analyses import ShadowPlan

    g, ctx = _ctx(model_dirs("qwen2"), calib_file=str(calib_file), shadow_keep=0.5)
    before = {}
    for n in g.nodes:
        before[n.op] = before.get(n.op, 0) + 1
    _run(g, ctx, "calibrate,extract_shadow_outliers,quantize")
    after = {}
    for n in g.nodes:
        after[n.op] = after.get(n.op, 0) + 1
    plan = ctx.get(ShadowPlan)
    assert "Linear" not in after and after["QLinear"] == before["Linear"]
    kept_inputs = {n.inputs[0].name for n in g.nodes if n.op == "QLinear" and plan.inputs[n.inputs[0].name].shadow}
    assert after["ShadowOutliers"] == len(kept_inputs) > 0  # one shadow per activation, shared by its Linears
    for sh in g.find("ShadowOutliers"):
        readers = [n for n in g.nodes if n.op == "QLinear" and n.inputs[0] is sh.inputs[0]]
        assert len(sh.inputs) == 1 + len(readers) and sh.attrs["splits"] == [r.weights["qweight"].shape[1] for r in readers]
    for op in before:
        if op != "Linear":
            assert after[op] == before[op], op
    q = g.node("model.layers.0.self_attn.q_proj.q")
    assert "bias" in q.weights and q.weights["qweight"].dtype == "int8" and q.attrs["w_zero_point"] == 0


def test_quantize_weight_roundtrip():
    from llmc.passes.quantize import quantize_weight

    rng = np.random.default_rng(1)
    w = rng.standard_normal((6, 10)).astype(np.float32)
    q, s = quantize_weight(w, per_channel=True)
    assert q.shape == (10, 6) and q.dtype == np.int8 and s.shape == (6,)
    deq = q.astype(np.float32) * s
    np.testing.assert_allclose(deq.T, w, atol=float(s.max()) / 2 + 1e-6)
    assert q.min() >= -127 and q.max() <= 127 and np.abs(q).max(axis=0).tolist() == [127] * 6  # symmetric: each channel reaches 127
    q, s = quantize_weight(w, per_channel=False)
    assert s.shape == (1,)


def test_quantize_weight_in_seven_bits():
    """--weight-bits 7: codes in [-63, 63], each channel's largest at 63, scale = max |w| / 63, rounded to the nearest;
    the uint8 form is the same codes plus 128; other widths are refused."""
    from llmc.passes.quantize import FED_ZERO_POINT, quantize_weight

    rng = np.random.default_rng(4)
    w = rng.standard_normal((5, 40)).astype(np.float32)
    q, s = quantize_weight(w, per_channel=True, bits=7)
    np.testing.assert_array_equal(s, (np.abs(w).max(axis=1) / 63.0).astype(np.float32))
    assert q.dtype == np.int8 and q.min() >= -63 and q.max() <= 63 and np.abs(q).max(axis=0).tolist() == [63] * 5
    np.testing.assert_array_equal(q, np.rint(w / s[:, None]).astype(np.int8).T)
    u, _ = quantize_weight(w, per_channel=True, offset=FED_ZERO_POINT, bits=7)
    np.testing.assert_array_equal(u.astype(np.int16) - 128, q)
    with pytest.raises(ValueError, match="weight bits 6"):
        quantize_weight(w, per_channel=True, bits=6)


@pytest.mark.parametrize("per_channel", [False, True])
def test_quantize_weight_in_blocks_matches_whole_matrix(per_channel, monkeypatch):
    """Blocks of rows (bounded temporaries) give exactly the whole-matrix formula's values."""
    from llmc.passes import quantize

    monkeypatch.setattr(quantize, "_BLOCK_ELEMENTS", 64)  # 7-row blocks of a 9-column matrix
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((50, 9)) * 3).astype(np.float32)
    w[3] = 0.0  # an all-zero row keeps scale 1 per channel
    w[40, 2] = 25.0  # the per-tensor maximum sits in a late block
    q, s = quantize.quantize_weight(w, per_channel)
    amax = np.abs(w).max(axis=1) if per_channel else np.array([np.abs(w).max()], np.float32)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    want = (np.clip(np.rint(w / (scale[:, None] if per_channel else scale)), -127, 127)).astype(np.int8).T
    np.testing.assert_array_equal(s, scale)
    np.testing.assert_array_equal(q, want)
    assert q.flags.c_contiguous


@pytest.fixture(scope="module")
def npu_bundles(tmp_path_factory, model_dirs, calib_file):
    from llmc.compile import compile_model

    root = tmp_path_factory.mktemp("npu")
    out = {}
    for name, kw in {"shadow": {}, "noshadow": {"shadow": False}, "tensor": {"weight_granularity": "tensor"}, "bits7": {"weight_bits": 7}}.items():
        out[name] = root / name
        compile_model(str(model_dirs("llama")), out[name], target="npu", chunk=CHUNK, max_context=MAX_CONTEXT,
                      calib_file=str(calib_file), calib_tokens=256, **kw)
    return out


def test_a_manifest_with_other_weight_bits_is_refused(npu_bundles, tmp_path):
    """The manifest names the weights' bits, which pick the int8 kernels: a value no compile writes is a named BundleError."""
    import shutil

    from conftest import write_manifest

    from llmc.runtime import Session
    from llmc.runtime.errors import BundleError

    root = tmp_path / "bundle"
    shutil.copytree(npu_bundles["bits7"], root)
    m = json.loads((root / "manifest.json").read_text())
    assert m["weight_bits"] == 7 and json.loads((npu_bundles["shadow"] / "manifest.json").read_text())["weight_bits"] == 8
    m["weight_bits"] = 4
    write_manifest(root, m)
    with pytest.raises(BundleError, match="weight_bits 4"):
        Session(root)


@pytest.mark.parametrize("granularity, kernels, bits", [("channel", None, 8), ("tensor", None, 8), ("channel", "u8u8", 8), ("channel", "u8u8", 7)])
def test_npu_bundle_runs_integer_graphs_exactly(npu_bundles, model_dirs, calib_file, granularity, kernels, bits, monkeypatch):
    """ONNX Runtime's integer kernels give what the IR's fake-quant semantics say (the
    AVX2 u8 x s8 saturation this guards against would show up here), with per-channel weight
    scales and with one per tensor (a scalar in the graphs), in prefill and in decode; on the
    kernels the runtime picks for this CPU, and on the u8 x u8 ones it picks without VNNI. A bundle
    of 7-bit weights runs on the u8 x s8 kernels on every CPU, without VNNI too, exactly."""
    from llmc.interpreter import Interpreter
    from llmc.runtime import Session, cpu

    if kernels:
        monkeypatch.setenv(cpu.ENV, kernels)

    g, ctx = _ctx(model_dirs("llama"), calib_file=str(calib_file), weight_granularity=granularity, weight_bits=bits)
    _run(g, ctx, "dce,select_logit_rows,calibrate,extract_shadow_outliers,quantize,quantize_embedding")
    ids = [int(t) for t in np.random.default_rng(3).integers(4, 120, size=2 * CHUNK + 3)]
    ref = Interpreter(g).run(ids, select_rows=np.arange(len(ids)))
    s = Session(npu_bundles["bits7" if bits == 7 else "shadow" if granularity == "channel" else "tensor"])
    assert s.weight_bits == bits and s.int8_kernels == ("u8s8" if bits == 7 or (not kernels and cpu.u8s8_is_exact()) else "u8u8")
    s.reset()
    got = s.prefill(ids, all_logits=True)
    np.testing.assert_allclose(got, ref, atol=2e-3 * np.abs(ref).max())
    s.reset()
    s.prefill(ids[:-1])
    np.testing.assert_allclose(s.decode(ids[-1]), ref[-1], atol=2e-3 * np.abs(ref).max())
    wanted = "0" if bits == 7 or s.int8_kernels == "u8s8" else "1"  # the sessions ran on the kernels int8_kernels names
    assert {o.get_session_options().get_session_config_entry("session.x64quantprecision") for o, _ in s._sessions.values()} == {wanted}


def test_npu_bundle_close_to_fp32(npu_bundles, bundles):
    from llmc.runtime import Session
    from llmc.runtime.evaluate import agreement

    s_q, s_f = Session(npu_bundles["shadow"]), Session(bundles("llama"))
    ids = [int(t) for t in np.random.default_rng(5).integers(4, 120, size=20)]
    s_q.reset(), s_f.reset()
    lq, lf = s_q.prefill(ids, all_logits=True), s_f.prefill(ids, all_logits=True)
    assert np.abs(lq - lf).max() < 0.1 * np.abs(lf).max()
    a = agreement(s_q, s_f, [ids[:5], ids[5:12]], new_tokens=8)
    assert a.teacher_forced >= 0.75
    m = Session(npu_bundles["shadow"]).manifest
    ops = {st.get("op") for st in m["program"]}
    assert "ShadowOutliers" in ops
    assert all(m["graphs"][st["name"]]["placement"] == "npu" for st in m["program"] if st["kind"] == "graph")
    assert "ShadowOutliers" not in {st.get("op") for st in Session(npu_bundles["noshadow"]).manifest["program"]}


def test_report_json(npu_bundles):
    r = json.loads((npu_bundles["shadow"] / "report.json").read_text())
    assert r["quantization"]["shadow"] is True
    assert r["summary"]["shadow_kept"] == r["summary"]["linear_inputs"]
    assert r["summary"]["resident_shadow_fraction_of_int8_weights"] <= 0.01 + 1e-9
    names = {l["linear"] for l in r["linears"]}
    assert "model.layers.1.mlp.down_proj" in names and "lm_head" in names
    for l in r["linears"]:
        assert l["shadow"] in ("kept", "pruned") and l["x_scale"] > 0 and l["clip"] <= l["calib_absmax"] + 1e-6
    r2 = json.loads((npu_bundles["noshadow"] / "report.json").read_text())
    assert r2["summary"]["shadow_kept"] == 0 and r2["quantization"]["shadow"] is False


def test_eval_cli(npu_bundles, bundles, tmp_path):
    from click.testing import CliRunner

    from llmc.cli import cli

    text = tmp_path / "t.txt"
    text.write_text("the dog ran over the river and the king saw a blue bird in the tree . " * 6)
    prompts = tmp_path / "p.txt"
    prompts.write_text("the cat\nthe king saw\n")
    r = CliRunner().invoke(cli, ["eval", str(npu_bundles["shadow"]), "--text", str(text), "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert res["perplexity"]["tokens"] > 50 and res["perplexity"]["perplexity"] > 1
    assert res["shadow_outliers_seen"] is None  # the CPU program corrects inside its graphs, uncounted
    r = CliRunner().invoke(cli, ["eval", str(npu_bundles["shadow"]), "--against", str(bundles("llama")), "--prompts", str(prompts), "--new-tokens", "6"])
    assert r.exit_code == 0, r.output
    assert "teacher-forced" in r.output and "2 prompts" in r.output
    r = CliRunner().invoke(cli, ["eval", str(npu_bundles["shadow"])])
    assert r.exit_code == 2


@pytest.mark.parametrize("family, shadow", [("llama", True), ("llama", False), ("qwen2", True), ("phi", False)])
def test_onnx_runtime_keeps_every_qlinear_integer(model_dirs, calib_file, family, shadow, tmp_path, monkeypatch):
    """After ONNX Runtime's graph optimisations every QLinear of every graph is one integer matmul
    (MatMulIntegerToFloat) and no float Gemm or weight dequantization is left: a QLinear's bias
    (Qwen2's q/k/v, Phi's everywhere) or the residual Add right after it (no shadow path between)
    must not be fused into a float Gemm that dequantizes the int8 weights on every call.
    The weights stay int8 where the runtime finds the u8 x s8 kernels exact and become uint8
    (ONNX Runtime's own rewrite, exact everywhere) where it does not (llmc.runtime.cpu)."""
    import json

    import onnx
    import onnxruntime as ort
    from onnx.external_data_helper import load_external_data_for_model

    from llmc.compile import compile_model
    from llmc.runtime import cpu

    root = tmp_path / "bundle"
    compile_model(str(model_dirs(family)), root, target="npu", chunk=CHUNK, max_context=MAX_CONTEXT, calib_file=str(calib_file),
                  calib_tokens=256, shadow=shadow)
    m = json.loads((root / "manifest.json").read_text())
    checked = 0
    for name, g in m["graphs"].items():
        for rows, inst in g["instances"].items():
            model = onnx.load(str(root / inst["file"]), load_external_data=False)
            load_external_data_for_model(model, str(root))  # weight locations are relative to the bundle root
            qlinears = sum(n.op_type == "MatMul" and n.input[0].endswith(".xdq") for n in model.graph.node)
            for exact, weight_type in ((True, onnx.TensorProto.INT8), (False, onnx.TensorProto.UINT8)):
                monkeypatch.setenv(cpu.ENV, "vnni" if exact else "u8u8")
                cpu.u8s8_is_exact.cache_clear()  # read the variable again
                so = ort.SessionOptions()
                so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
                so.optimized_model_filepath = str(tmp_path / f"{name}.{rows}.onnx")
                cpu.int8_session_options(so)
                ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"], **cpu.session_kwargs())
                opt = onnx.load(so.optimized_model_filepath, load_external_data=False).graph
                ops = [n.op_type for n in opt.node]
                assert "Gemm" not in ops and "DequantizeLinear" not in ops, (name, rows, sorted(set(ops)))
                assert ops.count("MatMulIntegerToFloat") == qlinears, (name, rows)
                types = {t.name: t.data_type for t in opt.initializer}
                assert all(types[n.input[1]] == weight_type for n in opt.node if n.op_type == "MatMulIntegerToFloat"), (name, rows, exact)
            checked += qlinears
    assert checked > 0


def test_inspect_and_bench_show_seven_bit_weights(npu_bundles, monkeypatch):
    """`llmc inspect` names the weights' bits, and `llmc bench` the u8 x s8 kernels a 7-bit bundle runs on a CPU without VNNI."""
    from click.testing import CliRunner

    from llmc.cli import cli
    from llmc.runtime import cpu

    monkeypatch.setenv(cpu.ENV, "u8u8")  # a CPU whose u8 x s8 kernels saturate 8-bit codes
    root = str(npu_bundles["bits7"])
    r = CliRunner().invoke(cli, ["inspect", root, "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["weight_bits"] == 7, r.output
    assert "W8A8 codes of 7 bits" in CliRunner().invoke(cli, ["inspect", root]).output
    r = CliRunner().invoke(cli, ["bench", root, "--prompt-len", "12", "--new-tokens", "2", "--repeat", "1", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["int8_kernels"] == "u8s8", r.output
    r = CliRunner().invoke(cli, ["bench", str(npu_bundles["shadow"]), "--prompt-len", "12", "--new-tokens", "2", "--repeat", "1", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["int8_kernels"] == "u8u8", r.output
    for bundle, hint in ((npu_bundles["shadow"], True), (npu_bundles["bits7"], False)):  # 8-bit codes on u8 x u8: the text says what to do
        r = CliRunner().invoke(cli, ["bench", str(bundle), "--prompt-len", "12", "--new-tokens", "2", "--repeat", "1"])
        assert r.exit_code == 0 and ("--weight-bits 7" in r.output) == hint, r.output
