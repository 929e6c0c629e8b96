"""quantize_embedding: the token embedding read from int8 codes, one scale per token.

Rewrites every ``Embedding`` (a float table ``[vocab, hidden]``, read by row) into::

    y = QEmbedding(ids)   # (codes[id] - zero point) * row_scale[id] * scale

When the table is the LM head's too (tied embeddings) and ``quantize`` made the
head a ``QLinear`` with one int8 scale per output channel, a channel is a token:
the embedding then gathers the head's own codes (``[hidden, vocab]``, a column
per token, ``transposed``) and scales, and adds no bytes. Otherwise it gets its
own codes ``[vocab, hidden]`` (symmetric int8 by row, a row per token, which a
memory-budgeted bundle reads by row). A float32 table costs 4 bytes a weight:
for SmolLM2-135M 113 MB of a 188 MB npu bundle. Its effect on quality is within
the noise of the W8A8 path's (docs/quantization.md has the measurements).

Run it after ``quantize`` (and ``fuse_sibling_linears``), before
``chunk_static_graphs``.
"""

from __future__ import annotations

import logging

import numpy as np

from llmc.ir import Graph
from llmc.pass_manager import Pass, PassContext, PassResult
from llmc.passes.quantize import W_ZERO_POINT, quantize_weight

log = logging.getLogger(__name__)


class QuantizeEmbedding(Pass):
    name = "quantize_embedding"
    summary = "the token embedding from int8 codes with a scale per token (a tied LM head's own codes)"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        store = graph.weights
        heads = {n.weights["qweight"].name: n for n in graph.find("QLinear")}
        changed = False
        for emb in list(graph.find("Embedding")):
            table = emb.weights["table"]
            vocab, hidden = table.shape
            head = heads.get(f"{table.name}.q8")
            if (head is not None and head.weights["qweight"].dtype == "int8" and head.weights["qweight"].shape == (hidden, vocab)
                    and head.weights["wscale"].shape == (vocab,)):
                weights, transposed = {"codes": head.weights["qweight"], "row_scale": head.weights["wscale"]}, True
            else:
                cache: dict[str, tuple[np.ndarray, np.ndarray]] = {}

                def rows(pop: bool, name=table.name, cache=cache):
                    # one quantization serves the codes and the scales; codes [vocab, hidden]: the transpose of
                    # quantize_weight's [in, out] layout for a [vocab, hidden] "weight" of one channel per token
                    if name not in cache:
                        q, s = quantize_weight(store.load(name), per_channel=True)
                        cache[name] = (np.ascontiguousarray(q.T), s)
                    return cache.pop(name) if pop else cache[name]

                codes = store.derived(f"{table.name}.q8r", (vocab, hidden), "int8", lambda rows=rows: rows(False)[0])
                scale = store.derived(f"{table.name}.row_scale", (vocab,), "float32", lambda rows=rows: rows(True)[1])
                weights, transposed = {"codes": codes, "row_scale": scale}, False
            q = graph.add_node("QEmbedding", [emb.inputs[0]], attrs={"scale": emb.attrs["scale"], "transposed": transposed, "zero_point": W_ZERO_POINT},
                               weights=weights, name=f"{emb.name}.q", before=emb)
            graph.replace_all_uses(emb.outputs[0], q.outputs[0])
            graph.remove_node(emb)
            log.info("%s: %s from %s", self.name, emb.name, "the LM head's codes" if transposed else "its own int8 codes")
            changed = True
        return PassResult(changed)
