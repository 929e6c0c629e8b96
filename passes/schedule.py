"""schedule: order prefill subgraphs across chunks, out of order (llm.npu).

A prompt of k chunks is a DAG of tasks (chunk i, step j) held in networkx:
within a chunk a step depends on the steps producing its inputs, and the
attention of layer l in chunk i depends on the attention of layer l in chunk
i-1 (it appends to and reads the KV cache). Each processor runs one task at a
time; a task placed on a different processor than its producer starts
``sync_s`` after it.

Two timelines are simulated with the cost model:

* ``in-order``: chunk after chunk, step after step, one task at a time — what a
  runtime without a schedule does;
* ``out-of-order``: list scheduling; whenever a processor is free it takes the
  ready task with the best llm.npu score: on the CPU, the largest total time of
  NPU tasks its completion unblocks (``+ΣT``); on the NPU the smallest total
  time it unblocks (``-ΣT``); ties go to the earlier chunk, then the earlier step.

The reported order is the out-of-order one unless it is slower. Orders are kept
for every chunk count up to ``max_context / C`` (``Schedule.orders``), so the
runtime follows the one that fits the prompt. The LM head steps (after
``SelectRows``) run once, after the last chunk, and are not part of the orders.

When every prefill graph is placed on the CPU and ``fuse_cpu_decode``'s
program has chunk-row instances, the runtime prefills through that program
instead (chunk after chunk); ``Schedule.cpu_program_s`` prices it and
``prefill_s`` uses it. The timelines still describe the chunk program.

When the decode graph also has a chunk instance and the CPU runs both phases,
the runtime prefills with it, one call per chunk (the last chunk at its own
length, its last row scored inside): ``Schedule.chunk_graph_s`` prices that and
``prefill_s`` is it (the timelines and ``head_s`` keep describing the chunk
program, with its head after the last chunk). Otherwise:

When decode runs the one-graph decode (``fuse_decode_graph``, the placement
keeping decode on the CPU), the runtime ends prefill in it as ``Session.prefill``
does: a tail of up to C / ``TAIL_DIVISOR`` tokens after the last whole chunk and
the last token are decode steps, and the last token always is when every
prefill graph is on the CPU too. When every prefill graph takes a last chunk at
its own length (``Subgraph.dynamic_rows``: CPU bundles, and the CPU program)
nothing is padded: only the last token is a decode step, and the last chunk is
priced at its own rows. The timelines then cover the tokens before
them and ``Schedule.head_s`` prices those steps instead of the LM head.

Produces :class:`llmc.analyses.Schedule`; the IR is unchanged.
"""

from __future__ import annotations

import logging
import math

from llmc.analyses import ChunkPlan, DecodePlan, Placement, Schedule, Task, Timeline
from llmc.cost_model import CostModel
from llmc.ir import Graph
from llmc.pass_manager import Pass, PassContext, PassResult
from llmc.passes.place import cost_model, prompt_len
from llmc.runtime.session import tokens_in_graph

log = logging.getLogger(__name__)

MAX_STORED_ORDERS = 16  # chunk counts with an order of their own in the bundle; larger prompts reuse the last


def head_steps(graph: Graph, plan: ChunkPlan | DecodePlan) -> set[int]:
    """Indices of the steps downstream of row selection (the LM head on selected rows)."""
    tainted: set[str] = set()
    out: set[int] = set()
    for i, s in enumerate(plan.steps):
        if (s.kind == "op" and graph.node(s.name).op == "SelectRows") or tainted.intersection(s.inputs):
            out.add(i)
            tainted.update(s.outputs)
    return out


class _Problem:
    """The task DAG of a k-chunk prefill and every task's processor and predicted seconds."""

    def __init__(self, graph: Graph, cm: CostModel, placement: Placement, k: int, tokens: int) -> None:
        import networkx as nx

        plan = cm.plan
        c = plan.chunk
        heads = head_steps(graph, plan)
        self.steps = [j for j in range(len(plan.steps)) if j not in heads]
        producer = {}
        for j in self.steps:
            for v in plan.steps[j].outputs:
                producer[v] = j
        attention = [j for j in self.steps if plan.steps[j].kind == "op" and graph.node(plan.steps[j].name).op == "Attention"]
        exact = exact_chunks(plan)
        dag = nx.DiGraph()
        for i in range(k):
            n = min(c, tokens - i * c)
            for j in self.steps:
                step = plan.steps[j]
                proc = placement.prefill[step.name]
                if j in attention or (step.kind == "op" and graph.node(step.name).op == "ShadowOutliers") or n < c:
                    cost = cm.step_seconds(step, n if exact else c, n, i * c + n, proc)
                else:  # a full chunk of a step that does not depend on the context: placed with this cost
                    cost = placement.costs[step.name].prefill[proc]
                dag.add_node((i, j), proc=proc, cost=cost)
                for v in step.inputs:
                    if v in producer:
                        dag.add_edge((i, producer[v]), (i, j))
            if i:
                for j in attention:
                    dag.add_edge((i - 1, j), (i, j))
        self.dag = dag
        self.sync = placement.sync_s

    def in_order(self) -> Timeline:
        tasks = []
        t = 0.0
        prev = None
        for node in sorted(self.dag.nodes):
            d = self.dag.nodes[node]
            if prev is not None and prev != d["proc"]:
                t += self.sync
            tasks.append(Task(node[0], node[1], d["proc"], t, t + d["cost"]))
            t += d["cost"]
            prev = d["proc"]
        return _timeline("in-order", tasks)

    def out_of_order(self) -> Timeline:
        dag = self.dag
        left = {v: dag.in_degree(v) for v in dag.nodes}
        frontier = {v for v, d in left.items() if d == 0}
        end: dict[tuple[int, int], float] = {}
        free = {"npu": 0.0, "cpu": 0.0}
        tasks = []

        def ready(v) -> float:
            p = dag.nodes[v]["proc"]
            return max((end[u] + (self.sync if dag.nodes[u]["proc"] != p else 0.0) for u in dag.predecessors(v)), default=0.0)

        def score(v) -> float:
            p = dag.nodes[v]["proc"]
            unblocked = [s for s in dag.successors(v) if left[s] == 1]
            if p == "cpu":
                return sum(dag.nodes[s]["cost"] for s in unblocked if dag.nodes[s]["proc"] == "npu")
            return -sum(dag.nodes[s]["cost"] for s in unblocked)

        while frontier:
            best = None
            for p in ("npu", "cpu"):
                cands = [(ready(v), v) for v in frontier if dag.nodes[v]["proc"] == p]
                if not cands:
                    continue
                t0 = max(free[p], min(r for r, _ in cands))
                avail = [v for r, v in cands if r <= t0]
                v = min(avail, key=lambda v: (-score(v), v))
                if best is None or t0 < best[0]:
                    best = (t0, p, v)
            t0, p, v = best
            e = t0 + dag.nodes[v]["cost"]
            tasks.append(Task(v[0], v[1], p, t0, e))
            end[v] = e
            free[p] = e
            frontier.discard(v)
            for s in dag.successors(v):
                left[s] -= 1
                if left[s] == 0:
                    frontier.add(s)
        return _timeline("out-of-order", tasks)


def _timeline(policy: str, tasks: list[Task]) -> Timeline:
    tasks = sorted(tasks, key=lambda t: (t.start, t.chunk, t.step))
    busy = {"npu": 0.0, "cpu": 0.0}
    for t in tasks:
        busy[t.processor] += t.end - t.start
    return Timeline(policy, tuple(tasks), max((t.end for t in tasks), default=0.0), busy["npu"], busy["cpu"])


class ScheduleSteps(Pass):
    name = "schedule"
    summary = "out-of-order prefill order across chunks (llm.npu greedy rule); simulated timelines, bubble rate, predicted latency"
    requires = (ChunkPlan, Placement)
    produces = (Schedule,)

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        cm = cost_model(graph, ctx)
        placement = ctx.get(Placement)
        plan = cm.plan
        c = plan.chunk
        tokens = prompt_len(ctx)
        decode_on_cpu = all(placement.decode[s.name] == "cpu" for s in plan.steps if s.kind == "graph")
        one_processor = all(p == "cpu" for p in placement.prefill.values())  # nothing to overlap: in order is optimal
        # prompt tokens the runtime feeds through the decode graph (a tail and the last one), as Session.prefill
        dp = cm.decode_plan
        cpu_program = dp is not None and one_processor and all(c in sub.row_counts for sub in dp.subgraphs)  # prefills, as the runtime
        exact = exact_chunks(dp if cpu_program else plan)
        # the decode graph's chunk instance prefills when the CPU runs both phases, as Session.prefill
        chunk_graph = decode_on_cpu and one_processor and cm.decode_graph is not None and len(cm.decode_graph.subgraph.row_counts) > 1
        in_graph = tokens_in_graph(tokens, c, one_processor, exact) if decode_on_cpu and cm.decode_graph is not None and not chunk_graph else 0
        chunked = tokens - in_graph  # prompt tokens in chunks
        k_prompt = math.ceil(chunked / c)
        k_max = math.ceil(plan.max_context / c)
        orders = {}
        report = (_timeline("in-order", []), _timeline("out-of-order", []))  # a prompt with no chunk
        for k in sorted({*range(1, min(k_max, MAX_STORED_ORDERS) + 1), k_prompt} - {0}):
            prob = _Problem(graph, cm, placement, k, chunked if k == k_prompt else k * c)
            ino = prob.in_order()
            ooo = ino if one_processor else prob.out_of_order()
            best = ooo if ooo.makespan_s <= ino.makespan_s else ino
            if k <= MAX_STORED_ORDERS:
                orders[k] = best.order
            if k == k_prompt:
                report = (ino, ooo)
        heads = sorted(head_steps(graph, plan))
        if in_graph:  # the decode graph scores the last token, after the tail
            head_s = sum(cm.decode_graph_seconds(chunked + i + 1) for i in range(in_graph))
        else:
            head_s = _chain_seconds(cm, placement, [plan.steps[j] for j in heads], "prefill", tokens)
        if decode_on_cpu and cm.decode_graph is not None:
            decode_s = cm.decode_graph_seconds(tokens)  # the runtime's one-graph decode
        elif dp is not None and decode_on_cpu:
            decode_s = sum(cm.step_seconds(s, 1, 1, tokens, "cpu") for s in dp.steps)  # the runtime's CPU decode program
        else:
            decode_s = _chain_seconds(cm, placement, list(plan.steps), "decode", tokens)
        rows = [min(c, chunked - i * c) for i in range(k_prompt)]  # real rows of each chunk
        cpu_program_s = None
        if cpu_program:
            # the runtime prefills through the CPU program, chunk by chunk (its head steps are head_s's)
            tail = head_steps(graph, dp)
            body = [s for j, s in enumerate(dp.steps) if j not in tail]
            cpu_program_s = sum(cm.step_seconds(s, n if exact else c, n, i * c + n, "cpu") for i, n in enumerate(rows) for s in body)
        chunk_graph_s = None
        if chunk_graph:  # nothing goes through the one-row graph: the chunks hold every token, the last one scored
            chunk_graph_s = sum(cm.chunk_graph_seconds(n, i * c + n, int(i == k_prompt - 1)) for i, n in enumerate(rows))
        ino, ooo = report
        log.info("schedule (%s, %d tokens): in-order %.1f ms (NPU bubbles %.0f%%), out-of-order %.1f ms (%.0f%%); decode %.2f ms/token",
                 cm.profile.name, tokens, ino.makespan_s * 1e3, ino.npu_bubble_rate * 100, ooo.makespan_s * 1e3, ooo.npu_bubble_rate * 100, decode_s * 1e3)
        ctx.put(Schedule(tokens, orders, ino, ooo, decode_s, head_s, cpu_program_s, chunk_graph_s))
        return PassResult(False)


def exact_chunks(plan) -> bool:
    """Whether the runtime runs ``plan``'s last chunk at its own length: every graph takes any row
    count up to C (``Subgraph.dynamic_rows``), as Session's ``_exact_chunks``."""
    return bool(plan.subgraphs) and all(s.dynamic_rows for s in plan.subgraphs)


def _chain_seconds(cm: CostModel, placement: Placement, steps, phase: str, keys: int) -> float:
    """Steps run one after another at one row (decode, or the head on the last token)."""
    t = 0.0
    prev = None
    for s in steps:
        p = placement.processor(s.name, phase)
        if prev is not None and p != prev:
            t += placement.sync_s
        t += cm.step_seconds(s, 1, 1, keys, p)
        prev = p
    return t
