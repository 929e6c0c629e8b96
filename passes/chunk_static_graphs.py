"""chunk_static_graphs: cut the model into static subgraphs shared by every chunk.

Dynamic ops (attention with its KV cache, the embedding gather, rotary tables,
row selection) are cut points; they run on the CPU per chunk. The static,
row-wise ops between two cut points form one subgraph of shape
``[C, features]`` that every prefill chunk reuses, and the same subgraph is also
instantiated at ``[1, features]`` for decode and for the LM head on the last
token. Both instances read one copy of the weights.

Grouping rule: a static node's *stage* is the number of dynamic ops on the
longest path from the graph inputs to it. Static nodes with equal stage form a
subgraph. For a decoder this gives, per layer, "o_proj + residual + norm + MLP +
residual + next norm + next q/k/v" — the llm.npu cut — with attention between.

Produces :class:`llmc.analyses.ChunkPlan` (subgraphs and the per-chunk step
order); the IR itself is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

from llmc.analyses import ChunkPlan, Step, Subgraph
from llmc.errors import CompileError
from llmc.ir import Graph, Node
from llmc.pass_manager import Pass, PassContext, PassResult


class ChunkStaticGraphs(Pass):
    name = "chunk_static_graphs"
    summary = "cut into static [C, hidden] subgraphs shared by all chunks, plus [1, hidden] decode instances"
    produces = (ChunkPlan,)

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        opts = ctx.options
        if opts.chunk < 1 or opts.chunk > opts.max_context:
            raise CompileError(f"chunk length {opts.chunk} must be between 1 and max-context {opts.max_context}")
        rows = tuple(sorted({opts.chunk, 1}, reverse=True))
        # a CPU bundle's graphs take a last chunk at its own length (no NPU needs their shapes fixed)
        subgraphs, steps = cut(graph, rows, lambda n: not n.schema.is_static, self.name, dynamic=opts.target == "cpu" and opts.chunk > 1)
        ctx.put(ChunkPlan(opts.chunk, opts.max_context, subgraphs, steps))
        return PassResult(False)


def cut(graph: Graph, rows: tuple[int, ...], is_cut: Callable[[Node], bool], who: str,
        prefix: str = "block", head: str = "head", dynamic: bool = False) -> tuple[tuple[Subgraph, ...], tuple[Step, ...]]:
    """Group the nodes that are not cut points by stage (see the module docstring) into
    subgraphs instantiated at ``rows`` (the largest with a symbolic row count if ``dynamic``:
    :class:`~llmc.analyses.Subgraph`); return them and the dependency-ordered steps.

    Subgraphs are named ``{prefix}NN`` in program order, the one after SelectRows ``head``.
    """
    import networkx as nx

    order = {n.name: i for i, n in enumerate(graph.nodes)}
    stage: dict[str, int] = {}
    for n in graph.nodes:
        s = 0
        for v in n.inputs:
            p = v.producer
            if p is not None:
                s = max(s, stage[p.name] + (1 if is_cut(p) else 0))
        stage[n.name] = s

    groups: dict[int, list[Node]] = {}
    unit_of: dict[str, str] = {}
    for n in graph.nodes:
        if not is_cut(n):
            groups.setdefault(stage[n.name], []).append(n)
    # Name the groups in program order; the group after SelectRows is the head.
    after_select = {stage[s.name] + 1 for s in graph.find("SelectRows")}
    names: dict[int, str] = {}
    block = 0
    for st in sorted(groups):
        if st in after_select:
            names[st] = head
        else:
            names[st] = f"{prefix}{block:02d}"
            block += 1
        for n in groups[st]:
            unit_of[n.name] = names[st]
    for n in graph.nodes:
        if is_cut(n):
            unit_of[n.name] = n.name

    outputs = {v.name for v in graph.outputs}
    subgraphs = []
    for st in sorted(groups):
        members = groups[st]
        member_names = {n.name for n in members}
        ins: list[str] = []
        outs: list[str] = []
        weights: list[str] = []
        for n in members:
            for v in n.inputs:
                if (v.producer is None or v.producer.name not in member_names) and v.name not in ins:
                    ins.append(v.name)
            for v in n.outputs:
                if v.name in outputs or any(u.name not in member_names for u, _ in v.uses):
                    outs.append(v.name)
            for ref in n.weights.values():
                if ref.name not in weights:
                    weights.append(ref.name)
        subgraphs.append(Subgraph(names[st], tuple(n.name for n in members), tuple(ins), tuple(outs), tuple(weights), rows, dynamic))

    # Order the units (subgraphs and cut-point ops) by their dependencies.
    dag = nx.DiGraph()
    first: dict[str, int] = {}
    for n in graph.nodes:
        u = unit_of[n.name]
        dag.add_node(u)
        first[u] = min(first.get(u, order[n.name]), order[n.name])
        for v in n.inputs:
            if v.producer is not None and unit_of[v.producer.name] != u:
                dag.add_edge(unit_of[v.producer.name], u)
    if not nx.is_directed_acyclic_graph(dag):
        cycle = nx.find_cycle(dag)
        raise CompileError(f"{who}: the cut produced a cycle between {cycle}; a static op depends on a later dynamic op")
    by_name = {s.name: s for s in subgraphs}
    steps = []
    for u in nx.lexicographical_topological_sort(dag, key=lambda u: first[u]):
        if u in by_name:
            s = by_name[u]
            steps.append(Step("graph", u, s.inputs, s.outputs))
        else:
            node = graph.node(u)
            steps.append(Step("op", u, tuple(v.name for v in node.inputs), tuple(v.name for v in node.outputs)))
    return tuple(subgraphs), tuple(steps)
