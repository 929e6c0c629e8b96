"""Decode as one ONNX Runtime call per token (the bundle's ``decode_graph``, from ``fuse_decode_graph``),
and prefill as one call per chunk where the graph has a chunk instance (:class:`ChunkGraphRunner`).

The graph holds the model after its embedding, attention included; its one-row
instance decodes. For it (:class:`DecodeGraphRunner`)
everything is bound once: each layer's K and V cache arrays as both the past
input and the present output (ONNX Runtime's ``GroupQueryAttention`` then
appends the token's row in place), the graph's inputs (the token's embedding
row, which the session gathers), the two cache lengths and the logits buffer. A
token costs copying its embedding row, writing two numbers, one
``run_with_iobinding`` and one copy of the logits (callers may keep them across
tokens).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from llmc.runtime import kernels


def _bind_model(ort: Any, session: Any, entry: dict[str, Any], cache: kernels.KVCache,
                constants: dict[str, np.ndarray] | None) -> tuple[Any, list[Any]]:
    """A new IOBinding of the decode graph ``session`` (either instance) with each layer's K and V cache
    arrays bound as both its past input and its present output and the weights that are graph inputs
    bound; returns it and what must outlive it."""
    b = session.io_binding()
    keep: list[Any] = []  # the OrtValues over the cache arrays and the bound constants
    for kv in entry["kv"]:
        layer = kv["layer"]
        for past, present, arr in ((kv["past_key"], kv["present_key"], cache.k[layer]), (kv["past_value"], kv["present_value"], cache.v[layer])):
            ov = ort.OrtValue.ortvalue_from_numpy(arr[None])  # a view: the node writes into the session's cache
            keep.append(ov)
            b.bind_ortvalue_input(past, ov)
            b.bind_ortvalue_output(present, ov)
    for name, a in (constants or {}).items():  # weights that are graph inputs (shadow tables)
        a = np.ascontiguousarray(a)
        keep.append(a)
        b.bind_input(name, "cpu", 0, a.dtype.type, list(a.shape), a.ctypes.data)
    return b, keep


class DecodeGraphRunner:
    def __init__(self, ort: Any, session: Any, entry: dict[str, Any], cache: kernels.KVCache, constants: dict[str, np.ndarray] | None,
                 logits_name: str) -> None:
        self._session = session
        b, self._keep = _bind_model(ort, session, entry, cache, constants)
        self._binding = b
        self._inputs = [np.zeros((1, x["features"]), np.dtype(x["dtype"])) for x in entry["inputs"]]
        self._seqlens = np.zeros(1, np.int32)
        self._total = np.zeros((), np.int32)
        named = [(x["name"], a) for x, a in zip(entry["inputs"], self._inputs)] + [(entry["seqlens"], self._seqlens), (entry["total_len"], self._total)]
        for name, a in named:
            b.bind_input(name, "cpu", 0, a.dtype.type, list(a.shape), a.ctypes.data)
        out = next(o for o in entry["outputs"] if o["name"] == logits_name)
        self._logits = np.zeros((1, out["features"]), np.float32)
        b.bind_output(logits_name, "cpu", 0, np.float32, [1, out["features"]], self._logits.ctypes.data)

    def prime(self) -> None:
        """Run the graph once at position 0 on zero inputs (its K/V rows at position 0 are written, and the next
        prompt writes them again)."""
        for dst in self._inputs:
            dst.fill(0)
        self._run(0)

    def _run(self, position: int) -> None:
        """One call on the bound inputs, the token at ``position``."""
        self._seqlens[0] = position
        self._total[()] = position + 1
        self._session.run_with_iobinding(self._binding)

    def __call__(self, inputs: Sequence[np.ndarray], position: int) -> np.ndarray:
        """The logits ``[vocab]`` of the token whose graph inputs (its embedding row) are ``inputs``,
        at ``position`` (the cache holds the positions before it)."""
        for dst, x in zip(self._inputs, inputs):
            np.copyto(dst, x.reshape(dst.shape))
        self._run(position)
        return self._logits[0].copy()


class ChunkGraphRunner:
    """Prefill as one call per chunk of the decode graph's chunk instance (``fuse_decode_graph``): the same
    model at any row count up to C, its attention nodes appending the chunk's K/V rows to the cache in
    place and attending over the positions before them. The caches and the weights that are inputs are
    bound once; a call binds the chunk's graph inputs (its embedding rows), the two cache lengths, the
    rows that need logits and a fresh logits array."""

    def __init__(self, ort: Any, session: Any, entry: dict[str, Any], cache: kernels.KVCache, constants: dict[str, np.ndarray] | None,
                 logits_name: str) -> None:
        self._session = session
        self._binding, self._keep = _bind_model(ort, session, entry, cache, constants)
        self._input_names = [x["name"] for x in entry["inputs"]]
        self._seqlens, self._total, self._rows = entry["seqlens"], entry["total_len"], entry["logit_rows"]
        self._logits_name = logits_name
        self._vocab = next(o for o in entry["outputs"] if o["name"] == logits_name)["features"]

    def __call__(self, inputs: Sequence[np.ndarray], position: int, rows: np.ndarray) -> np.ndarray:
        """The logits ``[len(rows), vocab]`` of the chunk whose graph inputs (its embedding rows) are ``inputs``,
        for its rows ``rows`` (none: ``[0, vocab]``), the chunk starting at ``position`` (the cache holds the
        positions before it)."""
        b = self._binding
        n = inputs[0].shape[0]
        for name, x in zip(self._input_names, inputs):
            b.bind_cpu_input(name, np.ascontiguousarray(x))
        b.bind_cpu_input(self._seqlens, np.array([position + n - 1], np.int32))
        b.bind_cpu_input(self._total, np.array(position + n, np.int32))
        b.bind_cpu_input(self._rows, np.asarray(rows, np.int64))
        logits = np.empty((len(rows), self._vocab), np.float32)
        b.bind_output(self._logits_name, "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        self._session.run_with_iobinding(b)
        return logits
