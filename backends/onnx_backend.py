"""ONNX backend: one static ONNX model per subgraph instance, weights stored once.

For every :class:`~llmc.analyses.Subgraph` of the :class:`~llmc.analyses.ChunkPlan`
this writes ``graphs/<name>.r<rows>.onnx`` for each row count (C for prefill, 1
for decode / last-token logits). All weights live once in ``weights/weights.bin``
(64-byte aligned); every graph declares them as ONNX external-data initializers
with ``location = "weights/weights.bin"`` relative to the *bundle root*, and the
runtime binds them by name from one shared memory map. (ONNX Runtime refuses
external data outside a model's own folder, so the graphs are loaded through the
runtime, not by path.) Under a memory budget every weight of a graph is a graph
input instead, fed by the runtime for each run — the plan's *streamed* weights
from its streaming buffers, the resident ones from memory — because ONNX Runtime
keeps a copy of each initializer per session (``docs/memory-budget.md``).

Op lowering (opset 23):

==============  ==========================================================
IR op           ONNX
==============  ==========================================================
Linear          Gemm(x, W, b, transB=1) — W stays [out, in], shared with a tied embedding
RMSNorm         RMSNormalization(x, offset + w, axis=-1); with llmc's native ops, where
                a W8A8 projection reads it, ai.llmc.RMSNorm, which writes the
                projection's uint8 codes too (SwiGLU likewise), and a block's last
                correction adds the residual stream (no Add)
LayerNorm       LayerNormalization(x, w, b, axis=-1)
Act             Sigmoid·x (silu), Gelu(approximate=none|tanh)
QLinear         QuantizeLinear, DequantizeLinear (x: uint8; W: int8, zero point 0),
                MatMul, + bias as Add (ONNX Runtime fuses the pattern into
                MatMulIntegerToFloat; see llmc.runtime.cpu for the int8 weights
                and for the MatMulAddFusion its sessions turn off); with llmc's
                native ops a one-row instance without bias is ai.llmc.W8A8MatMul(x,
                W, w_scale[, weight table][, residual][, norm]; x_scale,
                x_zero_point[, lo, hi][, epsilon][, pack]): the quantization and the QDQ
                MatMul, bit for bit, with the shadow correction of its result, the
                residual Add after it and the RMS norm before it (where only such
                ops read the norm) in the same op; the decode graph's have pack=1
                (the op may keep a copy of its weights in its own layout)
BlockQLinear    MatMulNBits (com.microsoft, bits 4 or 8, default zero point) for the
                codes, then (when the weights have offsets) Gemm(block sums of x,
                offsets, C = that result) (+ bias as Add); with the offsets folded into
                zero points and the codes (offset_digits D, fold_block_offsets) one
                MatMulNBits over Concat(x, D copies of the block sums and zeros to
                whole blocks: a constant, or a Pad at a symbolic row count); the
                block sums (Reshape, ReduceSum) once per input and graph; one-row instances with accuracy_level=4 (int8 activations
                per block: 2-4x faster at one row here), 4-bit chunk instances
                with accuracy_level=0 (float32 compute: 1.2x faster than int8 at
                256 rows here); 8-bit always 4 (ONNX Runtime 1.32 has no packed
                float32 kernel for 8 bits: it would dequantize the whole matrix
                per call); with llmc's native ops a one-row 4-bit instance without
                float offsets is ai.llmc.BlockQMatMul(x, codes, scales[, zero
                points][, residual][, norm]; K, N, block_size 32, digits D[,
                epsilon]): MatMulNBits' int8 numerics, the input widened in the
                kernel (no Reshape, ReduceSum, Concat); a block's last projection
                adds the residual stream (no Add) and its first ones apply the RMS
                norm that only they read (no RMSNormalization)
ShadowOutliers  Clip, Sub; a chunk in equal blocks of about 64 rows (Reshape; the
                block count looked up by the row count when it is symbolic):
                Abs, ReduceSum over each block's rows, TopK of its outlier
                channels, GatherElements, Gather of their weight rows, batched
                MatMul; one row: Compress, MatMul; then Split, Add
Add / Mul       Add / Mul
Scale           Mul by a scalar constant
Slice           Slice on axis 1
==============  ==========================================================
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from llmc import __version__
from llmc.analyses import ChunkPlan, DecodeGraph, DecodePlan, Subgraph
from llmc.errors import CompileError, UnsupportedModelError
from llmc.ir import Graph, Node, Value, WeightRef
from llmc.ops import sliced_whole
from llmc.runtime.kernels import shadow_blocks
from llmc.runtime.native import DOMAIN as NATIVE_DOMAIN  # llmc's native CPU kernels (ShadowCorrection, DecodeAttention)
from llmc.runtime.native import attention_takes
from llmc.runtime.ort_attention import node_rotates

log = logging.getLogger(__name__)

OPSET = 23
MS_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib ops (MatMulNBits)
BLOCK_Q_MATMUL = 32  # the inputs per block of llmc's native BlockQMatMul (4-bit codes, one-row graphs)
WEIGHTS_FILE = "weights/weights.bin"
DECODE_SEQLENS, DECODE_TOTAL = "seqlens_k", "total_len"  # the decode graph's cache-length inputs
DECODE_LOGIT_ROWS = "logit_rows"  # its chunk instance's rows that need logits (int64 [k])
ALIGN = 64

_NP_TO_ONNX = {"float32": 1, "uint8": 2, "int8": 3, "uint16": 4, "int16": 5, "int32": 6, "int64": 7, "float16": 10}


def write_weights(graph: Graph, names: Iterable[str], root: Path) -> dict[str, dict[str, Any]]:
    """Write the named weights once, in order, into ``weights/weights.bin``; return the table."""
    table: dict[str, dict[str, Any]] = {}
    path = root / WEIGHTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    offset = 0
    with open(path, "wb") as f:
        for name in names:
            if name in table:
                continue
            ref = graph.weights[name]
            arr = np.ascontiguousarray(graph.weights.load(name), dtype=np.dtype(ref.dtype))
            if tuple(arr.shape) != ref.shape:
                raise UnsupportedModelError(f"weight {name} loads with shape {arr.shape}, the IR says {ref.shape}")
            pad = (-offset) % ALIGN
            f.write(b"\0" * pad)
            offset += pad
            f.write(arr.data if arr.size else b"")  # the array's own buffer: no copy of a large weight
            table[name] = {"file": WEIGHTS_FILE, "offset": offset, "nbytes": arr.nbytes, "dtype": ref.dtype, "shape": list(ref.shape)}
            offset += arr.nbytes
    return table


class _Builder:
    # whether the native projections may keep their weights in a layout of their own too (W8A8MatMul's pack): the
    # decode graph's (_DecodeBuilder), whose session stays loaded and decodes every token; not the CPU program's
    # one-row graphs (bundles without a decode graph, and budgeted ones, whose weights stream)
    pack_weights = False

    def __init__(self, graph: Graph, sub: Subgraph, rows: int, weights: dict[str, dict[str, Any]], streamed: frozenset[str] = frozenset(),
                 native: bool = False) -> None:
        from onnx import helper

        self.helper = helper
        self.native = native  # llmc's native ops (--cpu-kernels native): shadow corrections, attention, SwiGLU, RMSNorm, BlockQMatMul
        # a W8A8 program (the npu target's): its native attention may multiply in bfloat16 (bf16=1), a rounding well
        # under the 8-bit one its output gets as o_proj's input; the float32 programs' attention stays float32
        self.bf16_attention = native and any(n.op == "QLinear" for n in graph.nodes)
        self.bf16_nodes = 0  # the attention nodes given bf16=1
        self.graph = graph
        self.sub = sub
        self.rows = rows
        # the largest instance of a dynamic_rows subgraph takes any row count up to ``rows``
        self.dynamic = sub.dynamic_rows and rows > 1 and rows == max(sub.row_counts)
        self.weights = weights
        self.streamed = streamed
        self.nodes: list[Any] = []
        self.consts: list[Any] = []
        self.used_weights: list[str] = []
        self.made_once: set[str] = set()  # values made once per graph (block sums, the decode position)
        self.norm_weights: dict[str, str] = {}  # RMSNorms done inside the native projections that read them: their weight
        self.scalar_weights: set[str] = set()  # one-element weights used as per-tensor quantization scales
        self.packed_weights: list[str] = []  # the weights of the W8A8MatMul ops given pack=1
        self.extra_inputs: list[Any] = []  # graph inputs and outputs beyond the subgraph's values (the decode graph's caches)
        self.extra_outputs: list[Any] = []
        self.values = {}
        self.members = set(sub.nodes)
        self.order = {name: i for i, name in enumerate(sub.nodes)}
        for n in (graph.node(x) for x in sub.nodes):
            for v in list(n.inputs) + list(n.outputs):
                self.values[v.name] = v

    def weight(self, ref: WeightRef) -> str:
        if ref.name not in self.used_weights:
            self.used_weights.append(ref.name)
        return ref.name

    def const(self, name: str, values: np.ndarray) -> str:
        from onnx import numpy_helper

        self.consts.append(numpy_helper.from_array(values, name))
        return name

    def unsigned_codes(self, name: str, codes: str) -> str:
        """int8 codes fed at run time as uint8 + 128, computed in the graph on every call.

        ONNX Runtime turns constant int8 weights into uint8 where its u8 x s8 kernels
        saturate (CPUs without VNNI, :mod:`llmc.runtime.cpu`), but not graph inputs; on
        uint8 they run on the u8 x u8 kernels, exact on every CPU. Memory-budgeted bundles
        store their W8A8 weights as uint8 already (``quantize``), so this serves only
        offload plans made without a budget (hand-made ones, in tests and research)."""
        from onnx import TensorProto

        c = self.const(f"{name}.w_offset", np.array(128, np.int16))
        self.add("Cast", [codes], [f"{name}.w16"], f"{name}.w16", to=TensorProto.INT16)
        self.add("Add", [f"{name}.w16", c], [f"{name}.w16u"], f"{name}.w16u")
        self.add("Cast", [f"{name}.w16u"], [f"{name}.wu8"], f"{name}.wu8", to=TensorProto.UINT8)
        return f"{name}.wu8"

    def add(self, op: str, inputs: list[str], outputs: list[str], name: str, **attrs: Any) -> None:
        self.nodes.append(self.helper.make_node(op, inputs, outputs, name=name, **attrs))

    def lower(self, n: Node) -> None:
        x = [v.name for v in n.inputs]
        y = [v.name for v in n.outputs]
        a = n.attrs
        if n.op == "Linear":
            ins = x + [self.weight(n.weights["weight"])]
            if "bias" in n.weights:
                ins.append(self.weight(n.weights["bias"]))
            self.add("Gemm", ins, y, n.name, transB=1)
        elif n.op == "QLinear" and self.w8a8_matmul(n):
            if self.shadow_of(n) is None:  # else its correction's lowering makes the one op (see shadow_outliers)
                self.native_projection(n, None, y[0])
        elif n.op == "QLinear":
            sc = self.const(f"{n.name}.x_scale", np.array(a["x_scale"], np.float32))
            zp = self.const(f"{n.name}.x_zero_point", np.array(a["x_zero_point"], np.uint8))
            xq = self.codes_of(n.inputs[0])  # the native op that made x wrote its codes too
            if xq is None:
                xq = f"{n.name}.xq"
                self.add("QuantizeLinear", x + [sc, zp], [xq], f"{n.name}.quant")
            self.add("DequantizeLinear", [xq, sc, zp], [f"{n.name}.xdq"], f"{n.name}.dequant")
            wq, ws = self.weight(n.weights["qweight"]), self.weight(n.weights["wscale"])
            out_f = n.weights["qweight"].shape[1]
            per_channel = n.weights["wscale"].shape != (1,)
            wtype, wz = n.weights["qweight"].dtype, a["w_zero_point"]
            if wtype == "int8" and wq in self.streamed:
                wq, wtype, wz = self.unsigned_codes(n.name, wq), "uint8", 128
            wzp = self.const(f"{n.name}.w_zero_point", np.full(out_f if per_channel else (), wz, wtype))
            attrs = {"axis": 1} if per_channel else {}
            if not per_channel:
                self.scalar_weights.add(ws)
            self.add("DequantizeLinear", [wq, ws, wzp], [f"{n.name}.w"], f"{n.name}.wdequant", **attrs)
            out = y if "bias" not in n.weights else [f"{n.name}.mm"]
            self.add("MatMul", [f"{n.name}.xdq", f"{n.name}.w"], out, n.name)
            if "bias" in n.weights:
                self.add("Add", [out[0], self.weight(n.weights["bias"])], y, f"{n.name}.bias")
        elif n.op == "BlockQLinear":
            # y = MatMulNBits(x; codes, scales; zero point 2^(bits-1)) + blocksum(x) @ offsets, or with the
            # offsets folded into the codes (fold_block_offsets) MatMulNBits([x, block sums, ...]; codes, scales)
            qw = n.weights["qweight"]
            out_f, nb, _ = qw.shape
            block, bits = a["block_size"], a["bits"]
            digits = a.get("offset_digits", 0)
            out = [f"{n.name}.sum"] if "bias" in n.weights else y
            codes = [self.weight(qw), self.weight(n.weights["scales"])]
            if "zero_points" in n.weights:
                codes.append(self.weight(n.weights["zero_points"]))
            if self.block_q_matmul(n):
                # llmc's BlockQMatMul: MatMulNBits' one-row numerics (int8 activations per block), the input
                # widened with its block sums inside the kernel; the block's residual Add too (out: its result)
                residual = self.residual_add(n)
                if residual is not None:
                    codes += [""] * (3 - len(codes)) + [residual[1]]
                    out = [residual[0].outputs[0].name]
                xin, attrs = x[0], {}
                if (inside := self.norm_inside(n.inputs[0])) is not None:  # the RMS norm before it, in the kernel
                    xin, weight, attrs["epsilon"] = inside
                    codes += [""] * (4 - len(codes)) + [weight]
                self.add("BlockQMatMul", [xin, *codes], out, n.name, domain=NATIVE_DOMAIN, K=nb * block, N=out_f, block_size=block,
                         digits=digits, **attrs)
            else:
                xin = self.widened(x[0], block, digits) if digits else x[0]
                self.add("MatMulNBits", [xin, *codes], [f"{n.name}.codes"] if "offsets" in n.weights else out, n.name, domain=MS_DOMAIN,
                         K=nb * block, N=out_f, bits=bits, block_size=block, accuracy_level=4 if self.rows == 1 or bits == 8 else 0)
            if "offsets" in n.weights:  # one Gemm adds the offsets' term to the codes' product: C = the MatMulNBits result
                self.add("Gemm", [self.block_sums(x[0], nb, block), self.weight(n.weights["offsets"]), f"{n.name}.codes"], out, f"{n.name}.offset")
            if "bias" in n.weights:
                self.add("Add", [f"{n.name}.sum", self.weight(n.weights["bias"])], y, f"{n.name}.bias")
        elif n.op == "RMSNorm":
            w = self.weight(n.weights["weight"])
            if a["offset"]:
                off = self.const(f"{n.name}.offset", np.array(a["offset"], np.float32))
                self.add("Add", [w, off], [f"{n.name}.scale"], f"{n.name}.scale")
                w = f"{n.name}.scale"
            if self.normed_in_projections(n):
                self.norm_weights[n.name] = w  # each projection reading the norm normalises its input itself (norm_inside)
            elif (quant := self.quantized_by(n.outputs[0])) is not None:
                self.add("RMSNorm", x + [w], y + [self.codes_of(n.outputs[0])], f"{n.name}.native", domain=NATIVE_DOMAIN,
                         epsilon=float(a["eps"]), scale=quant[0], zero_point=quant[1])
            else:
                self.add("RMSNormalization", x + [w], y, n.name, axis=-1, epsilon=float(a["eps"]))
        elif n.op == "LayerNorm":
            ins = x + [self.weight(n.weights["weight"])]
            if "bias" in n.weights:
                ins.append(self.weight(n.weights["bias"]))
            self.add("LayerNormalization", ins, y, n.name, axis=-1, epsilon=float(a["eps"]))
        elif n.op == "Act" and self.into_swiglu(n):
            pass  # the Mul after it is llmc's SwiGLU (see swiglu)
        elif n.op == "Mul" and (fused := self.swiglu(n)) is not None:
            if self.gated_in_projection(n):
                return  # the W8A8MatMul that reads its result computes it (see swiglu_inside)
            if self.swiglu_in_correction(n):
                return  # the gate/up projection's ShadowCorrection computes it (see swiglu_after)
            _, whole, gate, up, width = fused
            quant = self.quantized_by(n.outputs[0])
            codes = {} if quant is None else {"scale": quant[0], "zero_point": quant[1]}
            outs = y if quant is None else y + [self.codes_of(n.outputs[0])]
            self.add("SwiGLU", [whole], outs, f"{n.name}.swiglu", domain=NATIVE_DOMAIN, gate=gate, up=up, width=width, **codes)
        elif n.op == "Act":
            if a["kind"] == "silu":
                self.add("Sigmoid", x, [f"{n.name}.sigmoid"], f"{n.name}.sigmoid")
                self.add("Mul", [x[0], f"{n.name}.sigmoid"], y, n.name)
            else:
                self.add("Gelu", x, y, n.name, approximate="tanh" if a["kind"] == "gelu_tanh" else "none")
        elif n.op == "Add" and self.added_by_native_op(n):
            pass  # a native correction or BlockQMatMul adds it (see residual_add)
        elif n.op in ("Add", "Mul"):
            self.add(n.op, x, y, n.name)
        elif n.op == "Scale":
            c = self.const(f"{n.name}.value", np.array(a["value"], np.float32))
            self.add("Mul", x + [c], y, n.name)
        elif n.op == "Slice" and (self.corrected_whole(n) or self.drops(n.outputs[0])):
            pass  # the correction reads the projection whole (see shadow_outliers), or SwiGLU does
        elif n.op == "Slice":
            self.slice(x[0], a["start"], a["end"], y[0], n.name)
        elif n.op == "ShadowOutliers":
            self.shadow_outliers(n, x, y)
        else:
            raise UnsupportedModelError(f"the ONNX backend has no lowering for static op {n.op} (node {n.name})")

    def block_sums(self, x: str, nb: int, block: int) -> str:
        """``x [R, nb * block]`` summed over each block of inputs, ``[R, nb]``; once per value and graph
        (q/k/v and gate/up share theirs)."""
        out = f"{x}.blocksum{block}"
        if out not in self.made_once:
            self.made_once.add(out)
            shape = self.const(f"{out}.shape", np.array([-1, nb, block], np.int64))
            axes = self.const(f"{out}.axes", np.array([2], np.int64))
            self.add("Reshape", [x, shape], [f"{out}.blocks"], f"{out}.blocks")
            self.add("ReduceSum", [f"{out}.blocks", axes], [out], out, keepdims=0)
        return out

    def widened(self, x: str, block: int, digits: int) -> str:
        """``[x, P, ..., P]`` with ``digits`` copies of P, x's block sums zero-padded to whole blocks
        (:func:`llmc.runtime.kernels.widen_with_block_sums`); once per value and graph."""
        out = f"{x}.widened{digits}"
        if out not in self.made_once:
            self.made_once.add(out)
            nb = self.values[x].shape[-1] // block
            sums = self.block_sums(x, nb, block)
            pad = -nb % block
            parts = [sums]
            if pad and not self.dynamic:  # a fixed row count: the zeros are a constant of the Concat, no Pad kernel
                parts.append(self.const(f"{out}.zeros", np.zeros((self.rows, pad), np.float32)))
            elif pad:
                pads = self.const(f"{out}.pads", np.array([0, 0, 0, pad], np.int64))
                self.add("Pad", [sums, pads], [f"{out}.sums"], f"{out}.sums")
                parts = [f"{out}.sums"]
            self.add("Concat", [x] + parts * digits, [out], out, axis=1)
        return out

    def drops(self, v: Value) -> bool:
        """Whether no op of this graph reads ``v``: a gate or up half that SwiGLU reads whole (the decode graph
        also: q/k/v that attention takes packed)."""
        return self.read_by_swiglu(v)

    def read_by_swiglu(self, v: Value) -> bool:
        """Whether ``v`` is no graph output and read only by :meth:`swiglu` ops (the Mul, or the silu before it),
        which read the gate/up projection whole."""
        if not v.uses or v.name in self.sub.outputs:
            return False
        return all((u.op == "Mul" and self.swiglu(u) is not None) or (u.op == "Act" and self.into_swiglu(u)) for u, _ in v.uses)

    def quantized_by(self, v: Value) -> tuple[float, int] | None:
        """In a graph with llmc's native ops: (scale, zero point) when the W8A8 projections of this graph that read
        ``v`` all quantize it alike, so that the native op that makes ``v`` (RMSNorm, SwiGLU) writes their uint8 codes
        too and no QuantizeLinear runs; else None."""
        if not self.native:
            return None
        quants = {(float(u.attrs["x_scale"]), int(u.attrs["x_zero_point"])) for u, _ in v.uses
                  if u.op == "QLinear" and u.name in self.members and not self.w8a8_matmul(u)}
        return quants.pop() if len(quants) == 1 else None

    def codes_of(self, v: Value) -> str | None:
        """The name of ``v``'s uint8 codes when the native op that makes it (RMSNorm, SwiGLU) writes them for the
        W8A8 projections that read it (:meth:`quantized_by`); else None."""
        made = v.producer
        if made is None or made.name not in self.members or self.quantized_by(v) is None:
            return None
        return f"{v.name}.codes" if made.op == "RMSNorm" or (made.op == "Mul" and self.swiglu(made) is not None) else None

    def block_q_matmul(self, n: Node) -> bool:
        """Whether the BlockQLinear ``n`` lowers to llmc's native ``BlockQMatMul`` (one-row graphs with native
        ops, 4-bit codes in blocks of 32, offsets folded into the codes)."""
        a = n.attrs
        return (self.native and self.rows == 1 and n.op == "BlockQLinear" and a["bits"] == 4 and a["block_size"] == BLOCK_Q_MATMUL
                and "offsets" not in n.weights)

    def normed_in_projections(self, norm: Node) -> bool:
        """Whether the RMSNorm ``norm`` of a graph with llmc's native ops is done by the ``BlockQMatMul`` or
        ``W8A8MatMul`` ops that read its result (an optional input of theirs): every reader of it is one (or the
        correction a W8A8MatMul does too), in this graph, and no graph output or stock W8A8 projection needs the
        normalised values themselves."""
        return self.native and self.read_by_native_projections(norm.outputs[0], block_q=True)

    def gated_in_projection(self, mul: Node) -> bool:
        """Whether the :meth:`swiglu` ``mul`` (a graph with llmc's native ops) is computed by the ``W8A8MatMul`` ops
        that read its result (their gate and up attributes; one-row graphs, as W8A8MatMul): every reader of it is
        one (or the correction a W8A8MatMul does too), in this graph, and the result is no graph output."""
        return self.read_by_native_projections(mul.outputs[0], block_q=False)

    def read_by_native_projections(self, v: Value, block_q: bool) -> bool:
        """Whether every reader of ``v`` is a native projection of this graph that takes it as its input (a
        ``W8A8MatMul``, the correction one does too, and with ``block_q`` a ``BlockQMatMul``), and no graph output
        or stock projection needs ``v`` itself (:meth:`normed_in_projections`, :meth:`gated_in_projection`)."""
        if v.name in self.sub.outputs or not v.uses or self.quantized_by(v) is not None:
            return False
        return all(u.name in self.members and i == 0 and ((block_q and self.block_q_matmul(u)) or self.w8a8_matmul(u)
                   or (u.op == "ShadowOutliers" and (q := self.fused_projection(u)) is not None and q.inputs[0] is v)) for u, i in v.uses)

    def swiglu_inside(self, v: Value) -> tuple[str, int, int] | None:
        """When ``v`` is a SwiGLU's result that the native projection reading it computes itself
        (:meth:`gated_in_projection`): the gate/up value, gate's first column and up's, which it takes instead of v."""
        mul = v.producer
        if mul is None or mul.op != "Mul" or mul.name not in self.members or (fused := self.swiglu(mul)) is None or not self.gated_in_projection(mul):
            return None
        return fused[1], fused[2], fused[3]

    def w8a8_matmul(self, n: Node) -> bool:
        """Whether the QLinear ``n`` lowers to llmc's native ``W8A8MatMul`` (one-row graphs with native ops, int8
        weights, or uint8 with zero point 128, and no bias): its QuantizeLinear and QDQ MatMul as one op, which its
        shadow correction joins where it can (:meth:`shadow_of`)."""
        if not (self.native and self.rows == 1 and n.op == "QLinear" and "bias" not in n.weights):
            return False
        return (n.weights["qweight"].dtype, int(n.attrs["w_zero_point"])) in (("int8", 0), ("uint8", 128))

    def shadow_of(self, q: Node) -> Node | None:
        """The shadow correction of the :meth:`w8a8_matmul` QLinear ``q`` that its ``W8A8MatMul`` does too: the one
        reader of q's result (directly, or through column slices that only it reads, :meth:`whole_source`), correcting
        it whole with the outliers of q's own input; else None."""
        v = q.outputs[0]
        if not self.w8a8_matmul(q) or v.name in self.sub.outputs or not v.uses:
            return None
        readers = {id(u): u for u, _ in v.uses}.values()
        if all(u.op == "Slice" and u.name in self.members and self.corrected_whole(u) for u in readers):
            shadows = {id(s): s for u in readers for s, _ in u.outputs[0].uses}
            s = next(iter(shadows.values())) if len(shadows) == 1 else None
            ok = s is not None and self.whole_source(s) is v
        else:
            s = v.uses[0][0] if len(v.uses) == 1 else None
            ok = s is not None and s.op == "ShadowOutliers" and len(s.outputs) == 1 and s.inputs[1] is v and self.whole_source(s) is None
        return s if ok and s.name in self.members and s.inputs[0] is q.inputs[0] else None

    def fused_projection(self, shadow: Node) -> Node | None:
        """The QLinear whose ``W8A8MatMul`` does the correction ``shadow`` too (:meth:`shadow_of`), else None."""
        src = self.whole_source(shadow)
        base = src if src is not None else (shadow.inputs[1] if len(shadow.outputs) == 1 else None)
        q = base.producer if base is not None else None
        return q if q is not None and q.op == "QLinear" and q.name in self.members and self.shadow_of(q) is shadow else None

    def native_projection(self, q: Node, shadow: Node | None, out: str, residual: str | None = None) -> None:
        """``out = residual + (W8A8 q(x) + shadow's correction)`` as llmc's native ``W8A8MatMul`` (one op for
        QuantizeLinear, the QDQ MatMul, ShadowCorrection and the residual Add), the RMS norm before it inside too
        where only such ops read it (:meth:`normed_in_projections`), or the SwiGLU before it where only such ops read
        its result (:meth:`gated_in_projection`)."""
        a = q.attrs
        ins = [q.inputs[0].name, self.weight(q.weights["qweight"]), self.weight(q.weights["wscale"])]
        if q.weights["wscale"].shape == (1,):  # a per-tensor scale: a scalar, as in the instances with stock ops
            self.scalar_weights.add(ins[2])
        attrs: dict[str, Any] = {"x_scale": float(a["x_scale"]), "x_zero_point": int(a["x_zero_point"])}
        table: list[str] = []
        if shadow is not None:
            ins.append(self.weight(shadow.weights["codes"]))
            attrs.update(lo=float(shadow.attrs["lo"]), hi=float(shadow.attrs["hi"]))
            table, hot = self.native_table(shadow)
            attrs.update(hot)
        if residual is not None:
            ins += [""] * (4 - len(ins)) + [residual]
        if (inside := self.norm_inside(q.inputs[0])) is not None:
            ins[0], weight, attrs["epsilon"] = inside
            ins += [""] * (5 - len(ins)) + [weight]
        elif (gated := self.swiglu_inside(q.inputs[0])) is not None:
            ins[0], attrs["gate"], attrs["up"] = gated
        if table:
            ins += [""] * (6 - len(ins)) + table
        if self.pack_weights:
            attrs["pack"] = 1
            self.packed_weights.append(ins[1])
        self.add("W8A8MatMul", ins, [out], q.name, domain=NATIVE_DOMAIN, **attrs)

    def norm_inside(self, v: Value) -> tuple[str, str, float] | None:
        """When ``v`` is an RMS norm's result that the native projections reading it compute themselves
        (:meth:`normed_in_projections`): the norm's input, its weight and its epsilon, which they take instead of v."""
        norm = v.producer
        if norm is None or norm.name not in self.norm_weights:
            return None
        return norm.inputs[0].name, self.norm_weights[norm.name], float(norm.attrs["eps"])

    def residual_add(self, node: Node) -> tuple[Node, str] | None:
        """In a graph with llmc's native ops, for a native correction or ``BlockQMatMul`` (without a bias) whose one
        result only an Add of this graph reads (a block's last projection into the residual stream): (that Add,
        its other input, of the same shape and made before the node), which the native op adds itself; else None."""
        if not self.native or len(node.outputs) != 1:
            return None
        if node.op == "ShadowOutliers" and self.whole_source(node) is not None:
            return None
        if node.op == "BlockQLinear" and (not self.block_q_matmul(node) or "bias" in node.weights):
            return None
        v = node.outputs[0]
        if v.name in self.sub.outputs or len(v.uses) != 1:
            return None
        add, i = v.uses[0]
        if add.op != "Add" or add.name not in self.members:
            return None
        other = add.inputs[1 - i]
        made = other.producer
        if other.shape != v.shape or (made is not None and made.name in self.members and self.order[made.name] > self.order[node.name]):
            return None
        return add, other.name

    def added_by_native_op(self, add: Node) -> bool:
        """Whether a native correction or ``BlockQMatMul`` of this graph adds ``add`` itself (:meth:`residual_add`)."""
        return any(v.producer is not None and v.producer.op in ("ShadowOutliers", "BlockQLinear") and v.producer.name in self.members
                   and (r := self.residual_add(v.producer)) is not None and r[0] is add for v in add.inputs)

    def columns_of(self, v: Value) -> tuple[str, int] | None:
        """(value, first column) when ``v`` is a column slice of a value this graph lowers whole: an IR Slice,
        or a result a shadow correction adds to its projection whole (:meth:`shadow_outliers`)."""
        p = v.producer
        if p is None or p.name not in self.members:
            return None
        if p.op == "Slice" and not self.corrected_whole(p):
            return p.inputs[0].name, int(p.attrs["start"])
        if p.op == "ShadowOutliers" and self.whole_source(p) is not None:
            return whole_name(p), sum(p.attrs["splits"][: list(p.outputs).index(v)])
        return None

    def swiglu(self, mul: Node) -> tuple[Node, str, int, int, int] | None:
        """For ``silu(gate) * up`` with gate and up columns of one value (a gated MLP whose gate/up projection
        fuse_sibling_linears merged), in a graph with llmc's native ops: (the Act, the value, gate's first
        column, up's, their width), which lower to one ``ai.llmc.SwiGLU``; else None."""
        if not self.native:
            return None
        for i in (0, 1):
            act, up = mul.inputs[i].producer, mul.inputs[1 - i]
            if (act is None or act.op != "Act" or act.attrs["kind"] != "silu" or act.name not in self.members
                    or len(mul.inputs[i].uses) != 1 or mul.inputs[i].name in self.sub.outputs):
                continue
            gate, other = self.columns_of(act.inputs[0]), self.columns_of(up)
            if gate is not None and other is not None and gate[0] == other[0] and act.inputs[0].shape == up.shape:
                return act, gate[0], gate[1], other[1], up.shape[-1]
        return None

    def into_swiglu(self, act: Node) -> bool:
        """Whether Act ``act`` is the silu of a :meth:`swiglu`."""
        uses = act.outputs[0].uses
        return len(uses) == 1 and uses[0][0].op == "Mul" and (m := self.swiglu(uses[0][0])) is not None and m[0] is act

    def slice(self, x: str, start: int, end: int, out: str, name: str) -> None:
        """``out = x[:, start:end]``."""
        s = self.const(f"{name}.starts", np.array([start], np.int64))
        e = self.const(f"{name}.ends", np.array([end], np.int64))
        ax = self.const(f"{name}.axes", np.array([1], np.int64))
        self.add("Slice", [x, s, e, ax], [out], name)

    def whole_source(self, shadow: Node) -> Value | None:
        """The projection ``shadow`` corrects whole (:func:`~llmc.ops.sliced_whole`) when it and the slices
        are in this graph, else None."""
        src = sliced_whole(shadow)
        inside = {shadow.name, *(v.producer.name for v in shadow.inputs[1:])} <= self.members if src is not None else False
        return src if inside else None

    def corrected_whole(self, n: Node) -> bool:
        """Whether Slice ``n`` is read only by a correction of this graph that reads its source whole."""
        users = [u for u, _ in n.outputs[0].uses]
        return len(users) == 1 and users[0].op == "ShadowOutliers" and self.whole_source(users[0]) is not None

    def shadow_outliers(self, n: Node, x: list[str], y: list[str]) -> None:
        """``y_i = ys_i + (x - clip(x)) @ W_i^T`` over the channels where some row of x is
        outside ``[lo, hi]``: as ONNX ops (at one row found with a mask, in a chunk per block of
        rows: see :meth:`shadow_correction`), the runtime kernel's arithmetic, or as llmc's native
        op (``--cpu-kernels native``, :meth:`native_op`), for graphs that run on the CPU
        (``fuse_cpu_decode``). When the ys are the column slices of one projection (q/k/v merged
        by ``fuse_sibling_linears``), the correction adds to it whole and the results are sliced
        after: one add instead of a split and one per part."""
        a, p = n.attrs, n.name
        src = self.whole_source(n)
        if src is not None or len(y) == 1:
            base, out = (src.name, whole_name(n)) if src is not None else (x[1], y[0])
            residual = self.residual_add(n)
            if (q := self.fused_projection(n)) is not None:  # the projection, the correction (and the Add) as one op
                self.native_projection(q, n, residual[0].outputs[0].name if residual is not None else out,
                                       residual[1] if residual is not None else None)
            elif residual is not None:  # the block's residual Add too: out is the Add's result
                self.native_op(n, x[0], [base, residual[1]], residual[0].outputs[0].name)
            elif (mul := self.swiglu_after(n)) is not None:  # the SwiGLU after it too: its halves are never written
                self.native_op(n, x[0], [base], out, swiglu=mul)
            elif self.native:
                self.native_op(n, x[0], [base], out)
            else:
                self.shadow_correction(n, x[0])
                self.add("Add", [base, f"{p}.corr"], [out], f"{p}.add")
            if src is not None:
                start = 0
                for v, width in zip(n.outputs, a["splits"]):
                    if not self.drops(v):
                        self.slice(out, start, start + width, v.name, f"{v.name}.slice")
                    start += width
            return
        if self.native:
            self.native_op(n, x[0], [], f"{p}.corr")
        else:
            self.shadow_correction(n, x[0])
        parts = [f"{p}.corr{i}" for i in range(len(y))]
        sizes = self.const(f"{p}.splits", np.array(a["splits"], np.int64))
        self.add("Split", [f"{p}.corr", sizes], parts, f"{p}.split", axis=-1)
        for i, (ys, out) in enumerate(zip(x[1:], y)):
            self.add("Add", [ys, parts[i]], [out], f"{p}.add{i}")

    def native_op(self, n: Node, x: str, base: list[str], out: str, swiglu: Node | None = None) -> None:
        """``out = base + (x - clip(x)) @ W^T`` (no base: the correction alone; base and a residual: that added
        too, see :meth:`residual_add`) as llmc's native op ``ShadowCorrection`` (:mod:`llmc.runtime.native`):
        one op at any row count, visiting each row's own outliers where the stock ops take a block's union of
        outlier channels. With ``swiglu`` (:meth:`swiglu_after`) the op's outputs are that SwiGLU's result and
        its codes instead of ``out``."""
        a = n.attrs
        outs, extra = [out], {}
        if swiglu is not None:
            _, _, gate, up, width = self.swiglu(swiglu)
            v = swiglu.outputs[0]
            outs, extra = [v.name], {"gate": gate, "up": up, "width": width}
            if (quant := self.quantized_by(v)) is not None:
                outs.append(self.codes_of(v))
                extra.update(scale=quant[0], zero_point=quant[1])
        table, hot = self.native_table(n)
        ins = [x, self.weight(n.weights["codes"]), *base]
        self.add("ShadowCorrection", ins + [""] * (4 - len(ins)) + table, outs, f"{n.name}.native", domain=NATIVE_DOMAIN,
                 lo=float(a["lo"]), hi=float(a["hi"]), **hot, **extra)

    def native_table(self, n: Node) -> tuple[list[str], dict[str, Any]]:
        """The inputs after a native op's weight table (its codes) that give a correction its values: the codes'
        column scales and, with hot channels, their rows of ``hot_delta``; and the attribute ``hot_channels``."""
        ins = [self.weight(n.weights["scale"])]
        hot = list(n.attrs["hot_channels"])
        if not hot:
            return ins, {}
        return ins + [self.weight(n.weights["hot_delta"])], {"hot_channels": [int(c) for c in hot]}

    def swiglu_after(self, shadow: Node) -> Node | None:
        """The :meth:`swiglu` Mul that the native correction ``shadow`` computes as well (ShadowCorrection's gate, up
        and width attributes), so that the corrected gate/up projection is never written out: ``shadow`` corrects
        that projection whole (its one result, or its halves, :meth:`whole_source`) with no residual or projection
        joining it, only that SwiGLU reads the halves, and the SwiGLU is an op of this graph (not inside a
        ``W8A8MatMul``) of more than one row (a task of the op then takes whole rows: one row would be one task);
        else None."""
        if self.rows == 1 or not self.native or self.residual_add(shadow) is not None or self.fused_projection(shadow) is not None:
            return None
        v = shadow.outputs[0]
        if self.whole_source(shadow) is not None:
            whole, halves = whole_name(shadow), list(shadow.outputs)
        elif (len(shadow.outputs) == 1 and v.uses and v.name not in self.sub.outputs
              and all(u.op == "Slice" and u.name in self.members for u, _ in v.uses)):
            whole, halves = v.name, [u.outputs[0] for u, _ in v.uses]
        else:
            return None
        if not all(self.read_by_swiglu(h) for h in halves):  # (not drops: the decode graph's also drops q/k/v)
            return None
        muls = {id(m): m for h in halves for u, _ in h.uses for m in ([u] if u.op == "Mul" else [w for w, _ in u.outputs[0].uses if w.op == "Mul"])}
        mul = next(iter(muls.values())) if len(muls) == 1 else None
        if mul is None or mul.name not in self.members or (fused := self.swiglu(mul)) is None:
            return None
        return mul if fused[1] == whole and not self.gated_in_projection(mul) else None

    def swiglu_in_correction(self, mul: Node) -> bool:
        """Whether the :meth:`swiglu` ``mul`` is computed by the correction of its gate/up projection
        (:meth:`swiglu_after`)."""
        act = self.swiglu(mul)
        p = act[0].inputs[0].producer if act is not None else None
        if p is not None and p.op == "Slice":  # a half sliced from the correction's one result
            p = p.inputs[0].producer
        return p is not None and p.op == "ShadowOutliers" and p.name in self.members and self.swiglu_after(p) is mul

    def shadow_correction(self, n: Node, x: str) -> None:
        """``{name}.corr = (x - clip(x)) @ W^T`` over the outlier channels, all of the correction's columns."""
        a, p = n.attrs, n.name
        lo = self.const(f"{p}.lo", np.array(a["lo"], np.float32))
        hi = self.const(f"{p}.hi", np.array(a["hi"], np.float32))
        self.add("Clip", [x, lo, hi], [f"{p}.clip"], f"{p}.clip")
        self.add("Sub", [x, f"{p}.clip"], [f"{p}.delta"], f"{p}.delta")
        if self.rows == 1:
            # the one row, flat: its outlier entries and their weight rows, [m] x [m, N]; Compress by a bool
            # mask is one kernel where NonZero + Reshape + Gather are three (decode: about 5% of its kernels)
            flat = self.const(f"{p}.flat", np.array([-1], np.int64))
            self.add("Reshape", [f"{p}.delta", flat], [f"{p}.any"], f"{p}.any")
            self.add("Cast", [f"{p}.any"], [f"{p}.mask"], f"{p}.mask", to=9)  # bool: non-zero marks an outlier channel
            self.add("Compress", [f"{p}.any", f"{p}.mask"], [f"{p}.d"], f"{p}.select_x", axis=0)
            self.add("Compress", [self.weight(n.weights["codes"]), f"{p}.mask"], [f"{p}.wq"], f"{p}.select_w", axis=0)
            self.add("MatMul", [f"{p}.d", self.widened_codes(n, f"{p}.wq")], [f"{p}.corr_q"], f"{p}.corr_q")
            self.scaled_correction(n, f"{p}.corr_q")
            return
        # A chunk, in equal blocks of about 64 rows (llmc.runtime.kernels.shadow_blocks): each block's outlier
        # channels (where some row of the block has one), as many per block as the block with the most (a block
        # with fewer takes channels where its delta is zero), [B, R, M] x [B, M, N]. Outliers in the spread-out
        # inputs (o_proj, down_proj) touch half of a whole chunk's channels but far fewer of each block's.
        # A column sum of |delta| is non-zero exactly where its maximum is, and ONNX Runtime's
        # ReduceSum over the rows is vectorised where its ReduceMax is not (34 vs 189 us at 256 x 1536).
        blocks, spread = self.row_blocks(x)
        self.add("Reshape", [f"{p}.delta", blocks], [f"{p}.blocks"], f"{p}.blocks")
        self.add("Abs", [f"{p}.blocks"], [f"{p}.abs"], f"{p}.abs")
        one = self.const(f"{p}.axis1", np.array([1], np.int64))
        self.add("ReduceSum", [f"{p}.abs", one], [f"{p}.any"], f"{p}.any", keepdims=0)  # [B, K]
        zero = self.const(f"{p}.zero", np.array(0, np.float32))
        self.add("Equal", [f"{p}.any", zero], [f"{p}.miss"], f"{p}.miss")
        self.add("Not", [f"{p}.miss"], [f"{p}.hit"], f"{p}.hit")  # a NaN counts, as in the runtime's kernel
        self.add("Cast", [f"{p}.hit"], [f"{p}.hits"], f"{p}.hits", to=7)  # int64
        self.add("ReduceSum", [f"{p}.hits", one], [f"{p}.count"], f"{p}.count", keepdims=0)  # [B]
        self.add("ReduceMax", [f"{p}.count"], [f"{p}.m"], f"{p}.m", keepdims=1)  # [1]: M
        self.add("TopK", [f"{p}.any", f"{p}.m"], [f"{p}.top", f"{p}.chans"], f"{p}.chans", axis=1, sorted=0)  # [B, M]
        self.add("Unsqueeze", [f"{p}.chans", one], [f"{p}.chans3"], f"{p}.chans3")
        self.add("Expand", [f"{p}.chans3", spread], [f"{p}.idx"], f"{p}.idx")  # [B, R, M]
        self.add("GatherElements", [f"{p}.blocks", f"{p}.idx"], [f"{p}.d"], f"{p}.gather_x", axis=2)
        self.add("Gather", [self.weight(n.weights["codes"]), f"{p}.chans"], [f"{p}.wq"], f"{p}.gather_w", axis=0)  # [B, M, N]
        self.add("MatMul", [f"{p}.d", self.widened_codes(n, f"{p}.wq")], [f"{p}.corr3"], f"{p}.corr3")
        flat = self.const(f"{p}.rows_n", np.array([-1, n.weights["codes"].shape[1]], np.int64))
        self.add("Reshape", [f"{p}.corr3", flat], [f"{p}.corr_q"], f"{p}.unblock")
        self.scaled_correction(n, f"{p}.corr_q")

    def widened_codes(self, n: Node, codes: str) -> str:
        """The gathered rows ``codes`` of ``n``'s int8 (or uint8 + 128) table as floats, less the zero point."""
        from onnx import TensorProto

        p = n.name
        self.add("Cast", [codes], [f"{p}.wf"], f"{p}.widen", to=TensorProto.FLOAT)
        if not n.attrs["w_zero_point"]:
            return f"{p}.wf"
        zp = self.const(f"{p}.w_zero_point", np.array(n.attrs["w_zero_point"], np.float32))
        self.add("Sub", [f"{p}.wf", zp], [f"{p}.w"], f"{p}.unoffset")
        return f"{p}.w"

    def scaled_correction(self, n: Node, corr: str) -> None:
        """``{name}.corr``: ``corr`` (the outliers' excess times the codes) times the column scales, plus each hot
        channel's excess times its row of ``hot_delta`` (dense over the few hot channels: the excess is zero
        where a row has no outlier)."""
        p, hot = n.name, list(n.attrs["hot_channels"])
        out = f"{p}.corr" if not hot else f"{p}.corr_s"
        self.add("Mul", [corr, self.weight(n.weights["scale"])], [out], f"{p}.scale")
        if not hot:
            return
        idx = self.const(f"{p}.hot", np.array(hot, np.int64))
        self.add("Gather", [f"{p}.delta", idx], [f"{p}.dh"], f"{p}.gather_hot", axis=1)
        self.add("MatMul", [f"{p}.dh", self.weight(n.weights["hot_delta"])], [f"{p}.corr_h"], f"{p}.corr_h")
        self.add("Add", [out, f"{p}.corr_h"], [f"{p}.corr"], f"{p}.hot_add")

    def row_group(self, x: str) -> str:
        """The name prefix of the row blocks of the corrections whose input is ``x``: all of a graph's rows
        have one row count (the decode graph's chunk instance overrides this for the rows after SelectRows)."""
        return "shadow"

    def row_blocks(self, x: str) -> tuple[str, str]:
        """How a chunk's corrections split its rows (once per graph and row group): into B blocks of
        R = rows / B rows (:func:`~llmc.runtime.kernels.shadow_blocks`). Returns the shapes ``[B, R, -1]``
        and ``[1, R, 1]`` (which spreads a block's channels over its rows): constants at a fixed row count;
        at a symbolic one, looked up by the row count of ``x`` (any ``[rows, ...]`` value of the group,
        the first correction's input)."""
        g = self.row_group(x)
        if f"{g}.blocks" not in self.made_once:
            self.made_once.add(f"{g}.blocks")
            if not self.dynamic:
                b = shadow_blocks(self.rows)
                self.const(f"{g}.blocks", np.array([b, self.rows // b, -1], np.int64))
                self.const(f"{g}.spread", np.array([1, self.rows // b, 1], np.int64))
            else:
                table = self.const(f"{g}.block_counts", np.array([1] + [shadow_blocks(r) for r in range(1, self.rows + 1)], np.int64))
                one, minus_one = self.const(f"{g}.one", np.array([1], np.int64)), self.const(f"{g}.minus_one", np.array([-1], np.int64))
                self.add("Shape", [x], [f"{g}.rows"], f"{g}.rows", start=0, end=1)
                self.add("Gather", [table, f"{g}.rows"], [f"{g}.b"], f"{g}.b", axis=0)
                self.add("Div", [f"{g}.rows", f"{g}.b"], [f"{g}.r"], f"{g}.r")
                self.add("Concat", [f"{g}.b", f"{g}.r", minus_one], [f"{g}.blocks"], f"{g}.blocks", axis=0)
                self.add("Concat", [one, f"{g}.r", one], [f"{g}.spread"], f"{g}.spread", axis=0)
        return f"{g}.blocks", f"{g}.spread"

    def value_info(self, name: str):

        v = self.values[name]
        return self.helper.make_tensor_value_info(name, _NP_TO_ONNX[v.dtype], ["rows" if self.dynamic else self.rows, *v.shape[1:]])

    def build(self):
        from onnx import TensorProto

        for name in self.sub.nodes:
            self.lower(self.graph.node(name))
        inits = []
        weight_inputs = []
        for wname in self.used_weights:
            w = self.weights[wname]
            dims = [] if wname in self.scalar_weights else w["shape"]
            if wname in self.streamed:  # fed by the runtime for every run (streaming buffers or resident memory)
                weight_inputs.append(self.helper.make_tensor_value_info(wname, _NP_TO_ONNX[w["dtype"]], dims))
                continue
            t = TensorProto()
            t.name = wname
            t.data_type = _NP_TO_ONNX[w["dtype"]]
            # a one-element scale is a per-tensor (scalar) quantization parameter
            t.dims.extend(dims)
            t.data_location = TensorProto.EXTERNAL
            for k, val in (("location", w["file"]), ("offset", str(w["offset"])), ("length", str(w["nbytes"]))):
                e = t.external_data.add()
                e.key, e.value = k, val
            inits.append(t)
        g = self.helper.make_graph(
            self.nodes,
            f"{self.sub.name}_r{self.rows}",
            [self.value_info(n) for n in self.sub.inputs] + self.extra_inputs + weight_inputs,
            [self.value_info(n) for n in self.sub.outputs] + self.extra_outputs,
            inits + self.consts,
        )
        domains = sorted({node.domain for node in self.nodes if node.domain})  # contrib ops (MatMulNBits)
        opsets = [self.helper.make_opsetid("", OPSET)] + [self.helper.make_opsetid(d, 1) for d in domains]
        model = self.helper.make_model(g, opset_imports=opsets, producer_name="llmc", producer_version=__version__)
        model.ir_version = 10
        return model


def _kv_names(layer: int) -> dict[str, str]:
    """The decode graph's cache inputs and outputs of ``layer`` (bound to the same memory by the runtime)."""
    return {"past_key": f"past_key.{layer}", "past_value": f"past_value.{layer}", "present_key": f"present_key.{layer}",
            "present_value": f"present_value.{layer}"}


def whole_name(shadow: Node) -> str:
    """The corrected projection whole, when ``shadow`` corrects its slices (:func:`sliced_whole`)."""
    return f"{shadow.name}.whole"


def packed_qkv(attn: Node) -> str | None:
    """The fused projection whose consecutive column slices are ``attn``'s q, k and v (all of it), or None:
    the projection itself, or, when a shadow correction sits between, the corrected projection."""
    a = attn.attrs
    hd, kvd = a["num_heads"] * a["head_dim"], a["num_kv_heads"] * a["head_dim"]
    producers = [v.producer for v in attn.inputs[:3]]
    if any(p is None for p in producers):
        return None
    sh = producers[0]
    if sh.op == "ShadowOutliers":
        if any(p is not sh for p in producers) or list(attn.inputs[:3]) != list(sh.outputs):
            return None
        return whole_name(sh) if list(sh.attrs["splits"]) == [hd, kvd, kvd] and sliced_whole(sh) is not None else None
    if any(p.op != "Slice" for p in producers):
        return None
    src = producers[0].inputs[0]
    if any(p.inputs[0] is not src for p in producers) or src.shape[-1] != hd + 2 * kvd:
        return None
    if [(p.attrs["start"], p.attrs["end"]) for p in producers] != [(0, hd), (hd, hd + kvd), (hd + kvd, hd + 2 * kvd)]:
        return None
    return src.name


class _DecodeBuilder(_Builder):
    """The model after its embedding at one row, or a chunk (:class:`~llmc.analyses.DecodeGraph`): the static
    ops as :class:`_Builder` lowers them, and the dynamic ones as ONNX ops, attention as
    ``GroupQueryAttention`` over caches that are graph inputs and outputs (``past_key.L`` /
    ``present_key.L`` ``[1, kv heads, max_context, head dim]``, bound to the same memory by
    the runtime), with the token's cache length as ``seqlens_k`` (``[1]``, int32) and
    ``total_len`` (scalar, int32 = seqlens_k + 1). At ``rows`` > 1 the chunk instance
    (any row count up to ``rows``): ``seqlens_k`` is the cache length after the chunk
    minus one, ``SelectRows`` gathers the rows named by ``logit_rows`` (``[k]``, int64),
    and the corrections after it split those k rows into their own blocks."""

    pack_weights = True

    def __init__(self, graph: Graph, dg: DecodeGraph, weights: dict[str, dict[str, Any]], fed: frozenset[str], rows: int = 1,
                 native: bool = False) -> None:
        super().__init__(graph, dg.subgraph, rows, weights, fed, native)
        from onnx import TensorProto

        from llmc.runtime import kernels

        # cos/sin of every position, as the runtime's RotaryTable computes them
        table = graph.node(dg.rotary)
        inv_freq = np.asarray(graph.weights.load(table.weights["inv_freq"].name), np.float32)
        cos, sin = kernels.rotary_table(np.arange(dg.capacity), inv_freq, table.attrs["scaling"])
        half = cos.shape[1] // 2  # rotate-half tables repeat their first half
        self.const("rotary.cos_cache", np.ascontiguousarray(cos[:, :half]))
        self.const("rotary.sin_cache", np.ascontiguousarray(sin[:, :half]))
        vi = self.helper.make_tensor_value_info
        self.extra_inputs += [vi(DECODE_SEQLENS, TensorProto.INT32, [1]), vi(DECODE_TOTAL, TensorProto.INT32, [])]
        self.selected: set[str] = set()  # a chunk's values after SelectRows: one row per logit row
        if rows > 1:  # a chunk: the rows that need logits (SelectRows)
            self.extra_inputs.append(vi(DECODE_LOGIT_ROWS, TensorProto.INT64, [DECODE_LOGIT_ROWS]))
            self.selected = {v.name for n in graph.downstream("SelectRows", dg.subgraph.nodes) for v in n.outputs}
        int8 = {n.attrs["layer"] for n in graph.find("Attention") if "k_scale" in n.weights}  # quantize_kv_cache
        half = {n.attrs["layer"] for n in graph.find("Attention") if n.attrs.get("kv_dtype") == "float16"}  # float16_kv_cache
        for layer, kv, d in dg.layers:
            shape, names = [1, kv, dg.capacity, d], _kv_names(layer)
            elem = TensorProto.INT8 if layer in int8 else TensorProto.FLOAT16 if layer in half else TensorProto.FLOAT
            self.extra_inputs += [vi(names[k], elem, shape) for k in ("past_key", "past_value")]
            self.extra_outputs += [vi(names[k], elem, shape) for k in ("present_key", "present_value")]

    def lower(self, n: Node) -> None:
        x = [v.name for v in n.inputs]
        y = [v.name for v in n.outputs]
        if n.op == "Attention":
            self.attention(n, x, y)
        elif n.op == "SelectRows" and self.rows == 1:
            self.add("Identity", x, y, n.name)  # the one row is the row that needs logits
        elif n.op == "SelectRows":
            self.add("Gather", [x[0], DECODE_LOGIT_ROWS], y, n.name, axis=0)
        else:
            super().lower(n)  # a Slice that drops() (attention nodes take the fused projection packed) is left out there

    def drops(self, v: Value) -> bool:
        return super().drops(v) or (bool(v.uses) and all(u.op == "Attention" and self.packed(u) is not None for u, _ in v.uses))

    @staticmethod
    def node_rotates(attn: Node) -> bool:
        """Whether ``GroupQueryAttention`` rotates q and k itself (the runtime's rule for its attention calls)."""
        return node_rotates(attn.attrs["rotary_dim"], attn.attrs["head_dim"])

    def packed(self, attn: Node):
        """The fused projection ``attn`` takes whole (see :func:`packed_qkv`) when its node also rotates q and k, else None."""
        return packed_qkv(attn) if self.node_rotates(attn) else None

    def attention(self, n: Node, x: list[str], y: list[str]) -> None:
        """q/k/v ``[rows, F]`` -> ``[1, rows, F]``; rotary embedding in the attention node, or (partial rotary, other
        head sizes) by ONNX ``RotaryEmbedding`` at the position ``seqlens_k``; ``GroupQueryAttention`` over the
        layer's caches, a sliding window as its ``local_window_size`` (the same number: the tests check it against
        HF's Mistral and the numpy kernel past the window). llmc's native attention takes ``[rows, F]`` as it is
        (no Reshapes) when no ``RotaryEmbedding`` comes between."""
        a, p, kv = n.attrs, n.name, _kv_names(n.attrs["layer"])
        packed = self.packed(n)  # q, k and v are slices of one fused projection: the node takes it whole
        qkv = [packed] if packed is not None else x[:3]
        hd, kvd = a["num_heads"] * a["head_dim"], a["num_kv_heads"] * a["head_dim"]
        rotary = ["rotary.cos_cache", "rotary.sin_cache"] if self.node_rotates(n) else []
        native = self.native and attention_takes(a["num_heads"], a["num_kv_heads"], a["head_dim"], self.rows)
        half = a.get("kv_dtype") == "float16"
        if half and not native:  # fuse_decode_graph builds no such graph (why_not)
            raise CompileError(f"{p} has a float16 KV cache, which ONNX Runtime's GroupQueryAttention does not take with float32 queries",
                               hint="compile with --cpu-kernels native, or --kv-cache float32")
        flat = native and (bool(rotary) or not a["rotary_dim"])  # the node takes and makes [rows, F]
        if not flat:
            for v, width in zip(qkv, [hd + 2 * kvd] if packed is not None else [hd, kvd, kvd]):
                s3 = self.const(f"{v}.shape3", np.array([1, -1, width], np.int64))
                self.add("Reshape", [v, s3], [f"{v}.bsd"], f"{v}.bsd")
            qkv = [f"{v}.bsd" for v in qkv]
        if not rotary and a["rotary_dim"]:
            pos = self.position_ids()
            for i, heads in ((0, a["num_heads"]), (1, a["num_kv_heads"])):
                self.add("RotaryEmbedding", [qkv[i], "rotary.cos_cache", "rotary.sin_cache", pos], [f"{qkv[i]}.rot"], f"{qkv[i]}.rot",
                         num_heads=heads, rotary_embedding_dim=a["rotary_dim"], interleaved=0)
                qkv[i] = f"{qkv[i]}.rot"
        ins = qkv + ([""] * 2 if packed is not None else [])
        ins += [kv["past_key"], kv["past_value"], DECODE_SEQLENS, DECODE_TOTAL] + rotary
        attrs = {"num_heads": a["num_heads"], "kv_num_heads": a["num_kv_heads"], "scale": float(a["scale"])}
        if rotary:
            attrs.update(do_rotary=1, rotary_interleaved=0)
        if a["sliding_window"]:
            attrs["local_window_size"] = int(a["sliding_window"])
        if "k_scale" in n.weights:  # int8 cache, per-channel scales [1, kv, 1, d] (GroupQueryAttention's inputs 12, 13; native: 9, 10)
            shape = (1, a["num_kv_heads"], 1, a["head_dim"])
            scales = [self.const(f"{p}.{w}", np.asarray(self.graph.weights.load(n.weights[w].name), np.float32).reshape(shape))
                      for w in ("k_scale", "v_scale")]
            ins += [""] * ((9 if native else 12) - len(ins)) + scales
            if not native:
                attrs.update(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL", kv_cache_bit_width=8)
        if native:
            # llmc's native op (--cpu-kernels native): GroupQueryAttention's inputs and attributes
            attrs.pop("rotary_interleaved", None)
            op = "DecodeAttentionInt8" if "k_scale" in n.weights else "DecodeAttentionFloat16" if half else "DecodeAttention"
            if self.bf16_attention:
                attrs["bf16"] = 1
                self.bf16_nodes += 1
            self.add(op, ins, [y[0] if flat else f"{p}.bsd", kv["present_key"], kv["present_value"]], p, domain=NATIVE_DOMAIN, **attrs)
        else:
            self.add("GroupQueryAttention", ins, [f"{p}.bsd", kv["present_key"], kv["present_value"]], p, domain=MS_DOMAIN, **attrs)
        if not flat:
            self.add("Reshape", [f"{p}.bsd", self.const(f"{p}.shape2", np.array([-1, hd], np.int64))], y, f"{p}.rows")

    def row_group(self, x: str) -> str:
        return "shadow.selected" if x in self.selected else "shadow"

    def value_info(self, name: str):
        if name in self.selected:
            v = self.values[name]
            return self.helper.make_tensor_value_info(name, _NP_TO_ONNX[v.dtype], [DECODE_LOGIT_ROWS, *v.shape[1:]])
        return super().value_info(name)

    def position_ids(self) -> str:
        """The token's position ``[1, 1]`` (int64), from the cache length; made once per graph."""
        out = "decode.position_ids"
        if out not in self.made_once:
            self.made_once.add(out)
            self.add("Cast", [DECODE_SEQLENS], ["decode.position"], "decode.position", to=7)
            self.add("Reshape", ["decode.position", self.const(f"{out}.shape", np.array([1, 1], np.int64))], [out], out)
        return out


def _check(model, root: Path) -> None:
    """onnx.checker (with strict shape inference), resolving external data from the bundle root.

    Given a proto, the checker resolves external-data locations against the
    working directory; the locations are bundle-root relative, so check from there.
    """
    import contextlib

    import onnx

    with contextlib.chdir(root):
        onnx.checker.check_model(model, full_check=True)


def emit_graphs(graph: Graph, plan: ChunkPlan | DecodePlan, weights: dict[str, dict[str, Any]], root: Path, placement: str = "cpu",
                streamed: frozenset[str] = frozenset(), fed: frozenset[str] = frozenset(), native: bool = False) -> dict[str, dict[str, Any]]:
    """Write every subgraph instance; return the manifest's ``graphs`` table.

    Weights named in ``streamed`` (an :class:`~llmc.analyses.OffloadPlan`'s) become
    graph *inputs* of the same name, dtype and shape instead of external-data
    initializers: the runtime reads them from the weight file for every run and
    feeds them. The graph's entry lists them under ``"streamed"``. Weights in
    ``fed`` become graph inputs too, fed from the runtime's resident memory
    (listed under ``"fed"``). ``native`` writes the shadow corrections as llmc's native op
    (``--cpu-kernels native``, as :func:`emit_decode_graph` also writes the attention) and gated MLPs' activations.
    """

    table: dict[str, dict[str, Any]] = {}
    for sub in plan.subgraphs:
        builders = [_Builder(graph, sub, rows, weights, streamed | fed, native) for rows in sub.row_counts]
        table[sub.name] = _write(graph, sub, builders, weights, root, placement, streamed, fed)
    return table


def emit_decode_graph(graph: Graph, dg: DecodeGraph, weights: dict[str, dict[str, Any]], root: Path,
                      fed: frozenset[str] = frozenset(), native: bool = False) -> dict[str, dict[str, Any]]:
    """Write the one-graph decode (:class:`~llmc.analyses.DecodeGraph`); return its ``graphs`` entry.

    Its manifest entry also lists the graph's cache-length inputs and, per layer,
    the names of its past and present K/V (``"kv"``)."""
    builders = [_DecodeBuilder(graph, dg, weights, fed, rows, native) for rows in dg.subgraph.row_counts]
    entry = _write(graph, dg.subgraph, builders, weights, root, "cpu", frozenset(), fed)
    entry["kv"] = [{"layer": layer, **_kv_names(layer)} for layer, _, _ in dg.layers]
    entry["seqlens"], entry["total_len"] = DECODE_SEQLENS, DECODE_TOTAL
    packed = [w for b in builders for w in b.packed_weights]  # the one-row instance's (only it has W8A8MatMul ops)
    if packed:  # which the ops copy into their layout on CPUs with AVX-512 VNNI
        entry["packed"] = packed
    if len(builders) > 1:
        entry["logit_rows"] = DECODE_LOGIT_ROWS
    return {dg.subgraph.name: entry}


def _write(graph: Graph, sub: Subgraph, builders: list[_Builder], weights: dict[str, dict[str, Any]], root: Path, placement: str,
           streamed: frozenset[str], fed: frozenset[str]) -> dict[str, Any]:
    """Build, check and write ``sub``'s instances (one builder per row count); return its ``graphs`` entry."""
    (root / "graphs").mkdir(parents=True, exist_ok=True)
    instances = {}
    for b in builders:
        model = b.build()
        _check(model, root)
        rel = f"graphs/{sub.name}.r{b.rows}.onnx"
        (root / rel).write_bytes(model.SerializeToString(deterministic=True))
        instances[str(b.rows)] = {"file": rel, "rows": b.rows, **({"dynamic": True} if b.dynamic else {})}
    used = builders[0].used_weights  # the same for every instance; a node may hold weights its lowering does not read
    vals = {v.name: v for n in (graph.node(x) for x in sub.nodes) for v in list(n.inputs) + list(n.outputs)}
    entry = {
        "placement": placement,
        "nodes": len(sub.nodes),
        "ops": sorted({graph.node(x).op for x in sub.nodes}),
        "inputs": [{"name": n, "features": vals[n].shape[1], "dtype": vals[n].dtype} for n in sub.inputs],
        "outputs": [{"name": n, "features": vals[n].shape[1], "dtype": vals[n].dtype} for n in sub.outputs],
        "weights": used,
        "weight_bytes": sum(weights[w]["nbytes"] for w in used),
        "instances": instances,
    }
    for key, names in (("streamed", streamed), ("fed", fed), ("scalar", builders[0].scalar_weights)):
        mine = [w for w in used if w in names]
        if mine:
            entry[key] = mine
    if any(b.bf16_nodes and b.rows > 1 for b in builders):  # its chunks' attention multiplies in bfloat16 (AVX512_BF16)
        entry["bf16_attention"] = True
    return entry
