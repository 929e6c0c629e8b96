"""A reference interpreter for llmc IR, in numpy.

Runs a whole graph on ``T`` tokens (any ``T``: static ops are row-wise) with a
fresh KV cache, using the runtime's kernels for the dynamic ops so the two agree
by construction. Passes use it to observe activations (calibration) and tests
use it to check the IR against HuggingFace independently of any backend.

An ``observer(node, inputs, outputs)`` callback sees every node as it runs.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from llmc.ir import Graph, Node
from llmc.runtime import kernels

Observer = Callable[[Node, list[np.ndarray], list[np.ndarray]], None]


def _rms_norm(x, w, eps, offset):
    var = np.mean(np.square(x), axis=-1, keepdims=True)
    return (x / np.sqrt(var + np.float32(eps))) * (w + np.float32(offset))


def _layer_norm(x, w, b, eps):
    mu = x.mean(axis=-1, keepdims=True)
    var = np.square(x - mu).mean(axis=-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + np.float32(eps)) * w
    return y + b if b is not None else y


def _gelu(x, tanh: bool):
    if tanh:
        return 0.5 * x * (1 + np.tanh(np.float32(0.7978845608028654) * (x + np.float32(0.044715) * x**3)))
    from math import erf

    return 0.5 * x * (1 + np.vectorize(erf, otypes=[np.float32])(x / np.float32(np.sqrt(2.0))))


class Interpreter:
    """Runs ``graph`` node by node, holding each value only until its last use.

    So a run holds about one layer's activations (plus the KV cache) however
    deep the model is; ``peak_live_bytes`` reports the most it held. With
    ``cache_weights=False`` weights are loaded again for every run and dropped
    after their node (calibration: weights read from a checkpoint stay in the
    file's pages instead of piling up in memory).
    """

    def __init__(self, graph: Graph, cache_weights: bool = True) -> None:
        self.graph = graph
        self.cache_weights = cache_weights
        self._w: dict[str, np.ndarray] = {}
        self.attn_layers = {n.attrs["layer"]: (n.attrs["num_kv_heads"], n.attrs["head_dim"]) for n in graph.find("Attention")}
        # an int8 cache's per-channel scales (quantize_kv_cache)
        self.kv_scales = {n.attrs["layer"]: (self.weight(n, "k_scale"), self.weight(n, "v_scale")) for n in graph.find("Attention") if "k_scale" in n.weights}
        self.kv_half = {n.attrs["layer"] for n in graph.find("Attention") if n.attrs.get("kv_dtype") == "float16"}  # float16_kv_cache
        self.peak_live_bytes = 0
        # the index of each value's last reader; graph outputs are read at the end
        self._last_use: dict[str, int] = {}
        for i, node in enumerate(graph.nodes):
            for v in node.inputs:
                self._last_use[v.name] = i
        for v in graph.outputs:
            self._last_use[v.name] = len(graph.nodes)

    def weight(self, node: Node, slot: str) -> np.ndarray | None:
        ref = node.weights.get(slot)
        if ref is None:
            return None
        w = self._w.get(ref.name)
        if w is None:
            w = np.ascontiguousarray(self.graph.weights.load(ref.name))
            if self.cache_weights:
                self._w[ref.name] = w
        return w

    def run(self, ids: Sequence[int], observer: Observer | None = None, select_rows: np.ndarray | None = None,
            stop_at: str | None = None) -> np.ndarray | None:
        """Logits for ``ids`` (all rows, or ``select_rows`` if the graph has SelectRows).

        ``stop_at`` names a node where the run ends, without running it: the
        observer sees its inputs (and no outputs) and there are no logits.
        """
        ids = np.asarray(ids, np.int64)
        T = len(ids)
        cache = kernels.KVCache(self.attn_layers, T, self.kv_scales, self.kv_half)
        env: dict[str, np.ndarray] = {}
        for v in self.graph.inputs:
            env[v.name] = ids if v.name.startswith("input_ids") else np.arange(T, dtype=np.int64)
        rows = select_rows if select_rows is not None else np.arange(T)
        last_use = self._last_use
        live = sum(a.nbytes for a in env.values())
        for i, node in enumerate(self.graph.nodes):
            ins = [env[v.name] for v in node.inputs]
            if node.name == stop_at:
                if observer is not None:
                    observer(node, ins, [])
                return None
            outs = self.eval(node, ins, cache, T, rows)
            for v, o in zip(node.outputs, outs):
                if last_use.get(v.name, -1) > i:  # unread results are dropped at once
                    env[v.name] = o
                    live += o.nbytes
            self.peak_live_bytes = max(self.peak_live_bytes, live)
            if observer is not None:
                observer(node, ins, outs)
            del ins, outs
            for v in node.inputs:
                if last_use[v.name] == i and v.name in env:
                    live -= env.pop(v.name).nbytes
        return env[self.graph.outputs[0].name]

    def eval(self, n: Node, x: list[np.ndarray], cache, T: int, rows: np.ndarray) -> list[np.ndarray]:
        a = n.attrs
        op = n.op
        if op == "Linear":
            y = x[0] @ self.weight(n, "weight").T
            b = self.weight(n, "bias")
            return [y + b if b is not None else y]
        if op == "QLinear":
            sc, zp = np.float32(a["x_scale"]), a["x_zero_point"]
            xq = np.clip(np.rint(x[0] / sc) + zp, 0, 255)
            xd = ((xq - zp) * sc).astype(np.float32)
            w = (self.weight(n, "qweight").astype(np.float32) - a["w_zero_point"]) * self.weight(n, "wscale")[None, :]
            y = xd @ w
            b = self.weight(n, "bias")
            return [y + b if b is not None else y]
        if op == "BlockQLinear":
            w = kernels.dequantize_blocks(self.weight(n, "qweight"), self.weight(n, "scales"), self.weight(n, "offsets"), a["bits"],
                                          self.weight(n, "zero_points"))
            digits = a.get("offset_digits", 0)  # offsets folded into the codes (fold_block_offsets)
            y = (kernels.widen_with_block_sums(x[0], a["block_size"], digits) if digits else x[0]) @ w.T
            b = self.weight(n, "bias")
            return [y + b if b is not None else y]
        if op == "ShadowOutliers":
            hot = a["hot_channels"]
            codes = self.weight(n, "codes")
            pos = np.full(codes.shape[0], -1, np.int64)
            pos[list(hot)] = np.arange(len(hot))
            ys, _ = kernels.shadow_outliers(x[0], x[1:], a["splits"], self.weight(n, "hot_delta"), codes, self.weight(n, "scale"), a["w_zero_point"],
                                            pos, a["lo"], a["hi"], x[0].shape[0])
            return ys
        if op == "RMSNorm":
            return [_rms_norm(x[0], self.weight(n, "weight"), a["eps"], a["offset"])]
        if op == "LayerNorm":
            return [_layer_norm(x[0], self.weight(n, "weight"), self.weight(n, "bias"), a["eps"])]
        if op == "Act":
            k = a["kind"]
            if k == "silu":
                return [x[0] / (1 + np.exp(-x[0]))]
            return [_gelu(x[0], k == "gelu_tanh").astype(np.float32)]
        if op == "Add":
            return [x[0] + x[1]]
        if op == "Mul":
            return [x[0] * x[1]]
        if op == "Scale":
            return [x[0] * np.float32(a["value"])]
        if op == "Slice":
            return [x[0][:, a["start"] : a["end"]]]
        if op == "Embedding":
            return [kernels.embedding(x[0], self.weight(n, "table"), a["scale"])]
        if op == "QEmbedding":
            return [kernels.qembedding(x[0], self.weight(n, "codes"), self.weight(n, "row_scale"), a["zero_point"], a["transposed"], a["scale"])]
        if op == "BlockEmbedding":
            return [kernels.block_embedding(x[0], self.weight(n, "qweight"), self.weight(n, "scales"), self.weight(n, "offsets"), a["bits"], a["scale"])]
        if op == "RotaryTable":
            return list(kernels.rotary_table(x[0], self.weight(n, "inv_freq"), a["scaling"]))
        if op == "Attention":
            cos, sin = (x[3], x[4]) if len(x) == 5 else (None, None)
            return [kernels.attention(x[0], x[1], x[2], cos, sin, cache=cache, start=0, n=T, **a)]
        if op == "SelectRows":
            return [x[0][rows]]
        raise NotImplementedError(f"the interpreter has no implementation of {op} (node {n.name})")
