"""place: choose the NPU or the CPU for every program step, per phase.

For each static subgraph and phase (prefill: ``C`` rows over a context of
``prompt_len``; decode: 1 row), the cost model predicts its time on each
processor; running it on the NPU also pays two CPU<->NPU hand-offs (``sync_s``),
because the steps around a subgraph are dynamic CPU ops (attention, shadow
outliers). The subgraph goes to the NPU when that is faster. Dynamic ops always
run on the CPU. A profile without an NPU (``host``) places everything on the CPU.
``--placement npu`` (or ``cpu``) overrides the choice for every static subgraph
(the costs are still recorded): to run a small model's graphs on the HTP anyway,
or to keep a bundle off it.

Produces :class:`llmc.analyses.Placement` (with every step's predicted costs);
the IR is unchanged.
"""

from __future__ import annotations

import logging

from llmc.analyses import ChunkPlan, DecodeGraph, DecodePlan, Placement, ShadowPlan, StepCost
from llmc.cost_model import CostModel
from llmc.device_profile import load as load_profile
from llmc.errors import CompileError
from llmc.ir import Graph
from llmc.pass_manager import Pass, PassContext, PassResult

log = logging.getLogger(__name__)


def cost_model(graph: Graph, ctx: PassContext) -> CostModel:
    """The cost model of ``graph`` under the compile's device profile."""
    return CostModel(graph, ctx.get(ChunkPlan), load_profile(ctx.options.profile),
                     ctx.get(ShadowPlan) if ctx.has(ShadowPlan) else None, quantized=ctx.options.target == "npu",
                     decode_plan=ctx.get(DecodePlan) if ctx.has(DecodePlan) else None,
                     decode_graph=ctx.get(DecodeGraph) if ctx.has(DecodeGraph) else None, weight_bits=ctx.options.weight_bits)


def prompt_len(ctx: PassContext) -> int:
    return min(ctx.options.prompt_len or ctx.options.max_context, ctx.options.max_context)


class Place(Pass):
    name = "place"
    summary = "NPU or CPU per subgraph and phase, by the cost model over the device profile"
    requires = (ChunkPlan,)
    produces = (Placement,)

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        cm = cost_model(graph, ctx)
        plan = cm.plan
        c = plan.chunk
        keys = prompt_len(ctx)
        sync = cm.profile.get("sync_s", 0.0) if cm.profile.has_npu else 0.0
        procs = ("npu", "cpu") if cm.profile.has_npu else ("cpu",)
        forced = ctx.options.placement
        if forced not in ("auto", "npu", "cpu"):
            raise CompileError(f"--placement {forced!r}: choose auto, npu or cpu")
        prefill, decode, costs = {}, {}, {}
        for step in plan.steps:
            rows = 1 if step.name == "head" else c
            pre = {p: cm.step_seconds(step, rows, rows, keys, p) for p in procs if cm.can_run(step, p)}
            dec = {p: cm.step_seconds(step, 1, 1, keys, p) for p in procs if cm.can_run(step, p)}
            costs[step.name] = StepCost(step.name, pre, dec)
            if forced != "auto" and step.kind == "graph":
                where = forced
                if forced == "npu" and cm.profile.has_npu and not cm.can_run(step, "npu"):  # a CPU-only op (BlockQLinear)
                    log.warning("--placement npu: %s stays on the CPU (it has ops with no NPU lowering)", step.name)
                    where = "cpu"
                prefill[step.name] = decode[step.name] = where
            else:
                prefill[step.name] = _cheapest(pre, sync)
                decode[step.name] = _cheapest(dec, sync)
        on_npu = sum(1 for s in plan.steps if prefill[s.name] == "npu")
        log.info("place (%s): %d of %d steps on the NPU for prefill, %d for decode", cm.profile.name, on_npu, len(plan.steps),
                 sum(1 for s in plan.steps if decode[s.name] == "npu"))
        ctx.put(Placement(cm.profile.name, prefill, decode, costs, sync))
        return PassResult(False)


def _cheapest(costs: dict[str, float], sync: float) -> str:
    if "npu" in costs and costs["npu"] + 2 * sync < costs["cpu"]:
        return "npu"
    return "cpu"
