"""quantize: W8A8 Linears, with shadow outlier paths where the plan keeps them.

Rewrites, for every ``Linear`` (weights ``[out, in]``)::

    y = Linear(x)
  into
    y = QLinear(x)                            # uint8 per-tensor activations, int8 weights
  or, when the input keeps a shadow path,
    yq = QLinear(x); y = ShadowOutliers(x, yq)      # y = yq + (x - clip(x)) @ W^T

``QLinear`` quantizes ``x`` to uint8 with the plan's scale (zero point 128, so
values beyond the range saturate: that is the clip) and multiplies by symmetric
int8 weights (stored as uint8 + 128, see :func:`quantize_weight`), transposed
``[in, out]``, with one scale per output channel
(``--weight-granularity channel``, default) or one per tensor. ``ShadowOutliers``
is a dynamic op: it runs on the CPU, so the chunk cut puts the float ``x`` at a
subgraph boundary, and the merge with the NPU result happens on the CPU too.

Everything else stays float32 in this pass (norms, residual adds, attention on
the CPU); see docs/quantization.md for the measurements behind that choice.
"""

from __future__ import annotations

import numpy as np

from llmc.analyses import ShadowPlan
from llmc.ir import Graph, WeightStore
from llmc.pass_manager import Pass, PassContext, PassResult


W_ZERO_POINT = 128


def quantize_weight(w: np.ndarray, per_channel: bool) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 in [-127, 127], stored offset by 128 as uint8.

    Returns (q [in, out] uint8 = int8 + 128, scale [out] or [1] float32). The
    values are exactly those of symmetric int8 weights; the uint8 form keeps
    ONNX Runtime's x86 kernels exact: its AVX2 u8 x s8 path saturates 16-bit
    intermediate sums (measured: errors of 13% of the output range), its u8 x u8
    path does not. The QNN backend turns them back into int8.
    """
    w = np.asarray(w, np.float32)
    amax = np.abs(w).max(axis=1) if per_channel else np.array([np.abs(w).max()], np.float32)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / (scale[:, None] if per_channel else scale)), -127, 127)
    return np.ascontiguousarray((q + W_ZERO_POINT).astype(np.uint8).T), scale


def _derived(store: WeightStore, name: str, shape, dtype, fn):
    if name in store:
        return store[name]
    return store.add(name, shape, dtype, fn)


class Quantize(Pass):
    name = "quantize"
    summary = "W8A8 QLinear (uint8 per-tensor activations, int8 weights) plus CPU shadow paths from the plan"
    requires = (ShadowPlan,)

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        plan = ctx.get(ShadowPlan)
        self._cache: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        per_channel = ctx.options.weight_granularity == "channel"
        store = graph.weights
        changed = False
        for node in list(graph.nodes):
            if node.op != "Linear":
                continue
            x = node.inputs[0]
            q = plan.inputs[x.name]
            wref = node.weights["weight"]
            out_f, in_f = wref.shape

            def qw(name=wref.name, pop=False):
                # one quantization serves both the int8 weights and their scales
                if name not in self._cache:
                    self._cache[name] = quantize_weight(store.load(name), per_channel)
                return self._cache.pop(name) if pop else self._cache[name]

            qweight = _derived(store, f"{wref.name}.q8", (in_f, out_f), "uint8", lambda qw=qw: qw()[0])
            wscale = _derived(store, f"{wref.name}.scale", (out_f if per_channel else 1,), "float32", lambda qw=qw: qw(pop=True)[1])
            weights = {"qweight": qweight, "wscale": wscale}
            if "bias" in node.weights:
                weights["bias"] = node.weights["bias"]
            ql = graph.add_node("QLinear", [x], attrs={"x_scale": q.scale, "x_zero_point": q.zero_point, "w_zero_point": W_ZERO_POINT}, weights=weights,
                                name=f"{node.name}.q", before=node)
            y = ql.outputs[0]
            if q.shadow:
                hot = list(q.hot_channels)

                def hot_rows(name=wref.name, hot=tuple(hot)):
                    w = store.load(name)
                    rows = w[:, list(hot)].T if hot else np.zeros((1, w.shape[0]), np.float32)
                    return np.ascontiguousarray(rows, np.float32)

                def transposed(name=wref.name):
                    return np.ascontiguousarray(store.load(name).T, np.float32)

                hot_ref = _derived(store, f"{wref.name}.shadow_hot", (max(len(hot), 1), out_f), "float32", hot_rows)
                cold_ref = _derived(store, f"{wref.name}.shadow_t", (in_f, out_f), "float32", transposed)
                sh = graph.add_node("ShadowOutliers", [x, y], attrs={"lo": q.lo, "hi": q.hi, "hot_channels": hot},
                                    weights={"weight_t": cold_ref, "hot_rows": hot_ref}, name=f"{node.name}.shadow", before=node)
                y = sh.outputs[0]
            graph.replace_all_uses(node.outputs[0], y)
            graph.remove_node(node)
            changed = True
        return PassResult(changed)
