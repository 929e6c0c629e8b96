"""fold_block_offsets: a BlockQLinear's offsets become zero points and extra blocks of its own codes.

``quantize_int4`` stores a weight as ``s (q - 8) + o`` per block of 32 inputs, so
its matmul has two terms (``xs``: x summed over each block, ``O``: the offsets)::

    y = x @ (s (q - 8))^T + xs @ O

ONNX Runtime's ``MatMulNBits`` computes the first. It has no fast path for a
float offset (float zero points take its dequantizing path, 30-40x slower), so
the second was a float ``Gemm`` of its own. In SmolLM2's decode graph that is
120 Gemms per token: ~25% of a token's time for 11% of its bytes.

This pass moves each offset into the one ``MatMulNBits``, in two parts:

* **Zero points.** The whole steps of the offset go into the block's 4-bit zero
  point: ``z = clip(round(8 - o / s), 0, 15)``, so ``o = s (8 - z) + r`` with
  ``|r| <= s / 2`` unless z was clipped. ``MatMulNBits`` then computes the
  block as ``s (q - z)``.
* **Digits.** The remainders r of an output channel are written as D base-14
  digits of 4-bit codes and appended to that channel's codes as extra blocks.
  The input is widened with D copies of its block sums (P: xs zero-padded to a
  multiple of 32 entries)::

      y = [x, P, ..., P] @ (s' (q' - z'))^T

  Digit j has the scale ``t_j = max_b |r_bn| / (7 * 14^j)`` and codes ``c - 8``
  in [-7, 7], taken greedily: ``c_j = round(rest_j / t_j)``, ``rest_{j+1} =
  rest_j - t_j c_j``, starting from ``rest_0 = r``. Each remainder stays within
  half a step of the previous digit, which is 7 steps of the next one, so after D
  digits ``|r - r̂| <= max_b |r_bn| / 14^D``. With D = 3 that is 1/2744 of the
  channel's largest remainder, itself half a quantization step where no zero
  point was clipped.

A constant block (scale 0, the offset holds its value) gets codes 15 and the
scale ``o / 7`` with zero point 8, so it is exact without digits.

Numerics:
* chunk graphs compute in float32, so they differ from the offsets' exact term
  by the digits' remainder only;
* one-row graphs quantize their input to int8 per block (``accuracy_level=4``).
  The zero points' part of the offsets then uses each block's own quantized sum,
  as llama.cpp's Q4_1 x Q8_1 dot product does. The remainders' part uses the
  float block sums, quantized with one scale per 32 of them.

Per output channel the codes grow by ``D * ceil(blocks / 32)`` blocks and the
zero points take half a byte per block, while the float offsets go. For SmolLM2
that is 71 B instead of 72 B per channel of q/k/v, o_proj and gate/up, and 147 B
instead of 192 B for down_proj. Chunk graphs multiply over that many more inputs
(+17% for 576 inputs, +12.5% for 1,536). Measured on SmolLM2 in
``docs/quantization.md``: decode 12-15% faster, prefill 4% slower, perplexity
and decode's agreement with the chunk graphs as before.

Only 4-bit ``BlockQLinear`` nodes with offsets are rewritten (the symmetric
8-bit head has none). Run it after ``quantize_int4``; before or after
``fuse_sibling_linears``; before ``chunk_static_graphs``.
"""

from __future__ import annotations

import logging

import numpy as np

from llmc.analyses import ChunkPlan
from llmc.errors import CompileError
from llmc.ir import Graph, Node
from llmc.ops import folded_blocks
from llmc.pass_manager import Pass, PassContext, PassResult
from llmc.runtime.kernels import pack_nibbles

log = logging.getLogger(__name__)

DIGITS = 3
BASE = 14  # a digit's codes are -7..7 around the zero point 8, and a remainder is within 7 steps of the next digit
MID = 8  # 4-bit codes' default zero point (MatMulNBits' too)
TOP = 15


def offset_digits(offsets: np.ndarray, digits: int = DIGITS) -> tuple[np.ndarray, np.ndarray]:
    """Offsets ``[blocks, N]`` -> (codes ``[digits, N, blocks]`` uint8 in 1..15, scales ``[digits, N]``
    float32) with ``sum_j scales[j, n] * (codes[j, n, b] - 8)`` within ``max_b |o_bn| / 14^digits``
    of ``offsets[b, n]``. Each digit is fitted to what the stored (float32) scales before it left."""
    rest = np.asarray(offsets, np.float64).T.copy()
    step = np.abs(rest).max(axis=1) / (MID - 1)
    step[step == 0] = 1.0  # a channel whose offsets are all zero: codes 8 under any scale
    codes = np.empty((digits, *rest.shape), np.uint8)
    scales = np.empty((digits, rest.shape[0]), np.float32)
    for j in range(digits):
        scales[j] = step
        t = scales[j].astype(np.float64)[:, None]
        c = np.clip(np.rint(rest / t), 1 - MID, MID - 1)
        codes[j] = c + MID
        rest -= c * t
        step = step / BASE
    return codes, scales


def split_offsets(codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """4-bit codes ``[N, blocks, 16]``, scales ``[N * blocks]``, offsets ``[blocks, N]`` -> (codes,
    scales ``[N, blocks]``, zero points ``[N, blocks]`` and remainders ``[blocks, N]``) with
    ``s (q - z) + r`` the same weights: whole steps of each offset in the zero point, the rest in r.
    A constant block (scale 0) becomes codes 15 at the scale ``o / 7``, zero point 8, remainder 0."""
    s = scales.reshape(codes.shape[0], -1).copy()
    o = np.asarray(offsets, np.float64).T
    const = (s == 0) & (o != 0)
    codes = codes.copy()
    codes[const] = TOP | (TOP << 4)
    s[const] = o[const] / (TOP - MID)
    live = (s != 0) & ~const
    z = np.full(s.shape, MID, np.float64)
    z[live] = np.clip(np.rint(MID - o[live] / s[live]), 0, TOP)
    r = o - s.astype(np.float64) * (MID - z)
    r[const] = 0.0  # 7 * (o / 7) in float32: o up to rounding
    return codes, s, z.astype(np.uint8), r.T


def fold_offsets(codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray, block: int, digits: int = DIGITS
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """4-bit codes ``[N, blocks, block / 2]``, scales ``[N * blocks]`` and offsets ``[blocks, N]`` ->
    codes ``[N, F, block / 2]``, scales ``[N * F]`` and packed 4-bit zero points ``[N, ceil(F / 2)]``
    (F: :func:`~llmc.ops.folded_blocks`): each channel's blocks (:func:`split_offsets`), then the
    remainders' digits, each digit's codes padded with zeros (code 8) to whole blocks."""
    n, nb, _ = codes.shape
    per_digit = -(-nb // block)
    codes, s, z, rest = split_offsets(codes, scales, offsets)
    dcodes, dscales = offset_digits(rest, digits)
    padded = np.full((digits, n, per_digit * block), MID, np.uint8)
    padded[..., :nb] = dcodes
    out_codes = np.concatenate([codes] + [pack_nibbles(p).reshape(n, per_digit, block // 2) for p in padded], axis=1)
    out_scales = np.concatenate([s] + [np.repeat(t[:, None], per_digit, axis=1) for t in dscales], axis=1)
    zp = np.concatenate([z, np.full((n, digits * per_digit), MID, np.uint8)], axis=1)
    return out_codes, out_scales.reshape(-1), pack_nibbles(zp)


def _foldable(node: Node) -> bool:
    return node.op == "BlockQLinear" and "offsets" in node.weights and node.attrs["bits"] == 4


class FoldBlockOffsets(Pass):
    name = "fold_block_offsets"
    summary = ("a 4-bit BlockQLinear's offsets as zero points and 3 base-14 digits in extra blocks of its codes: "
               "one MatMulNBits, no float Gemm")

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        if ctx.has(ChunkPlan):  # the plan lists every graph's weights
            raise CompileError("fold_block_offsets rewrites weights after chunk_static_graphs has listed them",
                               hint="put fold_block_offsets before chunk_static_graphs in --pipeline")
        if not graph.find("BlockQLinear"):
            log.warning("%s: the graph has no BlockQLinear, nothing to fold; it runs after quantize_int4", self.name)
            return PassResult(False)
        store = graph.weights
        folded = 0
        for node in graph.nodes:
            if not _foldable(node):
                continue
            qw, sc, off = node.weights["qweight"], node.weights["scales"], node.weights["offsets"]
            block = node.attrs["block_size"]
            n = qw.shape[0]
            f = folded_blocks(node.inputs[0].shape[-1], block, DIGITS)
            specs = [(f"{qw.name}.fold{DIGITS}", (n, f, qw.shape[2]), "uint8"), (f"{sc.name}.fold{DIGITS}", (n * f,), "float32"),
                     (f"{qw.name}.fold{DIGITS}.zp", (n, -(-f // 2)), "uint8")]
            # one fold serves the codes, the scales and the zero points
            refs = store.derived_together(specs, lambda qw=qw, sc=sc, off=off, block=block:
                                          fold_offsets(store.load(qw.name), store.load(sc.name), store.load(off.name), block))
            node.weights.update(zip(("qweight", "scales", "zero_points"), refs))
            del node.weights["offsets"]
            node.attrs["offset_digits"] = DIGITS
            folded += 1
        if folded:
            log.info("%s: the offsets of %d BlockQLinear(s) folded into their codes", self.name, folded)
        return PassResult(folded > 0)
