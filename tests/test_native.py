"""llmc's native CPU kernels (llmc.runtime.native): the ShadowCorrection op against numpy, bundles
compiled with --cpu-kernels native against the stock-op bundle, and the errors around building and
loading the library."""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pytest

from conftest import CHUNK, MAX_CONTEXT


def _op_model(x_shape, wt: np.ndarray, lo: float, hi: float, base: bool):
    from onnx import TensorProto, helper, numpy_helper

    n = wt.shape[1]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))]
    names = ["x", "wt"]
    if base:
        inputs.append(helper.make_tensor_value_info("base", TensorProto.FLOAT, [*x_shape[:-1], n]))
        names.append("base")
    node = helper.make_node("ShadowCorrection", names, ["y"], domain="ai.llmc", lo=lo, hi=hi)
    g = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(wt, "wt")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.llmc", 1)])


def _session(model, library, threads: int = 2):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _outliers(rng, shape, rate: float, lo: float, hi: float) -> np.ndarray:
    x = rng.uniform(lo, hi, shape).astype(np.float32)
    hit = rng.random(shape) < rate
    x[hit] = (rng.choice([-1.0, 1.0], hit.sum()) * rng.uniform(1.5, 20.0, hit.sum()) * max(abs(lo), hi)).astype(np.float32)
    return x


@pytest.mark.parametrize("shape,n,threads", [((64, 96), 300, 2), ((2, 5, 40), 256, 1), ((1, 96), 520, 2), ((33, 8), 7, 2),
                                             ((4, 512), 4000, 2), ((48, 600), 1500, 2), ((40, 1000), 1500, 2)])
def test_shadow_correction_matches_numpy(native_kernels, shape, n, threads):
    """base + (x - clip(x, lo, hi)) @ wt, at chunk and one-row shapes, a partial last column tile (300,
    520), exactly one tile (256), fewer columns than a tile (7), with and without base, on one thread
    and on ONNX Runtime's pool (4 rows of 4,000 columns: tasks of a row by a group of column tiles, the
    outliers found before them; 48 and 40 rows: tasks that find their own rows' outliers, 16 blocks of 3
    rows, and 14 blocks by 2 groups of tiles); rows without outliers are base exactly."""
    rng = np.random.default_rng(sum(shape) + n)
    lo, hi = -0.75, 1.25
    x = _outliers(rng, shape, 0.03, lo, hi)
    x.reshape(-1, shape[-1])[0] = np.clip(x.reshape(-1, shape[-1])[0], lo, hi)  # a row with no outlier
    wt = rng.standard_normal((shape[-1], n)).astype(np.float32)
    base = rng.standard_normal((*shape[:-1], n)).astype(np.float32)
    corr = (x - np.clip(x, lo, hi)).astype(np.float64) @ wt.astype(np.float64)
    for with_base in (True, False):
        sess = _session(_op_model(shape, wt, lo, hi, with_base), native_kernels, threads)
        y = sess.run(None, {"x": x, "base": base} if with_base else {"x": x})[0]
        ref = corr + base if with_base else corr
        assert y.shape == ref.shape and y.dtype == np.float32
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-4 * np.abs(ref).max())
        first = y.reshape(-1, n)[0]
        np.testing.assert_array_equal(first, base.reshape(-1, n)[0] if with_base else np.zeros(n, np.float32))


@pytest.mark.parametrize("rows,n", [(0, 40), (6, 0)])
def test_shadow_correction_of_nothing_is_empty(native_kernels, rows, n):
    """No rows, or a weight table of no columns: an empty result of the right shape."""
    rng = np.random.default_rng(5)
    wt = rng.standard_normal((24, n)).astype(np.float32)
    x = _outliers(rng, (rows, 24), 0.2, -1.0, 1.0)
    sess = _session(_op_model((rows, 24), wt, -1.0, 1.0, True), native_kernels)
    y = sess.run(None, {"x": x, "base": np.zeros((rows, n), np.float32)})[0]
    assert y.shape == (rows, n) and y.dtype == np.float32


def test_shadow_correction_takes_float16_tables(native_kernels):
    """A float16 weight table: the correction is the float16 weights' (widened exactly) at 300 columns (a
    partial last vector); a table of another type is a named error when the op runs."""
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument, RuntimeException

    rng = np.random.default_rng(4)
    lo, hi = -0.5, 0.5
    x = _outliers(rng, (40, 64), 0.05, lo, hi)
    wt = rng.standard_normal((64, 300)).astype(np.float16)
    base = rng.standard_normal((40, 300)).astype(np.float32)
    y = _session(_op_model(x.shape, wt, lo, hi, True), native_kernels).run(None, {"x": x, "base": base})[0]
    ref = base + (x - np.clip(x, lo, hi)).astype(np.float64) @ wt.astype(np.float64)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-4 * np.abs(ref).max())
    with pytest.raises((Fail, InvalidArgument, RuntimeException), match="float32, float16, int8 or uint8"):
        _session(_op_model(x.shape, wt.astype(np.float64), lo, hi, True), native_kernels).run(None, {"x": x, "base": base})


def _codes_model(x_shape, codes: np.ndarray, scale: np.ndarray, hot: list[int], hot_delta: np.ndarray | None, lo: float, hi: float,
                 residual: bool = False):
    """ShadowCorrection(x, codes, base, residual?, wt_scale, hot_delta?; hot_channels): the correction from int8 codes."""
    from onnx import TensorProto, helper, numpy_helper

    n = codes.shape[1]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape)),
              helper.make_tensor_value_info("base", TensorProto.FLOAT, [*x_shape[:-1], n])]
    if residual:
        inputs.append(helper.make_tensor_value_info("res", TensorProto.FLOAT, [*x_shape[:-1], n]))
    inits = [numpy_helper.from_array(codes, "wt"), numpy_helper.from_array(scale, "wt_scale")]
    names = ["x", "wt", "base", "res" if residual else "", "wt_scale"]
    if hot_delta is not None:
        inits.append(numpy_helper.from_array(hot_delta, "hot_delta"))
        names.append("hot_delta")
    node = helper.make_node("ShadowCorrection", names, ["y"], domain="ai.llmc", lo=lo, hi=hi, **({"hot_channels": hot} if hot else {}))
    g = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.llmc", 1)])


@pytest.mark.parametrize("shape,n,threads,hot", [((64, 96), 300, 2, [0, 7, 95]), ((1, 96), 520, 2, [3]), ((33, 8), 7, 2, []),
                                                 ((48, 600), 1500, 2, list(range(0, 600, 9))), ((1, 576), 1100, 1, [5, 6])])
@pytest.mark.parametrize("zero_point", [0, 128])
def test_shadow_correction_reads_int8_codes(native_kernels, shape, n, threads, hot, zero_point):
    """From a projection's codes (int8, or uint8 offset by 128) the correction is base + delta @ ((codes - zero point)
    * wt_scale), and a hot channel's outliers add its row of hot_delta: what the runtime's kernel
    (llmc.runtime.kernels.shadow_outliers) computes, at chunk and one-row shapes, partial tiles, on one thread and two."""
    from llmc.runtime import kernels

    rng = np.random.default_rng(sum(shape) + n + zero_point)
    lo, hi = -0.75, 1.25
    x = _outliers(rng, shape, 0.03, lo, hi)
    for c in hot[:2]:  # the hot channels hold outliers in some rows
        x.reshape(-1, shape[-1])[-1, c] = 9.0
    codes = (rng.integers(-127, 128, (shape[-1], n)) + zero_point).astype(np.uint8 if zero_point else np.int8)
    scale = rng.uniform(0.5, 1.5, n).astype(np.float32) * 1e-2
    hot_delta = rng.standard_normal((max(len(hot), 1), n)).astype(np.float32) * 1e-3 if hot else None
    base = rng.standard_normal((*shape[:-1], n)).astype(np.float32)
    res = rng.standard_normal((*shape[:-1], n)).astype(np.float32)
    sess = _session(_codes_model(shape, codes, scale, hot, hot_delta, lo, hi, residual=True), native_kernels, threads)
    y = sess.run(None, {"x": x, "base": base, "res": res})[0]
    pos = np.full(shape[-1], -1, np.int64)
    pos[hot] = np.arange(len(hot))
    x2, b2 = x.reshape(-1, shape[-1]), base.reshape(-1, n)
    (ref,), count = kernels.shadow_outliers(x2, [b2], [n], hot_delta if hot else np.zeros((1, n), np.float32), codes, scale, zero_point, pos,
                                            lo, hi, len(x2))
    assert count > 0
    ref = ref.reshape(y.shape) + res
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    if hot:  # the hot rows count: without them the result differs
        plain = _session(_codes_model(shape, codes, scale, [], None, lo, hi, residual=True), native_kernels, threads)
        assert not np.allclose(plain.run(None, {"x": x, "base": base, "res": res})[0], y, rtol=0, atol=1e-7)


def test_shadow_correction_codes_named_errors(native_kernels):
    """Codes without one scale per column, hot channels without their rows or past K, and a float table with scales
    are errors that name the op and what it takes."""
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument, RuntimeException

    errors = (Fail, InvalidArgument, RuntimeException)
    codes, scale = np.ones((16, 8), np.int8), np.ones(8, np.float32)
    x, base = np.zeros((2, 16), np.float32), np.zeros((2, 8), np.float32)

    def run(match, *args):
        with pytest.raises(errors, match=match):
            _session(_codes_model((2, 16), *args, -1.0, 1.0), native_kernels).run(None, {"x": x, "base": base})

    run("wt_scale, one scale per column", codes, scale[:3], [], None)
    run("hot_channels need hot_delta \\[hot channels, N\\]", codes, scale, [1, 2], np.zeros((1, 8), np.float32))
    run("hot_channels must be channels of x \\(below K\\)", codes, scale, [16], np.zeros((1, 8), np.float32))
    run("a float weight table takes no wt_scale", codes.astype(np.float32), scale, [], None)


def test_shadow_correction_nan_is_an_outlier(native_kernels):
    """A NaN entry poisons its row (as the stock ops' correction does), and only its row."""
    rng = np.random.default_rng(1)
    x = rng.uniform(-1, 1, (4, 16)).astype(np.float32)
    x[2, 5] = np.nan
    wt = rng.standard_normal((16, 300)).astype(np.float32)
    base = np.zeros((4, 300), np.float32)
    y = _session(_op_model(x.shape, wt, -1.0, 1.0, True), native_kernels).run(None, {"x": x, "base": base})[0]
    assert np.isnan(y[2]).all() and not np.isnan(y[[0, 1, 3]]).any()


def test_shadow_correction_rejects_mismatched_shapes(native_kernels):
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument, RuntimeException

    errors = (InvalidArgument, Fail, RuntimeException)
    wt = np.zeros((8, 4), np.float32)
    sess = _session(_op_model(("r", "k"), wt, -1.0, 1.0, True), native_kernels)
    with pytest.raises(errors, match="ShadowCorrection: x must be"):
        sess.run(None, {"x": np.zeros((2, 9), np.float32), "base": np.zeros((2, 4), np.float32)})
    with pytest.raises(errors, match="ShadowCorrection: base must be"):
        sess.run(None, {"x": np.zeros((2, 8), np.float32), "base": np.zeros((3, 4), np.float32)})


@pytest.fixture(scope="module")
def npu_pair(model_dirs, calib_words, tmp_path_factory, native_kernels):
    """The tiny Llama compiled for npu twice: the corrections as stock ops, and as the native op (both over a float32
    cache, which native npu bundles otherwise replace with a float16 one)."""
    from llmc.compile import compile_model

    root = tmp_path_factory.mktemp("native")
    out = {}
    for kernels in ("onnx", "native"):
        out[kernels] = root / kernels
        compile_model(str(model_dirs("llama")), out[kernels], target="npu", chunk=CHUNK, max_context=MAX_CONTEXT,
                      calib_file=str(calib_words), calib_tokens=256, cpu_kernels=kernels, kv_cache="float32")
    return out


def test_a_warmed_session_computes_what_a_lazy_one_does(npu_pair, monkeypatch):
    """Warm-up runs the decode graph once at position 0 (its W8A8MatMul ops pack their weights then, with AVX-512 VNNI):
    the prompt's logits and the decode tokens' after it are the same, bit for bit, as a lazy session's, whose ops do
    that work at its first decode."""
    from llmc.runtime import Session
    from llmc.runtime.decode_graph import DecodeGraphRunner

    primed = []
    prime = DecodeGraphRunner.prime
    monkeypatch.setattr(DecodeGraphRunner, "prime", lambda self: (primed.append(self), prime(self))[1])
    ids = [int(i) for i in np.random.default_rng(4).integers(3, 120, CHUNK + 5)]
    got = []
    for lazy in (False, True):
        s = Session(npu_pair["native"], "cpu", lazy=lazy)
        assert len(primed) == 1  # at the warmed session's load, not the lazy one's
        logits = [s.prefill(ids)]
        for _ in range(4):
            logits.append(s.decode(int(np.argmax(logits[-1]))))
        got.append(logits)
    for a, b in zip(*got):
        np.testing.assert_array_equal(a, b)


def _ops(bundle) -> dict[str, set[str]]:
    import onnx

    m = json.loads((bundle / "manifest.json").read_text())
    ops = {}
    for name, g in m["graphs"].items():
        for inst in g["instances"].values():
            ops[f"{name}.r{inst['rows']}"] = {n.op_type for n in onnx.load(str(bundle / inst["file"]), load_external_data=False).graph.node}
    return ops


def _nodes(bundle, instance: str) -> list:
    """The nodes of a bundle's graph instance (``name.r<rows>``)."""
    import onnx

    m = json.loads((bundle / "manifest.json").read_text())
    name, rows = instance.rsplit(".r", 1)
    entry = next(i for i in m["graphs"][name]["instances"].values() if i["rows"] == int(rows))
    return list(onnx.load(str(bundle / entry["file"]), load_external_data=False).graph.node)


def test_native_bundle_computes_what_the_stock_bundle_does(npu_pair, tmp_path, monkeypatch):
    """Same logits over a two-chunk prompt (the chunk instances) and decode (the one-row ones) as the stock
    bundle (both corrections read the same int8 codes), its attention's products in float32
    (LLMC_ATTN_BF16=0; in bfloat16, where the CPU has them, the logits stay within 5% of the largest, as 8-bit
    codes move by one here and there); every CPU graph with a correction has the native op and none of the stock
    correction's ops."""
    from llmc.runtime import Session, native

    m = json.loads((npu_pair["native"] / "manifest.json").read_text())
    assert m["cpu_kernels"] == "native" and "cpu_kernels" not in json.loads((npu_pair["onnx"] / "manifest.json").read_text())
    native_ops, stock_ops = _ops(npu_pair["native"]), _ops(npu_pair["onnx"])
    corrected = [g for g, ops in stock_ops.items() if "Clip" in ops]
    assert corrected and any(g.endswith(".r1") for g in corrected) and any(not g.endswith(".r1") for g in corrected)
    for g in corrected:  # one-row graphs: the correction is inside the projection's W8A8MatMul, with its quantization
        op, stock = ("W8A8MatMul", {"ShadowCorrection", "QuantizeLinear", "DequantizeLinear", "MatMul"}) if g.endswith(".r1") else ("ShadowCorrection", set())
        assert op in native_ops[g] and not ({"Clip", "TopK", "Compress", "GatherElements"} | stock) & native_ops[g], g
    # the NPU's graphs (QNN) keep stock ops only
    npu_graphs = [g for g, e in m["graphs"].items() if e["placement"] == "npu"]
    assert npu_graphs and not any(op.startswith(("ShadowCorrection", "DecodeAttention", "SwiGLU"))
                                  for g, ops in native_ops.items() if g.rsplit(".r", 1)[0] in npu_graphs for op in ops)
    # the MLP's activation straight from the corrected gate/up projection, no Slice of it nor Sigmoid: in a chunk inside
    # that projection's ShadowCorrection (SwiGLU's attributes; it writes the codes the down projection reads), at one
    # row inside the down projection's W8A8MatMul (its gate and up attributes)
    decode, chunk = f"{m['decode_graph']}.r1", f"{m['decode_graph']}.r{CHUNK}"
    assert not {"SwiGLU", "Sigmoid", "Slice"} & (native_ops[chunk] | native_ops[decode])
    gated = [n for n in _nodes(npu_pair["native"], chunk) if n.op_type == "ShadowCorrection" and {"gate", "up", "width"} <= {a.name for a in n.attribute}]
    assert gated and all(len(n.output) == 2 and n.output[1].endswith(".codes") for n in gated)
    assert "Sigmoid" in stock_ops[decode] and "SwiGLU" not in stock_ops[decode]
    assert not any("ShadowCorrection" in ops for ops in stock_ops.values())
    # in the decode graph each projection is one W8A8MatMul: its quantization, correction, the norm before it and the
    # residual Add after it inside; a chunk's norms (llmc's RMSNorm) write the codes their projections read
    layers = sum(1 for n in _nodes(npu_pair["onnx"], decode) if n.op_type == "GroupQueryAttention")
    counts = {op: sum(1 for n in _nodes(npu_pair["native"], decode) if n.op_type == op)
              for op in ("W8A8MatMul", "QuantizeLinear", "Add", "RMSNorm", "RMSNormalization", "SwiGLU")}
    assert layers and counts == {"W8A8MatMul": 4 * layers + 1, "QuantizeLinear": 0, "Add": 0, "RMSNorm": 0, "RMSNormalization": 0, "SwiGLU": 0}, counts
    w8 = [n for n in _nodes(npu_pair["native"], decode) if n.op_type == "W8A8MatMul"]
    assert sum(len(n.input) > 5 and bool(n.input[5]) for n in w8) == 2 * layers + 1  # norms
    assert sum({"gate", "up"} <= {a.name for a in n.attribute} for n in w8) == layers  # the down projections
    # the decode graph's projections may keep their weights in their own layout too (they stay loaded); the other
    # one-row graphs' (the CPU program's, which a memory budget streams) may not
    assert all({(a.name, a.i) for a in n.attribute} >= {("pack", 1)} for n in w8)
    others = [n for g in native_ops if g.endswith(".r1") and g != decode for n in _nodes(npu_pair["native"], g) if n.op_type == "W8A8MatMul"]
    assert others and not any(a.name == "pack" for n in others for a in n.attribute)
    assert "RMSNorm" in native_ops[chunk] and "RMSNormalization" in stock_ops[decode] and "W8A8MatMul" not in native_ops[chunk]
    # a W8A8 program's attention may multiply in bfloat16 (bf16=1), in its chunk and one-row graphs alike
    attention = [n for g in (decode, chunk) for n in _nodes(npu_pair["native"], g) if n.op_type.startswith("DecodeAttention")]
    assert len(attention) == 2 * layers and all({(a.name, a.i) for a in n.attribute} >= {("bf16", 1)} for n in attention)

    # both bundles' corrections read the projections' int8 codes: the same weights, no float table beside them
    stock = json.loads((npu_pair["onnx"] / "manifest.json").read_text())["weights"]
    assert {n: (w["dtype"], w["nbytes"]) for n, w in m["weights"].items()} == {n: (w["dtype"], w["nbytes"]) for n, w in stock.items()}
    assert not [n for n in stock if n.endswith(".weight_t")] and not any(w["dtype"] in ("float16", "float32") and len(w["shape"]) == 2
                                                                         and w.get("part") == "codes" for w in stock.values())
    rounded = npu_pair["onnx"]

    ids = [int(t) for t in np.random.default_rng(7).integers(4, 120, size=2 * CHUNK + 5)]
    logits = {}
    monkeypatch.setenv("LLMC_ATTN_BF16", "0")
    for kernels, bundle in (("native", npu_pair["native"]), ("onnx", rounded), ("bf16", npu_pair["native"])):
        if kernels == "bf16":
            monkeypatch.delenv("LLMC_ATTN_BF16")
        s = Session(bundle, "cpu", verify=False)
        s.reset()
        logits[kernels] = [s.prefill(ids[:-4])] + [s.decode(t) for t in ids[-4:]]
    for a, b, c in zip(logits["native"], logits["onnx"], logits["bf16"]):
        np.testing.assert_allclose(a, b, atol=1e-4 * max(1.0, np.abs(b).max()))
        np.testing.assert_allclose(c, b, atol=5e-2 * max(1.0, np.abs(b).max()))
    if "bf16_chunks" in native.features(native.library_path()):  # the prompt's chunks did multiply in bfloat16
        assert not np.array_equal(logits["bf16"][0], logits["native"][0])


@pytest.mark.parametrize("options", [{"weight_granularity": "tensor"}, {"shadow": False}])
def test_w8a8_matmul_without_a_fused_correction(model_dirs, calib_words, tmp_path, native_kernels, options, monkeypatch):
    """One weight scale per matrix (q/k/v and gate/up not merged: their corrections take several projections and stay
    ShadowCorrection, while o_proj's and down_proj's join theirs) and no shadow outliers at all (W8A8MatMul without a
    weight table): the one-row graph's logits, token by token, are the chunk graph's over the same prompt (its
    attention's products in float32, LLMC_ATTN_BF16=0, as a row's are)."""
    from llmc.compile import compile_model
    from llmc.runtime import Session

    monkeypatch.setenv("LLMC_ATTN_BF16", "0")

    out = tmp_path / "npu"
    compile_model(str(model_dirs("llama")), out, target="npu", chunk=CHUNK, max_context=MAX_CONTEXT, calib_file=str(calib_words),
                  calib_tokens=256, cpu_kernels="native", **options)
    decode = f"{json.loads((out / 'manifest.json').read_text())['decode_graph']}.r1"
    nodes = _nodes(out, decode)
    w8 = [n for n in nodes if n.op_type == "W8A8MatMul"]
    assert w8 and not {"QuantizeLinear", "DequantizeLinear", "MatMul"} & {n.op_type for n in nodes}
    if options.get("shadow", True):  # q, k, v, gate, up alone; o_proj and down_proj with their corrections
        assert sum(len(n.input) == 3 for n in w8) == 5 * sum(n.op_type.startswith("DecodeAttention") for n in nodes)
        assert "ShadowCorrection" in {n.op_type for n in nodes}
    else:
        assert "ShadowCorrection" not in {n.op_type for n in nodes} and all(len(n.input) < 4 or not n.input[3] for n in w8)
    ids = [int(t) for t in np.random.default_rng(3).integers(4, 120, size=CHUNK + 6)]
    s = Session(out, "cpu")
    s.reset()
    whole = s.prefill(ids, all_logits=True)
    s.reset()
    s.prefill(ids[:CHUNK])
    stepped = [s.decode(t) for t in ids[CHUNK:]]
    for a, b in zip(stepped, whole[CHUNK:]):
        np.testing.assert_allclose(a, b, atol=1e-4 * max(1.0, np.abs(b).max()))


def test_native_bundle_without_the_library_is_a_named_error(npu_pair, tmp_path, monkeypatch):
    """inspect and bench name the native kernels; without the library a Session and `llmc run` fail with exit 11."""
    from click.testing import CliRunner

    from llmc.cli import cli
    from llmc.runtime import Session, native
    from llmc.runtime.errors import NativeKernelError

    r = CliRunner().invoke(cli, ["inspect", str(npu_pair["native"]), "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["cpu_kernels"] == "native"
    r = CliRunner().invoke(cli, ["bench", str(npu_pair["native"]), "--prompt-len", "12", "--new-tokens", "2", "--repeat", "1", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["native_kernels"] == str(native.library_path())
    r = CliRunner().invoke(cli, ["bench", str(npu_pair["onnx"]), "--prompt-len", "12", "--new-tokens", "2", "--repeat", "1", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["native_kernels"] is None
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "empty"))
    with pytest.raises(NativeKernelError, match="--cpu-kernels native") as e:
        Session(npu_pair["native"], "cpu")
    assert "llmc kernels build" in e.value.hint
    Session(npu_pair["onnx"], "cpu")  # a stock-op bundle needs no library
    r = CliRunner().invoke(cli, ["run", str(npu_pair["native"]), "--prompt-ids", "5,6,7", "--max-new-tokens", "2"])
    assert r.exit_code == 11 and "llmc kernels build" in r.output
    monkeypatch.setenv("LLMC_KERNELS", str(tmp_path / "missing.so"))
    with pytest.raises(NativeKernelError, match=r"\$LLMC_KERNELS names .*missing.so"):
        Session(npu_pair["native"], "cpu")


def test_library_name_is_keyed_by_the_cpu(monkeypatch):
    """-march=native builds for one CPU: another CPU's signature names another library."""
    from llmc.runtime import native

    name = native.library_name()
    monkeypatch.setattr(native, "cpu_signature", lambda: "another cpu")
    assert native.library_name() != name and native.library_name().startswith("libllmc_kernels-")


def test_build_is_cached_and_named_errors(native_kernels, tmp_path, monkeypatch):
    """A second build keeps the library; a missing header directory and a missing compiler are named
    errors (exit 11) that leave no file behind."""
    from click.testing import CliRunner

    from llmc.cli import cli
    from llmc.runtime import native
    from llmc.runtime.errors import NativeKernelError

    before = native_kernels.stat().st_mtime_ns
    assert native.build() == native_kernels and native_kernels.stat().st_mtime_ns == before
    assert native.library_path() == native_kernels
    r = CliRunner().invoke(cli, ["kernels", "path"])
    assert r.exit_code == 0 and r.output.strip() == str(native_kernels)

    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(NativeKernelError, match="onnxruntime_cxx_api.h is not in") as e:
        native.build(include=tmp_path)
    assert "--ort-include" in e.value.hint
    with pytest.raises(NativeKernelError, match=re.escape("no C++ compiler 'no-such-c++' on PATH")):
        native.build(cxx="no-such-c++")
    r = CliRunner().invoke(cli, ["kernels", "build", "--ort-include", str(tmp_path)])
    assert r.exit_code == 11 and "onnxruntime_cxx_api.h" in r.output
    r = CliRunner().invoke(cli, ["kernels", "path"])
    assert r.exit_code == 11 and "not built" in r.output
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "onnxruntime_cxx_api.h").write_text("#error not the real header\n")
    with pytest.raises(NativeKernelError, match="building llmc's native kernels failed"):
        native.build(include=tmp_path / "bad")
    assert not list((tmp_path / "cache" / "native").glob("*"))  # the failed build's temporary file is gone


def test_cpu_kernels_needs_a_pass_that_makes_its_ops(model_dirs, tmp_path):
    """--cpu-kernels is refused in a pipeline with neither shadow corrections nor the decode graph."""
    from llmc.compile import compile_model
    from llmc.errors import CompileError

    with pytest.raises(CompileError, match="--cpu-kernels has no effect"):
        compile_model(str(model_dirs("llama")), tmp_path / "b", target="cpu", chunk=CHUNK, max_context=MAX_CONTEXT, cpu_kernels="native",
                      pipeline="dce,select_logit_rows,chunk_static_graphs,place,schedule,plan_offload", explicit={"cpu_kernels"})
    with pytest.raises(CompileError, match="unknown --cpu-kernels 'fast'"):
        compile_model(str(model_dirs("llama")), tmp_path / "b", target="npu", cpu_kernels="fast")
    assert not (tmp_path / "b").exists()


def test_environment_names_a_library(native_kernels, monkeypatch, tmp_path):
    """$LLMC_KERNELS points the runtime at a library built elsewhere."""
    from llmc.runtime import native

    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "empty"))
    assert native.library_path() is None
    monkeypatch.setenv("LLMC_KERNELS", str(native_kernels))
    assert native.library_path() == native_kernels and os.path.isfile(native.require_library())


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma", "phi", "qwen2"])
def test_native_decode_attention_matches_the_stock_bundle(bundles, model_dirs, tmp_path, native_kernels, family):
    """fp32 bundles: the decode graph's attention as DecodeAttention (one row, and the chunk instance's rows
    where there is one) gives GroupQueryAttention's logits, past a chunk of prompt, with the node rotating q
    and k (llama, qwen2), a sliding window shorter than the context (mistral, 12), and q/k rotated before it
    (gemma's head size 24, phi's partial rotary)."""
    from llmc.compile import compile_model
    from llmc.runtime import Session

    out = tmp_path / family
    compile_model(str(model_dirs(family)), out, target="cpu", chunk=CHUNK, max_context=MAX_CONTEXT, cpu_kernels="native")
    m = json.loads((out / "manifest.json").read_text())
    assert m["cpu_kernels"] == "native"
    ops = _ops(out)[f"{m['decode_graph']}.r1"]
    assert "DecodeAttention" in ops and "GroupQueryAttention" not in ops
    assert "GroupQueryAttention" in _ops(bundles(family))[f"{m['decode_graph']}.r1"]
    # the gated MLPs' silu(gate) * up as one SwiGLU from the fused gate/up projection (gemma's and phi's MLPs are not silu-gated)
    assert ("SwiGLU" in ops) == (family in ("llama", "mistral", "qwen2")) and "Sigmoid" not in ops
    # DecodeAttention takes the projection's [rows, F] as it is where no RotaryEmbedding comes between
    assert ("Reshape" in ops) == ("RotaryEmbedding" in ops) == (family in ("gemma", "phi"))
    # the chunk instance (prefill, where the node rotates q and k) too, mistral's in its window (the stock bundle
    # has no chunk instance for a window)
    chunk_ops = _ops(out).get(f"{m['decode_graph']}.r{CHUNK}")
    assert (chunk_ops is not None) == (family in ("llama", "qwen2", "mistral"))
    assert chunk_ops is None or ("DecodeAttention" in chunk_ops and "GroupQueryAttention" not in chunk_ops)
    ids = [int(t) for t in np.random.default_rng(11).integers(4, 120, size=CHUNK + 18)]
    logits = {}
    for name, bundle in (("native", out), ("stock", bundles(family))):
        s = Session(bundle, "cpu")
        s.reset()
        s.prefill(ids[:CHUNK + 2])
        logits[name] = [s.decode(t) for t in ids[CHUNK + 2:]]
    for a, b in zip(logits["native"], logits["stock"]):
        np.testing.assert_allclose(a, b, atol=1e-4 * max(1.0, np.abs(b).max()))


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_native_decode_attention_over_an_int8_cache(model_dirs, calib_words, tmp_path, native_kernels, family):
    """--kv-cache int8: DecodeAttentionInt8 (the prompt's chunk and each token) stores and reads the codes the
    stock bundle's program and GroupQueryAttention's quantized cache do.
    Its float sums run in another order, so a value next to a rounding boundary can land on the neighbouring
    code (mistral: 1 of the cache's entries); the logits agree as closely as the int8 bundle agrees with the
    interpreter (test_quantize_kv_cache)."""
    from llmc.compile import compile_model
    from llmc.runtime import Session

    out = {}
    for kernels in ("onnx", "native"):
        out[kernels] = tmp_path / kernels
        compile_model(str(model_dirs(family)), out[kernels], target="cpu", chunk=CHUNK, max_context=MAX_CONTEXT, kv_cache="int8",
                      calib_file=str(calib_words), calib_tokens=256, cpu_kernels=kernels)
    m = json.loads((out["native"] / "manifest.json").read_text())
    ops = _ops(out["native"])[f"{m['decode_graph']}.r1"]
    assert "DecodeAttentionInt8" in ops and "GroupQueryAttention" not in ops
    # the prompt's chunk too: the native bundle's decode graph has a chunk instance over the int8 cache, the stock one none
    assert "DecodeAttentionInt8" in _ops(out["native"])[f"{m['decode_graph']}.r{CHUNK}"]
    assert f"{m['decode_graph']}.r{CHUNK}" not in _ops(out["onnx"])
    ids = [int(t) for t in np.random.default_rng(5).integers(4, 120, size=CHUNK + 18)]
    logits, caches = {}, {}
    for kernels, bundle in out.items():
        s = Session(bundle, "cpu")
        s.reset()
        s.prefill(ids[:CHUNK + 2])
        logits[kernels] = [s.decode(t) for t in ids[CHUNK + 2:]]
        caches[kernels] = [np.array(a[:, :len(ids)]) for a in [*s.cache.k.values(), *s.cache.v.values()]]
    for a, b in zip(logits["native"], logits["onnx"]):
        np.testing.assert_allclose(a, b, atol=2e-3 * np.abs(b).max())
    for a, b in zip(caches["native"], caches["onnx"]):
        diff = np.abs(a.astype(np.int16) - b)
        assert a.dtype == np.int8 and diff.max() <= 1 and np.count_nonzero(diff) <= 2e-3 * diff.size


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_native_int4_bundle_decodes_with_block_q_matmul(model_dirs, tmp_path, native_kernels, family):
    """--weights int4: the one-row graphs' 4-bit projections are BlockQMatMul, which widens its input itself
    (no Concat, Reshape or ReduceSum for the block sums), adds the residual stream after a block's last
    projection (no Add) and does the RMS norm before its first ones (no RMSNormalization), the chunk graphs keep MatMulNBits (float32 compute)
    and the 8-bit head its MatMulNBits; decode gives the stock bundle's logits (the same int8 activations),
    qwen2's q/k/v with their bias."""
    from llmc.compile import compile_model
    from llmc.runtime import Session

    out = {}
    for kernels in ("onnx", "native"):
        out[kernels] = tmp_path / kernels
        compile_model(str(model_dirs(family)), out[kernels], target="cpu", weight_format="int4", chunk=CHUNK, max_context=MAX_CONTEXT,
                      cpu_kernels=kernels)
    m = json.loads((out["native"] / "manifest.json").read_text())
    one_row = _nodes(out["native"], f"{m['decode_graph']}.r1")
    ops = [n.op_type for n in one_row]
    assert ops.count("BlockQMatMul") == 8 and not {"Concat", "ReduceSum", "Reshape"} & set(ops)
    # o_proj and down_proj add the residual stream themselves (2 layers): no Add but qwen2's q/k/v bias
    assert sum(len(n.input) == 5 for n in one_row if n.op_type == "BlockQMatMul") == 4
    assert ops.count("Add") == (2 if family == "qwen2" else 0)
    # ... and q/k/v and gate/up normalise their input themselves: the only RMSNormalization is the head's
    assert sum(len(n.input) == 6 for n in one_row if n.op_type == "BlockQMatMul") == 4 and ops.count("RMSNormalization") == 1
    assert [next(a.i for a in n.attribute if a.name == "bits") for n in one_row if n.op_type == "MatMulNBits"] == [8]
    assert not any("BlockQMatMul" in o for inst, o in _ops(out["native"]).items() if not inst.endswith(".r1"))
    ids = [int(t) for t in np.random.default_rng(3).integers(4, 120, size=CHUNK + 12)]
    logits = {}
    for kernels, bundle in out.items():
        s = Session(bundle, "cpu")
        s.reset()
        s.prefill(ids[:CHUNK + 2])
        logits[kernels] = [s.decode(t) for t in ids[CHUNK + 2:]]
    for a, b in zip(logits["native"], logits["onnx"]):
        np.testing.assert_allclose(a, b, atol=1e-4 * np.abs(b).max())


def test_more_than_16_query_heads_per_kv_head_keep_group_query_attention(tmp_path, native_kernels):
    """DecodeAttention takes up to 16 query heads per KV head; a model with more (32 heads, 1 KV head) keeps
    GroupQueryAttention in its native bundle, and the op refuses such a node when its session loads."""
    import torch
    import transformers as T
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument, RuntimeException

    from conftest import COMMON, make_tokenizer
    from llmc.compile import compile_model
    from llmc.runtime import Session

    torch.manual_seed(0)
    src = tmp_path / "mqa"
    T.AutoModelForCausalLM.from_config(T.LlamaConfig(**{**COMMON, "hidden_size": 256, "num_attention_heads": 32,
                                                        "num_key_value_heads": 1})).save_pretrained(src)
    make_tokenizer().save_pretrained(src)
    out = tmp_path / "b"
    compile_model(str(src), out, target="cpu", chunk=CHUNK, max_context=MAX_CONTEXT, cpu_kernels="native")
    m = json.loads((out / "manifest.json").read_text())
    ops = _ops(out)[f"{m['decode_graph']}.r1"]
    assert "GroupQueryAttention" in ops and "DecodeAttention" not in ops
    s = Session(out, "cpu")
    s.reset()
    s.prefill([5, 6, 7])
    assert np.isfinite(s.decode(8)).all()

    from onnx import TensorProto, helper

    vi = helper.make_tensor_value_info
    node = helper.make_node("DecodeAttention", ["q", "", "", "pk", "pv", "seqlens", "total"], ["o", "ck", "cv"], domain="ai.llmc",
                            num_heads=34, kv_num_heads=2, scale=1.0)
    g = helper.make_graph([node], "g", [vi("q", TensorProto.FLOAT, [1, 1, 34 * 8 + 4 * 8]), vi("pk", TensorProto.FLOAT, [1, 2, 4, 8]),
                                        vi("pv", TensorProto.FLOAT, [1, 2, 4, 8]), vi("seqlens", TensorProto.INT32, [1]),
                                        vi("total", TensorProto.INT32, [])],
                          [vi("o", TensorProto.FLOAT, None), vi("ck", TensorProto.FLOAT, None), vi("cv", TensorProto.FLOAT, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.llmc", 1)])
    with pytest.raises((Fail, InvalidArgument, RuntimeException), match="kv_num_heads times 1 to 16"):
        _session(model, native_kernels).run(None, {"q": np.zeros((1, 1, 34 * 8 + 4 * 8), np.float32), "pk": np.zeros((1, 2, 4, 8), np.float32),
                                                   "pv": np.zeros((1, 2, 4, 8), np.float32), "seqlens": np.zeros(1, np.int32),
                                                   "total": np.ones((), np.int32)})


_CACHE_OPS = {"float32": ("DecodeAttention", np.float32), "int8": ("DecodeAttentionInt8", np.int8),
              "float16": ("DecodeAttentionFloat16", np.float16)}


@pytest.mark.parametrize("d,heads,kv,cache,flat", [(16, 4, 2, "float32", False), (80, 4, 2, "float32", True), (20, 4, 2, "float32", False),
                                                 (16, 14, 2, "float32", False), (80, 7, 1, "int8", False), (20, 5, 1, "int8", True),
                                                 (16, 4, 2, "int8", False), (16, 4, 2, "float16", False), (80, 7, 1, "float16", True),
                                                 (20, 5, 1, "float16", False)])
def test_decode_attention_against_numpy(native_kernels, d, heads, kv, cache, flat):
    """DecodeAttention (and DecodeAttentionInt8, int8 caches with per-channel scales, and DecodeAttentionFloat16,
    float16 caches) alone, q/k/v separate, no rotary, 300 positions (3 split-K blocks, a partial one): the new K/V row lands at seqlens_k (as its codes),
    the output is softmax(q k^T * scale) v per head over the group's KV head, and a NaN in one head's query
    makes that head's output NaN and no other's. Head sizes: whole vectors (16), whole vectors past the widest
    register block (80), and one the vector loops do not take (20). Groups of 2, 5, 7 query heads per KV head:
    the kernel reads a key or value row once for a batch of heads (3, or 4 with AVX-512), so some groups end in
    a part-filled batch. flat: q, k, v and the output without the leading 1 ([rows, F], as the decode graph
    feeds the projection's rows)."""
    from onnx import TensorProto, helper
    from onnx.helper import np_dtype_to_tensor_dtype

    cap, p = 320, 299
    lead = [] if flat else [1]
    vi = helper.make_tensor_value_info
    op, dtype = _CACHE_OPS[cache]
    int8 = cache == "int8"
    ct = np_dtype_to_tensor_dtype(np.dtype(dtype))
    names = ["q", "k", "v", "pk", "pv", "seqlens", "total"] + (["", "", "ks", "vs"] if int8 else [])
    node = helper.make_node(op, names, ["o", "ck", "cv"], domain="ai.llmc", num_heads=heads, kv_num_heads=kv, scale=0.25)
    inputs = [vi("q", TensorProto.FLOAT, lead + [1, heads * d]), vi("k", TensorProto.FLOAT, lead + [1, kv * d]),
              vi("v", TensorProto.FLOAT, lead + [1, kv * d]), vi("pk", ct, [1, kv, cap, d]), vi("pv", ct, [1, kv, cap, d]),
              vi("seqlens", TensorProto.INT32, [1]), vi("total", TensorProto.INT32, [])]
    if int8:
        inputs += [vi("ks", TensorProto.FLOAT, [1, kv, 1, d]), vi("vs", TensorProto.FLOAT, [1, kv, 1, d])]
    g = helper.make_graph([node], "g", inputs, [vi("o", TensorProto.FLOAT, None), vi("ck", ct, None), vi("cv", ct, None)])
    sess = _session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.llmc", 1)]), native_kernels)
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((*lead, 1, n * d)).astype(np.float32) for n in (heads, kv, kv))
    feeds = {"q": q, "k": k, "v": v, "seqlens": np.array([p], np.int32), "total": np.array(p + 1, np.int32)}
    if int8:
        ks, vs = (rng.uniform(0.01, 0.03, (1, kv, 1, d)).astype(np.float32) for _ in range(2))
        pk, pv = (rng.integers(-128, 128, (1, kv, cap, d), dtype=np.int8) for _ in range(2))
        feeds.update(pk=pk, pv=pv, ks=ks, vs=vs)
        new_k, new_v = (np.clip(np.rint(x.reshape(kv, d) / sc[0, :, 0]), -128, 127).astype(np.int8) for x, sc in ((k, ks), (v, vs)))
    else:  # float16: a new row is stored as numpy rounds it
        pk, pv = (rng.standard_normal((1, kv, cap, d)).astype(dtype) for _ in range(2))
        feeds.update(pk=pk, pv=pv)
        new_k, new_v = k.reshape(kv, d).astype(dtype), v.reshape(kv, d).astype(dtype)
    o, ck, cv = sess.run(None, feeds)
    assert o.shape == (*lead, 1, heads * d)
    K, V = pk[0].copy(), pv[0].copy()
    K[:, p], V[:, p] = new_k, new_v
    np.testing.assert_array_equal(ck[0, :, p], K[:, p])
    np.testing.assert_array_equal(cv[0, :, p], V[:, p])
    if int8:
        K, V = K * ks[0], V * vs[0]
    K, V = K.astype(np.float32), V.astype(np.float32)
    group = heads // kv
    for h in range(heads):
        s = K[h // group, : p + 1].astype(np.float64) @ q.reshape(heads, d)[h] * 0.25
        w = np.exp(s - s.max())
        np.testing.assert_allclose(o.reshape(heads, d)[h], (w / w.sum()) @ V[h // group, : p + 1], rtol=1e-4, atol=1e-5)
    last = heads - 1  # in a group's last batch of heads
    q.reshape(-1)[last * d + 3] = np.nan
    o = sess.run(None, {**feeds, "q": q})[0].reshape(heads, d)
    assert np.isnan(o[last]).all() and np.isfinite(o[:last]).all()


@pytest.mark.parametrize("cache", ["int8", "float16"])
def test_chunk_rows_enter_the_cache_as_single_rows_do(native_kernels, cache):
    """A chunk's new rows, rotated and written into the caches in blocks on ONNX Runtime's pool (57 rows of 6 + 2 x 2
    heads of 80 columns), land in the caches bit for bit as the same rows sent one at a time (the decode path) put
    them, and the chunk's outputs match the single rows' (an int8 cache: queries times K's scales, codes of
    rint(x / scale))."""
    from onnx import TensorProto, helper
    from onnx.helper import np_dtype_to_tensor_dtype

    heads, kv, d, cap, p0, rows = 6, 2, 80, 128, 9, 57
    op, dtype = _CACHE_OPS[cache]
    ct = np_dtype_to_tensor_dtype(np.dtype(dtype))
    vi = helper.make_tensor_value_info
    int8 = cache == "int8"
    names = ["q", "k", "v", "pk", "pv", "seqlens", "total", "cos", "sin"] + (["ks", "vs"] if int8 else [])
    inputs = [vi("q", TensorProto.FLOAT, [1, None, heads * d]), vi("k", TensorProto.FLOAT, [1, None, kv * d]),
              vi("v", TensorProto.FLOAT, [1, None, kv * d]), vi("pk", ct, [1, kv, cap, d]), vi("pv", ct, [1, kv, cap, d]),
              vi("seqlens", TensorProto.INT32, [1]), vi("total", TensorProto.INT32, []),
              vi("cos", TensorProto.FLOAT, [cap, d // 2]), vi("sin", TensorProto.FLOAT, [cap, d // 2])]
    if int8:
        inputs += [vi("ks", TensorProto.FLOAT, [1, kv, 1, d]), vi("vs", TensorProto.FLOAT, [1, kv, 1, d])]
    node = helper.make_node(op, names, ["o", "ck", "cv"], domain="ai.llmc", num_heads=heads, kv_num_heads=kv, scale=0.1, do_rotary=1)
    g = helper.make_graph([node], "g", inputs, [vi("o", TensorProto.FLOAT, None), vi("ck", ct, None), vi("cv", ct, None)])
    sess = _session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.llmc", 1)]), native_kernels)
    rng = np.random.default_rng(57)
    q, k, v = (rng.standard_normal((1, rows, n * d)).astype(np.float32) for n in (heads, kv, kv))
    angles = np.arange(cap)[:, None] * 10000.0 ** (-np.arange(d // 2) / (d // 2))
    past = np.clip(np.rint(rng.standard_normal((1, kv, cap, d)) * 40), -128, 127) if int8 else rng.standard_normal((1, kv, cap, d))
    fixed = {"cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32)}
    if int8:
        fixed.update(ks=rng.uniform(0.01, 0.03, (1, kv, 1, d)).astype(np.float32), vs=rng.uniform(0.01, 0.03, (1, kv, 1, d)).astype(np.float32))
    pk0, pv0 = past.astype(dtype), past[:, :, ::-1].astype(dtype)

    def run(i0, i1, pk, pv):
        return sess.run(None, {**fixed, "q": q[:, i0:i1], "k": k[:, i0:i1], "v": v[:, i0:i1], "pk": pk, "pv": pv,
                               "seqlens": np.array([p0 + i1 - 1], np.int32), "total": np.array(p0 + i1, np.int32)})

    o, ck, cv = run(0, rows, pk0, pv0)
    pk, pv, singles = pk0, pv0, []
    for i in range(rows):
        out, pk, pv = run(i, i + 1, pk, pv)
        singles.append(out[0, 0])
    np.testing.assert_array_equal(ck, pk)
    np.testing.assert_array_equal(cv, pv)
    np.testing.assert_allclose(o[0], np.stack(singles), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("d,window,cache,rows,p0", [(32, 0, "float32", 21, 70), (80, 0, "float32", 21, 70), (32, 30, "float32", 21, 70),
                                                   (32, 0, "float16", 21, 70), (80, 30, "float16", 21, 70), (80, 0, "float16", 57, 70),
                                                   (32, 100, "float16", 57, 200)])
def test_chunk_attention_against_numpy(native_kernels, d, window, cache, rows, p0):
    """DecodeAttention (and DecodeAttentionFloat16) at 21 rows (two blocks of positions, 3 query heads per KV head:
    row groups that end part-filled) after 70 cached positions (two blocks of keys): the rows land at their
    positions, each row attends causally to the positions up to its own (with a window, the last 30 of them), over
    head sizes in whole blocks of 64 columns and not (80); a NaN in one row's query head makes that row and head NaN.
    57 rows of 80 columns: enough that blocks of the new rows are written to the caches on ONNX Runtime's pool.
    57 rows after 200 positions in a window of 100: the rows' windows start in different blocks of keys, none at the
    start of one (the call's key blocks are made once, from the earliest row's window start). Products in float32
    (no bf16 attribute: test_chunk_attention_products_in_bfloat16 has the other way)."""
    from onnx import TensorProto, helper
    from onnx.helper import np_dtype_to_tensor_dtype

    heads, kv, cap = 6, 2, 128 if p0 + rows <= 128 else 320
    p = p0 + rows - 1
    vi = helper.make_tensor_value_info
    op, dtype = _CACHE_OPS[cache]
    ct = np_dtype_to_tensor_dtype(np.dtype(dtype))
    attrs = {"local_window_size": window} if window else {}
    node = helper.make_node(op, ["q", "k", "v", "pk", "pv", "seqlens", "total"], ["o", "ck", "cv"], domain="ai.llmc",
                            num_heads=heads, kv_num_heads=kv, scale=0.2, **attrs)
    g = helper.make_graph([node], "g", [vi("q", TensorProto.FLOAT, [1, rows, heads * d]), vi("k", TensorProto.FLOAT, [1, rows, kv * d]),
                                        vi("v", TensorProto.FLOAT, [1, rows, kv * d]), vi("pk", ct, [1, kv, cap, d]),
                                        vi("pv", ct, [1, kv, cap, d]), vi("seqlens", TensorProto.INT32, [1]),
                                        vi("total", TensorProto.INT32, [])],
                          [vi("o", TensorProto.FLOAT, None), vi("ck", ct, None), vi("cv", ct, None)])
    sess = _session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.llmc", 1)]), native_kernels)
    rng = np.random.default_rng(d + window + p0)
    q, k, v = (rng.standard_normal((1, rows, n * d)).astype(np.float32) for n in (heads, kv, kv))
    pk, pv = (rng.standard_normal((1, kv, cap, d)).astype(dtype) for _ in range(2))
    feeds = {"q": q, "k": k, "v": v, "pk": pk, "pv": pv, "seqlens": np.array([p], np.int32), "total": np.array(p + 1, np.int32)}
    o, ck, cv = sess.run(None, feeds)
    K, V = pk[0].copy(), pv[0].copy()
    K[:, p0 : p + 1] = k.reshape(rows, kv, d).transpose(1, 0, 2)  # as the cache's type rounds them
    V[:, p0 : p + 1] = v.reshape(rows, kv, d).transpose(1, 0, 2)
    np.testing.assert_array_equal(ck[0, :, : p + 1], K[:, : p + 1])
    np.testing.assert_array_equal(cv[0, :, : p + 1], V[:, : p + 1])
    K, V = K.astype(np.float32), V.astype(np.float32)
    o = o.reshape(rows, heads, d)
    for i in range(rows):
        pos = p0 + i
        lo = max(0, pos + 1 - window) if window else 0
        for h in range(heads):
            s = K[h // 3, lo : pos + 1] @ q.reshape(rows, heads, d)[i, h] * 0.2
            w = np.exp(s - s.max())
            np.testing.assert_allclose(o[i, h], (w / w.sum()) @ V[h // 3, lo : pos + 1], rtol=1e-4, atol=1e-5)
    q[0, 3, d + 1] = np.nan  # row 3, head 1
    o = sess.run(None, {**feeds, "q": q})[0].reshape(rows, heads, d)
    assert np.isnan(o[3, 1]).all()
    o[3, 1] = 0
    assert np.isfinite(o).all()


def _bf16(x: np.ndarray) -> np.ndarray:
    """x's float32 values rounded to bfloat16 (to nearest, ties to even), as float32."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("cache,d,window,rows,p0", [("float16", 80, 0, 57, 70), ("float16", 32, 100, 57, 200), ("float16", 64, 0, 21, 0),
                                                    ("int8", 48, 0, 21, 70), ("int8", 64, 30, 57, 9), ("float32", 16, 0, 21, 70),
                                                    ("float16", 64, 0, 40, 1)])
def test_chunk_attention_products_in_bfloat16(native_kernels, cache, d, window, rows, p0, monkeypatch):
    """With bf16=1 (a W8A8 program's attention), on a CPU with AVX512_BF16, a chunk's products are bfloat16 ones
    with float32 sums: the output is numpy's with the queries (an int8 cache: times K's scales), the keys, the
    values and the softmax's terms rounded to bfloat16 (a block of 64 keys at a time, its terms against the
    running maximum, as the kernel does), and not the float32 path's, which the node takes without the attribute
    or with LLMC_ATTN_BF16=0. Odd key counts in a block (pairs of value rows end in a zero row), windows, a chunk
    at position 0, float16, int8 and float32 caches. Without the instructions bf16=1 is the float32 path, bit for
    bit. A NaN query still makes its row and head NaN, and an infinite value past a task's rows none of them."""
    from onnx import TensorProto, helper
    from onnx.helper import np_dtype_to_tensor_dtype

    from llmc.runtime.native import features

    heads, kv, scale = 6, 2, 0.2
    cap, p = 320, p0 + rows - 1
    op, dtype = _CACHE_OPS[cache]
    int8 = cache == "int8"
    ct = np_dtype_to_tensor_dtype(np.dtype(dtype))
    vi = helper.make_tensor_value_info
    names = ["q", "k", "v", "pk", "pv", "seqlens", "total"] + (["", "", "ks", "vs"] if int8 else [])
    inputs = [vi("q", TensorProto.FLOAT, [1, rows, heads * d]), vi("k", TensorProto.FLOAT, [1, rows, kv * d]),
              vi("v", TensorProto.FLOAT, [1, rows, kv * d]), vi("pk", ct, [1, kv, cap, d]), vi("pv", ct, [1, kv, cap, d]),
              vi("seqlens", TensorProto.INT32, [1]), vi("total", TensorProto.INT32, [])]
    if int8:
        inputs += [vi("ks", TensorProto.FLOAT, [1, kv, 1, d]), vi("vs", TensorProto.FLOAT, [1, kv, 1, d])]
    attrs = {"local_window_size": window} if window else {}

    def model(**bf16):
        node = helper.make_node(op, names, ["o", "ck", "cv"], domain="ai.llmc", num_heads=heads, kv_num_heads=kv, scale=scale, **attrs, **bf16)
        g = helper.make_graph([node], "g", inputs, [vi("o", TensorProto.FLOAT, None), vi("ck", ct, None), vi("cv", ct, None)])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.llmc", 1)])

    rng = np.random.default_rng(d + rows + p0)
    q, k, v = (rng.standard_normal((1, rows, n * d)).astype(np.float32) * 2 for n in (heads, kv, kv))
    if int8:
        ks, vs = (rng.uniform(0.01, 0.03, (1, kv, 1, d)).astype(np.float32) for _ in range(2))
        pk, pv = (np.clip(np.rint(rng.standard_normal((1, kv, cap, d)) * 40), -128, 127).astype(np.int8) for _ in range(2))
    else:
        pk, pv = (rng.standard_normal((1, kv, cap, d)).astype(dtype) for _ in range(2))
    feeds = {"q": q, "k": k, "v": v, "pk": pk, "pv": pv, "seqlens": np.array([p], np.int32), "total": np.array(p + 1, np.int32)}
    if int8:
        feeds.update(ks=ks, vs=vs)
    exact, ck, cv = _session(model(), native_kernels).run(None, feeds)  # no bf16 attribute: float32
    monkeypatch.setenv("LLMC_ATTN_BF16", "0")
    np.testing.assert_array_equal(_session(model(bf16=1), native_kernels).run(None, feeds)[0], exact)
    monkeypatch.delenv("LLMC_ATTN_BF16")
    sess = _session(model(bf16=1), native_kernels)
    o = sess.run(None, feeds)[0]
    if "bf16_chunks" not in features(native_kernels):
        np.testing.assert_array_equal(o, exact)
        return
    assert not np.array_equal(o, exact)
    K, V = ck[0].astype(np.float32), cv[0].astype(np.float32)  # the rows as the cache holds them (int8: codes)
    qh = q.reshape(rows, heads, d)
    o = o.reshape(rows, heads, d)
    base = max(0, p0 + 1 - window) if window else 0  # where the call's blocks of 64 keys start
    for i in range(rows):
        pos = p0 + i
        lo = max(0, pos + 1 - window) if window else 0
        for h in range(heads):
            qq = _bf16(qh[i, h] * ks[0, h // 3, 0] if int8 else qh[i, h]).astype(np.float64)
            top, total, acc = -np.inf, 0.0, np.zeros(d)
            for k0 in range(base + (lo - base) // 64 * 64, pos + 1, 64):  # the kernel's blocks, its running maximum
                at = slice(max(k0, lo), min(k0 + 64, pos + 1))
                s = (_bf16(K[h // 3, at]) @ qq) * scale
                grown = max(top, s.max())
                w = _bf16(np.exp(s - grown).astype(np.float32))
                total = total * np.exp(top - grown) + w.sum()  # of the rounded weights: a weighted mean of the rows
                acc = acc * np.exp(top - grown) + w @ _bf16(V[h // 3, at])
                top = grown
            ref = acc / total * (vs[0, h // 3, 0] if int8 else 1.0)
            np.testing.assert_allclose(o[i, h], ref, rtol=0, atol=2e-4 * np.abs(ref).max())
    q2 = q.copy()
    q2[0, 3, d + 1] = np.nan  # row 3, head 1
    o = sess.run(None, {**feeds, "q": q2})[0].reshape(rows, heads, d)
    assert np.isnan(o[3, 1]).all()
    o[3, 1] = 0
    assert np.isfinite(o).all()
    # an odd p0: the first task's block of keys ends at an odd count (16 rows a task), so its last pair of value rows
    # ends at position p0 + 16, the next task's first row; an infinity there (at weight 0) turns no row of the first
    # task NaN (an int8 cache holds no infinity)
    if p0 % 2 and cache != "int8":
        v2 = v.copy()
        v2[0, 16, 5] = np.inf
        o = sess.run(None, {**feeds, "v": v2})[0].reshape(rows, heads, d)
        assert np.isfinite(o[:16]).all() and not np.isfinite(o[16:]).all()


def test_float16_cache_rows_round_as_numpy(native_kernels):
    """DecodeAttentionFloat16 stores a new K/V row's floats as numpy's astype(float16) does: ties to even, subnormal
    halves, overflow past 65504 to infinity (65519 down to 65504, 65520 up), signed zeros and NaN."""
    _check_float16_rounding(native_kernels)


def test_float16_cache_rows_round_as_numpy_without_f16c(tmp_path, monkeypatch):
    """The same with the library built for a CPU without F16C (-mno-f16c): its own conversion, in C, rounds as
    numpy does too."""
    from llmc.runtime import native
    from llmc.runtime.errors import NativeKernelError

    cxx = tmp_path / "cxx-no-f16c"
    cxx.write_text('#!/bin/sh\nexec g++ "$@" -mno-f16c\n')
    cxx.chmod(0o755)
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))
    try:
        library = native.build(cxx=str(cxx))
    except NativeKernelError as e:  # as the native_kernels fixture: no headers, no test (CI requires them)
        if os.environ.get("LLMC_REQUIRE_NATIVE_KERNELS") == "1":
            raise
        pytest.skip(f"llmc's native kernels cannot be built here: {e}")
    _check_float16_rounding(library)


def _check_float16_rounding(library) -> None:
    from onnx import TensorProto, helper

    kv, d, cap = 1, 64, 4
    special = np.array([1 + 2**-11, 1 + 3 * 2**-11, 2**-25, 3 * 2**-25, 2**-24 * 1.5, 1e-8, -6e-5, 5.9e-8, 65504.0, 65519.0,
                        65520.0, 1e6, -1e6, np.inf, -np.inf, -0.0, 0.0, np.nan, 3.14159, -2.7182817, 1e-3, 6.1e-5, -1.0 - 2**-11], np.float32)
    rng = np.random.default_rng(4)
    k = np.concatenate([special, (rng.standard_normal(d - special.size) * 10 ** rng.uniform(-9, 5, d - special.size)).astype(np.float32)])
    vi = helper.make_tensor_value_info
    node = helper.make_node("DecodeAttentionFloat16", ["q", "k", "v", "pk", "pv", "seqlens", "total"], ["o", "ck", "cv"], domain="ai.llmc",
                            num_heads=1, kv_num_heads=kv, scale=1.0)
    g = helper.make_graph([node], "g", [vi("q", TensorProto.FLOAT, [1, 1, d]), vi("k", TensorProto.FLOAT, [1, 1, d]), vi("v", TensorProto.FLOAT, [1, 1, d]),
                                        vi("pk", TensorProto.FLOAT16, [1, kv, cap, d]), vi("pv", TensorProto.FLOAT16, [1, kv, cap, d]),
                                        vi("seqlens", TensorProto.INT32, [1]), vi("total", TensorProto.INT32, [])],
                          [vi("o", TensorProto.FLOAT, None), vi("ck", TensorProto.FLOAT16, None), vi("cv", TensorProto.FLOAT16, None)])
    sess = _session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.llmc", 1)]), library)
    zeros = np.zeros((1, kv, cap, d), np.float16)
    _, ck, cv = sess.run(None, {"q": np.zeros((1, 1, d), np.float32), "k": k.reshape(1, 1, d), "v": -k.reshape(1, 1, d), "pk": zeros,
                                "pv": zeros, "seqlens": np.array([0], np.int32), "total": np.array(1, np.int32)})
    with np.errstate(over="ignore"):
        want_k, want_v = k.astype(np.float16), (-k).astype(np.float16)
    nan = np.isnan(k)
    for got, want in ((ck[0, 0, 0], want_k), (cv[0, 0, 0], want_v)):
        assert np.isnan(got[nan]).all()
        np.testing.assert_array_equal(got[~nan].view(np.uint16), want[~nan].view(np.uint16))


def test_swiglu_against_numpy(native_kernels):
    """SwiGLU(x; gate, up, width) = silu(x[..., gate:gate + width]) * x[..., up:up + width] over [2, 35, W] (rows on
    ONNX Runtime's pool), the up half first and the width not in whole vectors; silu of large gates is the gate, of
    very negative ones -0, and a NaN stays in its place."""
    from onnx import TensorProto, helper

    width, w = 50, 104
    node = helper.make_node("SwiGLU", ["x"], ["y"], domain="ai.llmc", gate=52, up=2, width=width)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 35, w])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    sess = _session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.llmc", 1)]), native_kernels)
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((2, 35, w)) * 4).astype(np.float32)
    x[0, 0, 52:60] = [100.0, -100.0, 300.0, -300.0, 88.5, -88.5, 0.0, np.nan]
    y = sess.run(None, {"x": x})[0]
    gate, up = x[..., 52 : 52 + width].astype(np.float64), x[..., 2 : 2 + width].astype(np.float64)
    with np.errstate(over="ignore"):
        ref = gate / (1.0 + np.exp(-gate)) * up
    assert y.shape == (2, 35, width)
    assert np.isnan(y[0, 0, 7]) and np.isnan(ref[0, 0, 7])
    y[0, 0, 7] = ref[0, 0, 7] = 0.0
    np.testing.assert_allclose(y, ref, rtol=2e-6, atol=1e-30)


def _rms_norm(x: np.ndarray, g: np.ndarray, epsilon: float, library) -> np.ndarray:
    """llmc's RMSNorm op over the rows of x: the normalised input a projection with a norm input must see."""
    from onnx import TensorProto, helper, numpy_helper

    node = helper.make_node("RMSNorm", ["x", "g"], ["xn"], domain="ai.llmc", epsilon=epsilon)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                              [helper.make_tensor_value_info("xn", TensorProto.FLOAT, None)], [numpy_helper.from_array(g, "g")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.llmc", 1)])
    return _session(model, library).run(None, {"x": x})[0]


def _block_q_model(op: str, k: int, n: int, x_width: int, weights: dict, digits: int, **attrs):
    from onnx import TensorProto, helper, numpy_helper

    names = ["x", "codes", "scales"] + (["zero_points"] if "zero_points" in weights else [])
    residual = attrs.pop("residual", False)
    if residual:  # a graph input [rows, N], the op's input 4
        names += [""] * (4 - len(names)) + ["residual"]
    if "norm" in weights:  # the RMS norm's weight, input 5 (with the attribute epsilon)
        names += [""] * (5 - len(names)) + ["norm"]
    if op == "MatMulNBits":
        node = helper.make_node(op, names, ["y"], domain="com.microsoft", K=k, N=n, bits=4, block_size=32, accuracy_level=4)
    else:
        node = helper.make_node(op, names, ["y"], domain="ai.llmc", K=k, N=n, digits=digits, **{"block_size": 32, **attrs})
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, x_width])]
    if residual:
        inputs.append(helper.make_tensor_value_info("residual", TensorProto.FLOAT, [None, None]))  # any shape: the kernel checks it
    g = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(v, name) for name, v in weights.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1), helper.make_opsetid("ai.llmc", 1)])
    m.ir_version = 10
    return m


def _block_q_weights(rng, n: int, nb: int, zero_points: bool) -> dict:
    w = {"codes": rng.integers(0, 256, (n, nb, 16), dtype=np.uint8),
         "scales": (rng.standard_normal(n * nb) * 0.01).astype(np.float32)}
    w["scales"][::7] = 0.0  # constant blocks (fold_block_offsets' scale 0)
    w["codes"][:, 0, :2] = [0, 255]  # the extreme codes
    if zero_points:
        w["zero_points"] = rng.integers(0, 256, n * ((nb + 1) // 2), dtype=np.uint8)
    return w


@pytest.mark.parametrize("k0,n,digits,zero_points,rows,threads", [
    (576, 200, 3, True, 1, 2),    # SmolLM2's q/k/v: 21 blocks (two groups of 8 and one read past the column), 200 columns
    (1536, 70, 3, True, 1, 2),    # its down projection: 54 blocks
    (256, 130, 0, True, 2, 1),    # whole groups only, two rows, one thread
    (64, 5, 0, False, 3, 2),      # fewer blocks than a group, the default zero point 8
    (96, 33, 1, True, 1, 2),      # one digit over 3 block sums (one padded block)
])
def test_block_q_matmul_is_matmulnbits(native_kernels, k0, n, digits, zero_points, rows, threads):
    """BlockQMatMul computes what ONNX Runtime's MatMulNBits (4 bits, blocks of 32, accuracy_level 4: int8
    activations per block) computes over the input widened with its block sums (widen_with_block_sums, as the
    stock lowering's Concat widens it), at several block counts (a group's tail read past the column and
    summed singly in the last columns), with and without zero points, with blocks of scale 0 and an input
    block of zeros; and within the int8 activations' error of x @ W^T in float64."""
    from llmc.ops import folded_blocks
    from llmc.runtime.kernels import unpack_nibbles, widen_with_block_sums

    rng = np.random.default_rng(k0 + n + digits)
    k = folded_blocks(k0, 32, digits) * 32
    w = _block_q_weights(rng, n, k // 32, zero_points)
    x = rng.standard_normal((rows, k0)).astype(np.float32)
    x[0, 32:64] = 0.0
    wide = widen_with_block_sums(x, 32, digits)
    ref = _session(_block_q_model("MatMulNBits", k, n, k, w, 0), native_kernels, threads).run(None, {"x": wide})[0]
    got = _session(_block_q_model("BlockQMatMul", k, n, k0, w, digits), native_kernels, threads).run(None, {"x": x})[0]
    assert got.shape == (rows, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    nb = k // 32
    z = unpack_nibbles(w["zero_points"].reshape(n, -1))[:, :nb, None] if zero_points else 8
    weights = ((unpack_nibbles(w["codes"]).astype(np.float64) - z) * w["scales"].reshape(n, nb)[..., None]).reshape(n, k)
    exact = wide.astype(np.float64) @ weights.T
    assert np.abs(got - exact).max() < 2e-2 * np.abs(exact).max()


@pytest.mark.parametrize("zero_points,rows", [(True, 2), (False, 1)])
def test_block_q_matmul_adds_a_residual(native_kernels, zero_points, rows):
    """With a residual (input 4, after the optional zero points), BlockQMatMul's result is its product plus
    the residual, bit for bit as the Add it replaces; a residual of another shape is an error naming it."""
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument, RuntimeException

    rng = np.random.default_rng(5)
    n, k = 70, 576
    w = _block_q_weights(rng, n, k // 32, zero_points)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    r = rng.standard_normal((rows, n)).astype(np.float32)
    plain = _session(_block_q_model("BlockQMatMul", k, n, k, w, 0), native_kernels).run(None, {"x": x})[0]
    sess = _session(_block_q_model("BlockQMatMul", k, n, k, w, 0, residual=True), native_kernels)
    np.testing.assert_array_equal(sess.run(None, {"x": x, "residual": r})[0], plain + r)
    with pytest.raises((Fail, InvalidArgument, RuntimeException), match="BlockQMatMul: residual must have the result's shape"):
        sess.run(None, {"x": x, "residual": r[:, :-1]})


def test_block_q_matmul_normalises_its_input(native_kernels):
    """With a norm weight (input 5) and epsilon, BlockQMatMul computes what llmc's RMSNorm followed by
    BlockQMatMul computes, bit for bit, over rows of a width not in whole vectors of 16; a norm of another
    width is an error naming it."""
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument, RuntimeException

    from llmc.ops import folded_blocks

    rng = np.random.default_rng(6)
    n, k0, digits = 40, 96, 1
    k = folded_blocks(k0, 32, digits) * 32
    w = _block_q_weights(rng, n, k // 32, True)
    g = rng.uniform(0.5, 2.0, k0).astype(np.float32)
    x = (rng.standard_normal((3, k0)) * 4).astype(np.float32)
    xn = _rms_norm(x, g, 0.5, native_kernels)
    two_ops = _session(_block_q_model("BlockQMatMul", k, n, k0, w, digits), native_kernels).run(None, {"x": xn})[0]
    fused = _session(_block_q_model("BlockQMatMul", k, n, k0, {**w, "norm": g}, digits, epsilon=0.5), native_kernels)
    np.testing.assert_array_equal(fused.run(None, {"x": x})[0], two_ops)
    with pytest.raises((Fail, InvalidArgument, RuntimeException), match="BlockQMatMul: norm .* must be \\[K0\\]"):
        _session(_block_q_model("BlockQMatMul", k, n, k0, {**w, "norm": g[:-1]}, digits, epsilon=0.5), native_kernels).run(None, {"x": x})


def _w8_model(k: int | None, n: int, weights: dict, rows=None, residual: bool = False, **attrs):
    """One W8A8MatMul over x [rows, k] (k None: any width): weights w, w_scale and, optionally, wt (input 3) and norm
    (input 5); residual a graph input (input 4)."""
    from onnx import TensorProto, helper, numpy_helper

    names = ["x", "w", "w_scale"] + (["wt"] if "wt" in weights else [])
    if residual:
        names += [""] * (4 - len(names)) + ["residual"]
    if "norm" in weights:
        names += [""] * (5 - len(names)) + ["norm"]
    for i, extra in ((6, "wt_scale"), (7, "hot_delta")):  # a codes table's column scales and hot channels' rows
        if extra in weights:
            names += [""] * (i - len(names)) + [extra]
    node = helper.make_node("W8A8MatMul", names, ["y"], domain="ai.llmc", **{"x_scale": 0.02, "x_zero_point": 128, **attrs})
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, k])]
    if residual:
        inputs.append(helper.make_tensor_value_info("residual", TensorProto.FLOAT, [None, None]))  # any shape: the kernel checks it
    g = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(v, name) for name, v in weights.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("ai.llmc", 1)])
    m.ir_version = 10
    return m


def _w8_weights(rng, k: int, n: int, dtype, per_channel: bool) -> dict:
    """Random int8 weights (uint8: those + 128), the extremes in the first columns: -128 down column 0, 127 down column 1."""
    w = rng.integers(-128, 128, (k, n)).astype(np.int64)
    w[:, 0], w[:, 1 % n] = -128, 127
    scale = (rng.uniform(0.5, 1.5, n if per_channel else 1) * 1e-3).astype(np.float32)
    return {"w": (w + 128).astype(np.uint8) if dtype == np.uint8 else w.astype(np.int8), "w_scale": scale}


def _w8_reference(x: np.ndarray, w: dict, x_scale: float, zero_point: int) -> np.ndarray:
    """The stock projection's arithmetic exactly: ONNX Runtime's QuantizeLinear codes, their int64 dot products with the
    weights (less their zero points), times float32(x_scale * w_scale) in float32, as MatMulIntegerToFloat scales them."""
    codes = _quantize_reference(x, x_scale, zero_point).astype(np.int64) - zero_point
    weights = w["w"].astype(np.int64) - (128 if w["w"].dtype == np.uint8 else 0)
    return (codes @ weights).astype(np.float32) * (np.float32(x_scale) * w["w_scale"])


@pytest.mark.parametrize("pack", [0, 1])
@pytest.mark.parametrize("k,n,zero_point,dtype,per_channel,rows,threads", [
    (576, 960, 128, np.int8, True, 1, 2),     # SmolLM2's q/k/v: whole blocks of 64 columns, row ranges fetching ahead
    (1536, 70, 128, np.int8, True, 1, 2),     # its down projection's K, 6 columns past a block
    (77, 200, 3, np.uint8, True, 2, 1),       # an odd K, a zero point whose codes' high parts reach 16, uint8 weights
    (64, 5, 255, np.int8, False, 3, 2),       # fewer columns than a block, one scale, the highest zero point
    (576, 4160, 128, np.int8, True, 1, 2),    # many blocks of columns
    (6, 130, 0, np.uint8, False, 2, 2),       # K of one group of four rows and a half, the lowest zero point
    (10, 64, 128, np.int8, True, 1, 1),       # an odd number of groups of four rows (the packed loop's last one alone)
])
def test_w8a8_matmul_is_the_stock_projection(native_kernels, k, n, zero_point, dtype, per_channel, rows, threads, pack):
    """W8A8MatMul computes the stock projection (QuantizeLinear, then the QDQ MatMul that ONNX Runtime runs as
    MatMulIntegerToFloat) bit for bit: exact int32 sums of the codes less their zero point by the weights, at the
    extremes too (a row of codes 255 and one of 0 against columns of -128 and of 127: the byte multiply-adds' int16
    sums at their bound), over several shapes, zero points, int8 and uint8 (offset 128) weights, one and many rows;
    with the attribute pack too (on a CPU with AVX-512 VNNI, the weights in the op's own layout). Two calls: the
    first makes the packed copy."""
    rng = np.random.default_rng(k + n + zero_point)
    w = _w8_weights(rng, k, n, dtype, per_channel)
    x = rng.normal(0, 1.5, (rows, k)).astype(np.float32)
    x[0, : k // 2] = 1e3  # codes 255
    x[-1, k // 2 :] = -1e3  # codes 0
    x_scale = 0.02
    sess = _session(_w8_model(k, n, w, x_zero_point=zero_point, pack=pack), native_kernels, threads)
    for xi in (x, x[::-1].copy()):
        got = sess.run(None, {"x": xi})[0]
        assert got.shape == (rows, n) and got.dtype == np.float32
        np.testing.assert_array_equal(got, _w8_reference(xi, w, x_scale, zero_point))


def test_w8a8_matmul_row_ranges_from_the_environment(native_kernels, monkeypatch):
    """LLMC_W8_SPLITS sets how many row ranges a projection is cut into (one per CPU by default). 60 of them over K=4096
    (2,048 row pairs, 35 a range) make 59 ranges, not 60 with an empty last one: a kernel that kept the empty range added
    the sums an earlier projection (K=4800: 60 whole ranges) left in that range's row of the reused buffer."""
    monkeypatch.setenv("LLMC_W8_SPLITS", "60")
    rng = np.random.default_rng(11)
    for k in (4800, 4096):  # on one thread, one after the other: the same thread-local buffer
        w = _w8_weights(rng, k, 256, np.int8, True)
        x = rng.normal(0, 1.5, (1, k)).astype(np.float32)
        got = _session(_w8_model(k, 256, w), native_kernels, 1).run(None, {"x": x})[0]
        np.testing.assert_array_equal(got, _w8_reference(x, w, 0.02, 128))


@pytest.mark.parametrize("table,rows,pack,k,n,hi,residual", [
    (np.float16, 3, 0, 96, 130, 0.75, True), (np.float32, 3, 0, 96, 130, 0.75, True), (np.float16, 1, 0, 96, 130, 0.75, True),
    (np.float32, 1, 0, 96, 130, 0.75, True), (np.float16, 1, 1, 96, 130, 0.75, True), (np.float32, 3, 1, 96, 130, 0.75, True),
    # decode rows large enough for both threads: with the packed weights the correction's columns (1,024 a task, the
    # last one 76 wide, a partial vector) are tasks of the sums' loop; float16 and float32 tables, no outliers (the
    # correction's buffer, which earlier cases filled, zeroed), no residual
    (np.float16, 1, 1, 576, 1100, 0.75, True), (np.float32, 1, 1, 576, 1100, 0.75, True), (np.float16, 1, 1, 576, 1100, 1e4, True),
    (np.float32, 1, 1, 576, 1100, 1e4, True), (np.float16, 1, 1, 576, 1100, 0.75, False), (np.float16, 1, 0, 576, 1100, 0.75, True),
    # the table a bundle gives it: the projection's own codes (w itself) with its scales and hot channels' rows
    ("codes", 3, 0, 96, 130, 0.75, True), ("codes", 1, 0, 96, 130, 0.75, True), ("codes", 1, 1, 96, 130, 0.75, True),
    ("codes", 1, 1, 576, 1100, 0.75, True), ("codes", 1, 1, 576, 1100, 0.75, False), ("codes", 1, 0, 576, 1100, 0.75, True),
])
def test_w8a8_matmul_corrects_normalises_and_adds(native_kernels, table, rows, pack, k, n, hi, residual):
    """With a weight table (input 3, attributes lo and hi), a residual (input 4) and a norm weight (input 5, attribute
    epsilon), W8A8MatMul computes what RMSNorm, W8A8MatMul alone and ShadowCorrection (with that residual) compute one
    after the other, bit for bit: the outliers and codes are the normalised row's. One row (decode, whose row ranges
    fetch the outliers' table rows ahead, or whose packed loop does the correction too) and several."""
    from onnx import TensorProto, helper, numpy_helper

    from llmc.runtime import native

    if n > 1000 and pack and "w8_pack" not in native.features(native_kernels):
        pytest.skip("the packed decode path needs a library built for AVX-512 VNNI")
    rng = np.random.default_rng(8 + rows + k)
    lo = -hi
    w = _w8_weights(rng, k, n, np.int8, True)
    codes = table == "codes"
    wt = w["w"] if codes else rng.standard_normal((k, n)).astype(table)
    hot = [0, 7, k - 1] if codes else []
    extra = {"wt_scale": w["w_scale"], "hot_delta": rng.standard_normal((len(hot), n)).astype(np.float32) * 1e-3} if codes else {}
    g = rng.uniform(0.5, 1.5, k).astype(np.float32)
    x = (_outliers(rng, (rows, k), 0.05, lo, hi) * 3).astype(np.float32)
    r = rng.standard_normal((rows, n)).astype(np.float32)
    attrs = {"x_scale": 0.006, "x_zero_point": 128}
    xn = _rms_norm(x, g, 0.25, native_kernels)
    assert (np.abs(xn) > hi).any() == (hi < 1)  # some outliers, or none
    base = _session(_w8_model(k, n, w, **attrs), native_kernels).run(None, {"x": xn})[0]
    feeds = (("x", k), ("base", n)) + ((("residual", n),) if residual else ())
    names = ["x", "wt", "base", "residual" if residual else ""] + list(extra)
    corr = helper.make_node("ShadowCorrection", names, ["y"], domain="ai.llmc", lo=lo, hi=hi, **({"hot_channels": hot} if hot else {}))
    inputs = [helper.make_tensor_value_info(v, TensorProto.FLOAT, [rows, c]) for v, c in feeds]
    inits = [numpy_helper.from_array(v, name) for name, v in {"wt": wt, **extra}.items()]
    graph = helper.make_graph([corr], "c", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    three_ops = _session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.llmc", 1)]),
                         native_kernels).run(None, {"x": xn, "base": base, **({"residual": r} if residual else {})})[0]
    fused = _session(_w8_model(k, n, {**w, "wt": wt, "norm": g, **extra}, residual=residual, lo=lo, hi=hi, epsilon=0.25, pack=pack,
                               **({"hot_channels": hot} if hot else {}), **attrs), native_kernels)
    np.testing.assert_array_equal(fused.run(None, {"x": x, **({"residual": r} if residual else {})})[0], three_ops)


def test_w8a8_matmul_checks_weights_that_are_not_constants_on_every_call(native_kernels):
    """Weights that are graph inputs rather than initializers may change shape between calls: each call checks them
    and uses their shape (the kernel keeps its checked facts, and a packed copy with the attribute pack, only for
    constant weights)."""
    from onnx import TensorProto, helper
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument, RuntimeException

    node = helper.make_node("W8A8MatMul", ["x", "w", "w_scale"], ["y"], domain="ai.llmc", x_scale=0.02, x_zero_point=128, pack=1)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64]),
              helper.make_tensor_value_info("w", TensorProto.INT8, [64, None]),
              helper.make_tensor_value_info("w_scale", TensorProto.FLOAT, [None])]
    g = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("ai.llmc", 1)])
    m.ir_version = 10
    sess = _session(m, native_kernels)
    rng = np.random.default_rng(5)
    x = rng.normal(0, 1.5, (1, 64)).astype(np.float32)
    for n in (8, 200, 70):
        w = _w8_weights(rng, 64, n, np.int8, True)
        got = sess.run(None, {"x": x, **w})[0]
        np.testing.assert_array_equal(got, _w8_reference(x, w, 0.02, 128))
    with pytest.raises((Fail, InvalidArgument, RuntimeException), match="W8A8MatMul: w_scale must be \\[N\\]"):
        sess.run(None, {"x": x, "w": w["w"], "w_scale": w["w_scale"][:3]})


def test_w8a8_matmul_named_errors(native_kernels):
    """Weights of another type or width, scales, a weight table, a residual or a norm of another shape, and an
    x_zero_point outside 0..255 are errors that name the op and what it takes."""
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument, RuntimeException

    errors = (Fail, InvalidArgument, RuntimeException)
    rng = np.random.default_rng(0)
    w = _w8_weights(rng, 16, 8, np.int8, True)
    x = np.zeros((1, 16), np.float32)

    def run(weights, match, x=x, residual=None, **attrs):
        model = _w8_model(None, 8, weights, residual=residual is not None, **attrs)
        with pytest.raises(errors, match=match):
            _session(model, native_kernels).run(None, {"x": x, **({"residual": residual} if residual is not None else {})})

    run({**w, "w": w["w"].astype(np.float32)}, "W8A8MatMul: w must be int8 .* or uint8")
    run(w, "W8A8MatMul: x must be \\[..., K\\] and w \\[K, N\\]", x=np.zeros((1, 15), np.float32))
    run({**w, "w_scale": w["w_scale"][:3]}, "W8A8MatMul: w_scale must be \\[N\\]")
    run({**w, "wt": np.zeros((16, 7), np.float32)}, "W8A8MatMul: wt .* must be \\[K, N\\], as w", lo=-1.0, hi=1.0)
    run({**w, "wt": w["w"]}, "W8A8MatMul: int8 or uint8 codes \\(wt\\) need wt_scale", lo=-1.0, hi=1.0)
    run(w, "W8A8MatMul: residual must have the result's shape", residual=np.zeros((1, 7), np.float32))
    run({**w, "norm": np.ones(15, np.float32)}, "W8A8MatMul: norm .* must be \\[K\\]", epsilon=1e-5)
    run(w, "W8A8MatMul: x_scale must be positive and x_zero_point in 0..255", x_zero_point=256)


_ASAN_SCRIPT = """
import sys
import numpy as np
import onnxruntime as ort

so = ort.SessionOptions()
so.register_custom_ops_library(sys.argv[1])
for path in sys.argv[2:]:
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    x = sess.get_inputs()[0]
    y = sess.run(None, {x.name: np.ones((1, x.shape[1]), np.float32)})[0]
    assert np.isfinite(y).all()
print("clean")
"""


def test_native_matmuls_read_inside_their_inputs(native_kernels, tmp_path, monkeypatch):
    """BlockQMatMul reads a column's last group of blocks whole, past the column's end into the next column's codes,
    scales and zero points (where x is zero), except in the matrix's last columns, where that would read past the
    weights; W8A8MatMul pairs an odd K's last row with itself and sums the columns past its blocks of 64 one at a
    time. The kernels built with AddressSanitizer run BlockQMatMul at block counts that read past a column (21, 54, 2,
    4 and 8 blocks; fewer columns than a group reaches) and W8A8MatMul at an odd K and partial blocks without a read
    outside their inputs (a build that read past BlockQMatMul's last columns, and one that read an odd K's missing
    row, were caught). Skipped where GCC has no AddressSanitizer runtime."""
    import subprocess
    import sys

    from llmc.ops import folded_blocks
    from llmc.runtime import native

    libasan = subprocess.run(["g++", "-print-file-name=libasan.so"], capture_output=True, text=True, check=False).stdout.strip()
    if not os.path.isabs(libasan) or not os.path.isfile(libasan):
        pytest.skip("GCC's AddressSanitizer runtime (libasan.so) is not installed")
    rng = np.random.default_rng(0)
    models = []
    for k0, n, digits, zero_points in [(576, 200, 3, True), (1536, 9, 3, True), (64, 5, 0, False), (96, 33, 1, True), (256, 3, 0, True)]:
        k = folded_blocks(k0, 32, digits) * 32
        models.append(tmp_path / f"block_q_{k0}_{n}.onnx")
        models[-1].write_bytes(_block_q_model("BlockQMatMul", k, n, k0, _block_q_weights(rng, n, k // 32, zero_points), digits).SerializeToString())
    for k, n, dtype in [(77, 70, np.uint8), (576, 130, np.int8), (1536, 64, np.int8)]:  # W8A8MatMul: odd K, columns past a block
        models.append(tmp_path / f"w8a8_{k}_{n}.onnx")
        models[-1].write_bytes(_w8_model(k, n, _w8_weights(rng, k, n, dtype, True)).SerializeToString())
    cxx = tmp_path / "cxx-asan"
    cxx.write_text('#!/bin/sh\nexec g++ "$@" -fsanitize=address -fno-omit-frame-pointer\n')
    cxx.chmod(0o755)
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))
    library = native.build(cxx=str(cxx))
    env = dict(os.environ, LD_PRELOAD=libasan, ASAN_OPTIONS="detect_leaks=0")
    done = subprocess.run([sys.executable, "-c", _ASAN_SCRIPT, str(library), *map(str, models)], capture_output=True, text=True, env=env,
                          timeout=600, check=False)
    assert done.returncode == 0 and "AddressSanitizer" not in done.stderr and done.stdout.strip() == "clean", done.stderr[-3000:]


def test_block_q_matmul_named_errors(native_kernels):
    """An input whose width its digits do not widen to K, and a block size other than 32, are errors that name
    the op and what it takes."""
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument, RuntimeException

    w = _block_q_weights(np.random.default_rng(0), 8, 4, True)
    sess = _session(_block_q_model("BlockQMatMul", 128, 8, 64, w, 1), native_kernels)
    with pytest.raises((Fail, InvalidArgument, RuntimeException), match="BlockQMatMul: x must be"):
        sess.run(None, {"x": np.zeros((1, 64), np.float32)})
    with pytest.raises((Fail, InvalidArgument, RuntimeException), match="BlockQMatMul: block_size must be 32"):
        _session(_block_q_model("BlockQMatMul", 128, 8, 128, w, 0, block_size=16), native_kernels).run(None, {"x": np.zeros((1, 128), np.float32)})


def _quantize_reference(y: np.ndarray, scale: float, zero_point: int) -> np.ndarray:
    """ONNX Runtime's own QuantizeLinear (uint8) of y: the codes llmc's ops must write bit for bit."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    node = helper.make_node("QuantizeLinear", ["y", "s", "z"], ["q"])
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(y.shape))],
                          [helper.make_tensor_value_info("q", TensorProto.UINT8, None)],
                          [numpy_helper.from_array(np.array(scale, np.float32), "s"), numpy_helper.from_array(np.array(zero_point, np.uint8), "z")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"y": y})[0]


@pytest.mark.parametrize("codes", [False, True])
def test_rms_norm_against_numpy(native_kernels, codes):
    """RMSNorm(x, weight; epsilon) = x / sqrt(mean(x^2) + epsilon) * weight over [3, 37, 100] (rows on ONNX Runtime's
    pool, a width not in whole vectors), a NaN staying in its row; with scale and zero_point its second output is
    exactly ONNX Runtime's QuantizeLinear of the first (saturating both ways, a NaN as 0)."""
    from onnx import TensorProto, helper

    n, scale, zp = 100, 0.011, 97
    attrs = {"scale": scale, "zero_point": zp} if codes else {}
    outs = ["y", "q"] if codes else ["y"]
    node = helper.make_node("RMSNorm", ["x", "w"], outs, domain="ai.llmc", epsilon=0.25, **attrs)  # large enough to matter
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 37, n]),
                                        helper.make_tensor_value_info("w", TensorProto.FLOAT, [n])],
                          [helper.make_tensor_value_info(o, TensorProto.UINT8 if o == "q" else TensorProto.FLOAT, None) for o in outs])
    sess = _session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.llmc", 1)]), native_kernels)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((3, 37, n)).astype(np.float32)
    w = rng.uniform(0.5, 2.0, n).astype(np.float32)
    x[1, 2, 5] = np.nan
    got = sess.run(None, {"x": x, "w": w})
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 0.25) * w
    assert np.isnan(got[0][1, 2]).all() and np.isfinite(np.delete(got[0].reshape(-1, n), 37 + 2, axis=0)).all()
    np.testing.assert_allclose(got[0], ref, rtol=1e-5, atol=1e-6)
    if codes:
        y = got[0]
        assert (y / scale > 255 - zp).any() and (y / scale < -zp).any()  # both ends saturate
        np.testing.assert_array_equal(got[1], _quantize_reference(y, scale, zp))
        assert (got[1][1, 2] == 0).all()


def test_swiglu_codes_are_quantize_linear(native_kernels):
    """SwiGLU with scale and zero_point: its second output is ONNX Runtime's QuantizeLinear of its first, bit for bit,
    ties to even included."""
    from onnx import TensorProto, helper

    width, w, scale, zp = 70, 140, 0.02, 128
    node = helper.make_node("SwiGLU", ["x"], ["y", "q"], domain="ai.llmc", gate=0, up=width, width=width, scale=scale, zero_point=zp)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [40, w])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None), helper.make_tensor_value_info("q", TensorProto.UINT8, None)])
    sess = _session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.llmc", 1)]), native_kernels)
    x = (np.random.default_rng(10).standard_normal((40, w)) * 3).astype(np.float32)
    x[0, width:] = 1.0  # up = 1: y = silu(gate); some gates then give y exactly at a half step
    y, q = sess.run(None, {"x": x})
    np.testing.assert_array_equal(q, _quantize_reference(y, scale, zp))
    assert len(np.unique(q)) > 100


def test_shadow_correction_adds_a_residual(native_kernels):
    """ShadowCorrection's fourth input: y = residual + (base + correction), the float sums in the stock graph's
    order; a residual without base is an error."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(11)
    k, n, lo, hi = 48, 40, -1.0, 1.0
    wt = rng.standard_normal((k, n)).astype(np.float32)
    vi = helper.make_tensor_value_info
    node = helper.make_node("ShadowCorrection", ["x", "wt", "base", "res"], ["y"], domain="ai.llmc", lo=lo, hi=hi)
    g = helper.make_graph([node], "g", [vi("x", TensorProto.FLOAT, [33, k]), vi("base", TensorProto.FLOAT, [33, n]), vi("res", TensorProto.FLOAT, [33, n])],
                          [vi("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(wt, "wt")])
    sess = _session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.llmc", 1)]), native_kernels)
    x = _outliers(rng, (33, k), 0.05, lo, hi)
    base, res = (rng.standard_normal((33, n)).astype(np.float32) for _ in range(2))
    y = sess.run(None, {"x": x, "base": base, "res": res})[0]
    corr = (x - np.clip(x, lo, hi)).astype(np.float64) @ wt
    np.testing.assert_allclose(y, res + (base + corr), rtol=1e-5, atol=1e-4)
    assert np.abs(corr).max() > 1.0

    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument, RuntimeException

    node = helper.make_node("ShadowCorrection", ["x", "wt", "", "res"], ["y"], domain="ai.llmc", lo=lo, hi=hi)
    g = helper.make_graph([node], "g", [vi("x", TensorProto.FLOAT, [33, k]), vi("res", TensorProto.FLOAT, [33, n])],
                          [vi("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(wt, "wt")])
    sess = _session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.llmc", 1)]), native_kernels)
    with pytest.raises((InvalidArgument, Fail, RuntimeException), match="residual must come with base"):
        sess.run(None, {"x": x, "res": res})


@pytest.mark.parametrize("rows,wtype,codes", [(57, np.float16, True), (256, np.float32, True), (1, np.float16, True), (7, np.float32, False),
                                             (0, np.float16, True)])
def test_shadow_correction_with_swiglu_is_correction_then_swiglu(native_kernels, rows, wtype, codes):
    """With SwiGLU's attributes ShadowCorrection's outputs are, bit for bit, what ShadowCorrection and then SwiGLU
    compute (the result, and its codes): a gate/up projection's correction and its activation as one op, at a chunk's
    rows and 57 (row blocks on the pool), one row and 7 (on this thread), none; up before gate in the columns, a width
    and columns that end past whole vectors (the rows' and SwiGLU's tails)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(rows)
    k, width, lo, hi, scale, zp = 320, 133, -1.0, 1.0, 0.01, 128
    n = 2 * width + 5  # columns past the gate and up halves, which SwiGLU does not read
    gate, up = width + 5, 0
    wt = (rng.standard_normal((k, n)) * 0.5).astype(wtype)
    vi = helper.make_tensor_value_info
    q = {"scale": scale, "zero_point": zp} if codes else {}
    outs = ["h", "hq"] if codes else ["h"]
    fused = helper.make_node("ShadowCorrection", ["x", "wt", "base"], outs, domain="ai.llmc", lo=lo, hi=hi, gate=gate, up=up, width=width, **q)
    corr = helper.make_node("ShadowCorrection", ["x", "wt", "base"], ["y"], domain="ai.llmc", lo=lo, hi=hi)
    act = helper.make_node("SwiGLU", ["y"], [f"s{o}" for o in outs], domain="ai.llmc", gate=gate, up=up, width=width, **q)
    ins = [vi("x", TensorProto.FLOAT, [rows, k]), vi("base", TensorProto.FLOAT, [rows, n])]
    results = [vi(o, TensorProto.UINT8 if o.endswith("q") else TensorProto.FLOAT, None) for o in outs + [f"s{o}" for o in outs]]
    g = helper.make_graph([fused, corr, act], "g", ins, results, [numpy_helper.from_array(wt, "wt")])
    sess = _session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.llmc", 1)]), native_kernels)
    x = _outliers(rng, (rows, k), 0.03, lo, hi)
    base = (rng.standard_normal((rows, n)) * 2).astype(np.float32)
    got = sess.run(None, {"x": x, "base": base})
    half = len(outs)
    for a, b in zip(got[:half], got[half:]):
        np.testing.assert_array_equal(a, b)
    assert got[0].shape == (rows, width)
    if rows and codes:
        assert np.abs(got[0]).max() > 0.5 and len(np.unique(got[1])) > 20


def test_shadow_correction_with_swiglu_checks_its_attributes(native_kernels):
    """SwiGLU's attributes on ShadowCorrection come together and lie inside wt's columns; codes need them."""
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument, RuntimeException

    wt = np.ones((8, 20), np.float32)
    vi = helper.make_tensor_value_info

    def run(outs, ins=("x", "wt"), **attrs):  # ins: "b" is a [2, 20] input (base, residual)
        node = helper.make_node("ShadowCorrection", list(ins), outs, domain="ai.llmc", lo=-1.0, hi=1.0, **attrs)
        inputs = [vi("x", TensorProto.FLOAT, [2, 8])] + ([vi("b", TensorProto.FLOAT, [2, 20])] if "b" in ins else [])
        g = helper.make_graph([node], "g", inputs, [vi(o, TensorProto.FLOAT if o == "y" else TensorProto.UINT8, None) for o in outs],
                              [numpy_helper.from_array(wt, "wt")])
        sess = _session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.llmc", 1)]), native_kernels)
        return sess.run(None, {v.name: np.zeros([d.dim_value for d in v.type.tensor_type.shape.dim], np.float32) for v in inputs})

    errors = (InvalidArgument, Fail, RuntimeException)
    with pytest.raises(errors, match="gate, up and width come together"):
        run(["y"], gate=0, up=10)
    with pytest.raises(errors, match="codes output needs SwiGLU's attributes"):
        run(["y", "q"], scale=0.1, zero_point=128)
    with pytest.raises(errors, match="must lie inside wt's N"):
        run(["y"], gate=0, up=11, width=10)
    assert run(["y"], gate=0, up=10, width=10)[0].shape == (2, 10)
    with pytest.raises(errors, match="a residual and SwiGLU's attributes do not come together"):
        run(["y"], ins=("x", "wt", "b", "b"), gate=0, up=10, width=10)


def test_inspect_and_bench_name_the_native_kernels(npu_pair, native_kernels):
    """`llmc inspect` says a native bundle needs the kernels (text and JSON) and a stock one does not; `llmc bench`
    names the library it loaded."""
    from click.testing import CliRunner

    from llmc.cli import cli

    def run(*args):
        r = CliRunner().invoke(cli, [str(a) for a in args])
        assert r.exit_code == 0, r.output
        return r.output

    assert "kernels    llmc's native ops" in run("inspect", npu_pair["native"])
    assert "kernels " not in run("inspect", npu_pair["onnx"])
    assert json.loads(run("inspect", npu_pair["native"], "--json"))["cpu_kernels"] == "native"
    assert json.loads(run("inspect", npu_pair["onnx"], "--json"))["cpu_kernels"] == "onnx"
    out = run("bench", npu_pair["native"], "--prompt-len", 12, "--new-tokens", 2, "--repeat", 1)
    assert f"kernels  llmc's native ops (--cpu-kernels native) from {native_kernels}" in out
    # (a CPU without VNNI also gets a line on its exact int8 kernels, which names no native ops)
    assert "native ops" not in run("bench", npu_pair["onnx"], "--prompt-len", 12, "--new-tokens", 2, "--repeat", 1)


def _session_and_bench(monkeypatch, bundle, features, env_name, env):
    """A lazy session of ``bundle`` and `llmc bench`'s output for it, with the native library's features patched to
    ``features`` and ``env_name`` set to ``env`` (None: unset)."""
    from click.testing import CliRunner

    from llmc import runtime
    from llmc.cli import cli
    from llmc.runtime import Session

    monkeypatch.setattr(runtime.native, "features", lambda path: frozenset(features))
    if env is None:
        monkeypatch.delenv(env_name, raising=False)
    else:
        monkeypatch.setenv(env_name, env)
    out = CliRunner().invoke(cli, ["bench", str(bundle), "--prompt-len", "12", "--new-tokens", "2", "--repeat", "1"]).output
    return Session(bundle, "cpu", lazy=True), out


def test_bench_reports_the_packed_copy_of_the_decode_weights(npu_pair, monkeypatch):
    """The manifest lists the decode graph's packed weights (its W8A8MatMul ops' with pack=1); a session counts their
    copies' bytes (blocks of 64 columns, K in whole groups of four, and the columns' sums) where the library was built
    for AVX-512 VNNI and LLMC_W8_PACK is not 0, and `llmc bench` says so; elsewhere 0 and no line."""
    from llmc.runtime import Session

    m = json.loads((npu_pair["native"] / "manifest.json").read_text())
    w8 = [n for n in _nodes(npu_pair["native"], f"{m['decode_graph']}.r1") if n.op_type == "W8A8MatMul"]
    assert m["graphs"][m["decode_graph"]]["packed"] == [n.input[1] for n in w8]
    shapes = [m["weights"][n.input[1]]["shape"] for n in w8]
    want = sum(-(-k // 4) * 4 * -(-n // 64) * 64 + -(-n // 64) * 64 * 4 for k, n in shapes)
    for flags, env, expect in ((("w8_pack",), None, want), (("w8_pack",), "0", 0), (("bf16_chunks",), None, 0)):
        session, out = _session_and_bench(monkeypatch, npu_pair["native"], flags, "LLMC_W8_PACK", env)
        assert session.packed_weight_bytes == expect
        assert (f"packed   the decode graph's W8A8 weights copied into their ops' layout (AVX-512 VNNI): {want / 1e6:.1f} MB" in out) == (expect > 0), out
    assert Session(npu_pair["onnx"], "cpu", lazy=True).packed_weight_bytes == 0  # no native ops


def test_bench_reports_bfloat16_attention(npu_pair, monkeypatch):
    """The manifest marks the graphs whose native attention has bf16=1 (the decode graph of a W8A8 bundle); a session
    says its chunks' attention multiplies in bfloat16 where the library was built for AVX512_BF16 and LLMC_ATTN_BF16 is
    not 0, and `llmc bench` says so; elsewhere not, and no line."""
    from llmc.runtime import Session

    m = json.loads((npu_pair["native"] / "manifest.json").read_text())
    marked = {g for g, e in m["graphs"].items() if e.get("bf16_attention")}
    with_attr = {g for g, e in m["graphs"].items() for i in e["instances"].values() for n in _nodes(npu_pair["native"], f"{g}.r{i['rows']}")
                 if n.op_type.startswith("DecodeAttention") and any(a.name == "bf16" and a.i == 1 for a in n.attribute)}
    assert marked == with_attr == {m["decode_graph"]}
    line = "bf16     a chunk's attention multiplies in bfloat16 with float32 sums (AVX512_BF16); LLMC_ATTN_BF16=0 keeps float32"
    for flags, env, expect in ((("bf16_chunks",), None, True), (("bf16_chunks",), "0", False), (("w8_pack",), None, False)):
        session, out = _session_and_bench(monkeypatch, npu_pair["native"], flags, "LLMC_ATTN_BF16", env)
        assert session.bf16_attention == expect
        assert (line in out) == expect, out
    assert not Session(npu_pair["onnx"], "cpu", lazy=True).bf16_attention  # no native ops


def test_compile_warns_when_the_kernels_are_not_built(model_dirs, tmp_path, monkeypatch, caplog):
    """--cpu-kernels native where the kernels are not built: the bundle is written, with a warning that it will
    not run here until `llmc kernels build`."""
    import logging

    from llmc.compile import compile_model

    monkeypatch.delenv("LLMC_KERNELS", raising=False)
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "empty"))
    with caplog.at_level(logging.WARNING, logger="llmc"):
        compile_model(str(model_dirs("llama")), tmp_path / "b", target="cpu", chunk=CHUNK, max_context=MAX_CONTEXT, cpu_kernels="native")
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["cpu_kernels"] == "native"
    assert any("kernels are not built" in r.getMessage() and "llmc kernels build" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("rows", [1, 3])
def test_w8a8_matmul_reads_the_swiglu_of_its_input(native_kernels, rows):
    """With SwiGLU's gate and up attributes, W8A8MatMul reads silu(x[..., gate:gate+K]) * x[..., up:up+K] of its input
    [..., W] (the down projection straight from the gate/up projection): bit for bit what SwiGLU and then W8A8MatMul
    compute, the outliers (weight table) and the residual those of the activation's result."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(40 + rows)
    k, n, lo, hi, gate, up = 72, 130, -0.5, 0.5, 5, 80
    w = _w8_weights(rng, k, n, np.int8, True)
    wt = rng.standard_normal((k, n)).astype(np.float16)
    x = rng.normal(0, 2.0, (rows, 160)).astype(np.float32)
    r = rng.standard_normal((rows, n)).astype(np.float32)
    attrs = {"x_scale": 0.01, "x_zero_point": 128, "lo": lo, "hi": hi}
    act = helper.make_node("SwiGLU", ["x"], ["h"], domain="ai.llmc", gate=gate, up=up, width=k)
    graph = helper.make_graph([act], "a", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, 160])],
                              [helper.make_tensor_value_info("h", TensorProto.FLOAT, None)])
    h = _session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.llmc", 1)]),
                 native_kernels).run(None, {"x": x})[0]
    assert ((h < lo) | (h > hi)).any()  # some outliers
    two_ops = _session(_w8_model(k, n, {**w, "wt": wt}, residual=True, **attrs), native_kernels).run(None, {"x": h, "residual": r})[0]
    fused = _session(_w8_model(None, n, {**w, "wt": wt}, residual=True, gate=gate, up=up, **attrs), native_kernels)
    np.testing.assert_array_equal(fused.run(None, {"x": x, "residual": r})[0], two_ops)
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument, RuntimeException

    with pytest.raises((Fail, InvalidArgument, RuntimeException), match="W8A8MatMul: x must be \\[..., W\\] with the gate and up columns"):
        fused.run(None, {"x": x[:, :150], "residual": r})
    for bad, match in (({"gate": gate}, "gate and up come together"), ({"gate": gate, "up": up, "epsilon": 1e-5}, "a SwiGLU input .* and a norm")):
        weights = {**w, "norm": np.ones(k, np.float32)} if "epsilon" in bad else w
        with pytest.raises((Fail, InvalidArgument, RuntimeException), match=match):
            _session(_w8_model(None, n, weights, x_scale=0.01, x_zero_point=128, **bad), native_kernels)


def test_swiglu_stays_an_op_where_another_op_reads_its_result(model_dirs):
    """The backend leaves a gated MLP's activation to the down projection's W8A8MatMul only in one-row graphs and only
    where W8A8MatMul ops (and the corrections they do) are all that read it (so would a one-row graph in which any other
    op read the activation keep llmc's SwiGLU); in a chunk the gate/up projection's correction computes it, but not
    where another op reads a half of that projection, and not the q/k/v correction, whose halves attention takes."""
    from llmc.analyses import DecodeGraph
    from llmc.backends.onnx_backend import _Builder
    from llmc.passes import DEFAULT_PIPELINES

    from test_quantization import _ctx, _run

    g, ctx = _ctx(model_dirs("llama"), cpu_kernels="native")
    _run(g, ctx, DEFAULT_PIPELINES["npu"].split(",fuse_decode_graph")[0] + ",fuse_decode_graph")
    sub = ctx.get(DecodeGraph).subgraph
    one_row = _Builder(g, sub, 1, {}, native=True)
    muls = [n for n in g.nodes if n.name in one_row.members and n.op == "Mul" and one_row.swiglu(n) is not None]
    assert muls and all(one_row.gated_in_projection(m) for m in muls)
    assert not any(_Builder(g, sub, CHUNK, {}, native=True).gated_in_projection(m) for m in muls)
    other = next(n for n in g.nodes if n.name in one_row.members and n.op == "Add")
    muls[0].outputs[0]._uses.append((other, 0))  # another reader of the activation
    assert not one_row.gated_in_projection(muls[0]) and one_row.swiglu_inside(muls[0].outputs[0]) is None
    assert all(one_row.gated_in_projection(m) for m in muls[1:])

    from llmc.backends.onnx_backend import _DecodeBuilder

    chunk = _DecodeBuilder(g, ctx.get(DecodeGraph), {}, frozenset(), rows=CHUNK, native=True)
    shadows = [n for n in g.nodes if n.name in chunk.members and n.op == "ShadowOutliers"]
    fused = {id(s): chunk.swiglu_after(s) for s in shadows}
    assert sum(m is not None for m in fused.values()) == len(muls)  # the gate/up corrections, not q/k/v's, o's or down's
    assert all(chunk.swiglu_in_correction(m) for m in muls) and not any(one_row.swiglu_after(s) for s in shadows)
    gate_up = next(s for s in shadows if fused[id(s)] is muls[1])
    half = next(v for v in (gate_up.outputs[0], *(u.outputs[0] for u, _ in gate_up.outputs[0].uses)) if v.uses and v.uses[0][0].op in ("Act", "Mul"))
    half._uses.append((other, 0))  # another reader of a half of the gate/up projection
    assert chunk.swiglu_after(gate_up) is None and not chunk.swiglu_in_correction(muls[1])
