"""fuse_decode_graph: decode on the CPU as one graph call per token.

The CPU's decode program (``fuse_cpu_decode``, or the chunk program's one-row
instances) still alternates graphs and attention: a SmolLM2 token makes 31 graph
calls and 30 attention calls, and each call costs ONNX Runtime's per-run work
and a Python step. This pass lowers the model after its embedding into one
one-row graph:

- each ``Attention`` as ONNX Runtime's ``GroupQueryAttention`` over that layer's
  KV cache, which the runtime binds as both past and present input/output, so
  the node appends the token's K/V row in place;
- rotary embedding from cos/sin tables of every position up to
  ``--max-context`` that the backend computes from the ``RotaryTable`` (the
  graph then needs no positions: a token's position is the cache length);
- ``SelectRows`` of the one row as the identity;
- shadow corrections as ``fuse_cpu_decode`` lowers them.

The embedding gather stays outside, as in the other programs: the runtime
gathers the token's row from the memory-mapped table and feeds it (in the graph,
ONNX Runtime would read the whole float table, 113 MB for SmolLM2's W8A8 bundle).

The attention node rotates q and k itself when the rotation covers the whole
head and the head size is a multiple of 16 (its CPU kernel's rule); otherwise
(partial rotary, as Phi-2; other head sizes) ONNX ``RotaryEmbedding`` rotates
them at the token's position first. A sliding window is the node's
``local_window_size``.

With ``--chunk`` above 1 the graph also gets an instance at any row count up to
C (``Subgraph.dynamic_rows``): prefill as one call per chunk, the nodes appending
the chunk's K/V rows and attending over the positions before them, ``SelectRows``
a ``Gather`` of the rows that need logits (a graph input). On SmolLM2 that beats
the per-layer calls of the CPU program by 21-25% at 512 tokens (W8A8). Layers the
node cannot take a chunk for keep the other programs' prefill (``why_not_chunks``); with
``--cpu-kernels native`` llmc's attention op also takes a chunk over an int8 cache
and in a sliding window.

It applies when every dynamic op has such a lowering and the attention layers
take their rotation from one rotary table fed by the positions. Otherwise, or
under a memory budget (weights stream per step of the chunk
program), it logs why and leaves the decode program as it is. The bundle keeps
the other programs: prefill's chunks, the QNN provider and older runtimes use
them. (Without the chunk instance the runtime also feeds a prompt's last token,
and a short tail after its last whole chunk, through this graph.)

Produces :class:`llmc.analyses.DecodeGraph`; the IR is unchanged.
"""

from __future__ import annotations

import logging

from llmc.analyses import DecodeGraph, Subgraph
from llmc.ir import Graph
from llmc.pass_manager import Pass, PassContext, PassResult
from llmc.runtime.ort_attention import GQA_HEAD_MULTIPLE, node_rotates
from llmc.runtime.native import attention_takes

log = logging.getLogger(__name__)

EMBEDDINGS = ("Embedding", "QEmbedding", "BlockEmbedding")  # run by the runtime before the graph
LOWERED_DYNAMIC_OPS = ("RotaryTable", "Attention", "SelectRows", "ShadowOutliers")


def why_not(graph: Graph, native: bool = False) -> str | None:
    """Why ``graph`` cannot be one decode graph, or None if it can. A float16 KV cache (``float16_kv_cache``)
    needs llmc's native attention (``native``: --cpu-kernels native) to take every node at one row."""
    for n in graph.nodes:
        if n.op in EMBEDDINGS:
            if n.inputs[0] is not graph.inputs[0]:
                return f"embedding {n.name} does not read the token ids"
        elif not n.schema.is_static and n.op not in LOWERED_DYNAMIC_OPS:
            return f"op {n.op} (node {n.name}) has no one-graph lowering"
    tables = graph.find("RotaryTable")
    attns = graph.find("Attention")
    if not attns:
        return "the model has no attention"
    if len(tables) != 1:
        return f"the model has {len(tables)} rotary tables; one is supported"
    table = tables[0]
    if table.inputs[0].producer is not None:
        return f"rotary table {table.name} does not read the positions input"
    if any(u.name != table.name for u, _ in table.inputs[0].uses):
        return f"the positions {table.inputs[0].name} are read by more than the rotary table"
    for v in table.outputs:
        if any(u.op != "Attention" for u, _ in v.uses):
            return f"rotary table {table.name} is read by an op other than attention"
    for n in attns:
        if len(n.inputs) != 5 or [v.name for v in n.inputs[3:]] != [v.name for v in table.outputs]:
            return f"{n.name} does not take its rotation from {table.name}"
        if n.attrs["head_dim"] % GQA_HEAD_MULTIPLE:
            return f"{n.name} has heads of {n.attrs['head_dim']}, and ONNX Runtime's GroupQueryAttention needs a multiple of {GQA_HEAD_MULTIPLE}"
        a = n.attrs
        if a.get("kv_dtype") == "float16" and not (native and attention_takes(a["num_heads"], a["num_kv_heads"], a["head_dim"], rows=1)):
            return f"{n.name} has a float16 KV cache, which only llmc's native attention takes in a graph"
    return None


def why_not_chunks(graph: Graph, native: bool = False) -> str | None:
    """Why the decode graph cannot also take a chunk of rows (prefill as one call per chunk), or None.

    Its chunk instance needs attention nodes that rotate q and k themselves (the graph then needs no
    positions), over a float32 cache (ONNX Runtime's int8-cache kernel is several times slower for a
    chunk than attending over a dequantized copy, as the runtime does), without a sliding window. With
    llmc's native kernels (``native``: --cpu-kernels native), nodes that its attention op takes at chunk
    rows may have an int8 cache or a window: the op attends over the int8 codes and in the window itself."""
    for n in graph.find("Attention"):
        a = n.attrs
        if not node_rotates(a["rotary_dim"], a["head_dim"]):
            return f"{n.name} rotates {a['rotary_dim']} of {a['head_dim']} dims"
        if native and attention_takes(a["num_heads"], a["num_kv_heads"], a["head_dim"], rows=2):
            continue
        if "k_scale" in n.weights:
            return f"{n.name} has an int8 KV cache"
        if a.get("kv_dtype") == "float16":
            return f"{n.name} has a float16 KV cache"
        if a["sliding_window"]:
            return f"{n.name} attends in a sliding window"
    return None


class FuseDecodeGraph(Pass):
    name = "fuse_decode_graph"
    summary = "decode on the CPU as one graph per token: the model after its embedding, attention over the KV cache included"
    requires = ()
    produces = ()  # DecodeGraph, when the model allows it and there is no memory budget

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        if ctx.options.memory_budget:
            log.info("%s: skipped, a budgeted bundle streams weights per step of the chunk program", self.name)
            return PassResult(False)
        reason = why_not(graph, ctx.options.cpu_kernels == "native")
        if reason is not None:
            log.info("%s: skipped, %s; decode keeps one call per graph and per attention", self.name, reason)
            return PassResult(False)
        table = graph.find("RotaryTable")[0]
        members = [n for n in graph.nodes if n.name != table.name and n.op not in EMBEDDINGS]
        weights: list[str] = []
        for n in members:
            weights += [r.name for r in n.weights.values() if r.name not in weights]
        inputs = tuple(dict.fromkeys(v.name for n in graph.nodes if n.op in EMBEDDINGS for v in n.outputs))
        chunk = ctx.options.chunk
        why_no_chunk = why_not_chunks(graph, ctx.options.cpu_kernels == "native") if chunk > 1 else "the chunk is one row"
        rows = (1,) if why_no_chunk else (1, chunk)
        sub = Subgraph("decode_model", tuple(n.name for n in members), inputs, tuple(v.name for v in graph.outputs), tuple(weights), rows,
                       dynamic_rows=len(rows) > 1)
        layers = tuple((n.attrs["layer"], n.attrs["num_kv_heads"], n.attrs["head_dim"]) for n in graph.find("Attention"))
        log.info("%s: one decode graph of %d nodes over %d KV caches", self.name, len(members), len(layers))
        if why_no_chunk:
            log.info("%s: no chunk instance, %s; the CPU prefills through its program", self.name, why_no_chunk)
        ctx.put(DecodeGraph(sub, table.name, ctx.options.max_context, layers))
        return PassResult(False)
