"""plan_offload: FlexInfer's balanced locking and attention-first preservation under a budget."""

from __future__ import annotations

import pytest

from conftest import plan_small


def _plan(tmp_path, budget):
    return plan_small(tmp_path, memory_budget=budget)


def test_half_budget_is_balanced_and_attention_first(tmp_path):
    from llmc.analyses import OffloadPlan
    from llmc.passes.plan_offload import layer_of, preservation_rank

    graph, ctx = _plan(tmp_path, "50%")
    o = ctx.get(OffloadPlan)
    size = {w.name: w.nbytes for w in graph.weights}
    assert o.budget_bytes == o.weight_bytes // 2
    assert o.resident_bytes + o.buffer_bytes <= o.budget_bytes
    assert o.resident_bytes == sum(size[w] for w in o.resident)
    assert o.streamed_bytes == sum(size[w] for w in o.streamed) > 0
    assert not set(o.resident) & set(o.streamed)
    assert any(w.endswith("embed_tokens.weight") for w in o.row_streamed)
    assert all(w.endswith(".weight_t") or "embed" in w for w in o.row_streamed)
    # balanced: every layer keeps the same tensors resident
    per_layer: dict[int, set[str]] = {}
    for w in o.resident:
        if layer_of(w) is not None and w.endswith(".q8"):
            per_layer.setdefault(layer_of(w), set()).add(w.split(f"layers.{layer_of(w)}.")[1])
    assert len(per_layer) == 4 and len({frozenset(v) for v in per_layer.values()}) == 1
    kept = next(iter(per_layer.values()))
    # attention first: if any FFN matrix is resident, every attention matrix is
    ranks = {preservation_rank(w) for w in kept}
    assert 0 in ranks  # K and V first
    streamed_ranks = {preservation_rank(w) for w in o.streamed if layer_of(w) is not None}
    assert max(ranks) <= min(streamed_ranks)
    # prefetching hides I/O: max(T, S/bw) < T + S/bw
    assert o.predicted_decode_s < o.predicted_decode_no_prefetch_s
    # table rows read on demand are not prefetched: both predictions pay them
    from llmc.analyses import Schedule
    from llmc.passes.place import cost_model

    cm = cost_model(graph, ctx)
    rows = cm.row_reads_per_token(set(o.row_streamed))
    t = ctx.get(Schedule).decode_s + rows
    assert o.predicted_decode_s == pytest.approx(max(t, cm.io_seconds(o.streamed_bytes)))
    assert o.predicted_decode_no_prefetch_s == pytest.approx(t + cm.io_seconds(o.streamed_bytes))
    embed = next(n for n in graph.nodes if n.op == "Embedding").weights["table"]
    small = cm.profile["storage.small_read_s"]
    assert cm.row_read_seconds(100) == small and cm.row_read_seconds(4096 + 4e9) == pytest.approx(small + 1.0)
    assert rows > cm.row_read_seconds(embed.nbytes / embed.shape[0])  # the embedding row and some shadow rows


def test_budgets_order_and_limits(tmp_path):
    from llmc.analyses import OffloadPlan
    from llmc.errors import CompileError

    plans = [_plan(tmp_path, b)[1].get(OffloadPlan) for b in ("30%", "60%", "100%")]
    assert plans[0].resident_bytes < plans[1].resident_bytes < plans[2].resident_bytes
    assert plans[2].streamed == () and plans[2].buffer_bytes == 0
    with pytest.raises(CompileError, match="below the minimum"):
        _plan(tmp_path, "1MB")
    with pytest.raises(CompileError, match="cannot read the size"):
        _plan(tmp_path, "lots")
    _, ctx = _plan(tmp_path, None)
    assert not ctx.has(OffloadPlan)


def test_parse_size():
    from llmc.units import parse_size

    assert parse_size("300MB") == 300_000_000 and parse_size("1.5GiB") == int(1.5 * 2**30) and parse_size("50%", 1000) == 500
    assert parse_size("123") == 123
