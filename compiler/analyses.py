"""Typed analysis results that passes leave in the :class:`PassContext`.

Backends read these; they never reach into a pass's internals.
"""

from __future__ import annotations

import dataclasses

import numpy as _np


@dataclasses.dataclass(frozen=True)
class Subgraph:
    """A static, row-wise piece of the model, emitted once per row count.

    ``row_counts`` holds the shapes it is instantiated at: the prefill chunk
    length C and 1 (decode, and the LM head on the last token). Every instance
    reads the same weights. With ``dynamic_rows`` the instance at the largest
    row count has a symbolic first dimension and takes any count up to it: a
    prompt's last chunk then runs at its own length instead of padded to C.
    Only graphs that never run on the NPU (whose graphs need fixed shapes) are so.
    """

    name: str
    nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    weights: tuple[str, ...]
    row_counts: tuple[int, ...]
    dynamic_rows: bool = False


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of the per-chunk program: run a subgraph, or a dynamic op on the CPU."""

    kind: str  # "graph" | "op"
    name: str  # subgraph name, or IR node name
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """How the model runs: static subgraphs shared by every chunk, and the step order."""

    chunk: int
    max_context: int
    subgraphs: tuple[Subgraph, ...]
    steps: tuple[Step, ...]

    def subgraph(self, name: str) -> Subgraph:
        for s in self.subgraphs:
            if s.name == name:
                return s
        raise KeyError(name)


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """The one-row program decode runs on the CPU (``fuse_cpu_decode``).

    Same values and ops as the :class:`ChunkPlan`'s program, but each shadow-outlier
    correction is inside the static subgraph around it, so a decode step makes one
    graph call between two attentions instead of alternating NPU graphs and CPU
    corrections. Subgraphs are instantiated at one row only.
    """

    subgraphs: tuple[Subgraph, ...]
    steps: tuple[Step, ...]


@dataclasses.dataclass(frozen=True)
class DecodeGraph:
    """The whole model as one one-row graph for decode on the CPU (``fuse_decode_graph``).

    ``subgraph`` holds every node after the embedding gather (which the runtime runs
    and feeds, reading one row of the table); its dynamic ops are lowered too:
    attention as ONNX Runtime's ``GroupQueryAttention`` over the layer's KV
    cache (bound by the runtime as both past and present, so the node writes the new
    row in place and nothing is copied), and row selection (one row: the identity).
    The attention nodes rotate q and k themselves from cos/sin tables of every
    position below ``capacity`` (the backend computes them from the ``RotaryTable``
    node ``rotary``), so the graph reads no positions: a token's position is the
    cache length the runtime passes. ``layers`` lists each attention layer with its
    (kv heads, head dim): the caches ``[1, kv heads, capacity, head dim]`` it binds.
    With ``subgraph.row_counts == (1, C)`` (``dynamic_rows``) there is also an instance
    at any row count up to C, for prefill: a chunk's rows attend over the positions
    before them, and row selection gathers the rows a graph input names.
    """

    subgraph: Subgraph
    rotary: str
    capacity: int
    layers: tuple[tuple[int, int, int], ...]  # (layer, kv heads, head dim)


# --- quantization -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KVCachePlan:
    """The int8 KV cache (``quantize_kv_cache``): per attention layer, the calibration maxima its
    per-channel scales come from (keys after rotary, as bounded from the keys before it)."""

    dtype: str  # "int8"
    layers: dict[int, tuple[float, float]]  # layer -> (largest key bound, largest value) over its channels
    bytes_per_position: int  # K and V of one position over all layers
    float32_bytes_per_position: int  # the same in float32


HIST_PER_OCTAVE = 16  # global |x| histogram: 16 bins per power of two (4.4% wide)
HIST_MIN_EXP, HIST_MAX_EXP = -24, 20  # |x| below 2^-24 counts as zero; above 2^20 lands in the last bin
CH_PER_OCTAVE = 2  # per-channel histogram: coarse, for outlier counts
CH_MIN_EXP = -4  # per-channel bins start at 2^-4; smaller values share bin 0
BIN_KEY_SHIFT = 11  # a float32's bin is a function of its top 20 magnitude bits (exponent + 12 mantissa bits)


def _grid_edges(per_octave: int, min_exp: int) -> _np.ndarray:
    # 2^(k/per_octave), rounded up to the nearest float32 whose low BIN_KEY_SHIFT
    # mantissa bits are zero, so that |x| >= edge is decided by x's top 20 bits
    # (powers of two are on the grid already).
    e = _np.arange(min_exp * per_octave, HIST_MAX_EXP * per_octave + 1) / per_octave
    bits = _np.exp2(e).astype(_np.float32).view(_np.int32)
    step = 1 << BIN_KEY_SHIFT
    on_grid = ((bits + (step - 1)) & ~(step - 1)).astype(_np.int32).view(_np.float32)
    return _np.concatenate([[0.0], on_grid.astype(_np.float64)])


def hist_edges() -> _np.ndarray:
    """Lower edges of the global histogram bins (bin 0 holds zeros/tiny values)."""
    return _grid_edges(HIST_PER_OCTAVE, HIST_MIN_EXP)


def channel_edges() -> _np.ndarray:
    """Lower edges of the per-channel histogram bins (bin 0 holds everything below 2^CH_MIN_EXP)."""
    return _grid_edges(CH_PER_OCTAVE, CH_MIN_EXP)


@dataclasses.dataclass
class TensorStats:
    """Streaming statistics of one activation tensor ``[tokens, features]``."""

    absmax: float
    count: int
    hist: _np.ndarray  # [len(hist_edges())] counts of |x| per bin
    channel_absmax: _np.ndarray  # [features]
    channel_hist: _np.ndarray  # [features, len(channel_edges())]

    def percentile(self, p: float) -> float:
        """Upper edge of the bin holding the p-th percentile of |x| (0 < p < 100)."""
        target = self.count * p / 100.0
        cum = _np.cumsum(self.hist)
        i = int(_np.searchsorted(cum, target))
        edges = hist_edges()
        upper = edges[i + 1] if i + 1 < len(edges) else self.absmax
        return float(min(upper, self.absmax))

    def fraction_above(self, t: float) -> float:
        edges = hist_edges()
        return float(self.hist[edges >= t].sum() / max(self.count, 1))

    def channel_counts_above(self, t: float) -> _np.ndarray:
        """Per channel, how many entries had |x| in bins at or above ``t`` (bin-accurate)."""
        edges = channel_edges()
        start = int(_np.searchsorted(edges, t, side="right")) - 1
        return self.channel_hist[:, max(start, 0):].sum(axis=1)


@dataclasses.dataclass
class CalibrationStats:
    """Statistics of every Linear's input (q/k/v share one) and of every Attention's key and value input, by value name."""

    corpus: str
    tokens: int
    inputs: dict[str, TensorStats]


@dataclasses.dataclass(frozen=True)
class SmoothedInput:
    """One Linear input divided per channel by ``2^exponents[c]`` (its readers' weight rows multiplied)."""

    value: str
    site: str  # where the division is folded: "norm", "attention" (the value projection) or "up"
    exponents: tuple[int, ...]
    spread_before: float  # largest channel maximum over the median one, before
    spread_after: float  # ... and after


@dataclasses.dataclass(frozen=True)
class SmoothingPlan:
    """What ``smooth_activations`` did, by Linear input value name."""

    alpha: float
    inputs: dict[str, SmoothedInput]


@dataclasses.dataclass(frozen=True)
class InputQuant:
    """Per-tensor activation quantization of one Linear input value (shared by its Linears)."""

    value: str
    clip: float  # |x| above this is clipped on the NPU (the per-tensor range)
    scale: float  # uint8 scale: clip / 127
    zero_point: int  # 128: symmetric range [-128, 127] * scale in uint8
    absmax: float  # calibration maximum of |x|
    importance: float  # absmax / clip: how far outliers reach beyond the range
    outlier_rate: float  # fraction of calibration entries beyond clip
    shadow: bool  # whether the Linears reading it keep a CPU shadow path
    hot_channels: tuple[int, ...]  # input channels whose float weight rows stay resident
    channel_rates: tuple[float, ...] = ()  # per input channel, the share of calibration rows beyond clip (cost model)

    @property
    def lo(self) -> float:
        return -self.zero_point * self.scale

    @property
    def hi(self) -> float:
        return (255 - self.zero_point) * self.scale


@dataclasses.dataclass(frozen=True)
class ShadowPlan:
    """Activation ranges and shadow decisions for every Linear input, by value name."""

    inputs: dict[str, InputQuant]
    percentile: float
    keep_fraction: float
    enabled: bool


@dataclasses.dataclass(frozen=True)
class ValueRanges:
    """Observed [min, max] of every value of the (quantized) graph, for full-QDQ backends."""

    ranges: dict[str, tuple[float, float]]
    tokens: int


# --- placement, schedule, offload -------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StepCost:
    """Predicted seconds of one program step at the chunk shape and at one row, per processor.

    A processor missing from a dict cannot run the step (dynamic ops: the NPU).
    """

    step: str
    prefill: dict[str, float]
    decode: dict[str, float]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Which processor runs each program step, per phase (``place`` pass)."""

    profile: str
    prefill: dict[str, str]  # step name -> "npu" | "cpu"
    decode: dict[str, str]
    costs: dict[str, StepCost]
    sync_s: float  # one CPU<->NPU hand-off, from the profile

    def processor(self, step: str, phase: str) -> str:
        return (self.prefill if phase == "prefill" else self.decode)[step]


@dataclasses.dataclass(frozen=True)
class Task:
    """One (chunk, step) of a simulated prefill timeline."""

    chunk: int
    step: int  # index into the program
    processor: str
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Timeline:
    """A simulated prefill: tasks in issue order, makespan and NPU bubble rate."""

    policy: str  # "in-order" | "out-of-order"
    tasks: tuple[Task, ...]
    makespan_s: float
    npu_busy_s: float
    cpu_busy_s: float

    @property
    def npu_bubble_rate(self) -> float:
        """Share of the NPU's span (first start to last end) it sits idle; 0 with no NPU work."""
        npu = [t for t in self.tasks if t.processor == "npu"]
        if not npu:
            return 0.0
        span = max(t.end for t in npu) - min(t.start for t in npu)
        return 1.0 - self.npu_busy_s / span if span > 0 else 0.0

    @property
    def order(self) -> tuple[tuple[int, int], ...]:
        return tuple((t.chunk, t.step) for t in self.tasks)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Out-of-order prefill order for every chunk count, and the predicted timelines (``schedule`` pass).

    ``orders[k]`` is the issue order of (chunk, step) pairs for a prompt of
    ``k`` chunks; any prefix of chunks of it respects every dependency.
    ``prompt_len`` is the prompt the reported timelines were simulated for.
    """

    prompt_len: int
    orders: dict[int, tuple[tuple[int, int], ...]]
    in_order: Timeline
    out_of_order: Timeline
    decode_s: float  # predicted seconds per decoded token
    head_s: float  # after the timeline: the LM head on the last prompt token, or the decode graph's steps (the last token and a tail)
    # prefill through the CPU program (fuse_cpu_decode at chunk rows), which the runtime runs instead of the
    # timelines' chunk program when the CPU runs every prefill graph; None when it does not apply
    cpu_program_s: float | None = None
    # prefill as one call of the decode graph's chunk instance per chunk (fuse_decode_graph), which the runtime runs
    # instead of either program when it has one and the CPU runs prefill and decode; the last row's head included
    # (prefill_s is this alone; the timelines and head_s still describe the chunk program)
    chunk_graph_s: float | None = None

    @property
    def prefill_program(self) -> str:
        """What the runtime prefills with: ``"graph"`` (the decode graph's chunk instance), ``"cpu"`` (the CPU program) or ``"chunk"``."""
        return "graph" if self.chunk_graph_s is not None else "cpu" if self.cpu_program_s is not None else "chunk"

    @property
    def chosen(self) -> Timeline:
        """The timeline the stored orders follow: out-of-order unless it is slower."""
        return self.out_of_order if self.out_of_order.makespan_s <= self.in_order.makespan_s else self.in_order

    @property
    def prefill_s(self) -> float:
        if self.chunk_graph_s is not None:
            return self.chunk_graph_s  # the head's row is scored inside
        return (self.cpu_program_s if self.cpu_program_s is not None else self.chosen.makespan_s) + self.head_s


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
    """Which weights stay resident and which stream from the bundle (``plan_offload`` pass).

    ``streamed`` weights are read from the bundle for every use, ``prefetch_depth``
    steps ahead, into a ring of buffers of ``buffer_bytes``; ``row_streamed``
    tables (embedding, shadow weights) are read by row when a token needs them,
    except their ``resident_rows``, read once at load. All byte counts are of the
    bundle's stored weights; ``resident_bytes`` includes the resident rows.
    """

    budget_bytes: int
    weight_bytes: int  # every weight the program reads
    resident: tuple[str, ...]
    streamed: tuple[str, ...]
    row_streamed: tuple[str, ...]
    resident_bytes: int
    streamed_bytes: int  # per token (decode) and per chunk (prefill)
    buffer_bytes: int
    prefetch_depth: int
    predicted_decode_s: float  # per token, with prefetching
    predicted_decode_no_prefetch_s: float
    resident_rows: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # row_streamed table -> rows kept in memory
