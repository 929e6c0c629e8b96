"""The cost model: predicted seconds of every program step on every processor.

All predictions come from a :class:`~llmc.device_profile.DeviceProfile` and the
work each IR node does; nothing is fitted to end-to-end runs. Formulas (R rows
in the step, S keys attended, F features, N outputs, ``rate`` and ``bw`` from the
profile, ``max`` = roofline: a node is bound by compute or by memory traffic):

* ``Linear`` ``[R, K] x [K, N]``:
  CPU ``max(2RKN / cpu.fp32_flops_per_s, 4KN / cpu.mem_bytes_per_s)``;
  NPU float (never chosen in practice) ``2RKN / npu.fp16_ops_per_s``.
* ``QLinear`` (int8 weights):
  NPU ``max(2RKN / npu.int8_ops_per_s, KN / npu.weight_bytes_per_s)``;
  CPU ``max(2RKN / cpu.int8_ops_per_s, KN / cpu.mem_bytes_per_s, 2KN /
  cpu.int8_gemv_ops_per_s)`` (the last: one pass of the weights through the
  integer kernel, which on CPUs without a fast integer GEMV bounds decode;
  a profile with the measured table ``cpu.int8_gemv_s`` interpolates it at
  (K, N) instead, see :func:`gemv_table_seconds`; in a one-row graph that reads
  under ``ONE_THREAD_BYTES``, which the runtime runs on one thread, the
  one-thread table ``cpu.int8_gemv_1t_s``). With ``--weight-bits 7`` the chunk rate is
  ``cpu.int8_7bit_ops_per_s`` where the profile has it (a CPU without VNNI, whose faster
  uint8 x int8 kernels are exact only for 7-bit codes).
  A ``Linear`` placed on the NPU of a target that quantizes is costed as QLinear.
* ``BlockQLinear`` (CPU, weight-only b-bit codes in blocks of B): the bytes it
  reads, ``KN (b/8 + 8/B) / cpu.mem_bytes_per_s`` (``4/B`` for symmetric codes, which have no
  offsets; with folded offsets, ``fold_block_offsets``, K counts the digits' blocks too, and half a
  byte of zero point per block replaces the offset), against its arithmetic:
  ``2RKN / cpu.fp32_flops_per_s`` for a chunk (the backend computes chunks in
  float32), ``2KN / cpu.int8_gemv_ops_per_s`` at one row (int8 activations),
  falling back to the float32 rate when the profile has no int8 rate.
* element-wise and norms: bytes moved (inputs + output, 4 bytes per value on
  the CPU, 2 on the NPU's 16-bit activations) / ``mem_bytes_per_s``.
* ``Attention`` (CPU) of n new rows over S keys, H heads of D:
  ``max(4nSHD / cpu.attention_flops_per_s, 8S·kvH·D / cpu.kv_bytes_per_s)``
  (``kv_bytes_per_s`` defaults to ``cpu.mem_bytes_per_s``); ``2S·kvH·D`` bytes
  with an int8 cache (``quantize_kv_cache``).
* ``ShadowOutliers`` (CPU) for N outputs of the Linears reading x: a scan of
  ``x`` (``8nF`` bytes), the correction in B blocks of n / B rows
  (:func:`~llmc.runtime.kernels.shadow_blocks`) ``max(2nUN / cpu.fp32_flops_per_s,
  4BUN / cpu.mem_bytes_per_s)`` over the U channels expected to hold an outlier
  among a block's rows (``U = Σ_c 1 - (1 - p_c)^(n/B)`` from the calibration's
  per-channel outlier rates p_c; without calibration llm.npu's 0.3% of channels),
  and the copy of the results (``8nN`` bytes).
* Embedding, rotary tables, row selection: bytes moved / ``cpu.mem_bytes_per_s``.
* Every graph step adds its processor's ``launch_s``, every dynamic op step
  ``cpu.op_launch_s`` (default ``cpu.launch_s``); a hand-off between CPU and NPU
  adds ``sync_s`` (the ``place`` and ``schedule`` passes charge it).
* A graph on the CPU also pays ``cpu.node_s`` (default 0) per kernel it runs:
  QLinear 2 (quantize, integer matmul), BlockQLinear 3 (MatMulNBits, the
  offsets' Gemm or the widened input's Concat, the block sums; 4 at chunk rows
  with a Pad of the sums), ShadowOutliers lowered into a graph 7 at one row and
  17 at chunk rows, plus one per output and a split, everything else 1. At one row these fixed
  costs are a large part of a decode step.
* Decode follows the program the runtime runs: when every decode graph is placed
  on the CPU, the one-graph decode (:class:`~llmc.analyses.DecodeGraph`: one
  launch, the kernels' fixed costs and every node, attention included) if there
  is one, else the ``fuse_cpu_decode`` program (:class:`~llmc.analyses.DecodePlan`);
  otherwise the chunk program at one row.
* Weight I/O for streamed weights: ``bytes / storage.read_bytes_per_s``; a table
  row read on demand (embedding, shadow weights under a memory budget):
  ``storage.small_read_s + (row bytes - 4 KiB) / storage.read_bytes_per_s``.
"""

from __future__ import annotations

import dataclasses
import functools

from llmc.analyses import ChunkPlan, DecodeGraph, DecodePlan, ShadowPlan, Step, Subgraph
from llmc.device_profile import DeviceProfile
from llmc.ir import Graph, Node
from llmc.ops import kv_cache_itemsize
from llmc.runtime.kernels import shadow_blocks
from llmc.runtime.session import ONE_THREAD_BYTES

# llm.npu: outliers sit in 5-15 channels per layer, 0.1-0.3% of them (REFERENCES.md).
ASSUMED_OUTLIER_CHANNEL_FRACTION = 0.003
CPU_ONLY_STATIC = ("BlockQLinear",)  # static ops with no NPU lowering: their graphs stay on the CPU
ELEMENTWISE = ("RMSNorm", "LayerNorm", "Act", "Add", "Mul", "Scale", "Slice")


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Seconds of nodes and steps of ``graph`` under ``profile``.

    ``quantized``: the target runs Linears as int8 on the NPU (``npu``); float
    ``Linear`` nodes on the NPU are then costed as ``QLinear``.
    """

    graph: Graph
    plan: ChunkPlan
    profile: DeviceProfile
    shadow: ShadowPlan | None = None
    quantized: bool = False
    decode_plan: DecodePlan | None = None
    decode_graph: DecodeGraph | None = None
    weight_bits: int = 8  # of the QLinears' weight codes (--weight-bits): which CPU int8 rate applies

    @functools.cached_property
    def _subgraphs(self) -> dict[str, Subgraph]:
        subs = list(self.plan.subgraphs) + (list(self.decode_plan.subgraphs) if self.decode_plan is not None else [])
        if self.decode_graph is not None:
            subs.append(self.decode_graph.subgraph)
        return {s.name: s for s in subs}

    def decode_graph_seconds(self, keys: int) -> float | None:
        """One decode step through the one-graph decode (``fuse_decode_graph``), or None without one:
        one launch, the kernels' fixed costs and every node, attention over ``keys`` keys included."""
        if self.decode_graph is None:
            return None
        sub = self.decode_graph.subgraph
        return self.step_seconds(Step("graph", sub.name, sub.inputs, sub.outputs), 1, 1, keys, "cpu")

    def chunk_graph_seconds(self, n: int, keys: int, logit_rows: int) -> float | None:
        """One chunk of ``n`` rows through the decode graph's chunk instance (``fuse_decode_graph``), or None
        without one: one launch, the kernels' fixed costs and every node, attention over ``keys`` keys
        included; the nodes after ``SelectRows`` at ``logit_rows`` rows (none: only their kernels' fixed
        costs, as they still launch on zero rows)."""
        dg = self.decode_graph
        if dg is None or len(dg.subgraph.row_counts) < 2:
            return None
        t = self.profile["cpu.launch_s"]
        for name in dg.subgraph.nodes:
            rows = logit_rows if name in self._decode_graph_heads else n
            node = self._nodes[name]
            t += self.profile.get("cpu.node_s", 0.0) * _kernels(node, max(rows, 1))
            if rows:
                t += self.node_seconds(node, rows, rows, keys, "cpu")
        return t

    @functools.cached_property
    def _decode_graph_heads(self) -> set[str]:
        """The decode graph's nodes from its ``SelectRows`` on (the LM head)."""
        return {node.name for node in self.graph.downstream("SelectRows", self.decode_graph.subgraph.nodes)}

    @functools.cached_property
    def _nodes(self) -> dict[str, Node]:
        return {n.name: n for n in self.graph.nodes}

    def subgraph(self, name: str) -> Subgraph:
        """A subgraph of the chunk program, of the CPU decode program or the decode graph."""
        return self._subgraphs[name]

    # -- nodes -----------------------------------------------------------------
    def node_seconds(self, node: Node, rows: int, n: int, keys: int, proc: str, one_thread: bool = False) -> float:
        """``node`` at ``rows`` rows (``n`` of them real) attending ``keys`` keys, on ``proc``
        (``one_thread``: in a graph the runtime runs on one CPU thread)."""
        p = self.profile
        op = node.op
        if op in ("Linear", "QLinear"):
            ref = node.weights["weight" if op == "Linear" else "qweight"]
            k, nout = (ref.shape[1], ref.shape[0]) if op == "Linear" else ref.shape
            ops = 2.0 * rows * k * nout
            if proc == "npu":
                if op == "QLinear" or self.quantized:
                    return max(ops / p["npu.int8_ops_per_s"], k * nout / p["npu.weight_bytes_per_s"])
                return ops / p["npu.fp16_ops_per_s"]
            if op == "QLinear":
                gemv = p.get("cpu.int8_gemv_ops_per_s")
                table = (one_thread and p.tables.get("cpu.int8_gemv_1t_s")) or p.tables.get("cpu.int8_gemv_s")
                # one pass of the weights through the integer kernel
                floor = gemv_table_seconds(table, k, nout) if table else 2.0 * k * nout / gemv if gemv else 0.0
                rate = (self.weight_bits == 7 and p.get("cpu.int8_7bit_ops_per_s")) or p["cpu.int8_ops_per_s"]
                return max(ops / rate, k * nout / p["cpu.mem_bytes_per_s"], floor)
            return max(ops / p["cpu.fp32_flops_per_s"], 4.0 * k * nout / p["cpu.mem_bytes_per_s"])
        if op == "BlockQLinear":
            if proc != "cpu":
                raise ValueError("BlockQLinear runs on the CPU only")
            nout, nb, width = node.weights["qweight"].shape
            block = node.attrs["block_size"]
            k = nb * block
            # codes, a scale (and an offset, or half a byte of zero point) per block; folded offsets
            # (fold_block_offsets) are zero points and more blocks of codes
            extra = 4.0 if "offsets" in node.weights else 0.5 if "zero_points" in node.weights else 0.0
            read = nout * nb * (width + 4.0 + extra) / p["cpu.mem_bytes_per_s"]
            rate = p.get("cpu.int8_gemv_ops_per_s") if rows == 1 else None
            return max(read, 2.0 * rows * k * nout / (rate or p["cpu.fp32_flops_per_s"]))
        if op in ELEMENTWISE:
            if op == "Slice":  # reads only the columns it keeps
                elems = 2 * _features(node.outputs[0].shape)
            else:
                elems = sum(_features(v.shape) for v in node.inputs) + sum(_features(v.shape) for v in node.outputs)
            width = 2.0 if proc == "npu" else 4.0
            return rows * elems * width / p[f"{proc}.mem_bytes_per_s"]
        if proc != "cpu":
            raise ValueError(f"{op} runs on the CPU only")
        bw = p["cpu.mem_bytes_per_s"]
        a = node.attrs
        if op == "Attention":
            h, kvh, d = a["num_heads"], a["num_kv_heads"], a["head_dim"]
            s = min(keys, a["sliding_window"] + n - 1) if a["sliding_window"] else keys
            width = kv_cache_itemsize(node)
            return max(4.0 * n * s * h * d / p["cpu.attention_flops_per_s"], 2.0 * width * s * kvh * d / (p.get("cpu.kv_bytes_per_s") or bw))
        if op == "ShadowOutliers":
            x = node.inputs[0]
            f = _features(x.shape)
            nout = sum(a["splits"])
            b = shadow_blocks(n)  # blocks of n / b rows, each over the channels where it holds outliers
            u = self.outlier_channels(x.name, f, n // b)
            corr = max(2.0 * n * u * nout / p["cpu.fp32_flops_per_s"], 4.0 * b * u * nout / bw)
            return 8.0 * n * f / bw + corr + 8.0 * rows * nout / bw
        if op in ("Embedding", "QEmbedding", "BlockEmbedding"):
            return 8.0 * rows * _features(node.outputs[0].shape) / bw
        if op == "RotaryTable":
            return 4.0 * rows * sum(_features(v.shape) for v in node.outputs) / bw
        if op == "SelectRows":
            return 8.0 * rows * _features(node.inputs[0].shape) / bw
        raise ValueError(f"the cost model has no formula for op {op}")

    @functools.cached_property
    def _outlier_channels(self) -> dict[tuple[str, int], float]:
        return {}  # memo: the schedule asks for the same (value, rows) thousands of times

    def outlier_channels(self, value: str, features: int, n: int) -> float:
        """Expected number of input channels with at least one outlier among ``n`` rows."""
        memo = self._outlier_channels
        if (value, n) not in memo:
            q = self.shadow.inputs.get(value) if self.shadow is not None else None
            if q is not None and q.channel_rates:
                memo[value, n] = float(sum(1.0 - (1.0 - min(r, 1.0)) ** n for r in q.channel_rates))
            else:
                memo[value, n] = ASSUMED_OUTLIER_CHANNEL_FRACTION * features
        return memo[value, n]

    # -- steps -----------------------------------------------------------------
    def can_run(self, step: Step, proc: str) -> bool:
        if proc == "cpu":
            return True
        if not (proc == "npu" and self.profile.has_npu and step.kind == "graph"):
            return False
        return not any(self._nodes[n].op in CPU_ONLY_STATIC for n in self.subgraph(step.name).nodes)

    def step_seconds(self, step: Step, rows: int, n: int, keys: int, proc: str) -> float:
        """One step: its nodes plus the processor's launch cost."""
        one_thread = False
        if step.kind == "graph":
            nodes = self.subgraph(step.name).nodes
            t = self.profile[f"{proc}.launch_s"]
            if proc == "cpu":
                t += self.profile.get("cpu.node_s", 0.0) * sum(_kernels(self._nodes[n], rows) for n in nodes)
                one_thread = rows == 1 and self.read_bytes(step) < ONE_THREAD_BYTES  # as the runtime runs it
        else:
            nodes = (step.name,)
            t = self.profile.get("cpu.op_launch_s") or self.profile["cpu.launch_s"]
        for name in nodes:
            t += self.node_seconds(self._nodes[name], rows, n, keys, proc, one_thread)
        return t

    def read_bytes(self, step: Step) -> int:
        """Weight bytes a graph step reads whole (a shadow correction reads its table by row)."""
        nodes = (self._nodes[name] for name in self.subgraph(step.name).nodes)
        return sum(r.nbytes for node in nodes if node.op != "ShadowOutliers" for r in node.weights.values())

    def io_seconds(self, nbytes: float) -> float:
        return nbytes / self.profile["storage.read_bytes_per_s"]

    def row_read_seconds(self, nbytes: float) -> float:
        """One positioned read of a table row from storage: ``storage.small_read_s`` (default a
        4 KiB read at the sequential rate) plus the bytes beyond 4 KiB at the sequential rate."""
        bw = self.profile["storage.read_bytes_per_s"]
        return (self.profile.get("storage.small_read_s") or 4096 / bw) + max(nbytes - 4096, 0) / bw

    def row_reads_per_token(self, tables: set[str], kept: dict[str, tuple[int, ...]] | None = None) -> float:
        """Seconds per decoded token of reading rows of ``tables`` (kept in storage under a
        memory budget): one embedding row, and for every shadow correction the rows of the
        channels expected to hold an outlier that are not ``kept``
        rows (``p_c`` of each channel for one row; without calibration llm.npu's 0.3% of channels)."""
        t = 0.0
        for node in self.graph.nodes:
            if not any(r.name in tables for r in node.weights.values()):
                continue
            if node.op == "Embedding":
                t += self.row_read_seconds(node.weights["table"].nbytes / node.weights["table"].shape[0])
            elif node.op == "QEmbedding":
                t += self.row_read_seconds(node.weights["codes"].nbytes / node.weights["row_scale"].shape[0])
            elif node.op == "ShadowOutliers":
                wt = node.weights["codes"]
                rates = self.shadow_row_rates(node)
                if rates is not None:
                    skip = set((kept or {}).get(wt.name, ()))
                    rows = sum(r for c, r in rates if c not in skip)
                else:
                    rows = self.outlier_channels(node.inputs[0].name, wt.shape[0], 1)
                t += rows * self.row_read_seconds(wt.nbytes / wt.shape[0])
        return t

    def shadow_row_rates(self, node: Node) -> list[tuple[int, float]] | None:
        """Per input channel of a ShadowOutliers node, the calibrated chance that one token needs its row of the
        codes (a hot channel's too: its hot_delta row is resident, its codes row is the projection's); None
        without calibration."""
        q = self.shadow.inputs.get(node.inputs[0].name) if self.shadow is not None else None
        if q is None or not q.channel_rates:
            return None
        return [(c, min(r, 1.0)) for c, r in enumerate(q.channel_rates) if r > 0]


def gemv_table_seconds(rows: list[list[float]], k: int, n: int) -> float:
    """Seconds of a one-row int8 matmul ``[1,K]x[K,N]`` from a measured ``[K, N, seconds]`` grid.

    Bilinear in (log K, log N) on log seconds inside the grid; outside it the nearest
    edge point, scaled by the extra work (K·N) beyond the largest measured shape (a
    bigger matmul streams proportionally more) and not scaled below the smallest
    (fixed costs dominate there).
    """
    import math

    ks = sorted({r[0] for r in rows})
    ns = sorted({r[1] for r in rows})
    t = {(r[0], r[1]): r[2] for r in rows}

    def bracket(axis: list[float], v: float) -> tuple[float, float, float]:
        v = min(max(v, axis[0]), axis[-1])
        hi = next(i for i, a in enumerate(axis) if a >= v)
        lo = max(hi - 1, 0)
        if axis[hi] == axis[lo]:
            return axis[lo], axis[hi], 0.0
        return axis[lo], axis[hi], (math.log(v) - math.log(axis[lo])) / (math.log(axis[hi]) - math.log(axis[lo]))

    k0, k1, fk = bracket(ks, k)
    n0, n1, fn = bracket(ns, n)
    lg = ((1 - fk) * (1 - fn) * math.log(t[(k0, n0)]) + fk * (1 - fn) * math.log(t[(k1, n0)])
          + (1 - fk) * fn * math.log(t[(k0, n1)]) + fk * fn * math.log(t[(k1, n1)]))
    return math.exp(lg) * max(k / ks[-1], 1.0) * max(n / ns[-1], 1.0)


def _kernels(node: Node, rows: int) -> int:
    """ONNX Runtime kernels the ONNX backend's lowering of ``node`` at ``rows`` rows runs (after ORT's fusions)."""
    if node.op == "QLinear":
        return 2
    if node.op == "BlockQLinear":
        # MatMulNBits, the offsets' Gemm, and (about once per Linear) the block sums' Reshape + ReduceSum;
        # folded offsets: the widened input's Concat instead of the Gemm, and in a chunk-row graph (a symbolic row
        # count) a Pad of the block sums unless they fill whole blocks (one-row graphs concatenate constant zeros)
        if node.attrs.get("offset_digits"):
            block = node.attrs["block_size"]
            return 3 + (rows > 1 and bool(node.inputs[0].shape[-1] // block % block))
        return 3 if "offsets" in node.weights else 1
    if node.op == "ShadowOutliers":
        # Clip, Sub, then at one row Reshape, Cast, two Compress and the MatMul; at chunk rows the row blocks'
        # Reshape, Abs, ReduceSum, Equal, Not, Cast, ReduceSum, ReduceMax, TopK, Unsqueeze, Expand, GatherElements,
        # Gather, MatMul and Reshape; an Add per output and a Split of several
        splits = len(node.attrs["splits"])
        return (7 if rows == 1 else 17) + splits + (1 if splits > 1 else 0)
    return 1


def _features(shape: tuple[int, ...]) -> int:
    f = 1
    for d in shape[1:]:
        f *= int(d)
    return f
