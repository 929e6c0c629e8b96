"""fold_block_offsets: a BlockQLinear's offsets become extra blocks of its own codes.

``quantize_int4`` stores a weight as ``s (q - 8) + o`` per block of 32 inputs, so
its matmul has two terms (``xs``: x summed over each block, ``O``: the offsets)::

    y = x @ (s (q - 8))^T + xs @ O

ONNX Runtime's ``MatMulNBits`` computes the first. It has no fast path for a
float offset (float zero points take its dequantizing path, 30-40x slower), so
the second was a float ``Gemm`` of its own. In SmolLM2's decode graph that is
120 Gemms per token: ~25% of a token's time for 11% of its bytes.

This pass writes each output channel's offsets as D base-14 digits of 4-bit
codes and appends them to that channel's codes as extra blocks. Then one
``MatMulNBits`` computes both terms, over the input widened with D copies of
its block sums (P: xs zero-padded to a multiple of 32 entries)::

    y = [x, P, ..., P] @ (s' (q' - 8))^T

Digit j of channel n has the scale ``t_j = max_b |o_bn| / (7 * 14^j)`` and codes
``c - 8`` in [-7, 7], taken greedily: ``c_j = round(r_j / t_j)``, ``r_{j+1} =
r_j - t_j c_j``, starting from ``r_0 = o``. Each remainder stays within half a
step of the previous digit, which is 7 steps of the next one, so after D digits
``|o - ô| <= max_b |o_bn| / 14^D``. With D = 3 that is 1/2744 of the channel's
largest offset. On SmolLM2 that is a mean of 0.0007 and at most 0.039 of the
block's own quantization step.

Numerics:
* chunk graphs compute in float32, so they differ from the offsets' exact term
  by the digits' remainder only;
* one-row graphs quantize their input to int8 per block (``accuracy_level=4``),
  and the block sums with it. llama.cpp's Q4_1 x Q8_1 dot product likewise
  uses the sums of the quantized activations.

The codes grow by ``D * ceil(blocks / 32)`` blocks per channel and the float
offsets go. For SmolLM2 that is 60 B instead of 72 B per channel of q/k/v,
o_proj and gate/up, and 120 B instead of 192 B for down_proj. Chunk graphs
multiply over that many more inputs (+17% for 576 inputs, +12.5% for 1,536).
Measured on SmolLM2 (``docs/performance.md``): decode +18-25%, int4 prefill
-7%, perplexity 11.8808 -> 11.8777 on 1,024 held-out tokens.

Only 4-bit ``BlockQLinear`` nodes with offsets are rewritten (the symmetric
8-bit head has none). Run it after ``quantize_int4`` and ``fuse_sibling_linears``,
and before ``chunk_static_graphs``.
"""

from __future__ import annotations

import logging

import numpy as np

from llmc.analyses import ChunkPlan
from llmc.errors import CompileError
from llmc.ir import Graph, Node
from llmc.ops import folded_blocks
from llmc.pass_manager import Pass, PassContext, PassResult

log = logging.getLogger(__name__)

DIGITS = 3
BASE = 14  # a digit's codes are -7..7 around the zero point 8, and a remainder is within 7 steps of the next digit
ZERO_CODE = 8  # MatMulNBits' default zero point for 4-bit codes


def offset_digits(offsets: np.ndarray, digits: int = DIGITS) -> tuple[np.ndarray, np.ndarray]:
    """Offsets ``[blocks, N]`` -> (codes ``[digits, N, blocks]`` uint8 in 1..15, scales ``[digits, N]``
    float32) with ``sum_j scales[j, n] * (codes[j, n, b] - 8)`` within ``max_b |o_bn| / 14^digits``
    of ``offsets[b, n]``. Each digit is fitted to what the stored (float32) scales before it left."""
    rest = np.asarray(offsets, np.float64).T.copy()
    step = np.abs(rest).max(axis=1) / (ZERO_CODE - 1)
    step[step == 0] = 1.0  # a channel whose offsets are all zero: codes 8 under any scale
    codes = np.empty((digits, *rest.shape), np.uint8)
    scales = np.empty((digits, rest.shape[0]), np.float32)
    for j in range(digits):
        scales[j] = step
        t = scales[j].astype(np.float64)[:, None]
        c = np.clip(np.rint(rest / t), 1 - ZERO_CODE, ZERO_CODE - 1)
        codes[j] = c + ZERO_CODE
        rest -= c * t
        step = step / BASE
    return codes, scales


def fold_offsets(codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray, block: int, digits: int = DIGITS
                 ) -> tuple[np.ndarray, np.ndarray]:
    """4-bit codes ``[N, blocks, block / 2]``, scales ``[N * blocks]`` and offsets ``[blocks, N]`` ->
    codes ``[N, F, block / 2]`` and scales ``[N * F]`` (F: :func:`~llmc.ops.folded_blocks`): each
    channel's blocks, then its offsets' digits, each digit's codes padded with zeros (code 8) to
    whole blocks."""
    n, nb, _ = codes.shape
    per_digit = -(-nb // block)
    dcodes, dscales = offset_digits(offsets, digits)
    padded = np.full((digits, n, per_digit * block), ZERO_CODE, np.uint8)
    padded[..., :nb] = dcodes
    packed = padded[..., 0::2] | (padded[..., 1::2] << 4)  # two codes a byte, the lower input in the low nibble
    out_codes = np.concatenate([codes] + [p.reshape(n, per_digit, block // 2) for p in packed], axis=1)
    out_scales = np.concatenate([scales.reshape(n, nb)] + [np.repeat(s[:, None], per_digit, axis=1) for s in dscales], axis=1)
    return out_codes, out_scales.reshape(-1)


def _foldable(node: Node) -> bool:
    return node.op == "BlockQLinear" and "offsets" in node.weights and node.attrs["bits"] == 4


class FoldBlockOffsets(Pass):
    name = "fold_block_offsets"
    summary = "a 4-bit BlockQLinear's offsets as extra blocks of its codes (3 base-14 digits): one MatMulNBits, no float Gemm"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        if ctx.has(ChunkPlan):  # the plan lists every graph's weights
            raise CompileError("fold_block_offsets rewrites weights after chunk_static_graphs has listed them",
                               hint="put fold_block_offsets before chunk_static_graphs in --pipeline")
        store = graph.weights
        folded = 0
        for node in graph.nodes:
            if not _foldable(node):
                continue
            qw, sc, off = node.weights["qweight"], node.weights["scales"], node.weights["offsets"]
            block = node.attrs["block_size"]
            n = qw.shape[0]
            f = folded_blocks(node.inputs[0].shape[-1], block, DIGITS)
            cache: dict[str, tuple[np.ndarray, np.ndarray]] = {}

            def part(i, qw=qw, sc=sc, off=off, block=block, cache=cache):
                # one fold serves the codes and the scales: kept by the first read, dropped by the next
                if "v" in cache:
                    return cache.pop("v")[i]
                cache["v"] = fold_offsets(store.load(qw.name), store.load(sc.name), store.load(off.name), block)
                return cache["v"][i]

            node.weights["qweight"] = store.derived(f"{qw.name}.fold{DIGITS}", (n, f, qw.shape[2]), "uint8", lambda part=part: part(0))
            node.weights["scales"] = store.derived(f"{sc.name}.fold{DIGITS}", (n * f,), "float32", lambda part=part: part(1))
            del node.weights["offsets"]
            node.attrs["offset_digits"] = DIGITS
            folded += 1
        if folded:
            log.info("%s: the offsets of %d BlockQLinear(s) folded into their codes", self.name, folded)
        return PassResult(folded > 0)
