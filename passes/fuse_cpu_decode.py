"""fuse_cpu_decode: one CPU graph between two attentions, for decode and CPU prefill.

The chunk program cuts at every shadow-outlier correction, because on the phone
the quantized subgraphs run on the NPU and the float outlier part on the CPU.
When decode runs on the CPU that cut only costs calls: a SmolLM2 token makes
122 graph calls and 121 corrections in Python. This pass cuts the model again
with ``ShadowOutliers`` treated as a static op, so the correction
(``y_i += (x - clip(x)) @ W_i^T`` over the channels that hold outliers, with the
channel set found in the graph) is lowered into the ONNX subgraph around it:
per layer, "o_proj + residual + norm + MLP + residual + next norm + next q/k/v",
one call, with attention between. The results are the same numbers the chunk
program computes; only where the correction runs changes.

Its graphs are instantiated at one row and at the chunk's rows. The runtime
uses this program for decode when the CPU runs it and the bundle has no decode
graph (``fuse_decode_graph``), and for prefill when the
CPU runs every prefill graph (the CPU provider; the corrections then run on all of ONNX Runtime's threads,
with no Python step between a correction and its matmuls: SmolLM2 prefill at
512 tokens 1.31x faster, same-process A/B); the QNN provider keeps the chunk
program, whose quantized graphs run on the HTP. Without shadow corrections
(``--no-shadow``) the cut is the chunk program's, and the pass still gives the
CPU its own instances at a symbolic row count: the chunk program's graphs, which
may run on the NPU, have fixed shapes, so a prompt's last chunk would be padded
to C rows (SmolLM2, a 128-token prompt: as slow as 256 tokens). Bundles
compiled with a memory budget stream weights per step of the chunk program, so
the pass does nothing for them; nor for the cpu target, whose chunk program is
the CPU's already, nor without shadow corrections at ``--chunk 1``.

Produces :class:`llmc.analyses.DecodePlan`; the IR is unchanged.
"""

from __future__ import annotations

import logging

from llmc.analyses import ChunkPlan, DecodePlan
from llmc.ir import Graph
from llmc.pass_manager import Pass, PassContext, PassResult
from llmc.passes.chunk_static_graphs import cut

log = logging.getLogger(__name__)


class FuseCpuDecode(Pass):
    name = "fuse_cpu_decode"
    summary = "the CPU's program (decode, and prefill on --provider cpu): shadow corrections inside the graphs, one graph call between attentions"
    requires = (ChunkPlan,)
    produces = ()  # DecodePlan, only for the npu target without a memory budget

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        chunk_plan = ctx.get(ChunkPlan)
        if not graph.find("ShadowOutliers") and (ctx.options.chunk == 1 or all(s.dynamic_rows for s in chunk_plan.subgraphs)):
            return PassResult(False)  # the chunk program is already the CPU's (the cpu target)
        if ctx.options.memory_budget:
            log.info("%s: skipped, a budgeted bundle streams weights per step of the chunk program", self.name)
            return PassResult(False)
        rows = (1, ctx.options.chunk) if ctx.options.chunk > 1 else (1,)
        subgraphs, steps = cut(graph, rows, lambda n: not n.schema.is_static and n.op != "ShadowOutliers", self.name, prefix="decode", head="decode_head",
                               dynamic=len(rows) > 1)  # the CPU's graphs: a last chunk runs at its own length
        before = len(chunk_plan.steps)
        log.info("%s: %d decode steps instead of %d (%d graphs)", self.name, len(steps), before, len(subgraphs))
        ctx.put(DecodePlan(subgraphs, steps))
        return PassResult(False)
