"""Executing a compiled bundle: chunked prefill, KV cache, decode, sampling.

The bundle's ``program`` is the per-chunk step list the compiler scheduled:
``graph`` steps run a static ONNX subgraph (the instance whose row count fits:
C for prefill chunks, 1 for decode), ``op`` steps run a dynamic op from
:mod:`llmc.runtime.kernels` on the CPU. A prompt is split into chunks of C
tokens; the last one is padded, and padded rows never reach the KV cache or the
logits, so results are exact for any prompt length up to ``max_context``.
When the CPU runs decode, a bundle's ``decode_program`` (``fuse_cpu_decode``:
one graph between two attentions, the shadow corrections inside it) replaces
the program's one-row instances; with the CPU provider it also runs prefill,
chunk by chunk, at the chunk's rows (bundles whose CPU program has them).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import resource
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from llmc.runtime import kernels, native
from llmc.runtime.binding import BoundGraph
from llmc.runtime.cpu import int8_session_options, session_kwargs, u8s8_exact_for
from llmc.runtime.decode_graph import ChunkGraphRunner, DecodeGraphRunner
from llmc.runtime.errors import BundleError, PromptError, PromptTooLongError, ProviderError, TokenIdError
from llmc.runtime.manifest import SHAPE_ERRORS, load_manifest, map_weights, resolve_inside, shape_error
from llmc.runtime.ort_attention import OrtAttention, check_int8_cache_support
from llmc.runtime.residency import Residency
from llmc.runtime.sampling import Sampler

log = logging.getLogger(__name__)

PROVIDERS = ("auto", "cpu", "qnn")


@dataclasses.dataclass
class Metrics:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    peak_rss_mb: float = 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        steps = self.generated_tokens - 1
        return steps / self.decode_s if self.decode_s > 0 and steps > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        d = dataclasses.asdict(self)
        d["prefill_tok_s"] = self.prefill_tok_s
        d["decode_tok_s"] = self.decode_tok_s
        return d


@dataclasses.dataclass
class TokenEvent:
    token_id: int
    text: str  # the text this token adds (may be "" for partial UTF-8)


class TextStream:
    """The text each generated token adds, from a window of the last tokens: decoding every token so far at
    each step would cost a long generation time quadratic in its length (SmolLM2's tokenizer: 18 us for 64 ids,
    200 us for 1,024). The window starts at the tokens of the text given out last (decoded again as context,
    so that a decoder's handling of a sequence's first token applies to both texts alike) and grows while the
    tokens since make no whole character (partial UTF-8 decodes to U+FFFD), which then waits for them."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self._start = 0  # the window's first token
        self._given = 0  # the tokens whose text has been given out
        self._context = ""  # the text of ids[_start:_given], decoded once when the window moves

    def push(self, token: int) -> str:
        """Add ``token``; the text it adds ("" while it or the tokens before it make no whole character)."""
        self.ids.append(token)
        before = self._context
        text = self._decode(self.ids[self._start:])
        if len(text) <= len(before) or not text.startswith(before) or text.endswith("\ufffd"):
            return ""
        self._start, self._given = self._given, len(self.ids)
        self._context = self._decode(self.ids[self._start:self._given])
        return text[len(before):]


@dataclasses.dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "eos" | "length" | "context"
    metrics: Metrics


# A one-row graph that reads less than this many weight bytes runs on one thread: waking a
# second thread for each of its small kernels costs more than the second core saves.
# (Measured on SmolLM2-135M decode, same process, interleaved tokens: +16% tokens/s.) The
# cost model (llmc.cost_model) prices such graphs with the one-thread measurements.
ONE_THREAD_BYTES = 8 << 20

# How long the decode graph's idle workers spin before they sleep (ONNX Runtime's
# ``session.intra_op.spin_duration_us``, 1.26 and later; earlier releases ignore it and spin 2^20
# rounds). The gap between two tokens' calls, sampling included, is about 0.25 ms (SmolLM2, 512 + 64
# tokens), so a worker spins through it; after a generation's last token it sleeps within this bound,
# where its default spin (about 40 ms of a core, measured by thread) took a core from the prefill that
# follows: that prefill ran 12-14% slower (3 alternating pairs of processes, 5 generations of 512 + 64 tokens each,
# AVX-512 VNNI; docs/performance.md).
DECODE_SPIN_US = 2000

# With a decode graph, prefill runs a tail of up to C / TAIL_DIVISOR tokens after its last whole chunk
# token by token through it instead of as a padded chunk: SmolLM2 at C = 256 prefills a chunk in about
# 0.5 s and decodes a token in about 10-16 ms, so 16 tokens cost at most half a padded chunk. Programs
# whose graphs take a last chunk at its own length pad nothing and skip the rule (at 3-9 tokens their
# short chunk was as fast as or faster than the decode steps: SmolLM2, int4 and W8A8).
TAIL_DIVISOR = 16


def check_utf8(text: str, what: str) -> None:
    """``PromptError`` if ``text`` holds bytes that were not UTF-8 (kept as surrogates by Python's
    ``surrogateescape``, as command-line arguments and standard input are in some locales)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PromptError(f"{what} is not valid UTF-8 (character {e.start})", hint="pass UTF-8 text") from None


def tokens_in_graph(n: int, chunk: int, always: bool, exact: bool = False) -> int:
    """How many of a prompt's ``n`` tokens prefill feeds through the decode graph: the last one and the
    tail after the last whole chunk when that tail is short (it saves a mostly padded chunk), else the
    last one if ``always`` (the CPU prefills too), else none. With ``exact`` chunks (graphs that take
    a last chunk at its own length) nothing is padded: the last one if ``always``, else none. The
    schedule prices the same rule."""
    if exact:
        return 1 if always else 0
    rest = (n - 1) % chunk
    if rest <= chunk // TAIL_DIVISOR:
        return rest + 1
    return 1 if always else 0


_ARENA_REGISTERED = False


def _shared_arena(ort: Any) -> None:
    """Register one CPU arena allocator with ONNX Runtime's environment (once per process);
    sessions with ``session.use_env_allocators`` share it."""
    global _ARENA_REGISTERED
    if not _ARENA_REGISTERED:
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, -1, -1, -1))  # ORT's defaults, no size cap
        _ARENA_REGISTERED = True


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class Session:
    """A loaded bundle, ready to generate.

    ``provider``: ``"cpu"`` runs every graph on ONNX Runtime's CPU provider;
    ``"qnn"`` runs the NPU subgraphs on the QNN HTP backend (context binaries on
    the device; on x86_64 the simulator runs the bundle's fully quantized QDQ
    graphs, since it cannot load weight-shared contexts) and everything else on
    the CPU; ``"auto"`` picks ``qnn`` when onnxruntime-qnn is importable and the
    bundle has QNN artifacts, else ``cpu``.
    Every ONNX Runtime session is created up front (``lazy=True`` defers each
    to its first use), so timings of a generation exclude graph preparation.
    A bundle compiled with a memory budget keeps only its resident weights in
    memory and streams the others from storage (:mod:`llmc.runtime.residency`);
    ``prefetch=False`` reads each streamed weight when its step runs instead of
    ahead of time. ``placement`` ``"npu"`` or ``"cpu"`` overrides the compiled
    placement of every graph in both phases (``llmc verify --qnn`` runs every
    NPU graph on the HTP so).
    """

    def __init__(self, bundle: str | Path, provider: str = "auto", *, verify: bool = True, threads: int | None = None, lazy: bool = False,
                 prefetch: bool = True, placement: str | None = None) -> None:
        import onnxruntime as ort

        if provider not in PROVIDERS:
            raise ProviderError(f"unknown provider {provider!r}", hint="choose one of: " + ", ".join(PROVIDERS))
        if placement not in (None, "npu", "cpu"):
            raise ValueError(f"placement {placement!r}: None (the compiled one), 'npu' or 'cpu'")
        self._placement_override = placement
        # graph instance -> the inputs of its first run, when a caller sets this to a dict (llmc verify --qnn)
        self.recorded_inputs: dict[tuple[str, int], dict[str, np.ndarray]] | None = None
        self.bundle = Path(bundle)
        self.manifest = load_manifest(self.bundle, verify=verify)
        try:
            self._setup(ort, provider, threads, lazy, prefetch)
        except SHAPE_ERRORS as e:  # load_manifest checked the files and the manifest's digest: an old or hand-made manifest
            raise shape_error(self.bundle, e) from e

    def _setup(self, ort: Any, provider: str, threads: int | None, lazy: bool, prefetch: bool) -> None:
        """Everything the constructor derives from the manifest; the ONNX Runtime sessions unless ``lazy``."""
        self.requested_provider = provider
        self.provider = self._choose_provider(provider)
        self._ort = ort
        m = self.manifest
        self.chunk = int(m["chunk"])
        self.max_context = int(m["max_context"])
        self._vocab: int | None = m["model"].get("vocab_size")  # token ids are checked against it
        self.io = m["io"]
        self.program = m["program"]
        self.graphs = m["graphs"]
        if any(st["kind"] == "op" and st["op"] == "ShadowOutliers" and "codes" not in st["weights"] for st in self.program):
            raise BundleError(f"{self.bundle}: its shadow corrections read float weight tables (weight_t), which this runtime no longer reads",
                              hint="recompile the bundle with this llmc: its corrections read the int8 codes")
        self._threads = threads or os.cpu_count() or 1
        # a bundle compiled with --cpu-kernels native: its CPU graphs hold llmc's native ops (the library, or a named error now)
        self.native_kernels = native.require_library() if m.get("cpu_kernels") == "native" else None
        self.weight_bits = m.get("weight_bits", 8)  # of the W8A8 weights' codes (--weight-bits): which int8 kernels are exact
        if self.weight_bits not in (7, 8):
            raise BundleError(f"{self.bundle}: manifest says weight_bits {self.weight_bits!r}; a bundle's W8A8 weights have 7 or 8 bits",
                              hint="the manifest was edited or damaged, or a newer llmc wrote it: compile the bundle again with this llmc")
        # budgeted bundles: resident arrays + row tables, streamed weights fed per run
        self.residency = Residency(self.bundle, m, prefetch=prefetch) if "offload" in m else None
        self._weights: dict[str, Any] = self.residency.weights if self.residency else map_weights(self.bundle, m["weights"])
        self._ortvalues: dict[str, Any] = {}
        self._fed: dict[str, dict[str, np.ndarray]] = {}  # graph -> weights that are graph inputs, fed from memory
        self._sessions: dict[tuple[str, int], Any] = {}
        self._attn_layers = {
            s["attrs"]["layer"]: (s["attrs"]["num_kv_heads"], s["attrs"]["head_dim"]) for s in self.program if s["kind"] == "op" and s["op"] == "Attention"
        }
        self._head_steps = self._downstream_of_select(self.program)
        self._step_index = {st["name"]: i for i, st in enumerate(self.program)}
        self._head = next((self.program[i]["name"] for i in sorted(self._head_steps) if self.program[i]["kind"] == "graph"), None)
        # the compiled schedule: issue orders per chunk count, processor per step and phase
        self._orders = (m.get("schedule") or {}).get("orders", {})
        pl = m.get("placement") or {}
        self._placement = {"prefill": pl.get("prefill", {}), "decode": pl.get("decode", {})}
        if self._placement_override is not None:
            every = {st["name"]: self._placement_override for st in self.program if st["kind"] == "graph"}
            self._placement = {"prefill": dict(every), "decode": dict(every)}
        self._uses = self._readers(self.program, self._head_steps)
        self._head_inputs = {v for i in self._head_steps for v in self.program[i]["inputs"]}
        self._hot_pos: dict[str, np.ndarray] = {}
        for st in self.program:
            if st["kind"] == "op" and st["op"] == "ShadowOutliers":
                in_f = self._weights[st["weights"]["codes"]].shape[0]
                pos = np.full(in_f, -1, np.int64)
                pos[st["attrs"]["hot_channels"]] = np.arange(len(st["attrs"]["hot_channels"]))
                self._hot_pos[st["name"]] = pos
        # Outlier entries seen by each shadow path since the session was created.
        # outlier entries the chunk program's Python corrections saw; the CPU program corrects inside its graphs, uncounted
        self.outlier_counts: dict[str, int] = {name: 0 for name in self._hot_pos}
        # A shadow step corrects the NPU results in place when no other step reads them.
        readers: dict[str, int] = {}
        for st in self.program:
            for v in st["inputs"]:
                readers[v] = readers.get(v, 0) + 1
        self._shadow_inplace = {st["name"]: all(readers[v] == 1 for v in st["inputs"][1:]) for st in self.program
                                if st["kind"] == "op" and st["op"] == "ShadowOutliers"}
        # Graphs that do not produce the logits write into reused buffers (each graph is one step).
        self._reusable = {st["name"] for i, st in enumerate(self.program) if st["kind"] == "graph" and i not in self._head_steps}
        self._all_steps = list(range(len(self.program)))  # decode's step order, for the prefetcher
        # The CPU's program (fuse_cpu_decode), when decode runs on the CPU; prefill uses it too (below).
        self._decode_program: list[dict[str, Any]] | None = None
        cpu_program = m.get("decode_program", [])
        cpu_tail = self._downstream_of_select(cpu_program)  # its steps after SelectRows
        self._cpu_head: str | None = None  # the CPU program's head graph
        if "decode_program" in m and self._on_cpu("decode"):
            self._decode_program = cpu_program
            self._cpu_tail = cpu_tail
            self._cpu_head = next((st["name"] for i, st in enumerate(cpu_program) if i in cpu_tail and st["kind"] == "graph"), None)
            self._reusable |= {st["name"] for i, st in enumerate(self._decode_program) if st["kind"] == "graph" and i not in self._cpu_tail}
            self._cpu_uses = self._readers(self._decode_program)  # a chunk's values are freed after their last reader
        self._decode_graphs = {st["name"] for st in cpu_program if st["kind"] == "graph"}
        # Prefill runs the same program at chunk rows when the CPU runs every prefill graph (the CPU provider, or a
        # placement that keeps prefill off the NPU) and its graphs have those instances (bundles before them do not);
        # otherwise the chunk program, whose quantized graphs run on the HTP. (The decode graph's chunk instance,
        # below, takes precedence over both.)
        self._cpu_prefill = (self._decode_program is not None and self._on_cpu("prefill")
                             and all(str(self.chunk) in self.graphs[n]["instances"] for n in self._decode_graphs))
        # Decode as one graph call per token (fuse_decode_graph) when the CPU runs decode
        self._decode_graph: str | None = m.get("decode_graph") if self._on_cpu("decode") else None
        self._decode_runner: DecodeGraphRunner | None = None
        # the decode graph's inputs (the embedding row) and the program's op steps that make them (the gather)
        self._decode_graph_inputs = [x["name"] for x in self.graphs[self._decode_graph]["inputs"]] if self._decode_graph else []
        self._decode_graph_steps = [st for st in self.program if st["kind"] == "op" and set(self._decode_graph_inputs).intersection(st["outputs"])]
        # Prefill as one call of the decode graph per chunk when it has a chunk instance (fuse_decode_graph) and the CPU
        # prefills: no other prefill graph, attention call or one-row head session is made then
        self._chunk_graph = self._decode_graph is not None and self._on_cpu("prefill") and self._dynamic(self._decode_graph)
        self._chunk_runner: ChunkGraphRunner | None = None
        # Without that chunk instance, prefill ends in the decode graph: always when the CPU prefills too (one step
        # instead of the head, and no one-row head session), else only when that saves a chunk (on the NPU a CPU step
        # costs more than the head).
        self._ends_in_graph = self._decode_graph is not None and self._on_cpu("prefill")
        # the head graphs (after SelectRows), and those prefill's last-token logits run at one row: the CPU program's
        # when it prefills, else the chunk program's; none when the decode graph always scores the last token
        # (scoring with all_logits creates them when a chunk has one row)
        cpu_heads = {cpu_program[i]["name"] for i in cpu_tail}
        self._heads = cpu_heads | {self._head}
        self._one_row_heads = set() if self._ends_in_graph else cpu_heads if self._cpu_prefill else {self._head}
        self._bound: dict[tuple[str, int], BoundGraph] = {}
        # the graphs each phase has run, by provider ("qnn": on the HTP, "cpu": ONNX Runtime's CPU provider)
        self._graphs_run: dict[str, dict[str, set[str]]] = {phase: {"qnn": set(), "cpu": set()} for phase in ("prefill", "decode")}
        self.tokenizer = None
        tok = m.get("tokenizer") or {}
        if tok.get("file"):
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(resolve_inside(self.bundle, tok["file"])))
        self.eos_ids = set(tok.get("eos_token_ids", []))
        self.cache: kernels.KVCache | None = None
        self._attention: OrtAttention | None = None
        self.position = 0
        # the int8 KV cache's per-channel scales of each layer that has them (quantize_kv_cache)
        self._kv_scales = {s["attrs"]["layer"]: (self._weights[s["weights"]["k_scale"]], self._weights[s["weights"]["v_scale"]])
                           for s in self.program if s["kind"] == "op" and s["op"] == "Attention" and "k_scale" in s.get("weights", {})}
        if self._kv_scales:
            check_int8_cache_support(ort, self.bundle)
        # the layers whose cache holds float16 (float16_kv_cache)
        kinds = {s["attrs"]["layer"]: s["attrs"].get("kv_dtype", "float32") for s in self.program if s["kind"] == "op" and s["op"] == "Attention"}
        unknown = sorted({k for k in kinds.values() if k not in ("float32", "float16")})
        if unknown:
            raise BundleError(f"{self.bundle}: its attention caches are {unknown[0]}, which this runtime does not know (float32, float16 or int8)",
                              hint="the bundle was made by a newer llmc; upgrade the runtime")
        self._kv_half = {layer for layer, k in kinds.items() if k == "float16"}
        self._check_instances_present()
        if not lazy:
            self.warmup()

    # -- setup -------------------------------------------------------------
    def _choose_provider(self, requested: str) -> str:
        from llmc.runtime.qnn import qnn_available

        q = self.manifest.get("qnn") or {}
        # context binaries hold every weight, so a budgeted bundle has none; a package whose plan runs nothing on the NPU
        # holds none either, and runs on the CPU under the qnn provider as its bundle does
        has = (bool(q.get("graphs")) or ("package" in self.manifest and "soc" in q)) and "offload" not in self.manifest
        if requested == "qnn" and "offload" in self.manifest:
            raise ProviderError(f"{self.bundle} was compiled with a memory budget, which the QNN provider cannot honour "
                                "(its context binaries hold every weight)", hint="use --provider cpu")
        if requested == "qnn":
            if not has:
                why = q.get("skipped", "it was compiled without --soc")
                raise ProviderError(f"{self.bundle} has no QNN artifacts: {why}", hint="recompile with --target npu --soc 8gen3 (or another SoC)")
            reason = qnn_available()
            if reason:
                raise ProviderError(f"--provider qnn: {reason}", hint="pip install 'llmc[qnn]', or use --provider cpu")
            return "qnn"
        if requested == "auto" and has and qnn_available() is None:
            return "qnn"
        return "cpu"

    def graphs_run(self) -> dict[str, dict[str, int]]:
        """How many distinct graphs each phase has run on each provider since the session was made:
        ``{"prefill": {"qnn": n, "cpu": m}, "decode": {...}}``. With the qnn provider, a plan that places
        no graph on the NPU runs everything on the CPU, and this says so."""
        return {phase: {p: len(names) for p, names in by.items()} for phase, by in self._graphs_run.items()}

    @property
    def provider_used(self) -> str:
        """The provider that ran graphs: ``"qnn"`` once any graph has run on the HTP, else ``"cpu"`` (also with
        the qnn provider when the bundle's plan places every graph on the CPU)."""
        return "qnn" if any(by["qnn"] for by in self._graphs_run.values()) else "cpu"

    @property
    def npu_graphs_planned(self) -> dict[str, int]:
        """Graphs of the chunk program each phase would run on the QNN HTP (0 with the CPU provider)."""
        if self.provider != "qnn":
            return {"prefill": 0, "decode": 0}
        names = [st["name"] for st in self.program if st["kind"] == "graph"]
        return {phase: 0 if self._on_cpu(phase) else sum(self._on_npu(n, self._placement[phase].get(n, "npu")) for n in names)
                for phase in ("prefill", "decode")}

    @property
    def decode_path(self) -> str:
        """What runs a decode step: ``"graph"`` (one call of the decode graph), ``"cpu program"``
        (``fuse_cpu_decode``'s graph per layer and attention) or ``"chunk program"`` (its one-row instances)."""
        if self._decode_graph is not None:
            return "graph"
        return "cpu program" if self._decode_program is not None else "chunk program"

    @property
    def prefill_path(self) -> str:
        """What runs a prompt's chunks: ``"graph"`` (one call of the decode graph's chunk instance per chunk),
        ``"cpu program"`` (``fuse_cpu_decode``'s graph per layer and attention, at chunk rows) or ``"chunk
        program"`` (the compiled schedule of the chunk graphs, on the NPU where they are placed there)."""
        if self._chunk_graph:
            return "graph"
        return "cpu program" if self._cpu_prefill else "chunk program"

    @property
    def int8_kernels(self) -> str | None:
        """Which ONNX Runtime CPU kernels multiply the W8A8 weights of the graphs the CPU runs: ``"u8s8"``
        (int8 weights, on a CPU where those kernels are exact, or of 7 bits: :mod:`llmc.runtime.cpu`), ``"u8u8"`` (uint8
        weights: stored so, fed at run time, or rewritten by ONNX Runtime), or None (no W8A8 weights)."""
        names = {n for n in self.manifest["weights"] if n.endswith(".q8")}
        if not names:
            return None
        fed = {n for g in self.graphs.values() for key in ("streamed", "fed") for n in g.get(key, ())}
        constant_int8 = all(self.manifest["weights"][n]["dtype"] == "int8" and n not in fed for n in names)
        return "u8s8" if constant_int8 and u8s8_exact_for(self.weight_bits) else "u8u8"

    @property
    def packed_weight_bytes(self) -> int:
        """The bytes of the copies the decode graph's native ``W8A8MatMul`` ops make of their weights, in the layout
        their loop reads (``pack``; with a library built for AVX-512 VNNI, unless ``LLMC_W8_PACK=0``, which the kernels
        read when the session is made): 0 when they make none."""
        if self._decode_graph is None or self.native_kernels is None or os.environ.get("LLMC_W8_PACK") == "0":
            return 0
        if "w8_pack" not in native.features(self.native_kernels):
            return 0
        total = 0
        for name in self.graphs[self._decode_graph].get("packed", []):
            k, n = self.manifest["weights"][name]["shape"]
            blocks = -(-n // 64)
            total += -(-k // 4) * 4 * blocks * 64 + blocks * 64 * 4  # the bytes in blocks of 64 columns, their column sums
        return total

    @property
    def bf16_attention(self) -> bool:
        """Whether a chunk's attention multiplies in bfloat16 (float32 sums): graphs whose native chunk attention says
        so (``bf16``: a W8A8 program's), with a library built for AVX512_BF16, unless ``LLMC_ATTN_BF16=0`` (which the
        kernels read when the session is made)."""
        if self.native_kernels is None or os.environ.get("LLMC_ATTN_BF16") == "0":
            return False
        if "bf16_chunks" not in native.features(self.native_kernels):
            return False
        return any(g.get("bf16_attention") for g in self.graphs.values())

    @property
    def counts_outliers(self) -> bool:
        """Whether prefill's shadow corrections run in Python and count the outliers they see
        (``outlier_counts``); the CPU program and the chunk graph correct inside their graphs, uncounted. Scoring
        (``all_logits``) counts every position; a generation's prefill with a decode graph leaves
        its last token (and tail) to the graph, uncounted."""
        return bool(self.outlier_counts) and self.prefill_path == "chunk program"

    def _on_cpu(self, phase: str) -> bool:
        """Whether every graph of ``phase`` runs on the CPU: the provider is ``cpu``, or the
        placement keeps the phase off the NPU."""
        if self.provider == "cpu":
            return True
        return all(self._placement[phase].get(st["name"], "npu") == "cpu" for st in self.program if st["kind"] == "graph")

    @staticmethod
    def _readers(program: list[dict[str, Any]], skip: set[int] = frozenset()) -> dict[str, int]:
        """How many steps of ``program`` (but those in ``skip``) read each value."""
        uses: dict[str, int] = {}
        for i, st in enumerate(program):
            if i not in skip:
                for v in st["inputs"]:
                    uses[v] = uses.get(v, 0) + 1
        return uses

    def _chunk_feeds(self, ids: np.ndarray, i: int, start0: int) -> tuple[dict[str, np.ndarray], int]:
        """The inputs of chunk ``i`` of ``ids`` (the last one zero-padded to C rows, unless the prefill
        program takes it at its own length: ``_exact_chunks``) and its real row count."""
        C = self.chunk
        part = ids[i * C : (i + 1) * C]
        if self._exact_chunks:
            return self._feeds(part, start0 + i * C), len(part)
        padded = np.zeros(C, np.int64)
        padded[: len(part)] = part
        return self._feeds(padded, start0 + i * C), len(part)

    @staticmethod
    def _downstream_of_select(program: list[dict[str, Any]]) -> set[int]:
        tainted: set[str] = set()
        steps: set[int] = set()
        for i, s in enumerate(program):
            if (s["kind"] == "op" and s["op"] == "SelectRows") or tainted.intersection(s["inputs"]):
                steps.add(i)
                tainted.update(s["outputs"])
        return steps

    def _qnn_session(self, graph: str, rows: int):
        """The QNN HTP session of an NPU graph instance and the prefix of its tensor names."""
        from llmc.runtime.qnn import on_simulator, provider_options, qnn_session, register_qnn

        q = self.manifest["qnn"]
        inst = q["graphs"][graph][str(rows)]
        ort, oq, devices = register_qnn()
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        # Every node runs on the HTP, none on ONNX Runtime's intra-op pool: no worker threads, which would each
        # spin after the session is made (up to 2^20 rounds; 18 ms of CPU a session loading the test bundle), dozens
        # of sessions in turn while a bundle loads.
        so.intra_op_num_threads = 1
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts = provider_options(oq, q["htp_arch"], q["soc_model"])
        unshared = q.get("contexts") == "unshared"  # one graph per binary: these load on the simulator too
        if on_simulator() and not unshared:
            names = list(self.graphs[graph]["weights"])
            for n in names:
                if n not in self._ortvalues:
                    self._ortvalues[n] = ort.OrtValue.ortvalue_from_numpy(self._weights[n])
            names = [n for n in names if n.endswith(".q8")]  # the only weights the QDQ graphs read by name
            if names:
                so.add_external_initializers(names, [self._ortvalues[n] for n in names])
            so.add_provider_for_devices(devices, opts)
            sess = qnn_session(ort, resolve_inside(self.bundle, inst["qdq"]).read_bytes(), so)
        else:  # on the device: the weight-shared context binaries (or a package's unshared ones)
            if not unshared:
                so.add_session_config_entry("ep.share_ep_contexts", "1")
            so.add_provider_for_devices(devices, opts)
            if "binary" in inst:  # once per file: it holds the graphs the manifest records, or BundleError
                from llmc.runtime.qnn_binary import verify_binary

                verify_binary(self.bundle, inst["binary"], q)
            sess = qnn_session(ort, str(resolve_inside(self.bundle, inst["context"])), so)
        return sess, inst["io_prefix"]

    @property
    def _exact_chunks(self) -> bool:
        """Whether every graph prefill runs takes any row count up to C (a symbolic first dimension:
        graphs only the CPU runs), so that a prompt's last chunk runs at its own length, not padded to C."""
        graphs = self._decode_graphs if self._cpu_prefill else (st["name"] for st in self.program if st["kind"] == "graph")
        return self.chunk > 1 and all(self._dynamic(n) for n in graphs)

    def _dynamic(self, graph: str) -> bool:
        """Whether ``graph``'s chunk instance takes any row count up to C (``dynamic`` in the manifest)."""
        return bool(self.graphs[graph]["instances"].get(str(self.chunk), {}).get("dynamic", False))

    def _instance_rows(self, graph: str, rows: int, phase: str) -> int:
        """The instance of ``graph`` that runs ``rows`` rows: in prefill the chunk instance whenever it
        takes any count up to C (a last chunk of one row too: no one-row session, with its own copy of the
        weights, is made for it, and every prefill row computes alike), else the one of that row count."""
        if phase == "prefill" and rows < self.chunk and self._dynamic(graph):
            return self.chunk
        return rows

    def _on_npu(self, graph: str, processor: str) -> bool:
        """Whether ``graph`` runs on the QNN HTP: the provider is qnn, the placement says NPU and it has QNN artifacts."""
        return self.provider == "qnn" and processor == "npu" and graph in self.manifest["qnn"]["graphs"]

    def _session(self, graph: str, rows: int, processor: str = "npu", phase: str = "decode"):
        """The session of a graph instance: on the QNN HTP when the provider is qnn, the graph
        has QNN artifacts and the placement puts it on the NPU; else ONNX Runtime's CPU provider."""
        on_npu = self._on_npu(graph, processor)
        rows = self._instance_rows(graph, rows, phase)
        key = (graph, rows, on_npu)
        sess = self._sessions.get(key)
        if sess is not None:
            return sess
        if on_npu:
            self._sessions[key] = self._qnn_session(graph, rows)
            return self._sessions[key]
        ort = self._ort
        g = self.graphs[graph]
        inst = g["instances"].get(str(rows))
        if inst is None:
            raise BundleError(f"{self.bundle}: graph {graph} has no instance for {rows} rows (has {sorted(g['instances'])})")
        if "file" not in inst:  # a device package: this instance runs on its NPU
            raise ProviderError(f"{self.bundle} is a device package and holds no CPU instance of graph {graph} ({rows} rows)",
                                hint="run the bundle it was made from for this")
        so = ort.SessionOptions()
        by_row = g.get("fed", []) if self.residency is None else []  # the decode program's shadow tables: read by row
        small = rows == 1 and g["weight_bytes"] - sum(self.manifest["weights"][n]["nbytes"] for n in by_row) < ONE_THREAD_BYTES
        so.intra_op_num_threads = 1 if small else self._threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3
        # Dozens of sessions run one after another: spinning worker threads of
        # an idle session would steal the cores from the one that is running.
        # The decode graph is the one session that runs while decoding, a few
        # hundred short kernels per token: its workers spin between them instead
        # of sleeping and being woken (SmolLM2, same-process A/B at ~400 tokens:
        # int4 108 vs 74 tok/s, W8A8 67 vs 49; without spinning one thread beat two).
        spin = graph == self._decode_graph
        int8_session_options(so, self.weight_bits)
        if self.native_kernels is not None:
            so.register_custom_ops_library(str(self.native_kernels))
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
        if spin:  # spinning between kernels and between tokens, not on into the next prefill (DECODE_SPIN_US)
            so.add_session_config_entry("session.intra_op.spin_duration_us", str(DECODE_SPIN_US))
        if spin and rows > 1:
            # The decode graph's chunk instance (prefill, one call per chunk) spins too while it runs, but stops when
            # the call returns, so it does not take a core from the decode that follows. SmolLM2 W8A8, 512 tokens,
            # one process: 848 tok/s without spinning, 1,078 with it stopped after each call.
            so.add_session_config_entry("session.force_spinning_stop", "1")
        if rows > 1:
            # One memory arena for the chunk-sized sessions: each one's own would keep its peak
            # activations (a 256-row chunk's) for good, a few MB times a hundred sessions.
            # One-row sessions keep their own small arenas (the shared one slowed them down).
            _shared_arena(ort)
            so.add_session_config_entry("session.use_env_allocators", "1")
        streamed = g.get("streamed", [])
        budgeted = self.residency.session_options(ort, so) if self.residency is not None else {}  # copy no resident weight
        # weights that are graph inputs: a budgeted bundle's resident ones (ORT keeps a copy of each initializer
        # per session) and the decode program's shadow weights (ORT reads every initializer when it loads a graph)
        fed = g.get("fed", [])
        names = [n for n in g["weights"] if n not in streamed and n not in fed]
        scalar = set(g.get("scalar", ()))  # one-element per-tensor quantization scales: scalars in the graph
        for n in names:
            if n not in self._ortvalues:
                self._ortvalues[n] = ort.OrtValue.ortvalue_from_numpy(self._weights[n].reshape(()) if n in scalar else self._weights[n])
        if names:
            so.add_external_initializers(names, [self._ortvalues[n] for n in names])
        model_bytes = resolve_inside(self.bundle, inst["file"]).read_bytes()
        try:
            kwargs = session_kwargs()
            kwargs["disabled_optimizers"] += budgeted.pop("disabled_optimizers", [])
            sess = ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"], **kwargs, **budgeted)
        except Exception as e:  # onnxruntime's own exception types (InvalidProtobuf, InvalidGraph, Fail, ...)
            if type(e).__module__.split(".")[0] != "onnxruntime":
                raise
            raise BundleError(f"{self.bundle}: ONNX Runtime cannot load {inst['file']} (graph {graph}): {str(e).splitlines()[0][:300]}",
                              hint="the bundle is corrupt or was made by another llmc; recompile it") from e
        shapes = {i.name: tuple(i.shape) for i in sess.get_inputs()}  # a per-tensor scale is a scalar input
        if streamed:
            self.residency.streaming.shapes.update({n: shapes[n] for n in streamed})
        if fed:
            self._fed[graph] = {n: self._weights[n].reshape(shapes[n]) for n in fed}
        self._sessions[key] = (sess, "")
        return self._sessions[key]

    def _runs_in(self, name: str, rows: int) -> str | None:
        """The phase in which this session runs graph instance (``name``, ``rows``), or None if it never does."""
        if self._chunk_graph:  # the decode graph runs both phases
            return None if name != self._decode_graph else "decode" if rows == 1 else "prefill"
        if name == self.manifest.get("decode_graph"):  # its chunk instance only prefills with _chunk_graph (above)
            return "decode" if name == self._decode_graph and rows == 1 else None
        if rows == 1 and self._decode_graph is not None and name not in self._one_row_heads and (self.chunk > 1 or name in self._heads):
            return None  # decode is the one graph (with --chunk 1 the other one-row instances are prefill's)
        if name in self._decode_graphs:  # the CPU program: decode, and prefill on the CPU
            if self._decode_program is None or rows > 1 and not self._cpu_prefill:
                return None
            return "decode"
        phase = "decode" if rows == 1 and name != self._head else "prefill"
        if (phase == "decode" and self._decode_program is not None) or self._cpu_prefill:
            return None  # the CPU program runs decode (and prefill on the CPU provider)
        return phase

    def run_instance(self, graph: str, rows: int, inputs: dict[str, np.ndarray], processor: str = "cpu") -> dict[str, np.ndarray]:
        """Run one graph instance on ``inputs`` (its IR input names) on the CPU or, with the qnn provider, the NPU;
        its outputs by IR name."""
        sess, prefix = self._session(graph, rows, processor)
        feeds = {prefix + k: v for k, v in inputs.items()}
        if not self._on_npu(graph, processor) and graph in self._fed:
            feeds.update(self._fed[graph])
        names = [o["name"] for o in self.graphs[graph]["outputs"]]
        return dict(zip(names, sess.run([prefix + n for n in names], feeds)))

    def planned_instances(self) -> list[tuple[str, int, bool]]:
        """The graph instances a generation runs, as (graph, rows, on the QNN HTP): those :meth:`warmup` makes sessions of."""
        out = []
        for name, g in self.graphs.items():
            for rows in g["instances"]:
                phase = self._runs_in(name, int(rows))
                if phase is not None:
                    out.append((name, int(rows), self._on_npu(name, self._placement[phase].get(name, "npu"))))
        return out

    def _check_instances_present(self) -> None:
        """Every graph instance a generation runs is in the bundle: a device package (``llmc package``) holds only
        what its device runs, the context binaries of its NPU graphs and not their CPU instances or QDQ graphs."""
        from llmc.runtime.qnn import on_simulator

        pkg = self.manifest.get("package") or {}
        q = self.manifest.get("qnn") or {}
        for name, rows, on_npu in self.planned_instances():
            if not on_npu and "file" not in self.graphs[name]["instances"][str(rows)]:
                raise ProviderError(f"{self.bundle} is a package for {pkg.get('device', 'a device')}: graph {name} ({rows} rows) runs on its NPU, "
                                    f"and the package holds no CPU instance of it for --provider {self.provider}",
                                    hint="run the package with --provider qnn on the device, or run the bundle it was made from")
            if on_npu and on_simulator() and q.get("contexts") != "unshared" and "qdq" not in q["graphs"][name][str(rows)]:
                raise ProviderError(f"{self.bundle} is a package for {pkg.get('device', 'a device')}: its weight-shared context binaries load on "
                                    "the device's HTP, not on this machine's HTP simulator, and it holds no QDQ graphs to prepare here",
                                    hint="run it on the device; here, run the bundle it was made from, or make the package with --contexts unshared")

    def warmup(self) -> None:
        """Create every ONNX Runtime session now instead of on first use."""
        for name, rows, on_npu in self.planned_instances():
            phase = self._runs_in(name, rows)
            self._session(name, rows, self._placement[phase].get(name, "npu"))
        self.reset()
        if self._decode_graph is not None:
            # one call now, so that the ops' first-call work is done at load, not at a generation's second token: the
            # native W8A8MatMul ops copy their weights into their own layout (about 70 ms for SmolLM2 with AVX-512 VNNI)
            self._decode_graph_runner().prime()
        if self._chunk_graph:
            self._chunk_graph_runner()
            return
        for s in self.program:
            if s["kind"] == "op" and s["op"] == "Attention" and OrtAttention.supports(s["attrs"]):
                self._attention.prepare(**s["attrs"], one_row=self._decode_graph is None or self.chunk == 1)

    def _decode_graph_runner(self) -> DecodeGraphRunner:
        if self._decode_runner is None:
            name = self._decode_graph
            sess, _ = self._session(name, 1, "cpu")
            self._decode_runner = DecodeGraphRunner(self._ort, sess, self.graphs[name], self.cache, self._fed.get(name), self.io["logits"])
        return self._decode_runner

    def _chunk_graph_runner(self) -> ChunkGraphRunner:
        if self._chunk_runner is None:
            name = self._decode_graph
            sess, _ = self._session(name, self.chunk, "cpu", "prefill")
            self._chunk_runner = ChunkGraphRunner(self._ort, sess, self.graphs[name], self.cache, self._fed.get(name), self.io["logits"])
        return self._chunk_runner

    # -- execution -----------------------------------------------------------
    def reset(self) -> None:
        if self.cache is None:
            self.cache = kernels.KVCache(self._attn_layers, self.max_context, self._kv_scales, self._kv_half)
            self._attention = OrtAttention(self._ort, self.cache, self._threads)
        self.position = 0

    def rewind(self, position: int) -> None:
        """Forget the cached positions from ``position`` on: the next token fed is at ``position``.
        (Attention reads the cache only below the current position, so nothing is cleared.)"""
        if not 0 <= position <= self.position:
            raise ValueError(f"cannot rewind to position {position}: the cache holds positions 0..{self.position - 1}")
        self.position = position

    def _feeds(self, ids: np.ndarray, start: int) -> dict[str, np.ndarray]:
        return {
            self.io["input_ids"]: ids.astype(np.int64, copy=False),
            self.io["positions"]: np.arange(start, start + ids.shape[0], dtype=np.int64),
        }

    def _run_step(self, s: dict[str, Any], buf: dict[str, np.ndarray], start: int, n: int, logit_rows: np.ndarray | None, phase: str) -> None:
        """Run program step ``s`` on the values in ``buf`` (a chunk at ``start`` with ``n`` real rows)."""
        if s["kind"] == "graph":
            buf.update(zip(s["outputs"], self._run_graph(s, buf, phase)))
            return
        op, a, ins = s["op"], s.get("attrs", {}), [buf[x] for x in s["inputs"]]
        if op == "Embedding":
            res = [kernels.embedding(ins[0], self._weights[s["weights"]["table"]], a["scale"])]
        elif op == "QEmbedding":
            w = s["weights"]
            res = [kernels.qembedding(ins[0], self._weights[w["codes"]], self._weights[w["row_scale"]], a["zero_point"], a["transposed"], a["scale"])]
        elif op == "BlockEmbedding":
            w = s["weights"]
            res = [kernels.block_embedding(ins[0], self._weights[w["qweight"]], self._weights[w["scales"]],
                                         self._weights[w["offsets"]] if "offsets" in w else None, a["bits"], a["scale"])]
        elif op == "RotaryTable":
            res = list(kernels.rotary_table(ins[0], self._weights[s["weights"]["inv_freq"]], a["scaling"]))
        elif op == "Attention":
            cos, sin = (ins[3], ins[4]) if len(ins) == 5 else (None, None)
            if OrtAttention.supports(a):
                res = [self._attention(ins[0], ins[1], ins[2], cos, sin, start=start, n=n, **a)]
            else:
                res = [kernels.attention(ins[0], ins[1], ins[2], cos, sin, cache=self.cache, start=start, n=n, **a)]
        elif op == "ShadowOutliers":
            w = s["weights"]
            res, count = kernels.shadow_outliers(ins[0], ins[1:], a["splits"], self._weights[w["hot_delta"]], self._weights[w["codes"]],
                                                 self._weights[w["scale"]], a["w_zero_point"], self._hot_pos[s["name"]], a["lo"], a["hi"], n,
                                                 inplace=self._shadow_inplace[s["name"]])
            self.outlier_counts[s["name"]] += count
        elif op == "SelectRows":
            res = [self._select(ins[0], logit_rows, phase)]
        else:
            raise BundleError(f"{self.bundle}: program step {s['name']} uses op {op!r}, which this runtime does not know",
                              hint="the bundle was made by a newer llmc; upgrade the runtime")
        buf.update(zip(s["outputs"], res))


    def _order(self, k: int) -> list[tuple[int, int]]:
        """The compiled issue order of (chunk, step) for a prefill of ``k`` chunks.

        Bundles store one order per chunk count up to a limit; a longer prompt
        follows the longest stored order for its first chunks and runs the rest
        in order (any prefix of chunks of a valid order is valid).
        """
        orders = self._orders
        body = [j for j in range(len(self.program)) if j not in self._head_steps]
        if str(k) in orders:
            return [(int(i), int(j)) for i, j in orders[str(k)]]
        known = max((int(x) for x in orders), default=0)
        head = [(int(i), int(j)) for i, j in orders[str(known)]] if known else []
        return head + [(i, j) for i in range(known, k) for j in body]

    def _prefill_scheduled(self, ids: np.ndarray, logits_for: list[np.ndarray | None]) -> list[np.ndarray | None]:
        """Prefill ``ids`` in chunks, running (chunk, step) pairs in the compiled order.

        ``logits_for[i]`` are the rows of chunk i that need logits (or None); the
        head steps run for those chunks after the body. Values are dropped once
        their last consumer in the chunk has run.
        """
        C = self.chunk
        start0 = self.position
        k = -(-len(ids) // C)
        chunks = [self._chunk_feeds(ids, i, start0) for i in range(k)]
        bufs, ns = [b for b, _ in chunks], [n for _, n in chunks]
        keep = set(self._head_inputs)
        left = [dict(self._uses) for _ in range(k)]
        for i, j in self._order(k):
            s = self.program[j]
            buf = bufs[i]
            self._run_step(s, buf, start0 + i * C, ns[i], None, "prefill")
            uses = left[i]
            for v in s["inputs"]:
                uses[v] -= 1
                if uses[v] == 0 and v not in keep:
                    del buf[v]
        out = []
        for i in range(k):
            rows = logits_for[i]
            if rows is None:
                out.append(None)
                continue
            for j in sorted(self._head_steps):
                self._run_step(self.program[j], bufs[i], start0 + i * C, ns[i], rows, "prefill")
            out.append(bufs[i][self.io["logits"]][: len(rows)])
        self.position = start0 + len(ids)
        return out

    def _prefill_cpu_program(self, ids: np.ndarray, logits_for: list[np.ndarray | None]) -> list[np.ndarray | None]:
        """Prefill ``ids`` chunk by chunk through the CPU program (``fuse_cpu_decode``) at chunk rows;
        the steps after SelectRows run only for chunks with rows that need logits (``logits_for[i]``)."""
        C = self.chunk
        start0 = self.position
        logits = self.io["logits"]
        out = []
        for i in range(-(-len(ids) // C)):
            buf, n = self._chunk_feeds(ids, i, start0)
            rows = logits_for[i]
            uses = dict(self._cpu_uses)
            for j, s in enumerate(self._decode_program):
                if rows is None and j in self._cpu_tail:
                    continue
                self._run_step(s, buf, start0 + i * C, n, rows, "prefill")
                for v in s["inputs"]:  # a chunk's activations live until their last reader, as in the chunk program
                    uses[v] -= 1
                    if uses[v] == 0 and v != logits:
                        buf.pop(v, None)
            out.append(None if rows is None else buf[logits][: len(rows)])
        self.position = start0 + len(ids)
        return out

    def close(self) -> None:
        """Stop the prefetch and row-reader threads and close the weight file (budgeted bundles); the session is unusable after."""
        if self.residency is not None:
            self.residency.close()

    def _run_graph(self, s: dict[str, Any], buf: dict[str, np.ndarray], phase: str) -> list[np.ndarray]:
        """One graph step: a one-row instance through its IOBinding with reused outputs when it can
        (decode: nothing holds its results across calls), else an ordinary run with the streamed and
        fed weights of a budgeted bundle."""
        name, rows = s["name"], buf[s["inputs"][0]].shape[0]
        processor = self._placement[phase].get(name, "npu")
        sess, prefix = self._session(name, rows, processor, phase)
        on_qnn = self._on_npu(name, processor)
        self._graphs_run[phase]["qnn" if on_qnn else "cpu"].add(name)
        if self.recorded_inputs is not None and (name, rows) not in self.recorded_inputs:
            self.recorded_inputs[(name, rows)] = {x: np.array(buf[x]) for x in s["inputs"]}
        i = self._step_index.get(name)
        streamed = self.residency is not None and i in self.residency.streaming.by_step
        # Only decode reuses output buffers: a prefill of one-row chunks (--chunk 1) keeps every chunk's results
        if rows == 1 and phase == "decode" and name in self._reusable and not on_qnn and not streamed:
            bound = self._bound.get((name, rows))
            if bound is None:
                outs = self.graphs[name]["outputs"]
                bound = self._bound[(name, rows)] = BoundGraph(sess, s["inputs"], s["outputs"], rows,
                                                               [o["features"] for o in outs], [o["dtype"] for o in outs], self._fed.get(name))
            return bound([buf[x] for x in s["inputs"]])
        feeds = {prefix + x: buf[x] for x in s["inputs"]}
        if name in self._fed:  # weights that are inputs
            feeds.update(self._fed[name])
        names = [prefix + o for o in s["outputs"]]
        if not streamed:
            return sess.run(names, feeds)
        feeds.update(self.residency.streaming.acquire(i))
        try:
            return sess.run(names, feeds)
        finally:
            self.residency.streaming.release(i)

    def _select(self, x: np.ndarray, rows: np.ndarray, phase: str) -> np.ndarray:
        """The rows of ``x`` that need logits, padded to a row count the head graph has (in prefill, as
        they are when the running program's head takes any count up to C)."""
        head = self._cpu_head if self._cpu_prefill and phase == "prefill" else self._head
        if head is None:
            raise BundleError(f"{self.bundle}: the program has no head graph after SelectRows")
        sizes = sorted(int(r) for r in self.graphs[head]["instances"])
        size = next((s for s in sizes if s >= len(rows)), None)
        if size is None:
            raise BundleError(f"cannot score {len(rows)} rows at once; the head graph has instances {sizes}")
        if phase == "prefill" and self._dynamic(head):
            size = len(rows)  # the head takes the rows as they are
        out = np.zeros((size, x.shape[1]), x.dtype)
        out[: len(rows)] = x[rows]
        return out

    def prefill(self, ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Feed ``ids`` after what is already in the cache; return logits.

        Returns the last token's logits ``[vocab]``, or with ``all_logits`` the
        logits of every fed position ``[len(ids), vocab]``. When the decode graph
        has a chunk instance and the CPU runs both phases, each chunk is one call of
        it (``_prefill_graph``; the last chunk at its own length, scoring its last
        row). Otherwise the last chunk runs at its own length when the prefill
        program's graphs take any row count up to C (``_exact_chunks``), else padded
        to C; with a decode graph the last token goes through it when the CPU also
        prefills (no one-row head session), and where the last chunk would be
        padded, a tail of up to C / ``TAIL_DIVISOR`` tokens after the last whole
        chunk does too (instead of a mostly padded chunk).
        """
        ids = np.asarray(ids, dtype=np.int64)
        if not len(ids):
            raise PromptTooLongError("the prompt is empty", hint="give at least one token")
        self._check_ids(ids)
        if self.cache is None:
            self.reset()
        if self.position + len(ids) > self.max_context:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens and {self.position} are already in the context; "
                f"this bundle was compiled with --max-context {self.max_context}",
                hint="shorten the prompt, or recompile with a larger --max-context",
            )
        if self._chunk_graph:
            return self._prefill_graph(ids, all_logits)
        C = self.chunk
        in_graph = (tokens_in_graph(len(ids), C, self._ends_in_graph, self._exact_chunks)
                    if self._decode_graph is not None and not all_logits else 0)
        if in_graph:
            # whole chunks through the prefill program, then the tail and the last token through the decode graph
            chunked = len(ids) - in_graph
            if chunked:
                self._prefill_chunks(ids[:chunked], [None] * -(-chunked // C))
            for t in ids[chunked:-1]:
                self.decode(int(t))
            return self.decode(int(ids[-1]))
        k = -(-len(ids) // C)
        sizes = [min(C, len(ids) - i * C) for i in range(k)]
        if all_logits:
            rows = [np.arange(n) for n in sizes]
        else:
            rows = [None] * (k - 1) + [np.array([sizes[-1] - 1])]
        if self.residency is not None:  # the order the steps will run in, then decode's, for the prefetcher
            order = [j for _, j in self._order(k)] + [j for r in rows if r is not None for j in sorted(self._head_steps)]
            self.residency.streaming.schedule(order, then_repeat=self._all_steps)
        out = self._prefill_chunks(ids, rows)
        return np.concatenate(out) if all_logits else out[-1][0]

    def _prefill_graph(self, ids: np.ndarray, all_logits: bool) -> np.ndarray:
        """Prefill ``ids`` as one call of the decode graph's chunk instance per chunk of up to C tokens
        (the last one at its own length); the logits of every row with ``all_logits``, else of the last."""
        C, start0 = self.chunk, self.position
        runner = self._chunk_graph_runner()
        self._graphs_run["prefill"]["cpu"].add(self._decode_graph)
        k = -(-len(ids) // C)
        out = []
        for i in range(k):
            start = start0 + i * C
            part = ids[i * C : (i + 1) * C]
            buf = self._feeds(part, start)
            for s in self._decode_graph_steps:  # the embedding gather
                self._run_step(s, buf, start, len(part), None, "prefill")
            rows = np.arange(len(part)) if all_logits else np.arange(len(part) - 1, len(part)) if i == k - 1 else np.arange(0)
            out.append(runner([buf[x] for x in self._decode_graph_inputs], start, rows))
        self.position = start0 + len(ids)
        return np.concatenate(out) if all_logits else out[-1][0]

    def _prefill_chunks(self, ids: np.ndarray, logits_for: list[np.ndarray | None]) -> list[np.ndarray | None]:
        """``ids`` in chunks through the CPU program when the CPU prefills with it, else the compiled schedule."""
        return self._prefill_cpu_program(ids, logits_for) if self._cpu_prefill else self._prefill_scheduled(ids, logits_for)

    def _check_ids(self, ids: np.ndarray) -> None:
        vocab = self._vocab
        if vocab and len(ids) and (ids.min() < 0 or ids.max() >= vocab):
            bad = int(ids[(ids < 0) | (ids >= vocab)][0])
            raise TokenIdError(f"token id {bad} is outside the vocabulary of this bundle (ids 0..{vocab - 1})",
                               hint="token ids must come from the model's own tokenizer (llmc run --prompt TEXT encodes with it)")

    def decode(self, token: int) -> np.ndarray:
        """Feed one token through the decode graph (one call), the CPU decode program, or the
        program's one-row instances; return its logits."""
        self._check_ids(np.array([token], np.int64))
        start = self.position
        if start + 1 > self.max_context:
            raise PromptTooLongError(f"sequence would reach {start + 1} tokens; this bundle was compiled with --max-context {self.max_context}")
        if self._decode_graph is not None:
            if self.cache is None:
                self.reset()
            buf = self._feeds(np.array([token], np.int64), start)
            for s in self._decode_graph_steps:  # the embedding gather, then the graph
                self._run_step(s, buf, start, 1, None, "decode")
            logits = self._decode_graph_runner()([buf[x] for x in self._decode_graph_inputs], start)
            self._graphs_run["decode"]["cpu"].add(self._decode_graph)
            self.position = start + 1
            return logits
        if self.residency is not None:
            self.residency.streaming.schedule(self._all_steps, then_repeat=self._all_steps)
        buf = self._feeds(np.array([token], np.int64), start)
        rows = np.array([0])
        for s in self._decode_program or self.program:
            self._run_step(s, buf, start, 1, rows, "decode")
        self.position = start + 1
        return buf[self.io["logits"]][0]

    # -- text ----------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens=False`` leaves out what the tokenizer adds on
        its own (a BOS), as for text rendered from a chat template, which writes its own."""
        if self.tokenizer is None:
            raise PromptError(f"{self.bundle} has no tokenizer, so it cannot take text",
                              hint="pass token ids (llmc run --prompt-ids), or compile from a model directory that has tokenizer files")
        check_utf8(text, "the text")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode_text(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = 64, **kw: Any) -> Iterator[TokenEvent]:
        """Yield generated tokens one at a time, from an empty context; ``kw`` as :meth:`continue_stream`
        (sampling, ``stop_at_eos``, ``metrics``)."""
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise PromptTooLongError("the prompt is empty", hint="give at least one token")
        if len(ids) > self.max_context:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens but this bundle was compiled with --max-context {self.max_context}",
                hint="shorten the prompt, or recompile with a larger --max-context",
            )
        self.reset()
        return self.continue_stream(ids, max_new_tokens, **kw)

    def continue_stream(
        self,
        ids: Sequence[int],
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_at_eos: bool = True,
        metrics: Metrics | None = None,
    ) -> Iterator[TokenEvent]:
        """Feed ``ids`` after what the cache holds (``position``), then yield generated tokens.
        ``temperature=0`` is greedy.

        The last token yielded is not fed: the cache then holds the context, ``ids`` and
        every generated token but the last (a conversation feeds it with its next turn)."""
        ids = [int(t) for t in ids]
        metrics = metrics if metrics is not None else Metrics()
        metrics.prompt_tokens = len(ids)
        sampler = Sampler(temperature, top_k, top_p, seed)
        t0 = time.perf_counter()
        tok = sampler(self.prefill(ids))  # the prompt runs (and is checked) here, not at the first next()
        metrics.prefill_s = metrics.ttft_s = time.perf_counter() - t0
        return self._generate(tok, sampler, max_new_tokens, stop_at_eos, metrics)

    def _generate(self, tok: int, sampler: Sampler, max_new_tokens: int, stop_at_eos: bool, metrics: Metrics) -> Iterator[TokenEvent]:
        """Yield ``tok`` (sampled from the prompt's logits) and the tokens after it."""
        stream = TextStream(self.decode_text)
        generated = stream.ids
        t1 = time.perf_counter()
        while True:
            delta = stream.push(tok)
            metrics.generated_tokens = len(generated)
            yield TokenEvent(tok, delta)
            if (stop_at_eos and tok in self.eos_ids) or len(generated) >= max_new_tokens or self.position >= self.max_context:
                break
            tok = sampler(self.decode(tok))
        metrics.decode_s = time.perf_counter() - t1
        metrics.peak_rss_mb = peak_rss_mb()

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 64, **kw: Any) -> GenerationResult:
        metrics = Metrics()
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        out = [e.token_id for e in self.stream(ids, max_new_tokens, metrics=metrics, **kw)]
        return GenerationResult(ids, out, self.decode_text(out), self.finish_reason(out, max_new_tokens, kw.get("stop_at_eos", True)), metrics)

    def finish_reason(self, token_ids: Sequence[int], max_new_tokens: int, stop_at_eos: bool = True) -> str:
        """Why a generation of ``token_ids`` stopped: ``"eos"``, ``"length"`` (``max_new_tokens``) or ``"context"`` (full)."""
        if token_ids and stop_at_eos and token_ids[-1] in self.eos_ids:
            return "eos"
        return "length" if len(token_ids) >= max_new_tokens else "context"
