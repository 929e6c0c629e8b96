"""fuse_sibling_linears: one matmul for the Linears that read the same value, split by Slices."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import CHUNK


def _ops(g) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in g.nodes:
        out[n.op] = out.get(n.op, 0) + 1
    return out


@pytest.mark.parametrize("family,pre", [("llama", ""), ("qwen2", ""), ("llama", "quantize_int4"), ("qwen2", "quantize_int4")])
def test_merge_keeps_the_numbers(model_dirs, family, pre):
    """q/k/v and gate/up become one matmul each (biases too, qwen2's q/k/v), for float32 and block-quantized
    weights, and the interpreter gives the same logits as before the merge."""
    from test_quantize_int4 import _lift, _quantized

    from llmc.interpreter import Interpreter

    g = _quantized(_lift(model_dirs(family)), ",".join(p for p in ("dce", "select_logit_rows", pre) if p))
    op = "BlockQLinear" if pre else "Linear"
    ids = [int(t) for t in np.random.default_rng(1).integers(4, 120, size=CHUNK)]
    before = Interpreter(g).run(ids, select_rows=np.arange(len(ids)))
    n_before, layers = _ops(g)[op], len(g.find("Attention"))
    _quantized(g, "fuse_sibling_linears")
    g.verify()
    assert _ops(g)[op] == n_before - 3 * layers  # 7 -> 4 per layer
    assert _ops(g).get("Slice", 0) == 5 * layers
    merged = [n for n in g.find(op) if "+" in n.name]
    suffix = ".q4b" if pre else ""
    assert sorted({n.name.split(".", 3)[-1] for n in merged}) == [f"mlp.gate_proj+up_proj{suffix}", f"self_attn.q_proj+k_proj+v_proj{suffix}"]
    if family == "qwen2":
        assert any("bias" in n.weights for n in merged)
    after = Interpreter(g).run(ids, select_rows=np.arange(len(ids)))
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5 * np.abs(before).max())


def test_w8a8_linears_merge_and_the_shadow_corrects_them_whole(model_dirs, calib_words):
    """Per-channel W8A8 QLinears merge like float ones; the one ShadowOutliers of q/k/v (and of gate/up)
    then corrects the merged result whole and the Slices follow it. The interpreter's logits are the
    same numbers, outlier corrections included (the calibration text's own outliers)."""
    from test_quantization import _ctx, _run

    from llmc.interpreter import Interpreter

    g, ctx = _ctx(model_dirs("llama"), calib_file=str(calib_words))
    _run(g, ctx, "dce,select_logit_rows,calibrate,extract_shadow_outliers,quantize")
    layers = len(g.find("Attention"))
    shadows_before = {n.name for n in g.find("ShadowOutliers")}
    ids = [int(t) for t in np.random.default_rng(1).integers(4, 120, size=CHUNK)]
    before = Interpreter(g).run(ids, select_rows=np.arange(len(ids)))
    n_before = _ops(g)["QLinear"]
    _run(g, ctx, "fuse_sibling_linears")
    g.verify()
    assert _ops(g)["QLinear"] == n_before - 3 * layers
    assert _ops(g)["Slice"] == 5 * layers
    assert {n.name for n in g.find("ShadowOutliers")} == shadows_before  # same nodes, by name
    merged = [n for n in g.find("QLinear") if "+" in n.name]
    assert len(merged) == 2 * layers
    for q in merged:
        readers = [u for u, _ in q.outputs[0].uses]
        if "gate_proj" in q.name:  # corrected whole: the shadow reads the merged result and the slices read the shadow
            (sh,) = readers
            assert sh.op == "ShadowOutliers" and sh.attrs["splits"] == [q.outputs[0].shape[-1]]
            assert sorted(u.op for u, _ in sh.outputs[0].uses) == ["Slice", "Slice"]
        else:  # q/k/v: sliced before the correction, whose results attention reads (no graph of slices between them)
            assert [u.op for u in readers] == ["Slice"] * 3
            (sh,) = {u for s in readers for u, _ in s.outputs[0].uses}
            assert sh.op == "ShadowOutliers" and len(sh.outputs) == 3
            assert all(u.op == "Attention" for y in sh.outputs for u, _ in y.uses)
    after = Interpreter(g).run(ids, select_rows=np.arange(len(ids)))
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5 * np.abs(before).max())


def test_per_tensor_w8a8_linears_are_not_merged(model_dirs, calib_words):
    """With one weight scale per matrix (--weight-granularity tensor) the concatenation would need one
    scale for all: the pass leaves those QLinears alone."""
    from test_quantization import _ctx, _run

    g, ctx = _ctx(model_dirs("llama"), calib_file=str(calib_words), weight_granularity="tensor")
    _run(g, ctx, "dce,select_logit_rows,calibrate,extract_shadow_outliers,quantize")
    before = _ops(g)
    _run(g, ctx, "fuse_sibling_linears")
    assert _ops(g) == before


def test_cpu_bundles_merge_and_match_hf(bundles, model_dirs):
    """The default cpu pipeline merges: its chunk graphs hold the merged matmul and the slices; prefill
    matches HF eager."""
    import json

    from conftest import hf_logits

    from llmc.runtime import Session

    b = bundles("llama")
    m = json.loads((b / "manifest.json").read_text())
    assert "fuse_sibling_linears" in m["pipeline"]
    assert any("q_proj+k_proj+v_proj" in w for g in m["graphs"].values() for w in g["weights"])
    ids = [int(t) for t in np.random.default_rng(4).integers(4, 120, size=2 * CHUNK + 3)]
    s = Session(b, "cpu")
    got = s.prefill(ids, all_logits=True)
    ref = hf_logits(model_dirs("llama"), ids)
    np.testing.assert_allclose(got, ref, atol=1e-4 * np.abs(ref).max())


def test_pass_refuses_to_run_after_the_cut(model_dirs):
    """After chunk_static_graphs the plan names the Linears; merging them then is a named error."""
    from test_quantize_int4 import _lift, _quantized

    from llmc.errors import CompileError

    with pytest.raises(CompileError, match="after chunk_static_graphs has cut it") as e:
        _quantized(_lift(model_dirs("llama")), "dce,select_logit_rows,chunk_static_graphs,fuse_sibling_linears")
    assert "before chunk_static_graphs" in e.value.hint
