"""plan_offload: which weights stay resident under ``--memory-budget`` (FlexInfer).

Weights the program reads in full (the static subgraphs' matrices) are split
into a resident set and a streamed set; the runtime reads streamed weights from
the bundle for every use, ``prefetch_depth`` steps ahead of the step that needs
them, into a ring of buffers. Rules, after FlexInfer (EuroMLSys'25):

* small weights (vectors: norms, scales, biases; anything under 4 KiB) are
  always resident;
* tables the runtime reads by row (the embedding gather, the shadow-outlier
  weights) are not resident as a whole: they are read row by row when a token
  needs them, except the shadow rows the plan keeps (below);
  a table a graph also reads whole (an embedding tied to the LM head) follows
  the graph's choice, and when that is to stream it the op reads it by row;
* *balanced memory locking*: every layer keeps the same share of its matrix
  bytes resident, so each layer streams about the same number of bytes and the
  prefetcher never falls behind on one layer; whole tensors are the unit, so
  what the largest equal share leaves goes to one more tensor in as many layers
  as fit, spread over the model (layers differ by at most one tensor); a matrix
  outside the layers (an untied or tied LM head) is kept whole or streamed
  whole, whichever predicts faster — streamed, it also needs its size in the
  prefetch ring;
* *flexible tensor preservation*: within a layer the resident share goes to
  attention matrices first (K and V, then Q and O: small, read by every token),
  then to FFN matrices.

The budget covers resident weights, resident shadow rows and the prefetch ring.
Predictions per decoded token, with ``T`` the compute time from the schedule,
``R`` the table rows read on demand (one embedding row, the expected outlier
rows of every shadow correction that are not resident, each a small random
read) and ``I = S / storage.read_bytes_per_s`` for the streamed bytes ``S``:
``R + max(T, I)`` with prefetching and ``R + T + I`` without. Row reads are not
prefetched (which rows a token needs is known only when its step runs), so the
token waits for them, and they take the storage device from the prefetcher
while they run: prefetching hides compute behind streaming, not row reads.

*Resident shadow rows*: part of the budget may keep float rows of the shadow
tables in memory, the rows of the input channels calibration saw beyond the
clip range most often per byte (``InputQuant.channel_rates``). A resident row
saves ``p_c`` row reads per token; a resident matrix byte saves one streamed
byte. The pass tries a range of row counts, fits the largest balanced matrix
share in the rest of the budget for each, and keeps the split with the lowest
predicted time per token (with prefetching).

Runs only when ``memory_budget`` is set (bytes, or a percentage of the dense
weight bytes: the weights the graphs read whole, not the embedding and shadow
tables read by row); produces :class:`llmc.analyses.OffloadPlan`.
"""

from __future__ import annotations

import logging
import re

from llmc.analyses import ChunkPlan, OffloadPlan, Schedule
from llmc.errors import CompileError
from llmc.ir import Graph
from llmc.pass_manager import Pass, PassContext, PassResult
from llmc.passes.place import cost_model
from llmc.units import format_size, parse_size

log = logging.getLogger(__name__)

SMALL_BYTES = 4096
ROW_READ = {"Embedding": ("table",), "QEmbedding": ("codes",), "ShadowOutliers": ("codes",)}
# Preservation order inside a layer: lower first. Matched on the weight name.
_PRIORITY = (("k_proj", 0), ("v_proj", 0), ("qkv", 1), ("q_proj", 1), ("o_proj", 1), ("attn", 1), ("dense", 2))
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


def preservation_rank(name: str) -> int:
    for key, rank in _PRIORITY:
        if key in name:
            return rank
    return 3  # FFN and the rest


def layer_of(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


class PlanOffload(Pass):
    name = "plan_offload"
    summary = "resident vs streamed weights under --memory-budget: balanced per layer, attention first; predicted tokens/s"
    requires = (ChunkPlan, Schedule)
    produces = ()  # OffloadPlan, only when a budget is set

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        opts = ctx.options
        if opts.memory_budget is None:
            return PassResult(False)
        plan = ctx.get(ChunkPlan)
        sched = ctx.get(Schedule)
        cm = cost_model(graph, ctx)
        dense: list[str] = []
        for s in plan.subgraphs:
            for w in s.weights:
                if w not in dense:
                    dense.append(w)
        # Op-step weights: tables read by row are not resident as a whole; the rest (rotary
        # inv_freq, the shadow paths' scales and hot_delta) are read in full and stay resident.
        rows: list[str] = []
        extra: list[str] = []
        tied: list[str] = []  # tables read by row that a graph also reads whole (a tied embedding / LM head)
        for st in plan.steps:
            if st.kind == "op":
                node = graph.node(st.name)
                for slot, ref in node.weights.items():
                    by_row = slot in ROW_READ.get(node.op, ())
                    if ref.name in dense:
                        if by_row and ref.name not in tied:
                            tied.append(ref.name)
                        continue
                    into = rows if by_row else extra
                    if ref.name not in rows and ref.name not in extra:
                        into.append(ref.name)
        size = {w: graph.weights[w].nbytes for w in dense + rows + extra}
        small = [w for w in dense if len(graph.weights[w].shape) < 2 or size[w] < SMALL_BYTES]
        big = [w for w in dense if w not in small]
        fixed = sum(size[w] for w in small + extra)
        total = fixed + sum(size[w] for w in big)
        budget = parse_size(opts.memory_budget, total)
        depth = max(int(opts.prefetch_depth), 0)

        groups: dict[object, list[str]] = {}
        for w in big:
            layer = layer_of(w)
            groups.setdefault(layer if layer is not None else f"other:{w}", []).append(w)

        def layout(share: float, resident: set[str], pinned: int):
            """(share, resident, streamed, ring, bytes used) of a resident set with ``pinned`` row bytes."""
            streamed = [w for w in big if w not in resident]
            ring = _ring_bytes(plan, streamed, size, depth)
            return share, resident, streamed, ring, fixed + pinned + sum(size[w] for w in resident) + ring

        def attempt(share: float, pinned: int, whole: frozenset):
            resident = _balanced({g: ws for g, ws in groups.items() if g not in whole}, size, share)
            return layout(share, resident | {w for g in whole for w in groups[g]}, pinned)

        def fit(pinned: int, whole: frozenset = frozenset()):
            """The largest per-layer resident share whose resident set (``whole`` groups all in), ``pinned``
            row bytes and ring fit; None if none does."""
            best = attempt(1.0, pinned, whole)
            if best[4] <= budget:
                return best
            best = attempt(0.0, pinned, whole)
            if best[4] > budget:
                return None
            lo, hi = 0.0, 1.0
            for _ in range(30):
                trial = attempt((lo + hi) / 2, pinned, whole)
                if trial[4] <= budget:
                    best, lo = trial, trial[0]
                else:
                    hi = trial[0]
            return top_up(best, pinned)

        def top_up(best, pinned: int):
            """Spend what the equal share leaves (a layer's next tensor can be larger than the rest of the
            budget over all layers) on one more tensor in as many layers as fit, spread over the layers:
            each layer's first streamed tensor in preservation order that still fits."""
            share, resident, _, _, used = best
            resident = set(resident)
            layers = [g for g in groups if isinstance(g, int) and not all(w in resident for w in groups[g])]
            added = False
            for layer in _spread(layers):
                nxt = next((w for w in _preservation_order(groups[layer]) if w not in resident and used + size[w] <= budget), None)
                if nxt is not None:  # the ring can only shrink as more is resident
                    resident.add(nxt)
                    used += size[nxt]
                    added = True
            return layout(share, resident, pinned) if added else best

        # Weights outside the layers (an LM head) are one tensor each: under a share below 1 they
        # stream whole, and the ring must hold them. Also try keeping them resident outright.
        others = [g for g in groups if not isinstance(g, int)]
        options = [frozenset()] + ([frozenset(others)] if others else [])
        if len(others) > 1:
            options += [frozenset([g]) for g in others]
        # Budget bytes buy time two ways: resident matrix bytes are not streamed, and resident
        # shadow rows are not read one by one. Try shares of the budget for the rows with the
        # highest calibrated outlier rate per byte; keep the split with the fastest decode.
        # (a correction reads by row the codes of the projections it corrects, when they stream: tied tables)
        candidates = _row_candidates(graph, plan, cm, set(rows) | set(tied))
        cum_bytes, cum_saved = [0], [0.0]
        for saved, nbytes, _, _ in candidates:
            cum_bytes.append(cum_bytes[-1] + nbytes)
            cum_saved.append(cum_saved[-1] + saved)
        row_seconds: dict[frozenset, float] = {}  # the tables read by row differ only in a tied table
        chosen = None
        for whole in options:
            for k in _row_counts(len(candidates)):
                got = fit(cum_bytes[k], whole)
                if got is None:
                    break  # more rows fit even less
                streamed_k = got[2]
                rows_k = rows + [w for w in tied if w in streamed_k]
                key = frozenset(rows_k)
                if key not in row_seconds:
                    row_seconds[key] = cm.row_reads_per_token(set(key))
                row_s = row_seconds[key] - cum_saved[k]
                io = cm.io_seconds(sum(size[w] for w in streamed_k))
                # row reads hold both the token and the storage device; depth 0 reads each step's weights when it runs
                t = row_s + (max(sched.decode_s, io) if depth > 0 else sched.decode_s + io)
                if chosen is None or t < chosen[0] - 1e-12:
                    chosen = (t, row_s + sched.decode_s + io, k, got, rows_k)
        if chosen is None:  # not even without shadow rows, in any layout
            floor = min(attempt(0.0, 0, whole)[4] for whole in options)
            raise CompileError(f"--memory-budget {opts.memory_budget} ({format_size(budget)}) is below the minimum of {format_size(floor)} "
                               f"for this model (always-resident small weights {format_size(fixed)} plus the prefetch ring)",
                               hint=f"raise the budget to at least {format_size(floor)}" + (", or lower --prefetch-depth" if depth > 0 else ""))
        predicted, predicted_no_prefetch, k, (share, resident, streamed, ring, used), rows = chosen
        kept: dict[str, list[int]] = {}
        pinned = 0
        for _, nbytes, table, row in candidates[:k]:
            if table in rows:  # a tied table kept resident whole needs no rows of its own
                kept.setdefault(table, []).append(row)
                pinned += nbytes
        share, resident, streamed, ring, used = layout(share, resident, pinned)
        row_s = cm.row_reads_per_token(set(rows), {t: tuple(r) for t, r in kept.items()})
        io = cm.io_seconds(sum(size[w] for w in streamed))
        predicted = row_s + (max(sched.decode_s, io) if depth > 0 else sched.decode_s + io)
        predicted_no_prefetch = row_s + sched.decode_s + io
        resident_rows = {t: tuple(sorted(r)) for t, r in sorted(kept.items())}
        resident_all = small + extra + [w for w in big if w in resident]
        s_bytes = sum(size[w] for w in streamed)
        log.info("plan_offload: budget %s, resident %s (share %.0f%% per layer, %d shadow rows %s), streamed %s per token, ring %s",
                 format_size(budget), format_size(used - ring), share * 100, k, format_size(cum_bytes[k]), format_size(s_bytes), format_size(ring))
        ctx.put(OffloadPlan(budget, total, tuple(resident_all), tuple(streamed), tuple(rows), used - ring, s_bytes, ring, depth,
                            predicted, predicted_no_prefetch, resident_rows))
        return PassResult(False)


def _row_candidates(graph: Graph, plan: ChunkPlan, cm, tables: set[str]) -> list[tuple[float, int, str, int]]:
    """Shadow rows worth keeping resident, best first: (seconds saved per token, bytes, table, row),
    ordered by seconds saved per byte (a row's calibrated outlier rate times one row read)."""
    out = []
    seen: set[str] = set()
    for st in plan.steps:
        if st.kind != "op":
            continue
        node = graph.node(st.name)
        if node.op != "ShadowOutliers":
            continue
        wt = node.weights["codes"]
        if wt.name not in tables or wt.name in seen:
            continue
        seen.add(wt.name)
        rates = cm.shadow_row_rates(node)
        if not rates:
            continue
        nbytes = wt.nbytes // wt.shape[0]
        read_s = cm.row_read_seconds(nbytes)
        out += [(r * read_s, nbytes, wt.name, c) for c, r in rates]
    out.sort(key=lambda c: (-c[0] / c[1], c[2], c[3]))
    return out


def _spread(items: list) -> list:
    """``items`` in an order whose every prefix is spread evenly over the list (bit-reversed positions)."""
    def radical_inverse(i: int) -> float:
        x, f = 0.0, 0.5
        while i:
            x += f * (i & 1)
            i >>= 1
            f /= 2
        return x

    return [items[i] for i in sorted(range(len(items)), key=radical_inverse)]


def _row_counts(n: int) -> list[int]:
    """How many of ``n`` ranked rows to try keeping: none, then about 40 steps growing by ~20% up to all."""
    counts = {0, n}
    k = 16.0
    while k < n:
        counts.add(int(k))
        k *= 1.2
    return sorted(counts)


def _preservation_order(names: list[str]) -> list[str]:
    """A layer's tensors in the order they become resident: attention (K, V first), then FFN; ties in graph order."""
    return sorted(names, key=lambda w: (preservation_rank(w), names.index(w)))


def _balanced(groups: dict[object, list[str]], size: dict[str, int], share: float) -> set[str]:
    """Per group, tensors in preservation order while the group's resident bytes stay within ``share``."""
    resident: set[str] = set()
    for names in groups.values():
        cap = share * sum(size[w] for w in names)
        used = 0
        for w in _preservation_order(names):
            if used + size[w] <= cap + 1e-9:
                resident.add(w)
                used += size[w]
    return resident


def _ring_bytes(plan: ChunkPlan, streamed: list[str], size: dict[str, int], depth: int) -> int:
    """Largest streamed bytes of ``depth + 1`` consecutive graph steps: the step running plus those prefetched.

    Each weight counts with the runtime's buffer for it (rounded for block-aligned O_DIRECT reads).
    """
    from llmc.runtime.residency import buffer_size

    per_step: list[int] = []
    s = set(streamed)
    for st in plan.steps:
        if st.kind == "graph":
            per_step.append(sum(buffer_size(size[w]) for w in plan.subgraph(st.name).weights if w in s))
    if not per_step:
        return 0
    window = depth + 1
    per_step = per_step + per_step[: window - 1]  # the order wraps around from the last step to the first
    return max(sum(per_step[i : i + window]) for i in range(len(per_step) - window + 1))
