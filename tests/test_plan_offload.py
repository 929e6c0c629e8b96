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
    assert any(w.endswith("embed_tokens.weight.q8r") for w in o.row_streamed)  # the embedding's own codes (uint8 head codes)
    assert all(w.endswith(".q8") or "embed" in w for w in o.row_streamed)  # and the codes of streamed projections a correction reads
    # balanced: every layer keeps the same tensors resident, give or take the one tensor the
    # leftover budget adds to some layers
    per_layer: dict[int, set[str]] = {}
    for w in o.resident:
        if layer_of(w) is not None and w.endswith(".q8"):
            per_layer.setdefault(layer_of(w), set()).add(w.split(f"layers.{layer_of(w)}.")[1])
    assert len(per_layer) == 4
    common = set.intersection(*per_layer.values())
    assert common and all(len(v - common) <= 1 for v in per_layer.values())
    # attention first, in every layer: no resident matrix ranks after a streamed one of the same layer
    for layer, kept in per_layer.items():
        ranks = {preservation_rank(w) for w in kept}
        assert 0 in ranks  # K and V first
        streamed_ranks = {preservation_rank(w) for w in o.streamed if layer_of(w) == layer}
        assert not streamed_ranks or max(ranks) <= min(streamed_ranks)
    # prefetching hides I/O: max(T, S/bw) < T + S/bw
    assert o.predicted_decode_s < o.predicted_decode_no_prefetch_s
    # table rows read on demand are not prefetched: both predictions pay them
    from llmc.analyses import Schedule
    from llmc.passes.place import cost_model

    cm = cost_model(graph, ctx)
    rows = cm.row_reads_per_token(set(o.row_streamed))
    t, io = ctx.get(Schedule).decode_s, cm.io_seconds(o.streamed_bytes)
    assert o.predicted_decode_s == pytest.approx(rows + max(t, io))
    assert o.predicted_decode_no_prefetch_s == pytest.approx(rows + t + io)
    embed = next(n for n in graph.nodes if n.op == "QEmbedding").weights["codes"]
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


def test_budget_buys_the_shadow_rows_read_most_often_per_byte(tmp_path):
    """With calibrated channel rates, part of the budget keeps the float shadow rows with the highest
    outlier rate per byte resident: a prefix of that ranking, counted in resident_bytes and in the prediction."""
    import dataclasses

    import numpy as np

    from llmc.analyses import OffloadPlan, Schedule, ShadowPlan
    from llmc.passes.place import cost_model
    from llmc.passes.plan_offload import PlanOffload

    graph, ctx = _plan(tmp_path, "50%")
    no_rates = ctx.get(OffloadPlan)
    assert no_rates.resident_rows == {}  # the assumed plan has no per-channel rates: nothing to rank
    sp = ctx.get(ShadowPlan)
    features = {n.inputs[0].name: n.inputs[0].shape[1] for n in graph.nodes if n.op == "ShadowOutliers"}
    rng = np.random.default_rng(0)
    inputs = {}
    for v, q in sp.inputs.items():
        if q.shadow:
            rates = rng.uniform(0, 0.3, features[v])  # enough row reads per token to outweigh streaming
            rates[rng.choice(len(rates), 8, replace=False)] = 0.9  # a few channels with outliers on most tokens
            q = dataclasses.replace(q, channel_rates=tuple(float(r) for r in rates))
        inputs[v] = q
    ctx.put(dataclasses.replace(sp, inputs=inputs))
    PlanOffload().run(graph, ctx)
    o = ctx.get(OffloadPlan)
    cm = cost_model(graph, ctx)
    assert o.resident_rows and set(o.resident_rows) <= set(o.row_streamed)
    # value per byte of every candidate row; the kept ones are the best of them
    value = {}
    for node in graph.nodes:
        if node.op == "ShadowOutliers" and node.weights["codes"].name in o.row_streamed:
            wt = node.weights["codes"]
            nbytes = wt.nbytes // wt.shape[0]
            for c, r in cm.shadow_row_rates(node):
                value[wt.name, c] = (r * cm.row_read_seconds(nbytes) / nbytes, nbytes)
    kept = {(t, c) for t, rows in o.resident_rows.items() for c in rows}
    assert kept < set(value)
    assert min(value[k][0] for k in kept) >= max(v[0] for k, v in value.items() if k not in kept)
    size = {w.name: w.nbytes for w in graph.weights}
    assert o.resident_bytes == sum(size[w] for w in o.resident) + sum(value[k][1] for k in kept)
    assert o.resident_bytes + o.buffer_bytes <= o.budget_bytes
    rows = cm.row_reads_per_token(set(o.row_streamed), o.resident_rows)
    assert rows < cm.row_reads_per_token(set(o.row_streamed))
    t, io = ctx.get(Schedule).decode_s, cm.io_seconds(o.streamed_bytes)
    assert o.predicted_decode_s == pytest.approx(rows + max(t, io))
    assert o.predicted_decode_no_prefetch_s == pytest.approx(rows + t + io)


def test_leftover_budget_goes_to_one_more_tensor_in_spread_layers(tmp_path):
    """Whole tensors are the unit: what the largest equal share leaves buys the next tensor of as
    many layers as fit, spread over the model, and less than the smallest such tensor stays unused."""
    from llmc.analyses import OffloadPlan
    from llmc.passes.plan_offload import _spread, layer_of

    assert _spread(list(range(8))) == [0, 4, 2, 6, 1, 5, 3, 7]
    graph, ctx = plan_small(tmp_path, memory_budget="50%", config={"num_hidden_layers": 8})
    o = ctx.get(OffloadPlan)
    size = {w.name: w.nbytes for w in graph.weights}
    per_layer: dict[int, set[str]] = {}
    for w in o.resident:
        if layer_of(w) is not None and w.endswith(".q8"):
            per_layer.setdefault(layer_of(w), set()).add(w)
    counts = sorted(len(v) for v in per_layer.values())
    assert counts[0] < counts[-1] <= counts[0] + 1  # some layers hold one tensor more
    streamed_next = min(size[w] for w in o.streamed if layer_of(w) is not None)
    assert o.budget_bytes - (o.resident_bytes + o.buffer_bytes) < streamed_next


def test_head_kept_whole_or_streamed_whole(tmp_path):
    """A matrix outside the layers (a large LM head) is resident or streamed whole; streamed, the ring
    must hold it. Below its size it streams; with room for it, keeping it whole also frees its ring share."""
    from llmc.analyses import OffloadPlan

    where = {}
    for budget in ("60%", "75%"):  # the head is 52% of the weights
        graph, ctx = plan_small(tmp_path, memory_budget=budget, config={"vocab_size": 49152})
        o = ctx.get(OffloadPlan)
        size = {w.name: w.nbytes for w in graph.weights}
        head = max((w for w in list(o.resident) + list(o.streamed) if w.startswith("lm_head")), key=size.get)
        where[budget] = head in o.resident
        assert (o.buffer_bytes < size[head]) == where[budget]  # streamed, the ring holds it whole
        assert o.resident_bytes + o.buffer_bytes <= o.budget_bytes
    assert where == {"60%": False, "75%": True}
