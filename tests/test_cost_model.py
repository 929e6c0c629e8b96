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
    # a Slice of a merged projection moves only its own columns, read and written
    sl = next(n for n in graph.nodes if n.op == "Slice" and n.outputs[0].shape[-1] < n.inputs[0].shape[-1])
    width = sl.outputs[0].shape[-1]
    assert cm.node_seconds(sl, 256, 256, 256, "npu") == pytest.approx(256 * 2 * width * 2 / prof["npu.mem_bytes_per_s"])


def test_seven_bit_weights_use_their_own_cpu_rate(planned, tmp_path, monkeypatch):
    """--weight-bits 7 prices chunk QLinears on the CPU at cpu.int8_7bit_ops_per_s (the u8 x s8 kernels a CPU without
    VNNI runs them on) where the profile has it, else at the 8-bit rate; the compile's cost model gets the option."""
    import dataclasses

    from llmc import device_profile
    from llmc.analyses import ChunkPlan, ShadowPlan
    from llmc.cost_model import CostModel
    from llmc.passes.place import cost_model

    graph, ctx = planned
    data = device_profile.load("8gen3").as_json()
    base = data["numbers"]["cpu.int8_ops_per_s"]["value"]
    data["numbers"]["cpu.int8_7bit_ops_per_s"] = {"value": 3 * base, "source": "a test: three times the 8-bit rate"}
    path = tmp_path / "seven.json"
    path.write_text(json.dumps(data))
    q = next(n for n in graph.nodes if n.op == "QLinear" and n.weights["qweight"].shape == (1024, 1024))
    for prof, speedup in ((device_profile.load(str(path)), 3), (device_profile.load("8gen3"), 1)):
        t = {bits: CostModel(graph, ctx.get(ChunkPlan), prof, ctx.get(ShadowPlan), quantized=True, weight_bits=bits).node_seconds(q, 256, 256, 256, "cpu")
             for bits in (8, 7)}
        assert t[8] == pytest.approx(2 * 256 * 1024 * 1024 / base) and t[7] == pytest.approx(t[8] / speedup)
    monkeypatch.setattr(ctx, "options", dataclasses.replace(ctx.options, weight_bits=7, profile=str(path)))
    assert cost_model(graph, ctx).weight_bits == 7


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
    # a chunk's correction runs in 4 blocks of 64 rows, each over the channels expected among its own
    # rows: fewer than among 256 when outliers are rare and spread out; a prime row count is one block
    spread = dataclasses.replace(sp.inputs[x], channel_rates=tuple([0.01] * f))
    cm = CostModel(graph, ctx.get(ChunkPlan), load("8gen3"), ShadowPlan({**sp.inputs, x: spread}, 99.0, 1.0, True), quantized=True)
    assert cm.outlier_channels(x, f, 64) < 0.6 * cm.outlier_channels(x, f, 251)
    assert cm.node_seconds(sh, 256, 256, 256, "cpu") < 0.8 * cm.node_seconds(sh, 251, 251, 256, "cpu")


def test_gemv_table_interpolates_and_extrapolates():
    from llmc.cost_model import gemv_table_seconds

    rows = [[k, n, 1e-5 + 2.0 * k * n / 30e9] for k in (512, 2048) for n in (256, 4096)]
    for k, n, t in rows:  # exact on the grid
        assert gemv_table_seconds(rows, k, n) == pytest.approx(t)
    mid = gemv_table_seconds(rows, 1024, 1024)
    assert gemv_table_seconds(rows, 512, 256) < mid < gemv_table_seconds(rows, 2048, 4096)
    assert gemv_table_seconds(rows, 4096, 4096) == pytest.approx(2 * gemv_table_seconds(rows, 2048, 4096))  # more work, more time
    assert gemv_table_seconds(rows, 100, 100) == pytest.approx(gemv_table_seconds(rows, 512, 256))  # fixed costs below the grid


def test_profile_tables_are_checked(tmp_path):
    from llmc import device_profile
    from llmc.device_profile import ProfileError

    good = device_profile.load("8gen3").as_json()
    good["tables"] = {"cpu.int8_gemv_s": {"rows": [[576, 576, 4e-5], [576, 1536, 7e-5], [1536, 576, 7e-5], [1536, 1536, 1.3e-4]], "source": "measured"}}
    p = tmp_path / "p.json"
    p.write_text(json.dumps(good))
    assert len(device_profile.load(str(p)).tables["cpu.int8_gemv_s"]) == 4
    for bad, msg in (([[576, 576, 4e-5], [576, 1536, 7e-5], [1536, 576, 7e-5]], "full grid"), ([[576, 576, -1.0]], "positive")):
        good["tables"]["cpu.int8_gemv_s"]["rows"] = bad
        p.write_text(json.dumps(good))
        with pytest.raises(ProfileError, match=msg):
            device_profile.load(str(p))


def test_decode_prediction_follows_the_cpu_decode_program(tmp_path):
    """With every decode graph on the CPU the runtime runs the fuse_cpu_decode program: the
    prediction sums its steps (fewer launches, kernels charged at cpu.node_s)."""
    from llmc import device_profile
    from llmc.analyses import ChunkPlan, DecodePlan, Placement, Schedule
    from llmc.passes import FuseCpuDecode, ScheduleSteps
    from llmc.passes.place import cost_model

    prof = device_profile.load("8gen3").as_json()
    prof["numbers"]["cpu.node_s"] = {"value": 2e-6, "source": "test"}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    without = "dce,select_logit_rows,assume_shadow_plan,quantize,chunk_static_graphs,place,schedule,plan_offload"
    graph, ctx = plan_small(tmp_path, profile=str(path), placement="cpu", pipeline=without)
    assert not ctx.has(DecodePlan)
    chunk_s = ctx.get(Schedule).decode_s
    FuseCpuDecode().run(graph, ctx)
    ScheduleSteps().run(graph, ctx)
    fused_s = ctx.get(Schedule).decode_s
    cm = cost_model(graph, ctx)
    steps = ctx.get(DecodePlan).steps
    assert fused_s == pytest.approx(sum(cm.step_seconds(s, 1, 1, 1000, "cpu") for s in steps))
    assert len(steps) < len(ctx.get(ChunkPlan).steps) and 0 < fused_s < chunk_s
    assert all(v == "cpu" for v in ctx.get(Placement).decode.values())
    g = next(s for s in steps if s.kind == "graph" and s.name != "decode_head")
    kernels = sum({"QLinear": 2, "ShadowOutliers": 7 + len(graph.node(n).attrs.get("splits", [])) + (len(graph.node(n).attrs.get("splits", [])) > 1)}
                  .get(graph.node(n).op, 1) for n in cm.subgraph(g.name).nodes)
    bare = cm.profile["cpu.launch_s"] + sum(cm.node_seconds(graph.node(n), 1, 1, 1000, "cpu") for n in cm.subgraph(g.name).nodes)
    assert cm.step_seconds(g, 1, 1, 1000, "cpu") == pytest.approx(bare + 2e-6 * kernels)


def test_one_row_graphs_use_the_table_of_the_threads_they_run_on(tmp_path, monkeypatch):
    """A one-row CPU graph that reads less than the runtime's one-thread limit is priced
    with the one-thread int8 table, a bigger one with the all-threads table."""
    import llmc.cost_model
    from llmc import device_profile
    from llmc.analyses import ChunkPlan
    from llmc.passes.place import cost_model

    prof = device_profile.load("8gen3").as_json()
    grid = [[k, n] for k in (512, 4096) for n in (256, 8192)]
    prof["tables"] = {"cpu.int8_gemv_s": {"rows": [r + [1e-6] for r in grid], "source": "test"},
                      "cpu.int8_gemv_1t_s": {"rows": [r + [1e-2] for r in grid], "source": "test"}}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    graph, ctx = plan_small(tmp_path, profile=str(path))
    cm = cost_model(graph, ctx)
    steps = [st for st in ctx.get(ChunkPlan).steps
             if st.kind == "graph" and any(graph.node(n).op == "QLinear" for n in cm.subgraph(st.name).nodes)]
    assert steps and all(cm.read_bytes(st) < llmc.cost_model.ONE_THREAD_BYTES for st in steps)  # SMALL's graphs are all small
    # 10 ms per QLinear on one thread dominates every other term; 1 us does not
    assert all(cm.step_seconds(st, 1, 1, 1000, "cpu") > 1e-2 for st in steps)
    monkeypatch.setattr(llmc.cost_model, "ONE_THREAD_BYTES", 0)  # every graph now runs on all threads
    assert all(cm.step_seconds(st, 1, 1, 1000, "cpu") < 1e-2 for st in steps)
