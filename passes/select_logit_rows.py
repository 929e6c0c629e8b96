"""select_logit_rows: compute logits only for the rows that need them.

Rewrites::

    h -> FinalNorm -> LMHead -> logits
  into
    h -> SelectRows -> FinalNorm -> LMHead -> logits

The head is the chain of row-wise static nodes that ends at the logits output
and has a single activation input. At run time SelectRows picks the last valid
row of a prefill chunk (or every row when scoring text), so the vocabulary-sized
matmul runs on one row instead of C.
"""

from __future__ import annotations

from llmc.errors import PassError
from llmc.ir import Graph
from llmc.pass_manager import Pass, PassContext, PassResult


class SelectLogitRows(Pass):
    name = "select_logit_rows"
    summary = "run the final norm and LM head only on the rows that need logits"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        if graph.find("SelectRows"):
            return PassResult(False)
        if len(graph.outputs) != 1:
            raise PassError(f"{self.name}: expected one output (logits), found {len(graph.outputs)}")
        v = graph.outputs[0]
        head = []
        while v.producer is not None and v.producer.schema.is_static and len(v.producer.inputs) == 1:
            head.append(v.producer)
            v = v.producer.inputs[0]
            if len(v.uses) != 1:
                break
        if not head:
            raise PassError(f"{self.name}: the logits are not produced by a row-wise head (found {graph.outputs[0].producer})")
        first = head[-1]
        sel = graph.add_node("SelectRows", [v], attrs={"rows": 1}, name="select_logit_rows", before=first)
        graph.set_input(first, 0, sel.outputs[0])
        # Shapes downstream of the selection now have 1 row: rebuild the head's outputs.
        for node in reversed(head):
            want = node.schema.infer(node)
            for out, (shape, dtype) in zip(node.outputs, want):
                out.shape, out.dtype = shape, dtype
        return PassResult(True)
