"""The LLM-level operators of llmc's IR.

Two kinds of op exist:

* ``static`` ops are row-wise functions of ``[rows, features]`` tensors (Linear,
  norms, activations, element-wise arithmetic). Their result for a row depends
  only on that row, so a subgraph of static ops traced at ``rows = C`` works at
  any row count: it is what the chunk pass turns into shared static graphs.
* ``dynamic`` ops depend on more than their own row or on runtime state
  (attention with its KV cache, the embedding gather, rotary tables for the
  current positions, row selection for logits). They run in the runtime on the
  CPU and are where the chunk pass cuts.

The registry is the explicit :data:`OPS` table below; nothing registers itself
at import time.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # pragma: no cover
    from llmc.ir import Node, Value

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class OpDef:
    name: str
    kind: str  # "static" | "dynamic"
    n_inputs: tuple[int, int]  # (min, max)
    attrs: tuple[str, ...]  # required attributes
    weights: tuple[str, ...]  # required weight slots
    optional_weights: tuple[str, ...]
    summary: str
    _infer: Callable[["Node"], list[tuple[Shape, str]]]

    def infer(self, node: "Node") -> list[tuple[Shape, str]]:
        return self._infer(node)

    def check(self, node: "Node") -> str | None:
        """Return a reason the node is malformed, or None."""
        lo, hi = self.n_inputs
        if not lo <= len(node.inputs) <= hi:
            return f"expects {lo}..{hi} inputs, has {len(node.inputs)}"
        missing = [a for a in self.attrs if a not in node.attrs]
        if missing:
            return f"missing attributes {missing}"
        missing_w = [w for w in self.weights if w not in node.weights]
        if missing_w:
            return f"missing weights {missing_w}"
        extra_w = set(node.weights) - set(self.weights) - set(self.optional_weights)
        if extra_w:
            return f"unexpected weights {sorted(extra_w)}"
        try:
            want = self._infer(node)
        except Exception as e:  # a malformed node makes inference fail
            return f"shape inference failed: {e}"
        got = [(v.shape, v.dtype) for v in node.outputs]
        if want != got:
            return f"outputs {got} do not match inferred {want}"
        return None

    @property
    def is_static(self) -> bool:
        return self.kind == "static"


def _rows(node: "Node") -> int:
    return node.inputs[0].shape[0]


def _same(node: "Node"):
    return [(node.inputs[0].shape, node.inputs[0].dtype)]


def _binary(node: "Node"):
    a, b = node.inputs
    if a.shape != b.shape:
        raise ValueError(f"operand shapes differ: {a.shape} vs {b.shape}")
    return [(a.shape, a.dtype)]


def _norm(node: "Node"):
    (x,) = node.inputs
    if node.weights["weight"].shape != (x.shape[-1],):
        raise ValueError(f"norm weight {node.weights['weight'].shape} does not match features {x.shape[-1]}")
    return [(x.shape, x.dtype)]


def _linear(node: "Node"):
    (x,) = node.inputs
    out_f, in_f = node.weights["weight"].shape
    if x.shape[-1] != in_f:
        raise ValueError(f"input has {x.shape[-1]} features, weight expects {in_f}")
    if "bias" in node.weights and node.weights["bias"].shape != (out_f,):
        raise ValueError("bias shape does not match weight")
    return [((_rows(node), out_f), "float32")]


def _qlinear(node: "Node"):
    (x,) = node.inputs
    in_f, out_f = node.weights["qweight"].shape
    if x.shape[-1] != in_f:
        raise ValueError(f"input has {x.shape[-1]} features, weight expects {in_f}")
    if node.weights["wscale"].shape not in ((out_f,), (1,)):
        raise ValueError("weight scale must be per output channel or per tensor")
    form = (node.weights["qweight"].dtype, node.attrs.get("w_zero_point"))
    if form not in (("int8", 0), ("uint8", 128)):
        raise ValueError(f"quantized weights must be int8 with w_zero_point 0, or uint8 with 128 (the same values); got {form}")
    return [((_rows(node), out_f), "float32")]


def _block_codes(node: "Node") -> tuple[int, int, int]:
    """Check the block-quantized weights of ``node`` (codes ``[N, blocks, block * bits / 8]``, scales
    ``[N * blocks]``, offsets ``[blocks, N]``); return (N, blocks, block)."""
    n, nb, width = node.weights["qweight"].shape
    block, bits = node.attrs["block_size"], node.attrs["bits"]
    if bits not in (4, 8) or width * 8 != block * bits:
        raise ValueError(f"{width} bytes per block do not hold {block} {bits}-bit codes (bits must be 4 or 8)")
    if node.weights["scales"].shape != (n * nb,) or ("offsets" in node.weights and node.weights["offsets"].shape != (nb, n)):
        raise ValueError("scales must be [N * blocks] and offsets [blocks, N]")
    if "zero_points" in node.weights and (bits != 4 or node.weights["zero_points"].shape != (n, -(-nb // 2))):
        raise ValueError("zero points are 4-bit, two blocks a byte: [N, ceil(blocks / 2)]")
    return n, nb, block


def folded_blocks(in_features: int, block: int, digits: int) -> int:
    """Blocks per output channel of a ``BlockQLinear`` of ``in_features`` inputs whose offsets are
    folded into its codes as ``digits`` digits (``llmc.passes.fold_block_offsets``): the input's
    blocks, then per digit the block sums' blocks (``ceil(blocks / block)``)."""
    nb = in_features // block
    return nb + digits * -(-nb // block)


def _blockqlinear(node: "Node"):
    (x,) = node.inputs
    out_f, nb, block = _block_codes(node)
    digits = node.attrs.get("offset_digits", 0)
    if digits and ("offsets" in node.weights or node.attrs["bits"] != 4 or "zero_points" not in node.weights):
        raise ValueError("folded offsets (offset_digits) are 4-bit codes with zero points and replace the offsets weight")
    k = x.shape[-1]
    if k % block or folded_blocks(k, block, digits) != nb:
        folded = f" ({digits} offset digits)" if digits else ""
        raise ValueError(f"input has {k} features, the weight's {nb} blocks of {block}{folded} do not match it")
    if "bias" in node.weights and node.weights["bias"].shape != (out_f,):
        raise ValueError("bias shape does not match weight")
    return [((_rows(node), out_f), "float32")]


def _shadow(node: "Node"):
    x, ys = node.inputs[0], node.inputs[1:]
    in_f, total = node.weights["codes"].shape
    if x.shape[-1] != in_f:
        raise ValueError(f"input has {x.shape[-1]} features, weight expects {in_f}")
    if node.weights["codes"].dtype != CODE_DTYPES.get(node.attrs["w_zero_point"]) or node.weights["scale"].shape != (total,):
        raise ValueError("codes must be int8 (w_zero_point 0) or uint8 (128) [in, N], with one scale per column [N]")
    splits = list(node.attrs["splits"])
    if len(splits) != len(ys) or sum(splits) != total:
        raise ValueError(f"splits {splits} do not cover the {total} output columns of {len(ys)} results")
    hot = node.attrs["hot_channels"]
    if node.weights["hot_delta"].shape != (max(len(hot), 1), total):
        raise ValueError("hot_delta must hold one float row per hot channel")
    for y, w in zip(ys, splits):
        if y.shape != (x.shape[0], w):
            raise ValueError(f"the NPU result {y.shape} does not match its shadow columns {(x.shape[0], w)}")
    return [((_rows(node), w), "float32") for w in splits]


def _slice(node: "Node"):
    (x,) = node.inputs
    s, e = node.attrs["start"], node.attrs["end"]
    if not 0 <= s < e <= x.shape[-1]:
        raise ValueError(f"slice [{s}:{e}] out of range for {x.shape[-1]} features")
    return [((x.shape[0], e - s), x.dtype)]


def _embedding(node: "Node"):
    (ids,) = node.inputs
    return [((ids.shape[0], node.weights["table"].shape[1]), "float32")]


CODE_DTYPES = {0: "int8", 128: "uint8"}  # int8 codes' type by zero point (uint8 + 128: a memory-budgeted bundle's)


def _qembedding(node: "Node"):
    (ids,) = node.inputs
    codes, scale = node.weights["codes"], node.weights["row_scale"]
    vocab, hidden = codes.shape[::-1] if node.attrs["transposed"] else codes.shape
    if scale.shape != (vocab,):
        raise ValueError(f"row_scale must hold one scale per token [{vocab}], not {list(scale.shape)}")
    if codes.dtype != CODE_DTYPES.get(node.attrs["zero_point"]):
        raise ValueError("codes must be int8 (zero_point 0) or uint8 (128)")
    return [((ids.shape[0], hidden), "float32")]


def _block_embedding(node: "Node"):
    (ids,) = node.inputs
    _, nb, block = _block_codes(node)
    return [((ids.shape[0], nb * block), "float32")]


def _rotary(node: "Node"):
    (pos,) = node.inputs
    dim = 2 * node.weights["inv_freq"].shape[0]
    return [((pos.shape[0], dim), "float32"), ((pos.shape[0], dim), "float32")]


def _attention(node: "Node"):
    q, k, v = node.inputs[:3]
    a = node.attrs
    h, kv, d = a["num_heads"], a["num_kv_heads"], a["head_dim"]
    if q.shape[-1] != h * d or k.shape[-1] != kv * d or v.shape[-1] != kv * d:
        raise ValueError(f"q/k/v widths {q.shape[-1]}/{k.shape[-1]}/{v.shape[-1]} do not fit {h} heads, {kv} kv heads of {d}")
    if h % kv:
        raise ValueError(f"{h} heads is not a multiple of {kv} kv heads")
    scales = [node.weights[w] for w in ("k_scale", "v_scale") if w in node.weights]
    if scales and (len(scales) != 2 or any(w.shape != (kv, d) for w in scales)):
        raise ValueError(f"an int8 KV cache needs k_scale and v_scale of shape ({kv}, {d}), has {[w.shape for w in scales]}")
    if a.get("kv_dtype", "float32") not in ("float32", "float16") or (scales and a.get("kv_dtype", "float32") != "float32"):
        raise ValueError(f"kv_dtype {a.get('kv_dtype')!r}: a cache is float32, float16 (kv_dtype) or int8 (k_scale/v_scale, no kv_dtype)")
    return [((q.shape[0], h * d), "float32")]


KV_CACHE_ITEMSIZE = {"float32": 4, "float16": 2, "int8": 1}  # bytes per cached K or V element


def kv_cache_dtype(attrs: "dict", weights: "dict") -> str:
    """The element type of an ``Attention``'s cache, from a node's (or a bundle's program step's) attributes and
    weights: ``int8`` with ``k_scale``/``v_scale`` (``quantize_kv_cache``), else its ``kv_dtype`` (``float16`` from
    ``float16_kv_cache``), else ``float32``."""
    return "int8" if "k_scale" in weights else attrs.get("kv_dtype", "float32")


def kv_cache_itemsize(attention: "Node") -> int:
    """Bytes per cached K or V element of an ``Attention`` node (:data:`KV_CACHE_ITEMSIZE` of :func:`kv_cache_dtype`)."""
    return KV_CACHE_ITEMSIZE[kv_cache_dtype(attention.attrs, attention.weights)]


def sliced_whole(shadow: "Node") -> "Value | None":
    """The projection whose consecutive column slices, all of it, are the results ``shadow`` (a
    ``ShadowOutliers``) corrects, each slice read by it alone; or None."""
    slices = [v.producer for v in shadow.inputs[1:]]
    if len(slices) < 2 or any(p is None or p.op != "Slice" or len(p.outputs[0].uses) != 1 for p in slices):
        return None
    src = slices[0].inputs[0]
    ends = list(itertools.accumulate(shadow.attrs["splits"]))
    if any(p.inputs[0] is not src for p in slices) or ends[-1] != src.shape[-1]:
        return None
    if [(p.attrs["start"], p.attrs["end"]) for p in slices] != list(zip([0, *ends[:-1]], ends)):
        return None
    return src


def _select_rows(node: "Node"):
    (x,) = node.inputs
    return [((node.attrs["rows"], x.shape[1]), x.dtype)]


ACTIVATIONS = ("silu", "gelu", "gelu_tanh")

OPS: dict[str, OpDef] = {
    d.name: d
    for d in [
        OpDef("Embedding", "dynamic", (1, 1), ("scale",), ("table",), (), "gather token embeddings (CPU, from the shared table) times a constant", _embedding),
        OpDef("QEmbedding", "dynamic", (1, 1), ("scale", "transposed", "zero_point"), ("codes", "row_scale"), (),
              "gather token rows of int8 codes times a scale per token (a tied LM head's QLinear codes, a column per token, when transposed)", _qembedding),
        OpDef("BlockEmbedding", "dynamic", (1, 1), ("scale", "bits", "block_size"), ("qweight", "scales"), ("offsets",),
              "gather token rows of block-quantized weights (a tied LM head's BlockQLinear codes), dequantized, times a constant", _block_embedding),
        OpDef("RotaryTable", "dynamic", (1, 1), ("scaling",), ("inv_freq",), (), "cos/sin rotary tables for the chunk's positions", _rotary),
        OpDef(
            "Attention",
            "dynamic",
            (3, 5),
            ("layer", "num_heads", "num_kv_heads", "head_dim", "scale", "rotary_dim", "sliding_window"),
            (),
            ("k_scale", "v_scale"),
            "causal GQA attention with rotary embedding over the KV cache (CPU, per chunk); int8 cache with k_scale/v_scale, float16 with kv_dtype",
            _attention,
        ),
        OpDef("SelectRows", "dynamic", (1, 1), ("rows",), (), (), "pick the rows that need logits (last token, or all for scoring)", _select_rows),
        OpDef(
            "ShadowOutliers",
            "dynamic",
            (2, 16),
            ("lo", "hi", "hot_channels", "splits", "w_zero_point"),
            ("codes", "scale", "hot_delta"),
            (),
            "y_i + (x - clip(x, lo, hi)) @ W_i^T for every Linear reading x, W from the int8 codes (hot channels exact): the outlier part, on the CPU",
            _shadow,
        ),
        OpDef("Linear", "static", (1, 1), (), ("weight",), ("bias",), "x @ W^T (+ b)", _linear),
        OpDef(
            "QLinear",
            "static",
            (1, 1),
            ("x_scale", "x_zero_point", "w_zero_point"),
            ("qweight", "wscale"),
            ("bias",),
            "W8A8: dequant(quant_u8(x)) @ dequant(W_int8) (+ b); activations per tensor, weights symmetric",
            _qlinear,
        ),
        OpDef(
            "BlockQLinear",
            "static",
            (1, 1),
            ("block_size", "bits"),
            ("qweight", "scales"),
            ("offsets", "zero_points", "bias"),
            "weight-only 4/8-bit: x @ (s * (q - z) + o)^T (+ b), a scale, (optional) an offset and (optional, 4-bit) a zero point z"
            " per block of inputs (z = 2^(bits-1) without); float activations; with offset_digits D (fold_block_offsets) the"
            " offsets are zero points and extra blocks of the codes, read by D copies of x's block sums",
            _blockqlinear,
        ),
        OpDef("RMSNorm", "static", (1, 1), ("eps", "offset"), ("weight",), (), "x * rsqrt(mean(x^2) + eps) * (offset + w)", _norm),
        OpDef("LayerNorm", "static", (1, 1), ("eps",), ("weight",), ("bias",), "(x - mean) / sqrt(var + eps) * w + b", _norm),
        OpDef("Act", "static", (1, 1), ("kind",), (), (), "element-wise activation: " + ", ".join(ACTIVATIONS), _same),
        OpDef("Add", "static", (2, 2), (), (), (), "a + b (residual add)", _binary),
        OpDef("Mul", "static", (2, 2), (), (), (), "a * b (gated MLP product)", _binary),
        OpDef("Scale", "static", (1, 1), ("value",), (), (), "x * constant", _same),
        OpDef("Slice", "static", (1, 1), ("start", "end"), (), (), "x[:, start:end] (split of a fused projection)", _slice),
    ]
}


def get(name: str) -> OpDef:
    return OPS[name]
