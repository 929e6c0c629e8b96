"""plan_offload: which weights stay resident under ``--memory-budget`` (FlexInfer).

Weights the program reads in full (the static subgraphs' matrices) are split
into a resident set and a streamed set; the runtime reads streamed weights from
the bundle for every use, ``prefetch_depth`` steps ahead of the step that needs
them, into a ring of buffers. Rules, after FlexInfer (EuroMLSys'25):

* small weights (vectors: norms, scales, biases; anything under 4 KiB) are
  always resident;
* tables the runtime reads by row (the embedding gather, the shadow-outlier
  weights) are never resident: they are read row by row when a token needs them;
  a table a graph also reads whole (an embedding tied to the LM head) follows
  the graph's choice, and when that is to stream it the op reads it by row;
* *balanced memory locking*: every layer keeps the same share of its matrix
  bytes resident, so each layer streams about the same number of bytes and the
  prefetcher never falls behind on one layer;
* *flexible tensor preservation*: within a layer the resident share goes to
  attention matrices first (K and V, then Q and O: small, read by every token),
  then to FFN matrices.

The budget covers resident weights plus the prefetch ring. Predictions, with
``T`` the compute time per token from the schedule plus the table rows read on
demand (one embedding row, the expected non-hot outlier rows of every shadow
correction, each a small random read) and ``S`` the streamed bytes:
``max(T, S / storage.read_bytes_per_s)`` with prefetching and
``T + S / storage.read_bytes_per_s`` without.

Runs only when ``memory_budget`` is set (bytes, or a percentage of the dense
weight bytes); produces :class:`llmc.analyses.OffloadPlan`.
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
ROW_READ = {"Embedding": ("table",), "ShadowOutliers": ("weight_t",)}
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
        # Op-step weights: tables read by row are never resident; the rest (rotary inv_freq,
        # resident shadow rows) are read in full and stay resident.
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
        def attempt(share: float):
            resident = _balanced(groups, size, share)
            streamed = [w for w in big if w not in resident]
            ring = _ring_bytes(plan, streamed, size, depth)
            return share, resident, streamed, ring, fixed + sum(size[w] for w in resident) + ring

        best = attempt(1.0)
        if best[4] > budget:
            best = attempt(0.0)
            if best[4] > budget:
                raise CompileError(f"--memory-budget {opts.memory_budget} ({format_size(budget)}) is below the minimum of {format_size(best[4])} "
                                   f"for this model (always-resident small weights {format_size(fixed)} plus the prefetch ring)",
                                   hint=f"raise the budget to at least {format_size(best[4])}, or lower --prefetch-depth")
            lo, hi = 0.0, 1.0
            for _ in range(30):  # the largest per-layer resident share whose resident set and ring fit
                trial = attempt((lo + hi) / 2)
                if trial[4] <= budget:
                    best, lo = trial, trial[0]
                else:
                    hi = trial[0]
        share, resident, streamed, ring, used = best
        resident_all = small + extra + [w for w in big if w in resident]
        rows += [w for w in tied if w in streamed]  # the graph streams it whole, the op reads its rows
        s_bytes = sum(size[w] for w in streamed)
        io = cm.io_seconds(s_bytes)
        t = sched.decode_s + cm.row_reads_per_token(set(rows))  # row reads happen when the step runs: not prefetched
        log.info("plan_offload: budget %s, resident %s (share %.0f%% per layer), streamed %s per token, ring %s",
                 format_size(budget), format_size(used - ring), share * 100, format_size(s_bytes), format_size(ring))
        ctx.put(OffloadPlan(budget, total, tuple(resident_all), tuple(streamed), tuple(rows), used - ring, s_bytes, ring, depth,
                            max(t, io), t + io))
        return PassResult(False)


def _balanced(groups: dict[object, list[str]], size: dict[str, int], share: float) -> set[str]:
    """Per group, tensors in preservation order while the group's resident bytes stay within ``share``."""
    resident: set[str] = set()
    for names in groups.values():
        cap = share * sum(size[w] for w in names)
        used = 0
        for w in sorted(names, key=lambda w: (preservation_rank(w), names.index(w))):
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
