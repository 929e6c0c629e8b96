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
every cache float32 when the decode graph's chunk instance could not attend over
the float16 layers (``fuse_decode_graph.why_not_chunks`` with native kernels: a
layer llmc's op does not take at a chunk's rows, such as more than 16 query
heads per KV head, a head size it does not take there, or partial rotary): the
prompt would then attend with the numpy kernel where a float32 cache keeps ONNX
Runtime's.
"""

from __future__ import annotations

import logging

from llmc.errors import CompileError
from llmc.ir import Graph
from llmc.pass_manager import Pass, PassContext, PassResult
from llmc.passes.fuse_decode_graph import why_not_chunks

log = logging.getLogger(__name__)

KV_DTYPE = "float16"


class Float16KVCache(Pass):
    name = "float16_kv_cache"
    summary = "float16 KV cache: every Attention's cache holds halves (no calibration; native decode attention)"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        attns = graph.find("Attention")
        for n in attns:
            if "k_scale" in n.weights:
                raise CompileError(f"{n.name} already has an int8 KV cache (quantize_kv_cache): a layer's cache has one type",
                                   hint="choose one of --kv-cache int8 and --kv-cache float16")
        before = {n.name: n.attrs.get("kv_dtype") for n in attns}
        for n in attns:
            n.attrs["kv_dtype"] = KV_DTYPE
        # under auto: the decode graph's chunk instance (fuse_decode_graph) must take every float16 layer with llmc's
        # native attention, which then also takes it at one row
        if ctx.options.kv_cache_auto and (why := why_not_chunks(graph, native=True)) is not None:
            for n in attns:
                if before[n.name] is None:
                    del n.attrs["kv_dtype"]
                else:
                    n.attrs["kv_dtype"] = before[n.name]
            log.info("--kv-cache auto: the KV cache stays float32 (%s)", why)
            return PassResult(False)
        return PassResult(any(v != KV_DTYPE for v in before.values()))
