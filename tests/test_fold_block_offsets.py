"""fold_block_offsets: a 4-bit BlockQLinear's offsets as base-14 digits in extra blocks of its codes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import CHUNK
from llmc.ops import folded_blocks
from llmc.passes.fold_block_offsets import DIGITS, fold_offsets, offset_digits
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


@pytest.mark.parametrize("in_features", [576, 1536, 64])
def test_folded_codes_compute_the_offsets_term(in_features):
    """The widened input times the folded codes equals x times the original weights (offsets included) to
    within the digits' bound: 18 block sums (one padded digit block each), 48 (two), 2."""
    rng = np.random.default_rng(1)
    n = 24
    w = rng.standard_normal((n, in_features)).astype(np.float32)
    w[2] += 3.0  # blocks far from zero: large offsets
    codes, scales, offsets = quantize_blocks(w, 4)
    fc, fs = fold_offsets(codes, scales, offsets, BLOCK)
    nf = folded_blocks(in_features, BLOCK, DIGITS)
    assert fc.shape == (n, nf, BLOCK // 2) and fs.shape == (n * nf,)
    assert np.array_equal(fc[:, : in_features // BLOCK], codes)  # the input's blocks are the codes themselves
    x = rng.standard_normal((5, in_features)).astype(np.float32)
    ref = x.astype(np.float64) @ dequantize_blocks(codes, scales, offsets, 4).T.astype(np.float64)
    got = widen_with_block_sums(x, BLOCK, DIGITS) @ dequantize_blocks(fc, fs, None, 4).T
    sums = np.abs(x.reshape(5, -1, BLOCK).sum(axis=2)).sum(axis=1, keepdims=True)
    bound = sums * np.abs(offsets).max(axis=0) / 14.0**DIGITS + 1e-4 * np.abs(ref).max()
    assert (np.abs(got - ref) <= bound).all()
    # without the digits' blocks the offsets' term is missing: the check above would fail
    plain = x @ dequantize_blocks(codes, scales, None, 4).T
    assert not (np.abs(plain - ref) <= bound).all()


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
    assert qs and all("offsets" not in q.weights and q.attrs["offset_digits"] == DIGITS for q in qs)
    for q in qs:
        k = q.inputs[0].shape[-1]
        assert q.weights["qweight"].shape[1] == folded_blocks(k, BLOCK, DIGITS) > k // BLOCK
    assert head.weights == head_weights and "offset_digits" not in head.attrs
    after = Interpreter(g).run(ids, select_rows=np.arange(len(ids)))
    span = float(before.max() - before.min())
    assert np.abs(after - before).max() < 1e-3 * span


def test_pass_refuses_to_run_after_the_graphs_are_cut(model_dirs):
    from test_quantize_int4 import _lift, _quantized

    from llmc.errors import CompileError

    g = _lift(model_dirs("llama"))
    with pytest.raises(CompileError, match="after chunk_static_graphs"):
        _quantized(g, "dce,select_logit_rows,quantize_int4,chunk_static_graphs,fold_block_offsets")


def test_bundle_runs_one_matmulnbits_per_linear(model_dirs, tmp_path):
    """In the int4 bundle's graphs the offsets are no float Gemm: each 4-bit MatMulNBits reads the widened input
    (K = the folded width), one-row and chunk instances alike; and the bundle computes what the IR says."""
    import onnx

    from llmc.compile import compile_model
    from llmc.runtime import Session

    out = tmp_path / "b"
    compile_model(str(model_dirs("llama")), out, target="cpu", weight_format="int4", chunk=CHUNK, max_context=64)
    m = json.loads((out / "manifest.json").read_text())
    assert "fold_block_offsets" in m["pipeline"]
    assert not [n for n in m["weights"] if n.endswith(".offset")]
    ks = set()
    for g in m["graphs"].values():
        for inst in g["instances"].values():
            nodes = onnx.load(out / inst["file"], load_external_data=False).graph.node
            assert "Gemm" not in [n.op_type for n in nodes]
            for n in nodes:
                attrs = {a.name: a.i for a in n.attribute}
                if n.op_type == "MatMulNBits" and attrs["bits"] == 4:
                    ks.add(attrs["K"])
    assert ks == {folded_blocks(64, BLOCK, DIGITS) * BLOCK, folded_blocks(96, BLOCK, DIGITS) * BLOCK}  # hidden 64, MLP 96
    s = Session(out)
    ids = [1, 5, 9, 17, 33, 4, 8, 12, 40, 41]
    full = s.prefill(ids, all_logits=True)
    s.reset()
    s.prefill(ids[:5])
    steps = np.stack([s.decode(t) for t in ids[5:]])
    span = float(full.max() - full.min())
    assert np.abs(steps - full[5:]).max() < 3e-2 * span  # decode's int8 activations against the float chunks
