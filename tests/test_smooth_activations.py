"""smooth_activations: power-of-two SmoothQuant factors folded into norms, value and up projections."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import CHUNK, MAX_CONTEXT

IDS = [5, 9, 17, 33, 4, 60, 21, 8, 99, 12, 7, 41]


def _ctx(model_dir, **kw):
    import torch
    import transformers as T

    from llmc.lift import lift, trace
    from llmc.pass_manager import CompileOptions, ModelInputs, PassContext

    m = T.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    tok = T.AutoTokenizer.from_pretrained(model_dir)
    g = lift(trace(m, CHUNK), m)
    opts = CompileOptions(target="npu", chunk=CHUNK, max_context=MAX_CONTEXT, calib_tokens=128, **kw)
    return g, PassContext(opts, ModelInputs(lambda t: tok(t)["input_ids"], "test-" + str(model_dir)))


def _run(g, ctx, pipeline):
    from llmc.pass_manager import parse_pipeline, run_pipeline
    from llmc.passes import REGISTRY

    run_pipeline(g, parse_pipeline(pipeline, REGISTRY), ctx)


def _logits(g):
    from llmc.interpreter import Interpreter

    return Interpreter(g).run(IDS)


def test_power_of_two_factors():
    from llmc.passes.smooth_activations import MAX_EXPONENT, power_of_two_factors

    a = np.array([64.0, 1.0, 0.0, 4.0, 1e30, np.inf])
    w = np.array([1.0, 4.0, 1.0, 0.0, 1.0, 1.0])
    k = power_of_two_factors(a, w, 0.5)
    # sqrt(64 / 1) = 2^3; sqrt(1 / 4) = 2^-1; no factor where a maximum is zero or not finite; clipped
    assert k.tolist() == [3, -1, 0, 0, MAX_EXPONENT, 0]
    assert power_of_two_factors(np.array([8.0]), np.array([2.0]), 1.0).tolist() == [3]  # alpha 1: all of it into the weights
    assert power_of_two_factors(np.array([8.0]), np.array([2.0]), 0.0).tolist() == [-1]  # alpha 0: 1 / max|w|


@pytest.mark.parametrize("family, sites", [("llama", {"norm", "attention", "up"}), ("qwen2", {"norm", "attention", "up"}),
                                           ("phi", {"norm", "attention"})])
def test_float_model_unchanged_and_ranges_divided_exactly(model_dirs, calib_words, family, sites):
    """Power-of-two factors leave the float model bit for bit as it was (so the recalibrated statistics
    are the first ones divided by 2^k, exactly), with the division folded into a norm (Phi: a
    LayerNorm with a bias), the value projection (Qwen2 and Phi: with its bias) and the up projection
    (Phi has no gated product: fc2 reads a GELU, and stays as it is)."""
    from llmc.analyses import CalibrationStats, SmoothingPlan

    g, ctx = _ctx(model_dirs(family), calib_file=str(calib_words), smooth_alpha=0.5)
    _run(g, ctx, "dce,calibrate")
    before_stats = ctx.get(CalibrationStats)
    before = _logits(g)
    _run(g, ctx, "smooth_activations")
    assert not ctx.has(CalibrationStats)  # the smoothed model needs its own statistics
    plan = ctx.get(SmoothingPlan)
    assert {i.site for i in plan.inputs.values()} == sites
    np.testing.assert_array_equal(_logits(g), before)
    _run(g, ctx, "calibrate")
    after_stats = ctx.get(CalibrationStats)
    for name, s in plan.inputs.items():
        assert any(s.exponents), name
        want = before_stats.inputs[name].channel_absmax * np.exp2(-np.array(s.exponents, np.float64)).astype(np.float32)
        np.testing.assert_array_equal(after_stats.inputs[name].channel_absmax, want)
        assert s.spread_after <= s.spread_before * 2  # the spread is what the factors narrow (to within rounding to 2^k)


def test_query_heads_of_a_kv_group_share_factors(model_dirs, calib_words):
    """o_proj's input channel (head, j) reads kv head head // group's values: one factor per (kv head, j)."""
    from llmc.analyses import SmoothingPlan

    g, ctx = _ctx(model_dirs("llama"), calib_file=str(calib_words), smooth_alpha=0.5)
    _run(g, ctx, "dce,calibrate,smooth_activations")
    (attn,) = [n for n in g.find("Attention") if n.attrs["layer"] == 0]
    h, kv, d = attn.attrs["num_heads"], attn.attrs["num_kv_heads"], attn.attrs["head_dim"]
    assert h > kv
    k = np.array(ctx.get(SmoothingPlan).inputs[attn.outputs[0].name].exponents).reshape(kv, h // kv, d)
    assert (k == k[:, :1, :]).all() and k.any()


def test_planted_outlier_channel_moves_into_the_weights(model_dirs, calib_words):
    """A channel 64x larger than the rest gets a positive exponent and ends near the others."""
    from llmc.analyses import SmoothingPlan

    g, ctx = _ctx(model_dirs("llama"), calib_file=str(calib_words), smooth_alpha=0.5)
    norm = g.node("model.layers.1.post_attention_layernorm")
    ref = norm.weights["weight"]
    boosted = np.array(g.weights.load(ref.name), np.float32)
    boosted[7] *= 64.0
    norm.weights["weight"] = g.weights.add(ref.name + ".boosted", ref.shape, ref.dtype, lambda: boosted)
    _run(g, ctx, "dce,calibrate,smooth_activations")
    s = ctx.get(SmoothingPlan).inputs[norm.outputs[0].name]
    k = np.array(s.exponents)
    assert k[7] >= np.median(k) + 2  # sqrt(64) = 2^3 more than its neighbours, give or take rounding
    assert s.spread_after < s.spread_before / 4


def test_smoothing_needs_a_second_calibration(model_dirs, calib_words):
    from llmc.errors import PipelineError

    g, ctx = _ctx(model_dirs("llama"), calib_file=str(calib_words))
    with pytest.raises(PipelineError, match="extract_shadow_outliers needs CalibrationStats"):
        _run(g, ctx, "dce,calibrate,smooth_activations,extract_shadow_outliers")


def test_refused_after_quantize_kv_cache(model_dirs, calib_words):
    from llmc.errors import PassError

    g, ctx = _ctx(model_dirs("llama"), calib_file=str(calib_words))
    with pytest.raises(PassError, match="quantize_kv_cache has already set") as e:
        _run(g, ctx, "dce,calibrate,quantize_kv_cache,smooth_activations")
    assert "before quantize_kv_cache" in e.value.hint


def test_calibration_cache_tells_the_smoothed_model_apart(model_dirs, calib_words, tmp_path):
    """The second calibrate must not load the first one's statistics from the cache: its key names
    the smoothed weights."""
    from llmc.analyses import CalibrationStats

    g, ctx = _ctx(model_dirs("llama"), calib_file=str(calib_words), cache_dir=str(tmp_path), smooth_alpha=0.5)
    _run(g, ctx, "dce,calibrate")
    first = ctx.get(CalibrationStats)
    _run(g, ctx, "smooth_activations,calibrate")
    name = "model.layers.0.input_layernorm"
    assert not np.array_equal(ctx.get(CalibrationStats).inputs[name].channel_absmax, first.inputs[name].channel_absmax)
    assert len(list((tmp_path / "calibration").glob("*.npz"))) == 2


def test_pipeline_insertion_order():
    from llmc.compile import with_kv_cache, with_smoothing

    names = with_smoothing(["dce", "calibrate", "extract_shadow_outliers"])
    assert names == ["dce", "calibrate", "smooth_activations", "calibrate", "extract_shadow_outliers"]
    assert with_smoothing(names) == names
    assert with_kv_cache(names) == ["dce", "calibrate", "smooth_activations", "calibrate", "quantize_kv_cache", "extract_shadow_outliers"]


def test_cli_smooth_alpha_end_to_end(model_dirs, calib_words, tmp_path):
    """`--smooth-alpha` adds the pass and its calibration; `--no-shadow` smooths by default; the report
    says what was done; the bundle runs; on another target the flag is refused."""
    from click.testing import CliRunner

    from llmc.cli import cli
    from llmc.passes.smooth_activations import NO_SHADOW_ALPHA
    from llmc.runtime import Session

    base = [str(model_dirs("llama")), "--target", "npu", "--chunk", str(CHUNK), "--max-context", str(MAX_CONTEXT), "--calib", str(calib_words),
            "--calib-tokens", "128", "--no-cache", "--quiet"]
    for extra, alpha in ((["--smooth-alpha", "0.6", "--kv-cache", "int8"], 0.6), (["--no-shadow"], NO_SHADOW_ALPHA)):
        out = tmp_path / f"b{alpha}"
        r = CliRunner().invoke(cli, ["compile", *base, "-o", str(out), *extra])
        assert r.exit_code == 0, r.output
        assert "calibrate,smooth_activations,calibrate," in r.output
        report = json.loads((out / "report.json").read_text())
        sm = report["smoothing"]
        # per layer: q/k/v and gate/up behind their norms, o_proj, down_proj; and the LM head behind the final norm
        assert sm["alpha"] == alpha and sm["by_site"] == {"norm": 5, "attention": 2, "up": 2}
        s = Session(out)
        assert len(s.generate(IDS, 3, stop_at_eos=False).token_ids) == 3
        s.close()
    r = CliRunner().invoke(cli, ["compile", str(model_dirs("llama")), "-o", str(tmp_path / "cpu"), "--smooth-alpha", "0.5", "--quiet"])
    assert r.exit_code == 2 and "--smooth-alpha has no effect here" in r.output, r.output
    r = CliRunner().invoke(cli, ["compile", *base, "-o", str(tmp_path / "bad"), "--smooth-alpha", "0"])
    assert r.exit_code == 2 and not (tmp_path / "bad").exists()
