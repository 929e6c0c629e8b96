"""Attention over the KV cache as one ONNX Runtime ``GroupQueryAttention`` call.

The numpy kernel (:func:`llmc.runtime.kernels.attention`) runs on one core;
ONNX Runtime's fused CPU kernel (``com.microsoft.GroupQueryAttention``) runs the
same causal GQA on all of them and writes the new K/V rows straight into the
cache: the cache arrays are bound as both ``past`` and ``present`` (ORT's
shared-buffer mode), so no cache bytes are copied per step.

The runtime may not depend on the ``onnx`` package, so the one-node model is
serialised here with a minimal protobuf writer (the fields used are listed in
:func:`gqa_model`). The node rotates q and k itself from tables of every
position filled from the program's ``RotaryTable`` (for a chunk's rows at once);
partial rotary and head sizes that are not a multiple of 16 keep the numpy
arithmetic (``_rope``, as in the numpy kernel), as do chunks over an int8 cache;
sliding-window attention keeps the numpy kernel. A layer with an int8 cache (``--kv-cache int8``): one row goes
through the node's ``PER_CHANNEL`` int8 cache (it quantizes the row it appends
with the layer's scales, bound as two more inputs); a chunk stores its rows as
int8 codes and attends in float32 over a dequantized copy of the cached prefix
(:meth:`OrtAttention._int8_chunk`).
"""

from __future__ import annotations

import re
import struct
from typing import Any

import numpy as np

from llmc.runtime import kernels


# -- protobuf wire format (only what an ONNX ModelProto needs) ---------------
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _int(field: int, v: int) -> bytes:
    return _key(field, 0) + _varint(v)


def _bytes(field: int, v: bytes | str) -> bytes:
    b = v.encode() if isinstance(v, str) else v
    return _key(field, 2) + _varint(len(b)) + b


def _float(field: int, v: float) -> bytes:
    return _key(field, 5) + struct.pack("<f", v)


_FLOAT, _INT8, _INT32 = 1, 3, 6  # TensorProto.DataType


def _value_info(name: str, elem: int, dims: list[int | str]) -> bytes:
    dim_msgs = b"".join(_bytes(1, _bytes(2, d) if isinstance(d, str) else _int(1, d)) for d in dims)
    tensor_type = _int(1, elem) + _bytes(2, dim_msgs)  # TypeProto.Tensor: elem_type, shape
    return _bytes(1, name) + _bytes(2, _bytes(1, tensor_type))  # ValueInfoProto: name, type


def _attr_int(name: str, v: int) -> bytes:
    return _bytes(1, name) + _int(3, v) + _int(20, 2)  # AttributeProto: name, i, type=INT


def _attr_float(name: str, v: float) -> bytes:
    return _bytes(1, name) + _float(2, v) + _int(20, 1)  # AttributeProto: name, f, type=FLOAT


def _attr_str(name: str, v: str) -> bytes:
    return _bytes(1, name) + _bytes(4, v) + _int(20, 3)  # AttributeProto: name, s, type=STRING


def gqa_model(num_heads: int, num_kv_heads: int, head_dim: int, capacity: int, scale: float, rotary: bool = False,
              int8_cache: bool = False) -> bytes:
    """A serialised ONNX model with one ``GroupQueryAttention`` node (batch 1).

    Inputs ``q [1, n, H*D]``, ``k``/``v [1, n, KV*D]`` (already rotated unless
    ``rotary``), the caches ``past_k``/``past_v [1, KV, capacity, D]``,
    ``seqlens_k [1]`` (int32, total length - 1) and ``total_len`` (int32
    scalar); outputs ``out [1, n, H*D]`` and ``present_k``/``present_v`` (bound
    to the same buffers as the past). With ``rotary`` the node rotates q and k
    itself (rotate-half, all D dims) at the positions after the past, from the
    inputs ``cos_cache``/``sin_cache [capacity, D/2]``. With ``int8_cache`` the
    caches are int8 codes with per-channel scales, the inputs ``k_scale`` and
    ``v_scale`` ``[1, KV, 1, D]`` (see :class:`~llmc.runtime.kernels.KVCache`).
    """
    hd, kvd = num_heads * head_dim, num_kv_heads * head_dim
    cache = [1, num_kv_heads, capacity, head_dim]
    elem = _INT8 if int8_cache else _FLOAT
    inputs = [("q", _FLOAT, [1, "n", hd]), ("k", _FLOAT, [1, "n", kvd]), ("v", _FLOAT, [1, "n", kvd]),
              ("past_k", elem, cache), ("past_v", elem, cache), ("seqlens_k", _INT32, [1]), ("total_len", _INT32, [])]
    names = [i[0] for i in inputs]
    if rotary:
        inputs += [("cos_cache", _FLOAT, [capacity, head_dim // 2]), ("sin_cache", _FLOAT, [capacity, head_dim // 2])]
        names += ["cos_cache", "sin_cache"]
    if int8_cache:  # the node's inputs 12 and 13; position_ids, attention_bias and head_sink stay empty
        inputs += [("k_scale", _FLOAT, [1, num_kv_heads, 1, head_dim]), ("v_scale", _FLOAT, [1, num_kv_heads, 1, head_dim])]
        names += [""] * (12 - len(names)) + ["k_scale", "v_scale"]
    outputs = [("out", _FLOAT, [1, "n", hd]), ("present_k", elem, cache), ("present_v", elem, cache)]
    node = b"".join(_bytes(1, name) for name in names) + b"".join(_bytes(2, name) for name, _, _ in outputs)
    node += _bytes(3, "attention") + _bytes(4, "GroupQueryAttention") + _bytes(7, "com.microsoft")
    node += _bytes(5, _attr_int("num_heads", num_heads)) + _bytes(5, _attr_int("kv_num_heads", num_kv_heads))
    node += _bytes(5, _attr_float("scale", scale))
    if rotary:
        node += _bytes(5, _attr_int("do_rotary", 1)) + _bytes(5, _attr_int("rotary_interleaved", 0))
    if int8_cache:
        node += _bytes(5, _attr_str("k_quant_type", "PER_CHANNEL")) + _bytes(5, _attr_str("v_quant_type", "PER_CHANNEL"))
        node += _bytes(5, _attr_int("kv_cache_bit_width", 8))
    graph = _bytes(1, node) + _bytes(2, "attention")
    graph += b"".join(_bytes(11, _value_info(*i)) for i in inputs) + b"".join(_bytes(12, _value_info(*o)) for o in outputs)
    opsets = _bytes(8, _bytes(1, "") + _int(2, 21)) + _bytes(8, _bytes(1, "com.microsoft") + _int(2, 1))
    return _int(1, 10) + _bytes(2, "llmc") + opsets + _bytes(7, graph)  # ModelProto: ir_version, producer, opsets, graph


class OrtAttention:
    """Causal GQA of one layer configuration over a :class:`~llmc.runtime.kernels.KVCache`.

    One ONNX Runtime session per distinct (heads, kv heads, head dim, scale,
    node rotates, threads). Per layer, one IOBinding for chunks (fresh output per
    call) and those of a single row (:class:`_OneRow`: every buffer bound once,
    on one thread while the cache is short), all with the layer's cache bound as
    past and present; for a layer with an int8 cache, chunks bind a float32
    scratch cache instead (:meth:`_int8_chunk`).
    """

    def __init__(self, ort: Any, cache: kernels.KVCache, threads: int) -> None:
        self._ort = ort
        self._cache = cache
        self._threads = threads
        self._sessions: dict[tuple, Any] = {}
        self._caches: dict[int, tuple[Any, ...]] = {}  # layer -> K and V cache OrtValues (they keep the views alive), int8: their scales
        self._bound: dict[int, Any] = {}  # layer -> the chunks' IOBinding
        self._one: dict[int, _OneRow] = {}  # layer -> decode's binding, bound once
        self._tables: dict[int, _RotaryTables] = {}  # head dim -> cos/sin by position, shared by the layers
        self._scratch: dict[tuple[int, int], tuple] = {}  # (kv heads, head dim) -> float32 cache for chunks over int8 caches
        self._scratch_bound: dict[tuple, Any] = {}  # chunk session key -> its IOBinding of the scratch

    @staticmethod
    def supports(attrs: dict[str, Any]) -> bool:
        """Whether this class runs the Attention step of ``attrs`` (else the numpy kernel does): no
        sliding window, a head size ONNX Runtime's node takes, and a float32 or int8 cache (not float16)."""
        return not attrs["sliding_window"] and attrs["head_dim"] % GQA_HEAD_MULTIPLE == 0 and attrs.get("kv_dtype", "float32") == "float32"

    def prepare(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, rotary_dim: int = 0, one_row: bool = True, *,
                layer: int, **_: Any) -> None:
        """Create the sessions for this configuration (chunks, and with ``one_row`` one row) now rather than on first use."""
        key = (num_heads, num_kv_heads, head_dim, float(scale))
        int8 = self._cache.quantized(layer)
        self._session(key + (self._chunk_rotates(rotary_dim, head_dim, layer), False))  # chunks attend in float32 (see _int8_chunk)
        if one_row:
            self._one_row_sessions(key + (node_rotates(rotary_dim, head_dim), int8))

    def _chunk_rotates(self, rotary_dim: int, head_dim: int, layer: int) -> bool:
        """Whether the node rotates a chunk's q and k (else numpy does): as for one row, except over an
        int8 cache, where the chunk's keys are quantized rotated (:meth:`_int8_chunk`)."""
        return node_rotates(rotary_dim, head_dim) and not self._cache.quantized(layer)

    def _session(self, key: tuple, threads: int | None = None):
        """The session of ``(heads, kv heads, head dim, scale, node rotates, int8 cache)`` on ``threads`` (default: all)."""
        threads = threads or self._threads
        sess = self._sessions.get(key + (threads,))
        if sess is None:
            ort = self._ort
            so = ort.SessionOptions()
            so.intra_op_num_threads = threads
            so.inter_op_num_threads = 1
            so.log_severity_level = 3
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            sess = self._sessions[key + (threads,)] = ort.InferenceSession(gqa_model(*key[:3], self._cache.capacity, *key[3:]), so,
                                                                           providers=["CPUExecutionProvider"])
        return sess

    def _one_row_sessions(self, key: tuple) -> list[Any]:
        """Decode's sessions of ``key``: on one thread, then on all threads (one session if that is one)."""
        return list(dict.fromkeys(self._session(key, t) for t in (1, self._threads)))

    def _rotary_tables(self, head_dim: int) -> "_RotaryTables":
        t = self._tables.get(head_dim)
        if t is None:
            t = self._tables[head_dim] = _RotaryTables(self._cache.capacity, head_dim // 2)
        return t

    def _cache_binding(self, sess: Any, layer: int) -> Any:
        """A new IOBinding of ``sess`` with ``layer``'s cache bound as both past and present."""
        caches = self._caches.get(layer)
        if caches is None:
            ov = self._ort.OrtValue.ortvalue_from_numpy
            caches = (ov(self._cache.k[layer][None]), ov(self._cache.v[layer][None]))
            if self._cache.quantized(layer):  # [1, KV, 1, D], as the node broadcasts them
                caches += tuple(ov(np.ascontiguousarray(s[None, :, None, :])) for s in self._cache.scales[layer])
            self._caches[layer] = caches
        b = sess.io_binding()
        if len(caches) == 4:
            b.bind_ortvalue_input("k_scale", caches[2])
            b.bind_ortvalue_input("v_scale", caches[3])
        b.bind_ortvalue_input("past_k", caches[0])
        b.bind_ortvalue_input("past_v", caches[1])
        b.bind_ortvalue_output("present_k", caches[0])
        b.bind_ortvalue_output("present_v", caches[1])
        return b

    def __call__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, cos: np.ndarray | None, sin: np.ndarray | None, *,
                 layer: int, start: int, n: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 rotary_dim: int, sliding_window: int) -> np.ndarray:
        """Same contract as :func:`llmc.runtime.kernels.attention` (``sliding_window`` must be 0)."""
        rows = q.shape[0]
        h, kvh, d = num_heads, num_kv_heads, head_dim
        if rows == 1:
            one = self._one.get(layer)
            if one is None:
                # full-width rotary is done by the attention node itself, from tables of every position
                tables = self._rotary_tables(d) if node_rotates(rotary_dim, d) else None
                key = (h, kvh, d, float(scale), tables is not None, self._cache.quantized(layer))
                runs = [(sess, self._cache_binding(sess, layer)) for sess in self._one_row_sessions(key)]
                # in float32 bytes whatever the cache holds: ONNX Runtime dequantizes an int8 cache before its matmuls,
                # so the work per position is the float32 cache's (an int8 itemsize here kept 2,000-token decode on one thread)
                one = self._one[layer] = _OneRow(runs, h, kvh, d, tables, one_thread_len=ONE_THREAD_KV_BYTES // (2 * kvh * d * 4))
            return one(q, k, v, cos, sin, start, rotary_dim)
        qn, kn = q[:n], k[:n]
        rotates = self._chunk_rotates(rotary_dim, d, layer)
        if rotates:  # the node rotates q and k at the positions after the past, from tables of every position
            tables = self._rotary_tables(d)
            tables.write(start, cos[:n], sin[:n])
        elif rotary_dim:
            qn = kernels._rope(qn.reshape(n, h, d), cos[:n], sin[:n], rotary_dim).reshape(n, h * d)
            kn = kernels._rope(kn.reshape(n, kvh, d), cos[:n], sin[:n], rotary_dim).reshape(n, kvh * d)
        vn = v[:n]
        key = (h, kvh, d, float(scale), rotates, False)
        sess = self._session(key)
        if self._cache.quantized(layer):
            b, kn, vn = self._int8_chunk(sess, key, layer, start, kn.reshape(n, kvh, d), vn.reshape(n, kvh, d))
        else:
            b = self._bound.get(layer)
            if b is None:  # the caches (and the rotary tables) stay bound across calls
                b = self._bound[layer] = self._cache_binding(sess, layer)
                if rotates:
                    for name, a in (("cos_cache", tables.cos), ("sin_cache", tables.sin)):
                        b.bind_input(name, "cpu", 0, a.dtype.type, list(a.shape), a.ctypes.data)
        # A chunk gets a fresh output array: the compiled out-of-order schedule may run this layer
        # for the next chunk before the previous chunk's result has been consumed.
        out = np.zeros((rows, h * d), np.float32)
        b.bind_cpu_input("q", np.ascontiguousarray(qn, np.float32)[None])
        b.bind_cpu_input("k", np.ascontiguousarray(kn, np.float32)[None])
        b.bind_cpu_input("v", np.ascontiguousarray(vn, np.float32)[None])
        b.bind_cpu_input("seqlens_k", np.array([start + n - 1], np.int32))
        b.bind_cpu_input("total_len", np.array(start + n, np.int32))
        b.bind_output("out", "cpu", 0, np.float32, [1, n, h * d], out.ctypes.data)
        sess.run_with_iobinding(b)
        return out

    def _int8_chunk(self, sess: Any, key: tuple, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> tuple[Any, np.ndarray, np.ndarray]:
        """A chunk over an int8 cache, in float32: ONNX Runtime's quantized-cache kernel is 4-5x slower than
        its float32 one for a chunk of rows (SmolLM2's 256 rows over 1,792 cached: 53 vs 13 ms per layer),
        while for one row it is as fast or faster. So the chunk's rows ``k``/``v`` (``[n, kv, d]``, rotated)
        are stored as int8 codes, the cached positions before ``start`` are dequantized into a float32
        scratch cache shared by the layers of this shape, and the float32 node attends over the scratch
        with the chunk's rows dequantized: the numbers of an int8 cache, the float32 kernel's speed.
        Returns the binding and the dequantized rows (the node's k and v inputs, ``[n, kv * d]``).
        ``key`` is ``sess``'s: layers of one cache shape share the scratch arrays, and each session
        (heads, scale) has its own binding of them."""
        n, kvh, d = k.shape
        cache = self._cache
        cache.write(layer, start, k.transpose(1, 0, 2), v.transpose(1, 0, 2))
        scratch = self._scratch.get((kvh, d))
        if scratch is None:
            arrays = (np.zeros((1, kvh, cache.capacity, d), np.float32), np.zeros((1, kvh, cache.capacity, d), np.float32))
            ov = self._ort.OrtValue.ortvalue_from_numpy
            scratch = self._scratch[(kvh, d)] = (arrays, (ov(arrays[0]), ov(arrays[1])))
        (sk, sv), values = scratch
        b = self._scratch_bound.get(key)
        if b is None:
            b = self._scratch_bound[key] = sess.io_binding()
            b.bind_ortvalue_input("past_k", values[0])
            b.bind_ortvalue_input("past_v", values[1])
            b.bind_ortvalue_output("present_k", values[0])
            b.bind_ortvalue_output("present_v", values[1])
        end = start + n  # the cached positions and the chunk's rows, as the cache reads them back
        kd, vd = cache.read(layer, 0, end, out=(sk[0, :, :end], sv[0, :, :end]))
        return b, kd[:, start:].transpose(1, 0, 2).reshape(n, kvh * d), vd[:, start:].transpose(1, 0, 2).reshape(n, kvh * d)


# The first onnxruntime whose CPU GroupQueryAttention runs an int8 (PER_CHANNEL) cache: 1.26 fails
# inside the node, 1.22 and 1.24 reject the model; 1.27, 1.28, 1.30, 1.31 and 1.32 match numpy.
INT8_CACHE_MIN_ORT = (1, 27)


def ort_version(ort: Any) -> tuple[int, ...]:
    """``ort``'s (major, minor) release: "1.27.0" and "1.27rc1" give (1, 27)."""
    return tuple(int(x) for x in re.findall(r"\d+", ort.__version__)[:2])


def check_int8_cache_support(ort: Any, bundle: Any) -> None:
    """Raise a :class:`BundleError` naming the fix when ``ort`` is too old for an int8 KV cache."""
    from llmc.runtime.errors import BundleError

    if ort_version(ort) < INT8_CACHE_MIN_ORT:
        need = ".".join(map(str, INT8_CACHE_MIN_ORT))
        raise BundleError(f"{bundle} has an int8 KV cache (--kv-cache int8), which onnxruntime {ort.__version__} cannot run",
                          hint=f"pip install 'onnxruntime>={need}', or recompile with --kv-cache float32")


GQA_HEAD_MULTIPLE = 8  # ONNX Runtime's GroupQueryAttention refuses other head sizes ("head_size must be a multiple of 8")


def node_rotates(rotary_dim: int, head_dim: int) -> bool:
    """Whether ONNX Runtime's node can rotate q and k itself: all dims rotated, head size a multiple of 16 (its CPU kernel's rule)."""
    return rotary_dim == head_dim and head_dim % 16 == 0


class _RotaryTables:
    """``cos``/``sin`` by position (``[capacity, D/2]``), for attention nodes that rotate q and k.

    Rows are written when a chunk or a decode step reaches their position, from
    the program's own ``RotaryTable`` result for it (a position's row never
    changes: decode writes it once, a chunk its rows at once), so the rotation
    uses the same numbers as the numpy path (rotate-half tables repeat their
    first half).
    """

    def __init__(self, capacity: int, half: int) -> None:
        self.cos = np.zeros((capacity, half), np.float32)
        self.sin = np.zeros((capacity, half), np.float32)
        self._written = np.zeros(capacity, bool)

    def write(self, start: int, cos: np.ndarray, sin: np.ndarray) -> None:
        """The rows of positions ``start, start + 1, ...`` from a ``RotaryTable`` result (one row in decode,
        a chunk's rows); once per position, not once per layer. Positions are reached in order from 0, so
        the written ones are a prefix: the range is written if its last position is."""
        n = len(cos)
        if self._written[start + n - 1]:
            return
        half = self.cos.shape[1]
        self.cos[start : start + n] = cos[:, :half]
        self.sin[start : start + n] = sin[:, :half]
        self._written[start : start + n] = True


# Decode attends on one thread while a layer's cached K and V up to the position are at most this
# many bytes. SmolLM2 (3 KV heads of 64), same-process A/Bs of 12-30 rounds: one thread was 8-9%
# faster at 32 and 128 tokens and 3-10% at 512, but 3-6% slower at 1024 and 1800 tokens.
ONE_THREAD_KV_BYTES = 1 << 20


class _OneRow:
    """Decode's attention for one layer: its own IOBindings with every input and the output
    bound once to buffers that are reused, so a call rotates q and k into their buffers (or
    has the node rotate them, with ``tables``), copies v, sets the two lengths and runs;
    nothing is allocated or bound per token.

    ``runs`` holds (session, binding) on one thread and, if there are more, on all threads:
    positions below ``one_thread_len`` use the first (a short cache is not worth waking a
    second thread for), later ones the last."""

    def __init__(self, runs: list[tuple[Any, Any]], h: int, kvh: int, d: int, tables: _RotaryTables | None = None,
                 one_thread_len: int = 0) -> None:
        self._runs = runs
        self._one_thread_len = one_thread_len
        self._tables = tables
        self._h, self._kvh, self._d = h, kvh, d
        self.q = np.zeros((1, 1, h * d), np.float32)
        self.k = np.zeros((1, 1, kvh * d), np.float32)
        self.v = np.zeros((1, 1, kvh * d), np.float32)
        self.seqlens = np.zeros(1, np.int32)
        self.total = np.zeros((), np.int32)
        self.out = np.zeros((1, h * d), np.float32)
        self._tmp = np.zeros((h, d), np.float32)
        inputs = [("q", self.q), ("k", self.k), ("v", self.v), ("seqlens_k", self.seqlens), ("total_len", self.total)]
        if tables is not None:
            inputs += [("cos_cache", tables.cos), ("sin_cache", tables.sin)]
        for _, b in runs:  # the cache is bound already
            for name, a in inputs:
                b.bind_input(name, "cpu", 0, a.dtype.type, list(a.shape), a.ctypes.data)
            b.bind_output("out", "cpu", 0, np.float32, [1, 1, h * d], self.out.ctypes.data)

    def _rope_into(self, x: np.ndarray, heads: int, cos: np.ndarray, sin: np.ndarray, r: int, dst: np.ndarray) -> None:
        """``dst`` (``[1, 1, heads*d]``) = rotate-half rotary of the one row ``x``, as kernels._rope."""
        d = self._d
        x = x.reshape(heads, d)
        y = dst.reshape(heads, d)
        t = self._tmp[:heads, :r]
        half = r // 2
        c, s = cos[0, :r], sin[0, :r]
        np.multiply(x[:, :r], c, out=y[:, :r])
        np.multiply(x[:, half:r], s[:half], out=t[:, :half])
        np.subtract(y[:, :half], t[:, :half], out=y[:, :half])
        np.multiply(x[:, :half], s[half:], out=t[:, half:])
        np.add(y[:, half:r], t[:, half:], out=y[:, half:r])
        if r < d:
            y[:, r:] = x[:, r:]

    def __call__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, cos: np.ndarray | None, sin: np.ndarray | None, start: int,
                 rotary_dim: int) -> np.ndarray:
        if self._tables is not None:  # the node rotates q and k
            self._tables.write(start, cos, sin)
        if rotary_dim and self._tables is None:
            self._rope_into(q, self._h, cos, sin, rotary_dim, self.q)
            self._rope_into(k, self._kvh, cos, sin, rotary_dim, self.k)
        else:
            np.copyto(self.q.reshape(1, -1), q)
            np.copyto(self.k.reshape(1, -1), k)
        np.copyto(self.v.reshape(1, -1), v)
        self.seqlens[0] = start
        self.total[()] = start + 1
        sess, binding = self.run_for(start)
        sess.run_with_iobinding(binding)
        return self.out

    def run_for(self, position: int) -> tuple[Any, Any]:
        """The (session, binding) that attends at ``position``."""
        return self._runs[0] if position < self._one_thread_len else self._runs[-1]
