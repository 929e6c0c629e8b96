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


def test_w8a8_linears_are_not_merged(model_dirs, calib_words):
    """QLinear keeps one per-tensor weight scale per matrix: the pass leaves it alone."""
    from test_quantization import _ctx, _run

    g, ctx = _ctx(model_dirs("llama"), calib_file=str(calib_words))
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
