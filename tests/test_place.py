"""place: the cost model puts chunk-sized quantized subgraphs on the NPU, one-row decode on the CPU."""

from __future__ import annotations

import json

import pytest

from conftest import plan_small


def test_prefill_on_npu_decode_on_cpu(tmp_path):
    from llmc.analyses import ChunkPlan, Placement

    graph, ctx = plan_small(tmp_path)
    pl = ctx.get(Placement)
    plan = ctx.get(ChunkPlan)
    graphs = [s.name for s in plan.steps if s.kind == "graph" and s.name != "head"
              and any(graph.node(n).op == "QLinear" for n in plan.subgraph(s.name).nodes)]
    ops = [s.name for s in plan.steps if s.kind == "op"]
    assert len(graphs) == 16 and all(pl.prefill[g] == "npu" for g in graphs)
    assert all(pl.decode[g] == "cpu" for g in graphs)  # launch + two hand-offs dwarf a one-row matmul
    assert all(pl.prefill[o] == pl.decode[o] == "cpu" for o in ops)
    for g in graphs:  # the choice is the cheaper one, hand-offs included
        c = pl.costs[g]
        assert c.prefill["npu"] + 2 * pl.sync_s < c.prefill["cpu"]
        assert c.decode["npu"] + 2 * pl.sync_s >= c.decode["cpu"]
    assert "npu" not in pl.costs[ops[0]].prefill
    # a lone residual Add is not worth a launch and two hand-offs
    tail = [s.name for s in plan.steps if s.kind == "graph" and [graph.node(n).op for n in plan.subgraph(s.name).nodes] == ["Add"]]
    assert tail and all(pl.prefill[t] == "cpu" for t in tail)


def test_profile_without_npu_and_forced_placement(tmp_path):
    from llmc.analyses import ChunkPlan, Placement
    from llmc.device_profile import load

    cpu_only = load("8gen3").as_json()
    cpu_only["numbers"] = {k: v for k, v in cpu_only["numbers"].items() if not k.startswith("npu.") and k != "sync_s"}
    p = tmp_path / "cpuonly.json"
    p.write_text(json.dumps(cpu_only))
    _, ctx = plan_small(tmp_path, profile=str(p))
    assert set(ctx.get(Placement).prefill.values()) == set(ctx.get(Placement).decode.values()) == {"cpu"}

    _, ctx = plan_small(tmp_path, placement="npu")
    pl = ctx.get(Placement)
    for st in ctx.get(ChunkPlan).steps:
        want = "npu" if st.kind == "graph" else "cpu"
        assert pl.prefill[st.name] == pl.decode[st.name] == want

    with pytest.raises(Exception, match="--placement 'gpu'"):
        plan_small(tmp_path, placement="gpu")
