"""dce: remove nodes whose results nothing uses.

Rewrites: any node with no used output (and not a graph output) is deleted,
repeatedly, walking from the end so chains disappear in one pass.
"""

from __future__ import annotations

from llmc.ir import Graph
from llmc.pass_manager import Pass, PassContext, PassResult


class DeadCodeElimination(Pass):
    name = "dce"
    summary = "remove nodes whose results are never used"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        outputs = set(map(id, graph.outputs))
        changed = False
        for node in reversed(graph.nodes):
            if all(not v.uses and id(v) not in outputs for v in node.outputs):
                graph.remove_node(node)
                changed = True
        return PassResult(changed)
