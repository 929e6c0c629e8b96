"""Passes, pipelines and instrumentation.

A pass is a class with a ``name``, a one-line ``summary`` and a ``run(graph,
ctx)`` method returning a :class:`PassResult`. It states the typed analyses it
needs (``requires``) and the ones it leaves in the context (``produces``); the
manager checks both. After every pass the manager runs ``Graph.verify()``.

Pipelines are plain lists of passes. They print as a comma-separated string
(``"dce,select_logit_rows,chunk_static_graphs"``) and that string parses back
into the same list, so ``llmc compile --pipeline`` accepts what ``llmc passes``
and the bundle's report print.

Instrumentation (IR dumps, timing) lives in :class:`Instrument` objects handed
to the manager; passes never print or time themselves.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Mapping, TypeVar

from llmc.analyses import ChunkPlan
from llmc.errors import LlmcError, PassError, PipelineError
from llmc.ir import Graph

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """Options every pass may read. Frozen: passes cannot change them."""

    target: str = "cpu"
    chunk: int = 256
    max_context: int = 2048
    # quantized targets
    calib_file: str | None = None  # user calibration text; None = the built-in corpus
    calib_tokens: int = 2048
    cache_dir: str | None = None  # where calibration results are kept; None = no cache
    shadow: bool = True  # shadow outlier execution (False = plain per-tensor W8A8)
    clip_percentile: float = 99.0  # activation clip for shadow-enabled Linears (docs/quantization.md)
    shadow_keep: float = 1.0  # fraction of Linear inputs (by importance) that keep a shadow path
    pruned_percentile: float | None = 99.999  # clip of inputs whose shadow is pruned; None = calibration max
    hot_budget: float = 0.01  # resident float shadow rows, as a fraction of the int8 weight bytes
    smooth_alpha: float | None = None  # smooth_activations' migration strength (SmoothQuant's alpha); None = the pass's default
    weight_granularity: str = "channel"  # "channel" | "tensor"
    weight_bits: int = 8  # 8 (codes in [-127, 127]) | 7 ([-63, 63]: exact in x86 u8 x s8 kernels without VNNI)
    # cost model, placement, schedule, offload
    placement: str = "auto"  # "auto" (cost model) | "npu" (every static subgraph) | "cpu"
    profile: str = "8gen3"  # device profile (llmc.device_profile); compile_model picks --profile, --soc, else host when measured
    prompt_len: int | None = None  # prompt the schedule's timelines are reported for; None = max_context
    memory_budget: int | None = None  # bytes of weights that may stay resident; None = all
    prefetch_depth: int = 2  # streamed steps read ahead of the one running
    cpu_kernels: str = "onnx"  # "onnx" | "native": the ops of the CPU's graphs (llmc.runtime.native's with --cpu-kernels native)
    kv_cache_auto: bool = False  # float16_kv_cache runs for --kv-cache auto: it keeps float32 where native attention cannot read halves


@dataclasses.dataclass(frozen=True)
class ModelInputs:
    """What passes may need from the model source besides the IR."""

    encode: Callable[[str], list[int]] | None  # tokenizer, if the model has one
    fingerprint: str  # identity of the weights, for caches


@dataclasses.dataclass(frozen=True)
class PassResult:
    changed: bool


class PassContext:
    """Options plus the typed analysis results produced so far."""

    def __init__(self, options: CompileOptions, inputs: ModelInputs | None = None) -> None:
        self.options = options
        self.inputs = inputs or ModelInputs(None, "")
        self._analyses: dict[type, Any] = {}

    def put(self, result: Any) -> None:
        self._analyses[type(result)] = result

    def get(self, kind: type[T]) -> T:
        try:
            return self._analyses[kind]
        except KeyError:
            raise PassError(f"analysis {kind.__name__} is not available; run the pass that produces it earlier in the pipeline") from None

    def has(self, kind: type) -> bool:
        return kind in self._analyses

    def discard(self, kind: type) -> None:
        """Forget the ``kind`` result: a pass that invalidates it calls this, so a later pass that
        needs it fails unless the producing pass runs again."""
        self._analyses.pop(kind, None)


class Pass:
    name: ClassVar[str]
    summary: ClassVar[str]
    requires: ClassVar[tuple[type, ...]] = ()
    produces: ClassVar[tuple[type, ...]] = ()

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:  # pragma: no cover - interface
        raise NotImplementedError


class Instrument:
    def before_pass(self, p: Pass, graph: Graph) -> None:
        pass

    def after_pass(self, p: Pass, graph: Graph, result: PassResult, seconds: float) -> None:
        pass


class PassTiming(Instrument):
    """Collects (pass name, seconds, changed) rows."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float, bool]] = []

    def after_pass(self, p, graph, result, seconds):
        self.rows.append((p.name, seconds, result.changed))


class IRDump(Instrument):
    """Writes the IR after each pass to ``DIR/NN-<pass>.ir`` (and the input as 00-input.ir); the
    ``NN-*.ir`` files of an earlier dump into ``DIR`` are removed first, so one dump is never
    mixed with another."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.count = 0

    def before_pass(self, p, graph):
        if self.count == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            for old in self.directory.glob("[0-9][0-9]-*.ir"):
                old.unlink()
            (self.directory / "00-input.ir").write_text(graph.format() + "\n")
        self.count += 1

    def after_pass(self, p, graph, result, seconds):
        (self.directory / f"{self.count:02d}-{p.name}.ir").write_text(graph.format() + "\n")


def parse_pipeline(text: str, registry: Mapping[str, type[Pass]]) -> list[Pass]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise PipelineError("the pipeline is empty", hint="list pass names separated by commas; `llmc passes` shows them")
    out = []
    for n in names:
        if n not in registry:
            raise PipelineError(f"unknown pass {n!r} in pipeline {text!r}", hint="available passes: " + ", ".join(registry))
        out.append(registry[n]())
    return out


def format_pipeline(passes: Iterable[Pass]) -> str:
    return ",".join(p.name for p in passes)


def run_pipeline(graph: Graph, passes: list[Pass], ctx: PassContext, instruments: Iterable[Instrument] = ()) -> None:
    """Run ``passes`` in order on ``graph``, verifying the IR after each one."""
    instruments = list(instruments)
    done: list[str] = []
    for p in passes:
        for need in p.requires:
            if not ctx.has(need):
                raise PipelineError(
                    f"pass {p.name} needs {need.__name__}, which no earlier pass produced (ran: {', '.join(done) or 'none'})",
                    hint="put the producing pass before it in --pipeline (`llmc passes` lists what each one needs)",
                )
        cut = ctx.has(ChunkPlan)
        for ins in instruments:
            ins.before_pass(p, graph)
        t0 = time.perf_counter()
        try:
            result = p.run(graph, ctx)
            graph.verify()
        except LlmcError as e:
            if not isinstance(e, PassError) and done:  # the CLI reports the error itself; where it stopped is for -v
                log.info("pass %s stopped after %s", p.name, ", ".join(done))
            raise
        except Exception as e:
            raise PassError(
                f"pass {p.name} failed with {type(e).__name__}: {e} (passes already run: {', '.join(done) or 'none'})",
                hint="rerun with --dump-ir DIR to see the IR before the failing pass",
            ) from e
        seconds = time.perf_counter() - t0
        if cut and result.changed:  # the chunk plan names nodes and values of the IR as it was
            raise PipelineError(f"pass {p.name} rewrote the IR after chunk_static_graphs cut it (ran: {', '.join(done)})",
                                hint=f"put {p.name} before chunk_static_graphs in --pipeline")
        for kind in p.produces:
            if not ctx.has(kind):
                raise PassError(f"pass {p.name} promised {kind.__name__} but did not produce it")
        log.debug("pass %s: %.3fs changed=%s", p.name, seconds, result.changed)
        for ins in instruments:
            ins.after_pass(p, graph, result, seconds)
        done.append(p.name)
