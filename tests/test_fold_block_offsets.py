"""fold_block_offsets: a 4-bit BlockQLinear's offsets as base-14 digits in extra blocks of its codes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import CHUNK
from llmc.ops import folded_blocks
from llmc.passes.fold_block_offsets import DIGITS, fold_offsets, offset_digits, split_offsets
from llmc.passes.quantize_int4 import BLOCK, quantize_blocks
from llmc.runtime.kernels import dequantize_blocks, widen_with_block_sums


@pytest.mark.parametrize("digits", [1, 2, 3])
def test_digits_are_within_the_bound(digits):
    """|o - ô| <= max_b |o_bn| / 14^D per channel, codes 1..15; an all-zero channel stays exactly zero, and a
    channel with one large offset keeps its bound (relative to that offset)."""
    rng = np.random.default_rng(0)
    o = rng.standard_normal((18, 40)).astype(np.float32)
    o[:, 3] = 0.0
    o[5, 7] = 300.0
    codes, scales = offset_digits(o, digits)
    assert codes.shape == (digits, 40, 18) and scales.shape == (digits, 40)
    assert codes.min() >= 1 and codes.max() <= 15
    back = np.einsum("jn,jnb->bn", scales.astype(np.float64), codes.astype(np.float64) - 8)
    bound = np.abs(o).max(axis=0) / 14.0**digits
    assert (np.abs(back - o) <= bound * (1 + 1e-6)).all()
    assert np.all(back[:, 3] == 0.0)
    # each digit is used: one digit fewer would miss the bound somewhere
    if digits > 1:
        fewer = np.einsum("jn,jnb->bn", scales[:-1].astype(np.float64), codes[:-1].astype(np.float64) - 8)
        assert (np.abs(fewer - o) > bound).any()


@pytest.mark.parametrize("in_features", [576, 1536, 64, 1024])
def test_folded_codes_compute_the_offsets_term(in_features):
    """The widened input times the folded codes (zero points included) equals x times the original weights
    (offsets included) to within the digits' bound: 18 block sums (one padded digit block each), 48 (two), 2,
    32 (one, no padding)."""
    rng = np.random.default_rng(1)
    n = 24
    w = rng.standard_normal((n, in_features)).astype(np.float32)
    w[2] += 3.0  # blocks far from zero: offsets past the zero points' reach
    codes, scales, offsets = quantize_blocks(w, 4)
    fc, fs, fz = fold_offsets(codes, scales, offsets, BLOCK)
    nb, nf = in_features // BLOCK, folded_blocks(in_features, BLOCK, DIGITS)
    assert fc.shape == (n, nf, BLOCK // 2) and fs.shape == (n * nf,) and fz.shape == (n, -(-nf // 2))
    assert np.array_equal(fc[:, :nb], codes)  # the input's blocks are the codes themselves
    x = rng.standard_normal((5, in_features)).astype(np.float32)
    ref = x.astype(np.float64) @ dequantize_blocks(codes, scales, offsets, 4).T.astype(np.float64)
    got = widen_with_block_sums(x, BLOCK, DIGITS) @ dequantize_blocks(fc, fs, None, 4, fz).T
    _, s, _, rest = split_offsets(codes, scales, offsets)
    sums = np.abs(x.reshape(5, -1, BLOCK).sum(axis=2)).sum(axis=1, keepdims=True)
    bound = sums * np.abs(rest).max(axis=0) / 14.0**DIGITS + 1e-4 * np.abs(ref).max()
    assert (np.abs(got - ref) <= bound).all()
    # without the digits' blocks (their input zeroed) the remainders are missing: the check above would fail
    widened = widen_with_block_sums(x, BLOCK, DIGITS)
    widened[:, in_features:] = 0.0
    assert not (np.abs(widened @ dequantize_blocks(fc, fs, None, 4, fz).T - ref) <= bound).all()


def test_zero_points_take_the_whole_steps_and_constant_blocks_are_exact():
    """Each remainder is within half a step where the zero point was not clipped; a constant block becomes
    codes 15 at the scale o / 7 (exact), an all-zero block stays zero."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((6, 4 * BLOCK)).astype(np.float32)
    w[1, :BLOCK] = 0.25  # constant
    w[2, BLOCK : 2 * BLOCK] = 0.0  # all zero
    w[3, 2 * BLOCK : 3 * BLOCK] = np.abs(w[3, 2 * BLOCK : 3 * BLOCK]) + 5.0  # far from zero: the zero point clips
    w[4, 3 * BLOCK :] = -0.5  # constant and negative: a negative scale
    codes, scales, offsets = quantize_blocks(w, 4)
    c, s, z, rest = split_offsets(codes, scales, offsets)
    q = dequantize_blocks(c, s.reshape(-1), None, 4, (z[:, 0::2] | (z[:, 1::2] << 4)).astype(np.uint8))
    assert np.allclose(q + np.repeat(rest.T, BLOCK, axis=1), dequantize_blocks(codes, scales, offsets, 4), atol=1e-5)
    free = (z > 0) & (z < 15) & (scales.reshape(6, 4) != 0)  # a zero point that did not clip, not a constant block
    assert (np.abs(rest.T)[free] <= s[free] / 2 * (1 + 1e-6)).all()
    assert not free[3, 2] and abs(rest[2, 3]) > s[3, 2]  # clipped: the digits carry the rest
    assert s[1, 0] == np.float32(np.float32(0.25) / 7) and rest[0, 1] == 0.0 and np.allclose(q[1, :BLOCK], 0.25, rtol=1e-6)
    assert s[2, 1] == 0.0 and rest[1, 2] == 0.0 and np.all(q[2, BLOCK : 2 * BLOCK] == 0.0)
    assert s[4, 3] < 0 and rest[3, 4] == 0.0 and np.allclose(q[4, 3 * BLOCK :], -0.5, rtol=1e-6)


def test_pass_folds_the_4_bit_offsets_and_keeps_the_numbers(model_dirs):
    """Every 4-bit BlockQLinear loses its offsets weight and gains the digits' blocks; the symmetric 8-bit head
    (no offsets) is left alone; the interpreter's logits move by the digits' error only."""
    from test_quantize_int4 import _lift, _quantized

    from llmc.interpreter import Interpreter

    g = _quantized(_lift(model_dirs("llama")), "dce,select_logit_rows,quantize_int4,fuse_sibling_linears")
    ids = [int(t) for t in np.random.default_rng(2).integers(4, 120, size=CHUNK)]
    before = Interpreter(g).run(ids, select_rows=np.arange(len(ids)))
    head = g.outputs[0].producer
    head_weights = dict(head.weights)
    _quantized(g, "fold_block_offsets")
    g.verify()
    qs = [q for q in g.find("BlockQLinear") if q is not head]
    assert qs and all("offsets" not in q.weights and "zero_points" in q.weights and q.attrs["offset_digits"] == DIGITS for q in qs)
    for q in qs:
        k = q.inputs[0].shape[-1]
        assert q.weights["qweight"].shape[1] == folded_blocks(k, BLOCK, DIGITS) > k // BLOCK
    assert head.weights == head_weights and "offset_digits" not in head.attrs
    after = Interpreter(g).run(ids, select_rows=np.arange(len(ids)))
    span = float(before.max() - before.min())
    assert np.abs(after - before).max() < 1e-3 * span


def test_fold_before_or_after_the_merge_gives_the_same_numbers(model_dirs):
    """Folded q/k/v and gate/up merge like unfolded ones (codes, scales and zero points by output rows): the
    interpreter's logits are the same numbers whichever pass runs first."""
    from test_quantize_int4 import _lift, _quantized

    from llmc.interpreter import Interpreter

    ids = [int(t) for t in np.random.default_rng(5).integers(4, 120, size=CHUNK)]
    out = {}
    for order in ("fuse_sibling_linears,fold_block_offsets", "fold_block_offsets,fuse_sibling_linears"):
        g = _quantized(_lift(model_dirs("llama")), f"dce,select_logit_rows,quantize_int4,{order}")
        g.verify()
        assert [n for n in g.find("BlockQLinear") if "+" in n.name and "zero_points" in n.weights]
        out[order] = Interpreter(g).run(ids, select_rows=np.arange(len(ids)))
    a, b = out.values()
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(a).max())


def test_cost_model_counts_the_pad_only_at_chunk_rows(model_dirs):
    """A folded BlockQLinear whose block sums need padding (64 and 96 inputs) runs a Pad at chunk rows only:
    one-row graphs concatenate constant zeros."""
    from test_quantize_int4 import _lift, _quantized

    from llmc.cost_model import _kernels

    g = _quantized(_lift(model_dirs("llama")), "dce,select_logit_rows,quantize_int4,fuse_sibling_linears,fold_block_offsets")
    folded = [n for n in g.find("BlockQLinear") if n.attrs.get("offset_digits")]
    assert folded and {(_kernels(n, 1), _kernels(n, CHUNK)) for n in folded} == {(3, 4)}


def test_pass_before_quantize_int4_says_it_has_nothing_to_fold(model_dirs, caplog):
    import logging

    from test_quantize_int4 import _lift, _quantized

    with caplog.at_level(logging.WARNING, logger="llmc.passes.fold_block_offsets"):
        g = _quantized(_lift(model_dirs("llama")), "dce,fold_block_offsets,quantize_int4")
    assert "nothing to fold" in caplog.text and "after quantize_int4" in caplog.text
    assert all("offsets" in q.weights for q in g.find("BlockQLinear") if q.attrs["bits"] == 4)


def test_pass_refuses_to_run_after_the_graphs_are_cut(model_dirs):
    from test_quantize_int4 import _lift, _quantized

    from llmc.errors import CompileError

    g = _lift(model_dirs("llama"))
    with pytest.raises(CompileError, match="after chunk_static_graphs"):
        _quantized(g, "dce,select_logit_rows,quantize_int4,chunk_static_graphs,fold_block_offsets")


@pytest.mark.parametrize("hidden,mlp", [(64, 96), (1024, 1088)])
def test_bundle_runs_one_matmulnbits_per_linear(model_dirs, tmp_path, hidden, mlp):
    """In the int4 bundle's graphs the offsets are no float Gemm: each 4-bit MatMulNBits reads the widened input
    (K = the folded width) and zero points, one-row and chunk instances alike; and the bundle computes what the
    folded IR says (the interpreter): prefill within 1% of the logits' range, decode (int8 activations) 3%.
    Hidden 64 and MLP 96: 2 and 3 blocks; 1024 and 1088: 32 blocks (no padding) and 34 (two digit blocks each)."""
    import onnx
    import torch
    import transformers as T
    from test_quantize_int4 import _lift, _quantized

    from conftest import COMMON
    from llmc.compile import compile_model
    from llmc.interpreter import Interpreter
    from llmc.runtime import Session

    src = model_dirs("llama")
    if hidden != COMMON["hidden_size"]:
        torch.manual_seed(0)
        cfg = T.LlamaConfig(**{**COMMON, "hidden_size": hidden, "intermediate_size": mlp, "head_dim": 16, "num_attention_heads": 64,
                               "num_key_value_heads": 16, "initializer_range": 0.02})
        src = tmp_path / "wide"
        T.AutoModelForCausalLM.from_config(cfg).save_pretrained(src)
    out = tmp_path / "b"
    compile_model(str(src), out, target="cpu", weight_format="int4", chunk=CHUNK, max_context=64)
    m = json.loads((out / "manifest.json").read_text())
    assert "fold_block_offsets" in m["pipeline"]
    assert not [n for n in m["weights"] if n.endswith(".offset")]
    ks = set()
    for g in m["graphs"].values():
        for inst in g["instances"].values():
            nodes = onnx.load(out / inst["file"], load_external_data=False).graph.node
            assert "Gemm" not in [n.op_type for n in nodes]
            if inst["rows"] == 1:  # zeros to whole blocks are a constant of the Concat at a fixed row count
                assert "Pad" not in [n.op_type for n in nodes]
            for n in nodes:
                attrs = {a.name: a.i for a in n.attribute}
                if n.op_type == "MatMulNBits" and attrs["bits"] == 4:
                    assert len(n.input) == 4  # the zero points
                    ks.add(attrs["K"])
    assert ks == {folded_blocks(hidden, BLOCK, DIGITS) * BLOCK, folded_blocks(mlp, BLOCK, DIGITS) * BLOCK}
    ids = [1, 5, 9, 17, 33, 4, 8, 12, 40, 41, 42, 7]
    ref = Interpreter(_quantized(_lift(src), "dce,quantize_int4,fuse_sibling_linears,fold_block_offsets")).run(ids)
    span = float(ref.max() - ref.min())
    s = Session(out)
    full = s.prefill(ids, all_logits=True)
    assert np.abs(full - ref).max() < 1e-2 * span
    s.reset()
    s.prefill(ids[:5])
    steps = np.stack([s.decode(t) for t in ids[5:]])
    assert np.abs(steps - ref[5:]).max() < 3e-2 * span


@pytest.mark.parametrize("constant", [None, 0.05, -0.05])
def test_one_row_matmulnbits_keeps_the_offsets_close(constant):
    """ONNX Runtime's MatMulNBits at one row (int8 activations per block, accuracy_level 4) over the folded
    weights and the widened input, against x @ W^T in float64, with one input block 30x the others (errors
    relative to the largest output):
    - ordinary blocks: 3.1e-3 (the lowering with the offsets' float Gemm: 1.5e-3). The zero points' part
      uses each block's own quantized sum, as llama.cpp's Q4_1 x Q8_1 does; the remainders ride on the 18
      block sums' one shared int8 scale, which the large block sets;
    - constant blocks (scale 0), positive or negative: codes 15 at the scale o / 7 (negative for a negative
      o), exact weights, no digits: 4e-4. As digits over the float block sums they were off by 1.5e-2."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(4)
    k, n = 576, 256
    w = (np.full((n, k), constant, np.float32) + rng.standard_normal((n, 1)).astype(np.float32) * 0.01 if constant
         else rng.standard_normal((n, k)).astype(np.float32) * 0.05 + 0.02)
    codes, scales, offsets = quantize_blocks(w, 4)
    assert (scales == 0).all() == bool(constant)
    fc, fs, fz = fold_offsets(codes, scales, offsets, BLOCK)
    kf = fc.shape[1] * BLOCK
    node = helper.make_node("MatMulNBits", ["x", "b", "s", "z"], ["y"], domain="com.microsoft", K=kf, N=n, bits=4, block_size=BLOCK, accuracy_level=4)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, kf])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
                          [numpy_helper.from_array(fc, "b"), numpy_helper.from_array(fs, "s"), numpy_helper.from_array(fz, "z")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = rng.standard_normal((1, k)).astype(np.float32) * 0.1
    x[0, :BLOCK] += 3.0
    ref = x.astype(np.float64) @ dequantize_blocks(codes, scales, offsets, 4).T.astype(np.float64)
    got = sess.run(None, {"x": widen_with_block_sums(x, BLOCK, DIGITS)})[0]
    assert np.abs(got - ref).max() < (2e-3 if constant else 6e-3) * np.abs(ref).max(), np.abs(got - ref).max() / np.abs(ref).max()
    if constant:  # the constant blocks' scales carry the offsets' sign
        assert (fs.reshape(n, -1)[:, : k // BLOCK] < 0).all() == (constant < 0)
