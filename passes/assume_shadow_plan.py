"""assume_shadow_plan: a shadow plan without calibration, for planning from a config.

``llmc plan`` has no weights to calibrate on, but the quantized program's shape
(which Linears are W8A8 on the NPU, where shadow-outlier steps cut the chunk
graphs) must match what ``llmc compile --target npu`` produces. This pass
gives every Linear input the compile defaults' decision — a shadow path when
``--shadow`` is on, kept for the ``--shadow-keep`` fraction in program order —
with a nominal range and no per-channel outlier rates; the cost model then uses
llm.npu's published outlier density (0.3% of channels) for the shadow steps.
Never part of a compile pipeline: the ranges are placeholders.

Produces :class:`llmc.analyses.ShadowPlan`.
"""

from __future__ import annotations

from llmc.analyses import InputQuant, ShadowPlan
from llmc.ir import Graph
from llmc.pass_manager import Pass, PassContext, PassResult


class AssumeShadowPlan(Pass):
    name = "assume_shadow_plan"
    summary = "placeholder shadow plan (compile defaults, no calibration) so `llmc plan` sees the quantized program's shape"
    produces = (ShadowPlan,)

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        opts = ctx.options
        values: list[str] = []
        for n in graph.nodes:
            if n.op == "Linear" and n.inputs[0].name not in values:
                values.append(n.inputs[0].name)
        keep = int(round(opts.shadow_keep * len(values))) if opts.shadow else 0
        plan = {v: InputQuant(value=v, clip=1.0, scale=1.0 / 127.0, zero_point=128, absmax=1.0, importance=1.0, outlier_rate=0.0,
                              shadow=i < keep, hot_channels=()) for i, v in enumerate(values)}
        ctx.put(ShadowPlan(plan, opts.clip_percentile, opts.shadow_keep if opts.shadow else 0.0, opts.shadow))
        return PassResult(False)
