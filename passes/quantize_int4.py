"""quantize_int4: weight-only int4 Linears for the CPU (``--target cpu --weights int4``).

Rewrites every ``Linear`` whose input width is a multiple of the block size
(32, the block of llama.cpp's Q4 formats)::

    y = Linear(x)            ->   y = BlockQLinear(x)

``BlockQLinear`` keeps activations in float32 and stores each output channel's
weights in blocks of 32 along the input: b-bit codes ``q``, a float32 scale
``s`` and a float32 offset ``o`` per block, so a weight is
``s * (q - 2^(b-1)) + o``. The block's minimum and maximum map to the first
and last code (``s = (max - min) / (2^b - 1)``): for b = 4 llama.cpp's Q4_1
grid, so a GGUF stored as Q4_1 (the bundled SmolLM2's layers) is re-quantized
onto the very codes it was dequantized from, up to float rounding of ``s`` and
``o``. Every Linear gets b = 4 except the LM head, b = 8 with symmetric codes
and no offset (``s = max|w| / 127``, ``w = s * (q - 128)``): llama.cpp's Q8_0,
in which SmolLM2 stores it (tied to the embedding), so it too comes back onto
its own codes. Measured on SmolLM2, held-out English, float32 perplexity
11.84: this format 11.88 (with the head at 8 bits min/max like the layers,
11.89); a 4-bit head 12.56; an integer zero point (``s * (q - z)``, which must
put 0 in every block's range) 14.55 (docs/quantization.md).

The matmul splits accordingly (``xs_b`` = the sum of x over block b)::

    y = x @ (s * (q - 2^(b-1)))^T + xs @ O        # O: the offsets, [K/32, N]

The first term is ONNX Runtime's ``MatMulNBits`` with its default zero point
(the ONNX backend's lowering); the second is a float matmul 1/32 the size
(none for the head, whose ``BlockQLinear`` has no ``offsets``).
Storage: ``qweight [N, K/32, 32 b / 8]`` uint8 (at 4 bits two codes per byte,
the lower input index in the low nibble); ``scales [N * K/32]`` float32;
``offsets [K/32, N]`` float32. SmolLM2-135M's Linears then read 112 MB per
decoded token instead of 538 MB of float32.

A Linear whose input width is not a multiple of 32 stays float32 (with a warning).
An embedding tied to the LM head gathers its rows from the head's 8-bit codes
(``BlockEmbedding``), so no float copy of the table is in the bundle (SmolLM2:
113 MB less). An untied embedding stays float32.

The pass refuses targets other than ``cpu`` and ``--memory-budget``
(:func:`check_options`).
"""

from __future__ import annotations

import logging

import numpy as np

from llmc.errors import CompileError
from llmc.ir import Graph
from llmc.pass_manager import Pass, PassContext, PassResult
from llmc.runtime.kernels import pack_nibbles

log = logging.getLogger(__name__)

BLOCK = 32
BITS = 4
HEAD_BITS = 8  # the LM head (and a tied embedding's table): llama.cpp's mixes keep it at 6-8 bits too
# ... with symmetric codes and no offsets: llama.cpp's Q8_0, which a GGUF's 8-bit head (SmolLM2's) is
# re-quantized onto exactly; the head's offsets' term was 3.5 MB of float32 read per SmolLM2 token
HEAD_SYMMETRIC = True
_ROWS_PER_STEP = 1024  # output channels quantized at once: temporaries stay a few MB for any width


def quantize_blocks(w: np.ndarray, bits: int = 4, block: int = BLOCK, symmetric: bool = False
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``w [N, K]`` float -> (codes ``[N, K/block, block * bits / 8]`` uint8, scales
    ``[N * K/block]`` float32, offsets ``[K/block, N]`` float32); a weight is
    ``scale * (code - 2^(bits-1)) + offset``. With ``symmetric`` the block's largest
    magnitude maps to code 2^b - 1 or 1 (``scale = max|w| / (2^(b-1) - 1)``, llama.cpp's
    Q8_0 at 8 bits) and there are no offsets (None)."""
    if bits not in (4, 8):
        raise ValueError(f"{bits}-bit codes are not supported (4 or 8)")
    w = np.asarray(w)
    n, k = w.shape
    if k % block:
        raise ValueError(f"input width {k} is not a multiple of the block size {block}")
    nb = k // block
    top, mid = (1 << bits) - 1, 1 << (bits - 1)
    codes = np.empty((n, nb, block * bits // 8), np.uint8)
    scales = np.empty((n, nb), np.float32)
    offsets = None if symmetric else np.empty((nb, n), np.float32)
    for i in range(0, n, _ROWS_PER_STEP):
        b = np.asarray(w[i : i + _ROWS_PER_STEP], np.float32).reshape(-1, nb, block)
        if symmetric:
            s = np.abs(b).max(axis=2) / np.float32(mid - 1)
            q = b / np.where(s == 0, np.float32(1), s)[..., None]
            np.rint(q, out=q)
            np.clip(q, 1 - mid, mid - 1, out=q)
            q8 = (q + mid).astype(np.uint8)
            codes[i : i + len(q8)] = pack_nibbles(q8) if bits == 4 else q8
            scales[i : i + len(q8)] = s
            continue
        lo = b.min(axis=2)
        s = (b.max(axis=2) - lo) / np.float32(top)
        # A constant block: scale 0, every code 0, the offset holds the value. (A nonzero scale
        # there would make MatMulNBits' int8-activation rounding of (q - 2^(bits-1)) x show up
        # uncancelled by the offset's exact term: an all-zero vocabulary row scored up to 18.)
        q = b - lo[..., None]
        q /= np.where(s == 0, np.float32(1), s)[..., None]
        np.rint(q, out=q)
        np.clip(q, 0, top, out=q)
        q8 = q.astype(np.uint8)
        codes[i : i + len(q8)] = pack_nibbles(q8) if bits == 4 else q8
        scales[i : i + len(q8)] = s
        offsets[:, i : i + len(q8)] = (lo + mid * s).T
    return codes, scales.reshape(-1), offsets


_PASS_THROUGH = ("Scale", "Act", "Slice", "SelectRows")  # weightless one-input ops between the head and the logits


def logits_linear(graph: Graph):
    """The Linear that produces the logits (the LM head), following weightless one-input ops
    (a logit scale, a soft-cap's activation) back from the graph's output; None if there is none."""
    v = graph.outputs[0]
    while v.producer is not None:
        node = v.producer
        if node.op == "Linear":
            return node
        if node.op not in _PASS_THROUGH or len(node.inputs) != 1:
            return None
        v = node.inputs[0]
    return None


WEIGHT_FORMATS = ("float32", "int4")  # --weights of compile and plan


def check_weight_format(weight_format: str, target: str, pass_names) -> None:
    """``--weights`` against the target and the pipeline's passes, for compile and plan alike."""
    if weight_format not in WEIGHT_FORMATS:
        raise CompileError(f"unknown weight format {weight_format!r}", hint="choose one of: " + ", ".join(WEIGHT_FORMATS))
    if weight_format != "float32" and target != "cpu":
        raise CompileError(f"--weights {weight_format} applies to --target cpu; it does not apply to --target {target}",
                           hint="drop --weights (the npu target quantizes to W8A8 itself; mlir lowers the float32 graphs), or use --target cpu")
    if weight_format == "int4" and "quantize_int4" not in pass_names:
        raise CompileError("--weights int4 with a pipeline that has no quantize_int4 pass would make the float32 program",
                           hint="add quantize_int4 to the pipeline (after select_logit_rows), or drop --weights int4")


def check_options(options) -> None:
    """int4 bundles are for the CPU target, without a memory budget: a streamed MatMulNBits weight
    is a graph input, which ONNX Runtime does not prepack; it then dequantizes the whole matrix
    into a float32 buffer on every call (measured 20-80x slower, and for SmolLM2's head a 113 MB
    buffer per token), which defeats the budget."""
    if options.target != "cpu":
        raise CompileError(f"quantize_int4 makes CPU-only weight-only int4 graphs; it does not apply to --target {options.target}",
                           hint="use --target cpu --weights int4, or drop quantize_int4 from --pipeline")
    if options.memory_budget is not None:
        raise CompileError("--weights int4 cannot be combined with --memory-budget in this version: ONNX Runtime dequantizes "
                           "streamed int4 weights to float32 on every call",
                           hint="drop --memory-budget (an int4 bundle is already under a quarter of float32's size), "
                                "or use --target npu with --memory-budget")


class QuantizeInt4(Pass):
    name = "quantize_int4"
    summary = "weight-only int4 Linears (blocks of 32 with a float scale and offset, llama.cpp's Q4_1 grid; float activations) for the CPU"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        check_options(ctx.options)
        store = graph.weights
        changed = False
        kept = []
        head = logits_linear(graph)
        head_codes = None  # (float weight name, its BlockQLinear weights)
        for node in list(graph.nodes):
            if node.op != "Linear":
                continue
            wref = node.weights["weight"]
            out_f, in_f = wref.shape
            if in_f % BLOCK:
                kept.append(node.name)
                continue
            nb = in_f // BLOCK
            bits, symmetric = (HEAD_BITS, HEAD_SYMMETRIC) if node is head else (BITS, False)
            specs = [(f"{wref.name}.q{bits}b", (out_f, nb, BLOCK * bits // 8), "uint8"), (f"{wref.name}.q{bits}b.scale", (out_f * nb,), "float32")]
            if not symmetric:
                specs.append((f"{wref.name}.q{bits}b.offset", (nb, out_f), "float32"))
            # one quantization serves the codes, the scales and the offsets
            refs = store.derived_together(specs, lambda name=wref.name, bits=bits, symmetric=symmetric:
                                          quantize_blocks(store.load(name), bits, symmetric=symmetric))
            weights = dict(zip(("qweight", "scales", "offsets"), refs))
            if "bias" in node.weights:
                weights["bias"] = node.weights["bias"]
            if node is head:
                head_codes = (wref.name, {k: v for k, v in weights.items() if k != "bias"})
            q = graph.add_node("BlockQLinear", [node.inputs[0]], attrs={"block_size": BLOCK, "bits": bits}, weights=weights, name=f"{node.name}.q{bits}b", before=node)
            graph.replace_all_uses(node.outputs[0], q.outputs[0])
            graph.remove_node(node)
            changed = True
        if head_codes is not None:
            for emb in graph.find("Embedding"):
                if emb.weights["table"].name == head_codes[0]:  # tied: gather from the head's codes
                    be = graph.add_node("BlockEmbedding", [emb.inputs[0]], attrs={"scale": emb.attrs["scale"], "bits": HEAD_BITS, "block_size": BLOCK},
                                        weights=dict(head_codes[1]), name=f"{emb.name}.q", before=emb)
                    graph.replace_all_uses(emb.outputs[0], be.outputs[0])
                    graph.remove_node(emb)
        if kept:
            more = f" and {len(kept) - 5} more" if len(kept) > 5 else ""
            log.warning("quantize_int4: %d Linear(s) stay float32, their input width is not a multiple of %d: %s%s", len(kept), BLOCK, ", ".join(kept[:5]), more)
        return PassResult(changed)
