"""Hand-made offload plans for tests and experiments (the compiler's own comes from ``plan_offload``).

``hand_offload(select)`` is a pass class that, after ``chunk_static_graphs``,
puts an :class:`~llmc.analyses.OffloadPlan` streaming the graph weights for
which ``select(name)`` is true, reading the embedding and shadow ``codes``
tables by row and keeping everything else resident.
"""

from __future__ import annotations

from typing import Callable

from llmc.analyses import ChunkPlan, OffloadPlan
from llmc.pass_manager import Pass, PassResult
from llmc.runtime.residency import buffer_size


def plan_for(graph, chunk_plan: ChunkPlan, select: Callable[[str], bool], depth: int = 2, extra_buffer: int = 0) -> OffloadPlan:
    subs = {s.name: s for s in chunk_plan.subgraphs}
    graph_w: list[str] = []
    step_w: list[list[str]] = []
    op_w: dict[str, str] = {}
    for st in chunk_plan.steps:
        if st.kind == "graph":
            names = list(subs[st.name].weights)
            graph_w += [n for n in names if n not in graph_w]
            step_w.append([n for n in names if select(n)])
        else:
            node = graph.node(st.name)
            for slot, ref in node.weights.items():
                op_w[ref.name] = f"{node.op}.{slot}"
    size = {n: graph.weights[n].nbytes for n in set(graph_w) | set(op_w)}
    streamed = [n for n in graph_w if select(n)]
    # a table a graph also reads (tied embedding, LM head) is read by row when the graph streams it, else it is resident anyway
    rows = [n for n, k in op_w.items() if k in ("Embedding.table", "QEmbedding.codes", "ShadowOutliers.codes") and (n not in graph_w or n in streamed)]
    resident = [n for n in graph_w + list(op_w) if n not in streamed and n not in rows]
    resident = list(dict.fromkeys(resident))
    per_step = sorted((sum(buffer_size(size[n]) for n in ws) for ws in step_w), reverse=True)
    buffer = sum(per_step[: depth + 1]) + extra_buffer
    per_step_bytes = sum(size[n] for n in streamed)
    return OffloadPlan(
        budget_bytes=sum(size[n] for n in resident), weight_bytes=sum(size.values()), resident=tuple(resident), streamed=tuple(streamed),
        row_streamed=tuple(rows), resident_bytes=sum(size[n] for n in resident), streamed_bytes=per_step_bytes, buffer_bytes=buffer,
        prefetch_depth=depth, predicted_decode_s=0.0, predicted_decode_no_prefetch_s=0.0,
    )


def hand_offload(select: Callable[[str], bool], depth: int = 2, extra_buffer: int = 0) -> type[Pass]:
    class HandOffload(Pass):
        name = "hand_offload"
        summary = "test-only: an OffloadPlan streaming the selected graph weights"
        requires = (ChunkPlan,)
        produces = (OffloadPlan,)

        def run(self, graph, ctx):
            ctx.put(plan_for(graph, ctx.get(ChunkPlan), select, depth, extra_buffer))
            return PassResult(False)

    return HandOffload
