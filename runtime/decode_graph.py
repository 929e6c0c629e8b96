"""Decode as one ONNX Runtime call per token (the bundle's ``decode_graph``, from ``fuse_decode_graph``).

The graph holds the model after its embedding at one row, attention included.
Everything is bound once: each layer's K and V cache arrays as both the past
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


class DecodeGraphRunner:
    def __init__(self, ort: Any, session: Any, entry: dict[str, Any], cache: kernels.KVCache, constants: dict[str, np.ndarray] | None,
                 logits_name: str) -> None:
        self._session = session
        b = self._binding = session.io_binding()
        self._keep: list[Any] = []  # the OrtValues over the cache arrays and the bound constants must outlive the binding
        for kv in entry["kv"]:
            layer = kv["layer"]
            for past, present, arr in ((kv["past_key"], kv["present_key"], cache.k[layer]), (kv["past_value"], kv["present_value"], cache.v[layer])):
                ov = ort.OrtValue.ortvalue_from_numpy(arr[None])  # a view: the node writes into the session's cache
                self._keep.append(ov)
                b.bind_ortvalue_input(past, ov)
                b.bind_ortvalue_output(present, ov)
        for name, a in (constants or {}).items():  # weights that are graph inputs (shadow tables)
            a = np.ascontiguousarray(a)
            self._keep.append(a)
            b.bind_input(name, "cpu", 0, a.dtype.type, list(a.shape), a.ctypes.data)
        self._inputs = [np.zeros((1, x["features"]), np.dtype(x["dtype"])) for x in entry["inputs"]]
        self._seqlens = np.zeros(1, np.int32)
        self._total = np.zeros((), np.int32)
        named = [(x["name"], a) for x, a in zip(entry["inputs"], self._inputs)] + [(entry["seqlens"], self._seqlens), (entry["total_len"], self._total)]
        for name, a in named:
            b.bind_input(name, "cpu", 0, a.dtype.type, list(a.shape), a.ctypes.data)
        out = next(o for o in entry["outputs"] if o["name"] == logits_name)
        self._logits = np.zeros((1, out["features"]), np.float32)
        b.bind_output(logits_name, "cpu", 0, np.float32, [1, out["features"]], self._logits.ctypes.data)

    def __call__(self, inputs: Sequence[np.ndarray], position: int) -> np.ndarray:
        """The logits ``[vocab]`` of the token whose graph inputs (its embedding row) are ``inputs``,
        at ``position`` (the cache holds the positions before it)."""
        for dst, x in zip(self._inputs, inputs):
            np.copyto(dst, x.reshape(dst.shape))
        self._seqlens[0] = position
        self._total[()] = position + 1
        self._session.run_with_iobinding(self._binding)
        return self._logits[0].copy()
