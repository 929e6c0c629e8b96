"""extract_shadow_outliers: choose per-tensor activation ranges and the shadow paths.

For every Linear input (q/k/v share one, as do gate/up):

* with shadow enabled, the uint8 range is clipped at the ``--clip-percentile``
  of ``|x|`` on the calibration text; the NPU computes on ``clip(x)`` and the
  CPU adds ``(x - clip(x)) @ W`` for the rare entries beyond the range;
* ``importance = absmax / clip`` (llm.npu: largest outlier over the scale).
  Inputs are ranked by importance and only the top ``--shadow-keep`` fraction
  keeps a shadow path; the others are *pruned*: their range goes back to the
  calibration maximum, so nothing seen in calibration is clipped and no CPU<->NPU
  synchronisation is needed for them;
* hot channels: float weight rows kept resident for the (input, channel) pairs
  with the most calibration outliers per resident byte, greedily, until the
  resident rows reach ``--hot-budget`` of the int8 weight bytes; other rows are
  read from the bundle (memory-mapped) when an outlier needs them.

With ``--no-shadow`` every range is the calibration maximum (plain W8A8).

Produces :class:`llmc.analyses.ShadowPlan`; the IR is unchanged.
"""

from __future__ import annotations

import numpy as np

from llmc.analyses import CalibrationStats, InputQuant, ShadowPlan
from llmc.ir import Graph
from llmc.pass_manager import Pass, PassContext, PassResult

ZERO_POINT = 128


class ExtractShadowOutliers(Pass):
    name = "extract_shadow_outliers"
    summary = "per-tensor int8 activation ranges from the clipped range; shadow kept/pruned by importance; hot channels"
    requires = (CalibrationStats,)
    produces = (ShadowPlan,)

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        opts = ctx.options
        stats = ctx.get(CalibrationStats)
        values = []
        row_bytes: dict[str, int] = {}  # float bytes of one input channel's rows over all Linears reading it
        int8_bytes = 0
        for n in graph.nodes:
            if n.op == "Linear":
                v = n.inputs[0].name
                if v not in values:
                    values.append(v)
                out_f, in_f = n.weights["weight"].shape
                row_bytes[v] = row_bytes.get(v, 0) + 4 * out_f
                int8_bytes += out_f * in_f
        importance = {}
        clips = {}
        for v in values:
            st = stats.inputs[v]
            clips[v] = max(st.percentile(opts.clip_percentile), 1e-8)
            importance[v] = st.absmax / clips[v]
        ranked = sorted(values, key=lambda v: (-importance[v], v))
        n_keep = int(round(opts.shadow_keep * len(values))) if opts.shadow else 0
        keep = set(ranked[:n_keep])
        clip_of = {}
        for v in values:
            st = stats.inputs[v]
            if v in keep:
                clip_of[v] = clips[v]
            elif opts.shadow and opts.pruned_percentile is not None:
                clip_of[v] = max(st.percentile(opts.pruned_percentile), 1e-8)
            else:
                clip_of[v] = max(st.absmax, 1e-8)
        hot = self._hot_channels(stats, [v for v in values if v in keep], clip_of, row_bytes, opts.hot_budget * int8_bytes)
        plan = {}
        for v in values:
            st = stats.inputs[v]
            shadow = v in keep
            clip = clip_of[v]
            plan[v] = InputQuant(
                value=v,
                clip=float(clip),
                scale=float(clip / 127.0),
                zero_point=ZERO_POINT,
                absmax=float(st.absmax),
                importance=float(importance[v]),
                outlier_rate=st.fraction_above(clips[v]),
                shadow=shadow,
                hot_channels=tuple(sorted(hot.get(v, ()))),
                channel_rates=tuple(float(c) for c in st.channel_counts_above(clip) / max(st.count // len(st.channel_absmax), 1)) if shadow else (),
            )
        ctx.put(ShadowPlan(plan, opts.clip_percentile, opts.shadow_keep if opts.shadow else 0.0, opts.shadow))
        return PassResult(False)

    @staticmethod
    def _hot_channels(stats, values, clip_of, row_bytes, budget: float) -> dict[str, list[int]]:
        """Greedy: (input, channel) pairs by calibration outliers per resident byte, within ``budget`` bytes."""
        cands = []
        for v in values:
            counts = stats.inputs[v].channel_counts_above(clip_of[v])
            for c in np.flatnonzero(counts):
                cands.append((-counts[c] / row_bytes[v], v, int(c)))
        cands.sort()
        hot: dict[str, list[int]] = {}
        used = 0
        for _, v, c in cands:
            if used + row_bytes[v] > budget:
                continue
            used += row_bytes[v]
            hot.setdefault(v, []).append(c)
        return hot
