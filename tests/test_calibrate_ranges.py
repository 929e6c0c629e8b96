"""calibrate_ranges: the range of every value of the quantized graph, with analytic bounds where they hold."""

from __future__ import annotations

import numpy as np


def test_linear_results_and_their_slices_get_the_analytic_bound(model_dirs, calib_words):
    """A QLinear's result is bounded by its clipped input times its weights; after q/k/v and gate/up are
    merged (fuse_sibling_linears) each slice keeps the bound of its own columns, so a token the
    calibration text never used cannot saturate q, k or v on the HTP. Every value has a range that
    contains what calibration saw."""
    from test_quantization import _ctx, _run

    from llmc.analyses import ValueRanges
    from llmc.interpreter import Interpreter

    g, ctx = _ctx(model_dirs("llama"), calib_file=str(calib_words))
    _run(g, ctx, "dce,select_logit_rows,calibrate,extract_shadow_outliers,quantize,fuse_sibling_linears,calibrate_ranges")
    ranges = ctx.get(ValueRanges).ranges
    interp = Interpreter(g, cache_weights=False)
    merged = [n for n in g.find("QLinear") if "+" in n.name]
    assert merged
    for node in merged:
        a = node.attrs
        c = max(a["x_zero_point"], 255 - a["x_zero_point"]) * a["x_scale"]
        w = np.abs(interp.weight(node, "qweight").astype(np.float32) - a["w_zero_point"]) * interp.weight(node, "wscale")[None, :]
        bound = c * w.sum(axis=0)
        lo, hi = ranges[node.outputs[0].name]
        assert lo <= -bound.max() * 0.999 and hi >= bound.max() * 0.999
        slices = [u for u, _ in node.outputs[0].uses if u.op == "Slice"]
        for s in slices:
            part = bound[s.attrs["start"] : s.attrs["end"]].max()
            lo, hi = ranges[s.outputs[0].name]
            assert lo <= -part * 0.999 and hi >= part * 0.999, (s.name, lo, hi, part)
    assert any(u.op == "Slice" for n in merged for u, _ in n.outputs[0].uses)  # q/k/v: slices straight off the QLinear
    for node in g.nodes:
        for v in node.outputs:
            if v.dtype == "float32":
                assert v.name in ranges, v.name
