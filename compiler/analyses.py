"""Typed analysis results that passes leave in the :class:`PassContext`.

Backends read these; they never reach into a pass's internals.
"""

from __future__ import annotations

import dataclasses


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
