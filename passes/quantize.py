"""quantize: W8A8 Linears, with shadow outlier paths where the plan keeps them.

Rewrites, for every ``Linear`` (weights ``[out, in]``)::

    y = Linear(x)
  into
    y = QLinear(x)                            # uint8 per-tensor activations, int8 weights
  and, when their input keeps a shadow path, one op for all Linears reading it
  (q/k/v, or gate/up)::

    yq_i = QLinear_i(x); (y_1, .., y_n) = ShadowOutliers(x, yq_1, .., yq_n)
    # y_i = yq_i + (x - clip(x)) @ W_i^T, outliers detected once per x

``QLinear`` quantizes ``x`` to uint8 with the plan's scale (zero point 128, so
values beyond the range saturate: that is the clip) and multiplies by symmetric
int8 weights (zero point 0, see :func:`quantize_weight`), transposed
``[in, out]``, with one scale per output channel
(``--weight-granularity channel``, default) or one per tensor. With
``--weight-bits 7`` the weights' codes stay in [-63, 63] (see
:data:`WEIGHT_BITS`). ``ShadowOutliers``
is a dynamic op: it runs on the CPU, so the chunk cut puts the float ``x`` at a
subgraph boundary, and the merge with the NPU result happens on the CPU too.

The correction reads its outliers' rows of the QLinears' own int8 codes (times
their per-channel scales): no float copy of the weights. The channels calibration
found hot (``hot_channels``, where most outliers fall) are exact: ``hot_delta``
holds their float rows less what the codes give, added for each hot outlier.
On SmolLM2-135M this holds perplexity closer to fp32 than a full float32 table
at a quarter of its bytes (docs/quantization.md has the measurements).

Everything else stays float32 in this pass (norms, residual adds, attention on
the CPU); see docs/quantization.md for the measurements behind that choice.
"""

from __future__ import annotations

import numpy as np

from llmc.analyses import ShadowPlan
from llmc.errors import CompileError
from llmc.ir import Graph
from llmc.pass_manager import Pass, PassContext, PassResult


W_ZERO_POINT = 0
FED_ZERO_POINT = 128  # the uint8 form of the same values, for weights fed at run time (see Quantize)
CODE_DTYPE = {W_ZERO_POINT: "int8", FED_ZERO_POINT: "uint8"}  # the stored codes' type, by zero point
# --weight-bits: 8, codes in [-127, 127]; or 7, codes in [-63, 63] (ONNX Runtime's quantizer calls this reduce_range).
# x86 CPUs without VNNI multiply uint8 activations by int8 weights with vpmaddubsw, which adds two products
# into int16 and saturates past 32767: 255 * 127 * 2 can, 255 * 63 * 2 = 32130 cannot. 7-bit weights are
# exact there, so the runtime keeps them on those fast kernels (llmc.runtime.cpu) instead of ONNX Runtime's
# uint8 x uint8 ones. SmolLM2-135M npu native on an AVX2 EPYC, 512-token prefill: +10% on natural text (compare.py),
# +7-37% on random ids; perplexity on 3,000 tokens of English (windows of 512): fp32 12.570, 8-bit 12.682, 7-bit 12.733.
WEIGHT_BITS = (8, 7)


def weight_qmax(bits: int) -> int:
    """The largest weight code of ``bits`` bits (codes are symmetric: [-qmax, qmax]): 127 or 63."""
    return (1 << (bits - 1)) - 1


def check_weight_bits(bits: int) -> None:
    """A named CompileError for a --weight-bits no quantization has (the CLI offers only these; the API does not)."""
    if bits not in WEIGHT_BITS:
        raise CompileError(f"--weight-bits {bits!r} is not available", hint="choose one of: " + ", ".join(map(str, WEIGHT_BITS)))


def quantize_weight(w: np.ndarray, per_channel: bool, offset: int = W_ZERO_POINT, bits: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 codes in [-127, 127], or in [-63, 63] with ``bits`` 7.

    Returns (q [in, out] int8, scale [out] or [1] float32). ONNX Runtime's x86
    u8 x s8 kernels saturate on CPUs without VNNI (measured: errors of 13% of the
    output range) unless the codes fit 7 bits; for 8-bit codes the runtime has
    ONNX Runtime turn the weights into uint8 there (:mod:`llmc.runtime.cpu`), and
    keeps them int8 where the kernels are exact and 2-3x faster at chunk rows.
    With ``offset`` 128 the same values come as uint8 ``q + 128``.
    """
    if bits not in WEIGHT_BITS:
        raise ValueError(f"weight bits {bits!r}: choose one of {WEIGHT_BITS}")
    qmax = float(weight_qmax(bits))
    w = np.asarray(w, np.float32)
    out_f, in_f = w.shape
    step = max(1, _BLOCK_ELEMENTS // max(in_f, 1))  # rows per block: temporaries stay a few MB for any matrix
    blocks = range(0, out_f, step)
    if per_channel:
        amax = np.concatenate([np.abs(w[i : i + step]).max(axis=1) for i in blocks]) if out_f else np.zeros(0, np.float32)
    else:
        amax = np.array([max((float(np.abs(w[i : i + step]).max()) for i in blocks), default=0.0)], np.float32)
    scale = np.where(amax > 0, amax / qmax, 1.0).astype(np.float32)
    q = np.empty((in_f, out_f), CODE_DTYPE[offset])
    for i in blocks:
        b = w[i : i + step] / (scale[i : i + step, None] if per_channel else scale)
        np.rint(b, out=b)
        np.clip(b, -qmax, qmax, out=b)
        b += offset
        q[:, i : i + step] = b.T
    return q, scale


_BLOCK_ELEMENTS = 1 << 20



def _shadow_name(xname: str) -> str:
    return f"shadow[{xname}]"


class Quantize(Pass):
    name = "quantize"
    summary = "W8A8 QLinear (uint8 per-tensor activations, int8 weights) plus CPU shadow paths from the plan"
    requires = (ShadowPlan,)

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        plan = ctx.get(ShadowPlan)
        self._cache: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        per_channel = ctx.options.weight_granularity == "channel"
        # Under a memory budget the weights are graph inputs, fed at run time: ONNX Runtime's load-time
        # rewrite of int8 weights into uint8 (CPUs without VNNI) meets only constant ones, so a budgeted
        # bundle keeps the uint8 form, exact on every CPU's u8 x u8 kernels.
        zero_point = FED_ZERO_POINT if ctx.options.memory_budget else W_ZERO_POINT
        store = graph.weights
        changed = False
        groups: dict[str, list] = {}
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
                    self._cache[name] = quantize_weight(store.load(name), per_channel, zero_point, ctx.options.weight_bits)
                return self._cache.pop(name) if pop else self._cache[name]

            qweight = store.derived(f"{wref.name}.q8", (in_f, out_f), CODE_DTYPE[zero_point], lambda qw=qw: qw()[0])
            wscale = store.derived(f"{wref.name}.scale", (out_f if per_channel else 1,), "float32", lambda qw=qw: qw(pop=True)[1])
            weights = {"qweight": qweight, "wscale": wscale}
            if "bias" in node.weights:
                weights["bias"] = node.weights["bias"]
            ql = graph.add_node("QLinear", [x], attrs={"x_scale": q.scale, "x_zero_point": q.zero_point, "w_zero_point": zero_point}, weights=weights,
                                name=f"{node.name}.q", before=node)
            graph.replace_all_uses(node.outputs[0], ql.outputs[0])
            graph.remove_node(node)
            if q.shadow:
                groups.setdefault(x.name, []).append((ql, wref))
            changed = True
        for xname, members in groups.items():
            self._add_shadow(graph, plan.inputs[xname], members)
        return PassResult(changed)

    @staticmethod
    def _add_shadow(graph: Graph, q, members) -> None:
        """One ShadowOutliers for all QLinears reading ``q.value``, after the last of them. Its table is the
        QLinears' own codes and scales (one member's are shared; ``fuse_sibling_linears`` shares a merged
        group's), and ``hot_delta`` holds, for the hot channels, their float rows less what the codes give."""
        store = graph.weights
        x = members[0][0].inputs[0]
        qls = [ql for ql, _ in members]
        splits = [w.shape[0] for _, w in members]
        total, hot = sum(splits), list(q.hot_channels)
        base = _shadow_name(q.value)
        if len(qls) == 1:
            codes, scale = qls[0].weights["qweight"], qls[0].weights["wscale"]
        else:  # (an unmerged group: per-tensor scales) one copy of the codes, concatenated
            names = tuple(ql.weights["qweight"].name for ql in qls)
            codes = store.add(f"{base}.codes", (x.shape[1], total), qls[0].weights["qweight"].dtype,
                              lambda names=names: np.concatenate([store.load(n) for n in names], axis=1))
            scale = None
        if scale is None or scale.shape != (total,):  # per-tensor scales, one per column
            scales = tuple((ql.weights["wscale"].name, k) for ql, k in zip(qls, splits))
            scale = store.add(f"{base}.scale", (total,), "float32",
                              lambda scales=scales: np.concatenate([np.broadcast_to(store.load(n), (k,)) for n, k in scales]).astype(np.float32))
        zero_point = qls[0].attrs["w_zero_point"]

        def hot_delta(names=tuple(w.name for _, w in members), hot=tuple(hot), codes=codes.name, scale=scale.name):
            if not hot:
                return np.zeros((1, total), np.float32)
            exact = np.concatenate([store.load(n)[:, list(hot)] for n in names], axis=0).T
            given = (np.asarray(store.load(codes))[list(hot)].astype(np.float32) - zero_point) * store.load(scale)
            return np.ascontiguousarray(exact - given, np.float32)

        hot_ref = store.add(f"{base}.hot_delta", (max(len(hot), 1), total), "float32", hot_delta)
        qls = sorted(qls, key=graph.nodes.index)
        # The QLinears depend only on x: gather them after the first so the shadow
        # can follow them all before any of their results is used (gate/up: the
        # activation on gate comes before the up projection in traced order).
        for prev, ql in zip(qls, qls[1:]):
            graph.move_after(ql, prev)
        i = graph.nodes.index(qls[-1]) + 1
        after = graph.nodes[i] if i < len(graph.nodes) else None  # None: append at the end
        ys = [ql.outputs[0] for ql in qls]
        sh = graph.add_node("ShadowOutliers", [x, *ys], attrs={"lo": q.lo, "hi": q.hi, "hot_channels": hot, "splits": splits, "w_zero_point": zero_point},
                            weights={"codes": codes, "scale": scale, "hot_delta": hot_ref}, name=base, before=after)
        for y, out in zip(ys, sh.outputs):
            graph.replace_all_uses(y, out, exclude=sh)
