"""smooth_activations: move activation outliers' range into the weights (SmoothQuant), exactly.

A Linear input whose channel ``c`` reaches far beyond the others forces a wide
per-tensor int8 range, or many shadow corrections. Dividing that channel by a
factor ``s_c`` and multiplying the weights' input row ``c`` by it leaves the
Linear's output unchanged, and narrows the activation's spread. The division is
folded into whatever produces the input, so it costs nothing at run time:

* a norm (RMSNorm, LayerNorm) whose output only Linears read: its weight (and
  bias) divided by ``s``;
* an Attention's output (``o_proj``'s input): the value projection's output rows,
  per kv head (every query head of a group reads the same values, so the group
  shares one factor per channel: the largest of its heads' needs);
* a gated product ``act(gate) * up`` (``down_proj``'s input): ``up``'s output rows.

``s_c = max|x_c|^alpha / max|w_c|^(1 - alpha)`` (Xiao et al., SmoothQuant, 2023),
rounded to a power of two: scaling a float32 by ``2^k`` is exact, so the float
model computes bit for bit what it did before (the products ``(x_c / 2^k)(w_c 2^k)``
are the same numbers), and only the quantized ranges move.

Needs the calibration's per-channel maxima, and changes what the next calibration
sees: it drops :class:`CalibrationStats`, so ``calibrate`` must run again after
it (the ``npu`` pipeline: ``calibrate,smooth_activations,calibrate``). Produces
:class:`llmc.analyses.SmoothingPlan`.
"""

from __future__ import annotations

import hashlib
import logging

import numpy as np

from llmc.analyses import CalibrationStats, SmoothedInput, SmoothingPlan
from llmc.errors import PassError
from llmc.ir import Graph, Node, Value
from llmc.pass_manager import Pass, PassContext, PassResult

log = logging.getLogger(__name__)

MAX_EXPONENT = 16  # factors within 2^-16 .. 2^16
DEFAULT_ALPHA = 0.5  # SmoothQuant's default, for a --pipeline that names the pass without --smooth-alpha
NO_SHADOW_ALPHA = 0.8  # compile's default with --no-shadow (SmolLM2 measurements in docs/quantization.md)


def power_of_two_factors(act_max: np.ndarray, weight_max: np.ndarray, alpha: float) -> np.ndarray:
    """Exponents ``k_c`` with ``2^k_c`` nearest (in log) to ``act_max^alpha / weight_max^(1 - alpha)``;
    0 where either maximum is zero or not finite."""
    a = np.asarray(act_max, np.float64)
    w = np.asarray(weight_max, np.float64)
    ok = (a > 0) & (w > 0) & np.isfinite(a) & np.isfinite(w)
    k = np.zeros(a.shape, np.int32)
    with np.errstate(divide="ignore", invalid="ignore"):
        k[ok] = np.rint(alpha * np.log2(a[ok]) - (1.0 - alpha) * np.log2(w[ok])).astype(np.int32)
    return np.clip(k, -MAX_EXPONENT, MAX_EXPONENT)


class SmoothActivations(Pass):
    name = "smooth_activations"
    summary = "SmoothQuant with power-of-two factors folded into norms, value and up projections (float model unchanged)"
    requires = (CalibrationStats,)
    produces = (SmoothingPlan,)

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        alpha = ctx.options.smooth_alpha if ctx.options.smooth_alpha is not None else DEFAULT_ALPHA
        stats = ctx.get(CalibrationStats)
        store = graph.weights
        if any("v_scale" in n.weights for n in graph.find("Attention")):
            raise PassError("smooth_activations changes the cached values, whose int8 scales quantize_kv_cache has already set",
                            hint="put smooth_activations (and its calibrate) before quantize_kv_cache in --pipeline")
        smoothed: dict[str, SmoothedInput] = {}
        edits: list[tuple[Node, str, np.ndarray, str]] = []  # (node, weight, factor per row/col, "rows"|"cols"|"vector")
        for value in self._linear_inputs(graph):
            readers = [n for n, _ in value.uses]
            site = self._fold_site(value)
            if site is None:
                log.debug("smooth_activations: %s has no producer to fold into; left alone", value.name)
                continue
            st = stats.inputs.get(value.name)
            if st is None:
                continue
            wmax = np.zeros(value.shape[1], np.float64)
            for r in readers:
                wmax = np.maximum(wmax, np.abs(store.load(r.weights["weight"].name)).max(axis=0))
            amax = np.asarray(st.channel_absmax, np.float64)
            kind, producer = site
            if kind == "attention":
                attn = producer
                h, kv, d = attn.attrs["num_heads"], attn.attrs["num_kv_heads"], attn.attrs["head_dim"]
                group = h // kv
                # channel (head, j) reads kv head head // group: one factor per (kv head, j)
                a_g = amax.reshape(kv, group, d).max(axis=1)
                w_g = wmax.reshape(kv, group, d).max(axis=1)
                k_g = power_of_two_factors(a_g, w_g, alpha)
                k = np.repeat(k_g[:, None, :], group, axis=1).reshape(-1)
                v_proj = attn.inputs[2].producer
                edits.append((v_proj, "weight", k_g.reshape(-1), "rows"))
                if "bias" in v_proj.weights:
                    edits.append((v_proj, "bias", k_g.reshape(-1), "vector"))
            else:
                k = power_of_two_factors(amax, wmax, alpha)
                if kind == "norm":
                    edits.append((producer, "weight", k, "norm"))
                    if "bias" in producer.weights:
                        edits.append((producer, "bias", k, "vector"))
                else:  # "up": the gated product's Linear factor
                    edits.append((producer, "weight", k, "rows"))
                    if "bias" in producer.weights:
                        edits.append((producer, "bias", k, "vector"))
            if not k.any():
                continue
            for r in readers:
                edits.append((r, "weight", k, "cols"))
            spread_before = float(amax.max() / max(np.median(amax), 1e-30))
            after = amax * np.exp2(-k.astype(np.float64))
            smoothed[value.name] = SmoothedInput(value.name, kind, tuple(int(e) for e in k),
                                                 spread_before, float(after.max() / max(np.median(after), 1e-30)))
        for node, wname, k, how in edits:
            if not k.any():
                continue
            self._apply(graph, node, wname, k, how)
        ctx.discard(CalibrationStats)
        ctx.put(SmoothingPlan(alpha, smoothed))
        if not smoothed:
            log.warning("smooth_activations: no Linear input could be smoothed (none is fed by a norm, an attention or a gated product)")
        return PassResult(bool(smoothed))

    @staticmethod
    def _linear_inputs(graph: Graph) -> list[Value]:
        """Values read by Linears only (q/k/v's norm output, o_proj's and down_proj's inputs), in graph order."""
        seen, out = set(), []
        for n in graph.nodes:
            if n.op != "Linear":
                continue
            v = n.inputs[0]
            if v.name in seen:
                continue
            seen.add(v.name)
            if v.uses and all(u.op == "Linear" and i == 0 for u, i in v.uses):
                out.append(v)
        return out

    @staticmethod
    def _fold_site(value: Value) -> tuple[str, Node] | None:
        """Where ``value``'s per-channel division can go, or None."""
        p = value.producer
        if p is None:
            return None
        if p.op in ("RMSNorm", "LayerNorm"):
            return ("norm", p)
        if p.op == "Attention":
            v_in = p.inputs[2]
            vp = v_in.producer
            if vp is not None and vp.op == "Linear" and len(v_in.uses) == 1:
                return ("attention", p)
            return None
        if p.op == "Mul":
            for x in reversed(p.inputs):  # the gate goes through Act; the up projection does not
                q = x.producer
                if q is not None and q.op == "Linear" and len(x.uses) == 1 and p.inputs[0] is not p.inputs[1]:
                    return ("up", q)
        return None

    @staticmethod
    def _apply(graph: Graph, node: Node, wname: str, k: np.ndarray, how: str) -> None:
        """Replace ``node.weights[wname]`` by a derived weight scaled by ``2^k`` (input columns) or
        ``2^-k`` (output rows, norm weights, biases)."""
        store = graph.weights
        old = node.weights[wname]
        factor = np.exp2(k.astype(np.float64)).astype(np.float32)
        tag = hashlib.sha256(k.astype(np.int8).tobytes() + how.encode()).hexdigest()[:10]
        offset = float(node.attrs.get("offset", 0.0)) if how == "norm" else 0.0

        def load(old=old.name, factor=factor, how=how, offset=offset):
            w = np.asarray(store.load(old), np.float32)
            if how == "cols":
                return np.ascontiguousarray(w * factor[None, :])
            if how == "rows":
                return np.ascontiguousarray(w / factor[:, None])
            if how == "norm" and offset:
                return np.ascontiguousarray(((w + np.float32(offset)) / factor - np.float32(offset)).astype(np.float32))
            return np.ascontiguousarray(w / factor)

        node.weights[wname] = store.derived(f"{old.name}@smooth.{tag}", old.shape, old.dtype, load)
