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
    reads the same weights.
    """

    name: str
    nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    weights: tuple[str, ...]
    row_counts: tuple[int, ...]


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


# --- quantization -------------------------------------------------------------


HIST_PER_OCTAVE = 16  # global |x| histogram: 16 bins per power of two (4.4% wide)
HIST_MIN_EXP, HIST_MAX_EXP = -24, 20  # |x| below 2^-24 counts as zero; above 2^20 lands in the last bin
CH_PER_OCTAVE = 2  # per-channel histogram: coarse, for outlier counts
CH_MIN_EXP = -4  # per-channel bins start at 2^-4; smaller values share bin 0


def hist_edges() -> _np.ndarray:
    """Lower edges of the global histogram bins (bin 0 holds zeros/tiny values)."""
    e = _np.arange(HIST_MIN_EXP * HIST_PER_OCTAVE, HIST_MAX_EXP * HIST_PER_OCTAVE + 1) / HIST_PER_OCTAVE
    return _np.concatenate([[0.0], _np.exp2(e)])


def channel_edges() -> _np.ndarray:
    e = _np.arange(CH_MIN_EXP * CH_PER_OCTAVE, HIST_MAX_EXP * CH_PER_OCTAVE + 1) / CH_PER_OCTAVE
    return _np.concatenate([[0.0], _np.exp2(e)])


@dataclasses.dataclass
class TensorStats:
    """Streaming statistics of one activation tensor ``[tokens, features]``."""

    absmax: float
    count: int
    hist: _np.ndarray  # [len(hist_edges())] counts of |x| per bin
    channel_absmax: _np.ndarray  # [features]
    channel_hist: _np.ndarray  # [features, len(channel_edges())]
    minimum: float = 0.0
    maximum: float = 0.0

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
    """Statistics of every Linear's input (by value name) and output (by node name)."""

    corpus: str
    tokens: int
    inputs: dict[str, TensorStats]
    outputs: dict[str, TensorStats]


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
