"""calibrate_ranges: observe the range of every value of the quantized graph.

Backends that need every tensor quantized (the QNN HTP backend: 16-bit QDQ on
norms, residual adds and Linear outputs) need a range for each value of the
graph as it will run, after ``quantize``. This pass runs the IR (with its
fake-quant and shadow semantics) on the first ``min(--calib-tokens, 512)``
calibration tokens and records ``[min, max]`` of every node output.

Produces :class:`llmc.analyses.ValueRanges`; the IR is unchanged.
"""

from __future__ import annotations

import numpy as np

from llmc.analyses import ValueRanges
from llmc.errors import CompileError
from llmc.ir import Graph
from llmc.pass_manager import Pass, PassContext, PassResult
from llmc.passes.calibrate import Calibrate, default_corpus

MAX_TOKENS = 512


class CalibrateRanges(Pass):
    name = "calibrate_ranges"
    summary = "record [min, max] of every value of the quantized graph (for full-QDQ backends)"
    produces = (ValueRanges,)

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        from pathlib import Path

        from llmc.interpreter import Interpreter

        if ctx.inputs.encode is None:
            raise CompileError("range calibration needs the model's tokenizer, and this model has none")
        opts = ctx.options
        text = Path(opts.calib_file).read_text(encoding="utf-8", errors="replace") if opts.calib_file else default_corpus()[1]
        ids = Calibrate._tokens(ctx.inputs.encode, text, min(opts.calib_tokens, MAX_TOKENS))
        lo: dict[str, float] = {}
        hi: dict[str, float] = {}

        def observe(node, inputs, outputs):
            for v, o in zip(node.outputs, outputs):
                if o.dtype.kind == "f" and o.size:
                    lo[v.name] = min(lo.get(v.name, 0.0), float(o.min()))
                    hi[v.name] = max(hi.get(v.name, 0.0), float(o.max()))

        sel = graph.find("SelectRows")
        Interpreter(graph).run(ids, observer=observe, select_rows=np.arange(len(ids)) if sel else None)
        ctx.put(ValueRanges({k: (lo[k], hi[k]) for k in lo}, len(ids)))
        return PassResult(False)
