"""float16_kv_cache: a float16 KV cache (``--kv-cache float16``).

Every ``Attention`` node gets the attribute ``kv_dtype = "float16"``: the
runtime's cache for that layer then holds each key and value row as the nearest
IEEE half (ties to even), and attention reads them back as float32. The decode
graph's attention is llmc's native ``DecodeAttentionFloat16`` over float16
``past_key``/``past_value`` (so the pass needs ``--cpu-kernels native``; ONNX
Runtime's ``GroupQueryAttention`` takes a float16 cache only with float16
queries); a program step's attention runs the numpy kernel over the same cache.

Half the float32 cache's bytes are read per decoded token and held for the whole
context, with no calibration: a half keeps 11 significant bits, and SmolLM2's
keys and values stay far inside its range. It is llama.cpp's default cache type.
An ``Attention`` node with an int8 cache (``quantize_kv_cache``'s scales) is an
error: a layer's cache has one type.

Run for ``--kv-cache auto`` (``CompileOptions.kv_cache_auto``), the pass leaves
every cache float32 when a layer's attention is not one that llmc's native op
takes both at one row and at a chunk's rows (more than 16 query heads per KV
head, a head size it does not take at chunk rows, partial rotary): the decode
graph, or its chunk instance, would then not run it, and the prompt would attend
with the numpy kernel where a float32 cache keeps ONNX Runtime's.
"""

from __future__ import annotations

import logging

from llmc.errors import CompileError
from llmc.ir import Graph
from llmc.pass_manager import Pass, PassContext, PassResult
from llmc.runtime.native import attention_takes
from llmc.runtime.ort_attention import node_rotates

log = logging.getLogger(__name__)

KV_DTYPE = "float16"


def not_in_graphs(graph: Graph) -> str | None:
    """Why llmc's native attention would not read some layer's float16 cache in the decode graph at one row and at a
    chunk's rows, or None."""
    for n in graph.find("Attention"):
        a = n.attrs
        if not (attention_takes(a["num_heads"], a["num_kv_heads"], a["head_dim"], rows=1)
                and attention_takes(a["num_heads"], a["num_kv_heads"], a["head_dim"], rows=2)):
            return f"{n.name} has {a['num_heads']} heads over {a['num_kv_heads']} of size {a['head_dim']}, which llmc's attention op does not take at every row count"
        if not node_rotates(a["rotary_dim"], a["head_dim"]):
            return f"{n.name} rotates {a['rotary_dim']} of {a['head_dim']} dims, so its prompt attends outside the decode graph"
    return None


class Float16KVCache(Pass):
    name = "float16_kv_cache"
    summary = "float16 KV cache: every Attention's cache holds halves (no calibration; native decode attention)"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        if ctx.options.kv_cache_auto and (why := not_in_graphs(graph)) is not None:
            log.info("--kv-cache auto: the KV cache stays float32 (%s)", why)
            return PassResult(False)
        changed = False
        for n in graph.find("Attention"):
            if "k_scale" in n.weights:
                raise CompileError(f"{n.name} already has an int8 KV cache (quantize_kv_cache): a layer's cache has one type",
                                   hint="choose one of --kv-cache int8 and --kv-cache float16")
            if n.attrs.get("kv_dtype") != KV_DTYPE:
                n.attrs["kv_dtype"] = KV_DTYPE
                changed = True
        return PassResult(changed)
