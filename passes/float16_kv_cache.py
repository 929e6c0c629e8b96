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
"""

from __future__ import annotations

from llmc.errors import CompileError
from llmc.ir import Graph
from llmc.pass_manager import Pass, PassContext, PassResult

KV_DTYPE = "float16"


class Float16KVCache(Pass):
    name = "float16_kv_cache"
    summary = "float16 KV cache: every Attention's cache holds halves (no calibration; native decode attention)"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        changed = False
        for n in graph.find("Attention"):
            if "k_scale" in n.weights:
                raise CompileError(f"{n.name} already has an int8 KV cache (quantize_kv_cache): a layer's cache has one type",
                                   hint="choose one of --kv-cache int8 and --kv-cache float16")
            if n.attrs.get("kv_dtype") != KV_DTYPE:
                n.attrs["kv_dtype"] = KV_DTYPE
                changed = True
        return PassResult(changed)
