"""schedule: out-of-order issue orders that respect every dependency, beat in-order on the
simulated timeline, and that the runtime follows with exact results."""

from __future__ import annotations


import numpy as np
import pytest

from conftest import CHUNK, MAX_CONTEXT, hf_logits, plan_small


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    return plan_small(tmp_path_factory.mktemp("cfg"))


def _check_order(graph, plan, order, k):
    """Every (chunk, non-head step) once, each after its producers and the previous chunk's attention."""
    from llmc.passes.schedule import head_steps

    heads = head_steps(graph, plan)
    body = [j for j in range(len(plan.steps)) if j not in heads]
    assert sorted(order) == sorted((i, j) for i in range(k) for j in body)
    pos = {t: n for n, t in enumerate(order)}
    producer = {v: j for j in body for v in plan.steps[j].outputs}
    for (i, j), n in pos.items():
        step = plan.steps[j]
        for v in step.inputs:
            if v in producer:
                assert pos[(i, producer[v])] < n, f"chunk {i}: {step.name} before the producer of {v}"
        if i and step.kind == "op" and graph.node(step.name).op == "Attention":
            assert pos[(i - 1, j)] < n, f"attention {step.name} of chunk {i} before chunk {i - 1}"


def test_orders_are_valid_and_out_of_order_wins(planned):
    from llmc.analyses import ChunkPlan, Schedule

    graph, ctx = planned
    sched, plan = ctx.get(Schedule), ctx.get(ChunkPlan)
    assert sorted(sched.orders) == [1, 2, 3, 4]
    for k, order in sched.orders.items():
        _check_order(graph, plan, list(order), k)
    ino, ooo = sched.in_order, sched.out_of_order
    assert ooo.makespan_s < 0.8 * ino.makespan_s
    assert ooo.npu_bubble_rate < ino.npu_bubble_rate
    assert ino.npu_busy_s == pytest.approx(ooo.npu_busy_s) and ino.cpu_busy_s == pytest.approx(ooo.cpu_busy_s)
    # the out-of-order order really interleaves chunks
    chunks = [i for i, _ in sched.orders[4]]
    assert chunks != sorted(chunks)
    # no processor runs two tasks at once
    for proc in ("npu", "cpu"):
        spans = sorted((t.start, t.end) for t in ooo.tasks if t.processor == proc)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))
    assert sched.prefill_s == pytest.approx(ooo.makespan_s + sched.head_s)
    assert sched.decode_s > 0


def test_runtime_follows_an_out_of_order_schedule_exactly(tmp_path, model_dirs):
    """NPU placement on 8gen3 makes the order interleave chunks; the fp32 results stay equal to HF."""
    from llmc.compile import compile_model
    from llmc.runtime import Session, load_manifest

    out = tmp_path / "ooo"
    compile_model(str(model_dirs("llama")), out, chunk=CHUNK, max_context=MAX_CONTEXT, profile="8gen3", placement="npu")
    m = load_manifest(out)
    ids = [int(t) for t in np.random.default_rng(3).integers(4, 120, size=3 * CHUNK + 5)]
    order = [tuple(t) for t in m["schedule"]["orders"]["4"]]
    assert [i for i, _ in order] != sorted(i for i, _ in order)
    s = Session(out, lazy=True)
    s._chunk_graph = False  # the order is the NPU's (QNN provider); on the CPU provider the decode graph's chunk instance prefills
    s.warmup()
    seen = []
    run_step = s._run_step

    def spy(step, buf, start, n, rows, phase):
        if phase == "prefill" and rows is None:
            seen.append(((start - 0) // CHUNK, s.program.index(step)))
        return run_step(step, buf, start, n, rows, phase)

    s._run_step = spy
    s.reset()
    got = s.prefill(ids, all_logits=True)
    assert seen == order
    np.testing.assert_allclose(got, hf_logits(model_dirs("llama"), ids), atol=2e-4, rtol=1e-4)


def test_all_cpu_prefill_is_priced_on_the_cpu_program(tmp_path, monkeypatch):
    """With every prefill graph on the CPU (and a decode graph without a chunk instance) the runtime
    prefills through fuse_cpu_decode's program at chunk rows, so the prediction does too; with NPU graphs
    in the placement it stays the chunk timelines'."""
    from conftest import plan_small

    from llmc.analyses import DecodePlan, Schedule
    from llmc.passes import fuse_decode_graph

    monkeypatch.setattr(fuse_decode_graph, "why_not_chunks", lambda graph, native=False: "a model whose attention cannot take a chunk")
    graph, ctx = plan_small(tmp_path, placement="cpu")
    s = ctx.get(Schedule)
    assert ctx.has(DecodePlan) and s.cpu_program_s is not None
    assert s.prefill_s == s.cpu_program_s + s.head_s and s.cpu_program_s < s.in_order.makespan_s
    graph, ctx = plan_small(tmp_path)  # 8gen3, auto placement: the NPU runs graphs
    s = ctx.get(Schedule)
    assert s.cpu_program_s is None and s.prefill_s == s.chosen.makespan_s + s.head_s
