"""The dynamic ops a bundle's program runs on the CPU, in numpy.

Each function implements one IR op of kind ``dynamic`` (see ``llmc.ops``) with
the semantics the frontend lifted from the HuggingFace model. They are
vectorised over heads and rows: no Python loop per token or per head.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np


class KVCache:
    """Per-layer K and V buffers ``[kv_heads, capacity, head_dim]``, preallocated.

    A layer listed in ``scales`` (``(k_scale, v_scale)``, each ``[kv_heads, head_dim]``)
    keeps int8 codes: a stored row is ``clip(rint(x / scale), -128, 127)`` and reads
    back as ``code * scale`` (ONNX Runtime's ``GroupQueryAttention`` with a
    ``PER_CHANNEL`` int8 cache; ``llmc.passes.quantize_kv_cache``). A layer in ``half``
    keeps float16: a stored row is the nearest half (ties to even), read back as float32
    (``llmc.passes.float16_kv_cache``). Other layers are float32.
    """

    def __init__(self, layers: dict[int, tuple[int, int]], capacity: int,
                 scales: dict[int, tuple[np.ndarray, np.ndarray]] | None = None, half: set[int] | frozenset[int] = frozenset()) -> None:
        self.capacity = capacity
        self.scales = {l: (np.asarray(k, np.float32).reshape(layers[l]), np.asarray(v, np.float32).reshape(layers[l]))
                       for l, (k, v) in (scales or {}).items()}
        both = set(self.scales) & set(half)
        if both:
            raise ValueError(f"layer {min(both)}'s KV cache cannot be both int8 and float16")
        dtype = {l: np.int8 if l in self.scales else np.float16 if l in half else np.float32 for l in layers}
        self.k = {l: np.zeros((kv, capacity, d), dtype[l]) for l, (kv, d) in layers.items()}
        self.v = {l: np.zeros((kv, capacity, d), dtype[l]) for l, (kv, d) in layers.items()}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k.values()) + sum(a.nbytes for a in self.v.values())

    def quantized(self, layer: int) -> bool:
        return layer in self.scales

    def dtype(self, layer: int) -> str:
        """The element type layer ``layer``'s cache holds: ``"float32"``, ``"float16"`` or ``"int8"``."""
        return str(self.k[layer].dtype)

    def write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store rows ``k``/``v`` (``[kv_heads, n, head_dim]``) at positions ``start..``."""
        end = start + k.shape[1]
        for cache, x, i in ((self.k[layer], k, 0), (self.v[layer], v, 1)):
            if layer in self.scales:
                x = quantize_kv(x, self.scales[layer][i])
            cache[:, start:end] = x

    def read(self, layer: int, lo: int, end: int, out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """K and V (``[kv_heads, end - lo, head_dim]``, float32) of positions ``lo..end-1``: views of a
        float32 layer, float32 copies of a float16 one, the dequantized codes of an int8 one (into ``out``'s
        two arrays when given)."""
        k, v = self.k[layer][:, lo:end], self.v[layer][:, lo:end]
        if k.dtype == np.float16 and out is None:
            return k.astype(np.float32), v.astype(np.float32)
        if layer not in self.scales:
            if out is not None:
                np.copyto(out[0], k)
                np.copyto(out[1], v)
                return out
            return k, v
        ks, vs = self.scales[layer]
        ok, ov = out if out is not None else (None, None)
        return np.multiply(k, ks[:, None, :], out=ok), np.multiply(v, vs[:, None, :], out=ov)


def quantize_kv(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """int8 codes of ``x [kv_heads, n, head_dim]`` with per-channel ``scale [kv_heads, head_dim]``
    (round half to even, saturating, as ONNX Runtime's quantized cache)."""
    q = np.rint(x / scale[:, None, :])
    np.clip(q, -128, 127, out=q)
    return q.astype(np.int8)


def embedding(ids: np.ndarray, table: np.ndarray, scale: float) -> np.ndarray:
    """``table[ids] * scale``; ``table`` may be a row reader (``table[rows]`` gives a fresh array), see ``residency.RowTable``."""
    out = np.take(table, ids, axis=0) if isinstance(table, np.ndarray) else table[ids]
    if scale != 1.0:
        out *= np.float32(scale)
    return out


def qembedding(ids: np.ndarray, codes: np.ndarray, row_scale: np.ndarray, zero_point: int, transposed: bool, scale: float) -> np.ndarray:
    """``(codes[id] - zero_point) * row_scale[id] * scale`` for each token id: ``codes`` is ``[vocab, hidden]``, or
    ``[hidden, vocab]`` (``transposed``: a tied LM head's codes, a column per token); either may be a memory map, and the
    row form a row reader (``codes[rows]`` reads those rows, ``residency.RowTable``)."""
    ids = np.asarray(ids, np.int64)
    if transposed:  # a row reader (an offload plan that streams the head) is read whole: a column per token
        table = codes if isinstance(codes, np.ndarray) else codes[np.arange(codes.shape[0])]
        rows = table[:, ids].T
    else:
        rows = np.take(codes, ids, axis=0) if isinstance(codes, np.ndarray) else codes[ids]
    out = np.asarray(rows, np.float32)
    if zero_point:
        out -= np.float32(zero_point)
    out *= (np.asarray(row_scale)[ids] * np.float32(scale))[:, None]
    return out


def pack_nibbles(values: np.ndarray) -> np.ndarray:
    """4-bit ``values`` (0..15) two a byte along the last axis, the lower index in the low nibble (the
    layout of ``MatMulNBits``' codes and zero points); an odd count is padded with 0."""
    v = np.asarray(values, np.uint8)
    if v.shape[-1] % 2:
        v = np.concatenate([v, np.zeros((*v.shape[:-1], 1), np.uint8)], axis=-1)
    return v[..., 0::2] | (v[..., 1::2] << 4)


def unpack_nibbles(packed: np.ndarray, dtype: Any = np.uint8) -> np.ndarray:
    """The inverse of :func:`pack_nibbles` (with its padding), as ``dtype``."""
    out = np.empty((*packed.shape[:-1], 2 * packed.shape[-1]), dtype)
    out[..., 0::2] = packed & 15
    out[..., 1::2] = packed >> 4
    return out


def dequantize_blocks(codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray | None, bits: int,
                      zero_points: np.ndarray | None = None) -> np.ndarray:
    """Float32 ``[N, K]`` rows of block-quantized weights (``llmc.passes.quantize_int4``'s format: codes
    ``[N, blocks, block * bits / 8]``, scales ``[N * blocks]``, offsets ``[blocks, N]`` or None for
    symmetric codes; ``fold_block_offsets`` adds 4-bit zero points ``[N, ceil(blocks / 2)]``, two blocks
    a byte): ``s * (q - z) + o``, z = 2^(bits-1) without zero points."""
    n, nb, width = codes.shape
    q = unpack_nibbles(codes, np.float32) if bits == 4 else codes.astype(np.float32)
    if zero_points is None:
        q -= 1 << (bits - 1)
    else:
        q -= unpack_nibbles(zero_points, np.float32)[:, :nb, None]
    q *= scales.reshape(n, nb)[..., None]
    if offsets is not None:
        q += offsets.T[..., None]
    return q.reshape(n, -1)


def widen_with_block_sums(x: np.ndarray, block: int, digits: int) -> np.ndarray:
    """``[x, P, ..., P]`` (``digits`` copies of P): the input of a ``BlockQLinear`` whose offsets are
    folded into its codes (``llmc.passes.fold_block_offsets``). P is x summed over each block of
    ``block`` inputs, zero-padded to a multiple of ``block`` entries."""
    rows, k = x.shape
    nb = k // block
    p = np.zeros((rows, -(-nb // block) * block), np.float32)
    p[:, :nb] = x.reshape(rows, nb, block).sum(axis=2)
    return np.concatenate([x] + [p] * digits, axis=1)


def block_embedding(ids: np.ndarray, codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray | None, bits: int, scale: float) -> np.ndarray:
    """Rows ``ids`` of block-quantized weights (see :func:`dequantize_blocks`), times ``scale``."""
    v, nb, _ = codes.shape
    rows_offsets = None if offsets is None else np.take(offsets, ids, axis=1)
    out = dequantize_blocks(np.take(codes, ids, axis=0), np.take(scales.reshape(v, nb), ids, axis=0), rows_offsets, bits)
    if scale != 1.0:
        out *= np.float32(scale)
    return out


def rotary_table(positions: np.ndarray, inv_freq: np.ndarray, scaling: float) -> tuple[np.ndarray, np.ndarray]:
    freqs = positions.astype(np.float32)[:, None] * inv_freq.astype(np.float32)[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)
    if scaling != 1.0:
        cos *= np.float32(scaling)
        sin *= np.float32(scaling)
    return cos, sin


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rotary_dim: int) -> np.ndarray:
    """Rotate-half rotary embedding on the first ``rotary_dim`` dims of ``x [n, heads, d]``."""
    c, s = cos[:, None, :], sin[:, None, :]
    rot = x[..., :rotary_dim]
    half = rotary_dim // 2
    rotated = np.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    out = rot * c + rotated * s
    if rotary_dim == x.shape[-1]:
        return out
    return np.concatenate([out, x[..., rotary_dim:]], axis=-1)


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    cos: np.ndarray | None,
    sin: np.ndarray | None,
    *,
    cache: KVCache,
    layer: int,
    start: int,
    n: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    rotary_dim: int,
    sliding_window: int,
    kv_dtype: str = "float32",
) -> np.ndarray:
    """Causal GQA attention of ``n`` new rows at positions ``start..start+n-1``.

    Writes the new K/V rows into the cache, attends over ``[0, start + n)``, and
    returns ``[rows, heads*head_dim]`` with rows past ``n`` (chunk padding) zero.
    ``kv_dtype`` (the node's, ``float16`` from ``float16_kv_cache``) must be the
    element type the cache keeps for the layer (an int8 cache's node has none).
    """
    if kv_dtype != "float32" and cache.dtype(layer) != kv_dtype:
        raise ValueError(f"layer {layer}'s attention needs a {kv_dtype} KV cache, the cache holds {cache.dtype(layer)}")
    rows = q.shape[0]
    h, kvh, d = num_heads, num_kv_heads, head_dim
    g = h // kvh
    qh = q[:n].reshape(n, h, d)
    kh = k[:n].reshape(n, kvh, d)
    vh = v[:n].reshape(n, kvh, d)
    if rotary_dim:
        qh = _rope(qh, cos[:n], sin[:n], rotary_dim)
        kh = _rope(kh, cos[:n], sin[:n], rotary_dim)
    end = start + n
    cache.write(layer, start, kh.transpose(1, 0, 2), vh.transpose(1, 0, 2))
    lo = max(0, end - n - sliding_window + 1) if sliding_window else 0
    keys, values = cache.read(layer, lo, end)  # [kv, s, d]
    # Contiguous [kv, d, s] keys so the batched matmul below goes to BLAS.
    keys_t = np.ascontiguousarray(keys.transpose(0, 2, 1))
    # Head j uses kv head j // g (HF repeat_kv), so group query heads by kv head.
    qg = np.ascontiguousarray(qh.transpose(1, 0, 2)).reshape(kvh, g * n, d)
    scores = np.matmul(qg, keys_t)  # [kv, g*n, s]
    scores *= np.float32(scale)
    qpos = np.arange(start, end)[:, None]
    kpos = np.arange(lo, end)[None, :]
    allowed = kpos <= qpos
    if sliding_window:
        allowed &= kpos > qpos - sliding_window
    scores = scores.reshape(kvh, g, n, end - lo)
    scores = np.where(allowed, scores, np.float32(-np.inf))
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = np.matmul(scores.reshape(kvh, g * n, end - lo), values)  # [kv, g*n, d]
    out = out.reshape(h, n, d).transpose(1, 0, 2).reshape(n, h * d)
    if n == rows:
        return np.ascontiguousarray(out, dtype=np.float32)
    full = np.zeros((rows, h * d), np.float32)
    full[:n] = out
    return full


# Rows per block of a chunk's shadow correction (ShadowOutliers) that shadow_blocks aims for: SmolLM2,
# 256-row chunks, the corrections of four inputs of two layers took 8.9 ms as one block, 5.2 / 4.5 / 4.7 /
# 5.2 ms in 2 / 4 / 8 / 16 blocks.
SHADOW_BLOCK_ROWS = 64


@functools.lru_cache(maxsize=None)
def shadow_blocks(rows: int) -> int:
    """Into how many blocks of equal rows a chunk of ``rows`` rows splits its shadow corrections: the
    divisor of ``rows`` whose block is nearest SHADOW_BLOCK_ROWS rows (by ratio; the larger block on a
    tie). Equal blocks need no padding (a copy of the delta and one of the result); a prime row count
    is one block."""
    divisors = [b for b in range(1, rows + 1) if rows % b == 0]
    return min(divisors, key=lambda b: (abs(math.log(rows / b / SHADOW_BLOCK_ROWS)), b))


def shadow_outliers(
    x: np.ndarray,
    ys: list[np.ndarray],
    splits: list[int],
    hot_delta: np.ndarray,
    codes: np.ndarray,
    scale: np.ndarray,
    zero_point: int,
    hot_pos: np.ndarray,
    lo: float,
    hi: float,
    n: int,
    *,
    inplace: bool = False,
) -> tuple[list[np.ndarray], int]:
    """Each ``ys[i]`` plus the float contribution of the entries of ``x`` outside ``[lo, hi]``.

    ``ys[i]`` is the NPU's result of Linear i on ``clip(x)``; its correction is
    ``(x - clip(x)) @ W_i^T`` over the few channels that hold outliers, computed
    for all Linears reading ``x`` in one matmul per block of rows
    (:func:`shadow_blocks`: each block over the channels where it holds
    outliers). ``W^T`` is the Linears' codes ``[in, sum(splits)]`` (int8, or uint8
    with ``zero_point`` 128) times ``scale`` (one per column); a hot channel c
    (``hot_pos[c]`` its row of ``hot_delta``, else -1) adds ``hot_delta``'s row, its
    float weights less the codes' values. The codes may be a memory map or, under a
    memory budget, a row reader (``codes[rows]`` reads those rows). Returns the
    corrected results and the number of outlier entries. With ``inplace`` the
    ``ys`` arrays themselves are corrected.
    """
    xs = x[:n]
    n = len(xs)  # rows after SelectRows (the head's input) are fewer than the chunk's
    # x - clip(x) is non-zero exactly at the outliers (a difference of distinct floats never is zero).
    delta = xs - np.clip(xs, np.float32(lo), np.float32(hi))
    if n == 1:  # decode: one row, skip the reductions
        chans = delta[0].nonzero()[0]
        count = len(chans)
    else:
        nonzero = delta != 0
        count = int(np.count_nonzero(nonzero))
        chans = nonzero.any(axis=0).nonzero()[0]
    if count == 0:
        return list(ys), 0
    # as the graphs' lowering computes it: the excess times the codes, times the column scales, plus the hot
    # channels' excess times their hot_delta rows (the same float operations in the same order)
    rows = np.asarray(codes[chans], np.float32)
    if zero_point:
        rows -= np.float32(zero_point)
    r = n // shadow_blocks(n)
    if r == n:  # one block: its channels are all of them
        corr = delta[:, chans] @ rows
    else:  # in row blocks, each over its own channels, as the graphs' lowering
        sub = nonzero[:, chans]
        corr = np.empty((n, rows.shape[1]), np.float32)
        for s in range(0, n, r):
            cols = sub[s : s + r].any(axis=0).nonzero()[0]
            corr[s : s + r] = delta[s : s + r, chans[cols]] @ rows[cols]
    corr *= scale
    if (hot_pos[chans] >= 0).any():  # over every hot channel, in hot_delta's order, as the graphs
        idx = np.flatnonzero(hot_pos >= 0)
        order = np.empty(len(idx), np.int64)
        order[hot_pos[idx]] = idx
        corr += delta[:, order] @ hot_delta[: len(order)]
    out, start = [], 0
    for y, w in zip(ys, splits):
        o = y if inplace and y.dtype == np.float32 and y.flags.writeable else np.array(y, dtype=np.float32, copy=True)
        o[:n] += corr[:, start : start + w]
        out.append(o)
        start += w
    return out, count
