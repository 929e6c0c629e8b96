"""Cost model and device profiles: the formulas behave as documented, profiles carry sources."""

from __future__ import annotations

import json

import pytest

from conftest import plan_small

@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """The SMALL Llama (4 layers, hidden 1024) planned from its config for 8gen3."""
    return plan_small(tmp_path_factory.mktemp("cfg"))


def test_shipped_profiles_have_a_source_for_every_number():
    from llmc import device_profile

    for name in ("8gen2", "8gen3", "8elite"):
        p = device_profile.load(name)
        assert p.has_npu and p.values.keys() == p.sources.keys()
        assert all(len(src) > 20 for src in p.sources.values())
        for key in device_profile.CPU_KEYS + device_profile.NPU_KEYS + device_profile.OTHER_KEYS + ("sync_s",):
            assert p[key] > 0


def test_bad_profiles_are_refused(tmp_path):
    from llmc import device_profile
    from llmc.device_profile import ProfileError

    good = device_profile.load("8gen3").as_json()
    no_source = json.loads(json.dumps(good))
    no_source["numbers"]["cpu.launch_s"]["source"] = ""
    half_npu = json.loads(json.dumps(good))
    del half_npu["numbers"]["npu.weight_bytes_per_s"]
    for data, msg in ((no_source, "non-empty"), (half_npu, "npu.weight_bytes_per_s")):
        p = tmp_path / "p.json"
        p.write_text(json.dumps(data))
        with pytest.raises(ProfileError, match=msg):
            device_profile.load(str(p))
    with pytest.raises(ProfileError, match="unknown device profile"):
        device_profile.load("9gen9")
    with pytest.raises(ProfileError, match="not been measured"):
        device_profile.load("host")  # tests run with an empty LLMC_PROFILE_DIR


def test_roofline_of_linears_and_attention(planned):
    from llmc.analyses import ChunkPlan, ShadowPlan
    from llmc.cost_model import CostModel
    from llmc.device_profile import load

    graph, ctx = planned
    prof = load("8gen3")
    cm = CostModel(graph, ctx.get(ChunkPlan), prof, ctx.get(ShadowPlan), quantized=True)
    q = next(n for n in graph.nodes if n.op == "QLinear" and n.weights["qweight"].shape == (1024, 1024))
    # NPU: weight-streaming bound at chunk 256 (Table 3 of llm.npu), so time does not grow with rows
    t256 = cm.node_seconds(q, 256, 256, 256, "npu")
    assert t256 == pytest.approx(1024 * 1024 / prof["npu.weight_bytes_per_s"])
    assert cm.node_seconds(q, 64, 64, 64, "npu") == pytest.approx(t256)
    # CPU: compute bound at 256 rows, memory bound at one row
    assert cm.node_seconds(q, 256, 256, 256, "cpu") == pytest.approx(2 * 256 * 1024 * 1024 / prof["cpu.int8_ops_per_s"])
    assert cm.node_seconds(q, 1, 1, 1, "cpu") == pytest.approx(1024 * 1024 / prof["cpu.mem_bytes_per_s"])
    a = graph.find("Attention")[0]
    t1, t2 = cm.node_seconds(a, 256, 256, 512, "cpu"), cm.node_seconds(a, 256, 256, 1024, "cpu")
    assert t2 == pytest.approx(2 * t1)
    with pytest.raises(ValueError):
        cm.node_seconds(a, 256, 256, 512, "npu")
    # a float Linear on the NPU would run at the FP16 rate: hundreds of times slower
    fcm = CostModel(graph, ctx.get(ChunkPlan), prof, None, quantized=False)
    lin = type("N", (), {"op": "Linear", "weights": {"weight": type("W", (), {"shape": (1024, 1024)})()}})()
    assert fcm.node_seconds(lin, 256, 256, 256, "npu") > 100 * cm.node_seconds(q, 256, 256, 256, "npu")


def test_shadow_cost_follows_calibrated_channel_rates(planned):
    import dataclasses

    from llmc.analyses import ChunkPlan, ShadowPlan
    from llmc.cost_model import CostModel
    from llmc.device_profile import load

    graph, ctx = planned
    sp = ctx.get(ShadowPlan)
    sh = graph.find("ShadowOutliers")[0]
    x = sh.inputs[0].name
    f = sh.inputs[0].shape[1]
    cold = dataclasses.replace(sp.inputs[x], channel_rates=tuple([0.0] * f))
    hot = dataclasses.replace(sp.inputs[x], channel_rates=tuple([0.5] * f))
    costs = []
    for q in (cold, hot):
        cm = CostModel(graph, ctx.get(ChunkPlan), load("8gen3"), ShadowPlan({**sp.inputs, x: q}, 99.0, 1.0, True), quantized=True)
        assert cm.outlier_channels(x, f, 256) == pytest.approx(0.0 if q is cold else f)
        costs.append(cm.node_seconds(sh, 256, 256, 256, "cpu"))
    assert costs[1] > 10 * costs[0]
