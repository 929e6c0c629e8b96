"""quantize_kv_cache: an int8 KV cache with per-channel scales from calibration (``--kv-cache int8``).

Every ``Attention`` node gets two weights, ``k_scale`` and ``v_scale``
(``[kv heads, head dim]`` float32): the runtime's cache for that layer then holds
int8 codes, ``clip(rint(x / scale), -128, 127)``, which read back as
``code * scale``. Decode runs ONNX Runtime's ``GroupQueryAttention`` with a
``PER_CHANNEL`` int8 cache, so the node that attends appends the quantized
row; prefill's chunks store int8 codes and attend in float32 over a
dequantized copy (``runtime/ort_attention.py``). A quarter of the float32
cache's bytes are read per decoded token and held for the whole context.

The scale of a value channel is its calibration maximum ``|v|`` over 127. Keys
are cached after rotary embedding, which mixes channel ``i`` with ``i + r/2``
(rotate-half over the first ``r`` = ``rotary_dim`` channels) at every position,
so a key channel's bound is ``sqrt(a_i^2 + a_{i+r/2}^2)`` for the calibration
maxima ``a`` of the keys before rotary, times the rotary tables' ``scaling``
(YaRN's and longrope's attention factor): no rotation can take a calibrated key
past it. Channels beyond ``r`` keep their own maximum. Values beyond the bound
at run time saturate at +/-127 codes.

Needs :class:`~llmc.analyses.CalibrationStats` with the attention inputs
(``calibrate`` records them); produces :class:`~llmc.analyses.KVCachePlan`.
"""

from __future__ import annotations

import numpy as np

from llmc.analyses import CalibrationStats, KVCachePlan
from llmc.errors import CompileError
from llmc.ir import Graph
from llmc.ops import kv_cache_itemsize
from llmc.pass_manager import Pass, PassContext, PassResult

QMAX = 127
TINY = 1e-8  # a channel that was always zero still gets a usable scale


def key_bounds(absmax: np.ndarray, num_kv_heads: int, head_dim: int, rotary_dim: int, scaling: float = 1.0) -> np.ndarray:
    """Per key channel (``[kv heads * head dim]``), the largest ``|k|`` after rotary for keys whose
    pre-rotary channel maxima are ``absmax``; ``scaling`` multiplies the rotary tables (the
    ``RotaryTable``'s attention factor of YaRN and longrope)."""
    a = np.asarray(absmax, np.float64).reshape(num_kv_heads, head_dim).copy()
    half = rotary_dim // 2
    if half:
        pair = abs(scaling) * np.sqrt(a[:, :half] ** 2 + a[:, half:rotary_dim] ** 2)
        a[:, :half] = pair
        a[:, half:rotary_dim] = pair
    return a.reshape(-1)


class QuantizeKVCache(Pass):
    name = "quantize_kv_cache"
    summary = "int8 KV cache: per-channel key (after rotary) and value scales from calibration, on every Attention"
    requires = (CalibrationStats,)
    produces = (KVCachePlan,)

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        half = [n.name for n in graph.find("Attention") if n.attrs.get("kv_dtype") == "float16"]
        if half:
            raise CompileError(f"{half[0]} already has a float16 KV cache (float16_kv_cache): a layer's cache has one type",
                               hint="choose one of --kv-cache int8 and --kv-cache float16")
        stats = ctx.get(CalibrationStats)
        store = graph.weights
        layers = {}
        q_bytes = f_bytes = 0
        for n in graph.find("Attention"):
            a = n.attrs
            kv, d = a["num_kv_heads"], a["head_dim"]
            k_in, v_in = n.inputs[1].name, n.inputs[2].name
            if k_in not in stats.inputs or v_in not in stats.inputs:
                raise CompileError(f"attention {n.name} has no calibration statistics for its keys and values",
                                   hint="run calibrate right before quantize_kv_cache in the pipeline")
            table = n.inputs[3].producer if len(n.inputs) == 5 else None
            scaling = table.attrs["scaling"] if table is not None and table.op == "RotaryTable" else 1.0
            kmax = key_bounds(stats.inputs[k_in].channel_absmax, kv, d, a["rotary_dim"], scaling)
            vmax = np.asarray(stats.inputs[v_in].channel_absmax, np.float64)
            scales = {}
            for slot, m in (("k_scale", kmax), ("v_scale", vmax)):
                s = (np.maximum(m, TINY) / QMAX).astype(np.float32).reshape(kv, d)
                scales[slot] = store.add(f"{n.name}.{slot}", (kv, d), "float32", lambda s=s: s)
            n.weights.update(scales)
            layers[a["layer"]] = (float(kmax.max()), float(vmax.max()))
            q_bytes += 2 * kv * d * kv_cache_itemsize(n)
            f_bytes += 2 * kv * d * 4
        ctx.put(KVCachePlan("int8", layers, q_bytes, f_bytes))
        return PassResult(bool(layers))
