"""calibrate_ranges: observe the range of every value of the quantized graph.

Backends that need every tensor quantized (the QNN HTP backend: 16-bit QDQ on
norms, residual adds and Linear outputs) need a range for each value of the
graph as it will run, after ``quantize``. This pass runs the IR (with its
fake-quant and shadow semantics) on the first ``min(--calib-tokens, 512)``
calibration tokens and records ``[min, max]`` of every node output (embedding
outputs get the exact bound over the whole table, RMSNorm outputs their
analytic bound, ``QLinear`` outputs, and the column slices of merged ones, the
bound of their clipped input times their weights, so tokens the text never used
cannot saturate them).

Produces :class:`llmc.analyses.ValueRanges`; the IR is unchanged.
"""

from __future__ import annotations

import numpy as np

from llmc.analyses import ValueRanges
from llmc.errors import CompileError
from llmc.ir import Graph
from llmc.pass_manager import Pass, PassContext, PassResult
from llmc.passes.calibrate import Calibrate, calibration_text

MAX_TOKENS = 512


class CalibrateRanges(Pass):
    name = "calibrate_ranges"
    summary = "record [min, max] of every value of the quantized graph (for full-QDQ backends)"
    produces = (ValueRanges,)

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        from llmc.interpreter import Interpreter

        if ctx.inputs.encode is None:
            raise CompileError("range calibration needs the model's tokenizer, and this model has none")
        opts = ctx.options
        _, text = calibration_text(opts)
        ids = Calibrate._tokens(ctx.inputs.encode, text, min(opts.calib_tokens, MAX_TOKENS))
        lo: dict[str, float] = {}
        hi: dict[str, float] = {}

        def observe(node, inputs, outputs):
            for v, o in zip(node.outputs, outputs):
                if o.dtype.kind == "f" and o.size:
                    lo[v.name] = min(lo.get(v.name, 0.0), float(o.min()))
                    hi[v.name] = max(hi.get(v.name, 0.0), float(o.max()))

        sel = graph.find("SelectRows")
        interp = Interpreter(graph, cache_weights=False)  # int8 and shadow weights are derived per load: keep none
        interp.run(ids, observer=observe, select_rows=np.arange(len(ids)) if sel else None)
        # Some values have a bound that holds for every token, not just the tokens the
        # calibration text happened to use: the embedding table's range, and for
        # RMSNorm |y_i| <= sqrt(features) * |offset + w_i| (one spike takes all the norm).
        for node in graph.find("Embedding"):
            table = interp.weight(node, "table") * np.float32(node.attrs["scale"])
            self._widen(lo, hi, node.outputs[0].name, float(table.min()), float(table.max()))
        for node in graph.find("QEmbedding"):
            codes, zp = interp.weight(node, "codes"), node.attrs["zero_point"]
            per_token = (codes.max(axis=0), codes.min(axis=0)) if node.attrs["transposed"] else (codes.max(axis=1), codes.min(axis=1))
            s = interp.weight(node, "row_scale") * np.float32(node.attrs["scale"])
            ends = np.concatenate([(per_token[0].astype(np.float32) - zp) * s, (per_token[1].astype(np.float32) - zp) * s])
            self._widen(lo, hi, node.outputs[0].name, float(ends.min()), float(ends.max()))
        for node in graph.find("RMSNorm"):
            w = np.abs(interp.weight(node, "weight") + np.float32(node.attrs["offset"]))
            bound = float(np.sqrt(node.inputs[0].shape[1]) * w.max())
            self._widen(lo, hi, node.outputs[0].name, -bound, bound)
        # Linear results and the MLP's gated products are bounded by their operands'
        # ranges (interval arithmetic), in graph order. Residual sums are not: the
        # bounds would compound over the layers and cost the stream its precision.
        for node in graph.nodes:
            if node.op == "QLinear":
                # the NPU result is bounded by its clipped input: |y_j| <= c * sum_i |W_ij| (+ |b_j|)
                a = node.attrs
                c = max(a["x_zero_point"], 255 - a["x_zero_point"]) * a["x_scale"]
                w = np.abs(interp.weight(node, "qweight").astype(np.float32) - a["w_zero_point"]) * interp.weight(node, "wscale")[None, :]
                bound = c * w.sum(axis=0)
                b = interp.weight(node, "bias")
                if b is not None:
                    bound = bound + np.abs(b)
                self._widen(lo, hi, node.outputs[0].name, -float(bound.max()), float(bound.max()))
                for user, _ in node.outputs[0].uses:  # a merged projection's parts (fuse_sibling_linears): their own columns
                    if user.op == "Slice":
                        part = float(bound[user.attrs["start"] : user.attrs["end"]].max())
                        self._widen(lo, hi, user.outputs[0].name, -part, part)
            elif node.op == "Mul" and all(v.name in lo for v in node.inputs):
                a, b = (max(-lo[v.name], hi[v.name]) for v in node.inputs)
                self._widen(lo, hi, node.outputs[0].name, -a * b, a * b)
        ctx.put(ValueRanges({k: (lo[k], hi[k]) for k in lo}, len(ids)))
        return PassResult(False)

    @staticmethod
    def _widen(lo: dict, hi: dict, v: str, a: float, b: float) -> None:
        lo[v] = min(lo.get(v, 0.0), a)
        hi[v] = max(hi.get(v, 0.0), b)
