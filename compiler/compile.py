"""The compile driver: model source -> IR -> pipeline of passes -> bundle.

Stages, each reported through the ``progress`` callback:
load (frontend) -> trace (torch.export) -> lift (IR) -> passes -> emit (backend).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from llmc import __version__
from llmc.analyses import ChunkPlan, DecodeGraph, DecodePlan, KVCachePlan
from llmc.errors import CompileError
from llmc.pass_manager import CompileOptions, Instrument, ModelInputs, PassContext, format_pipeline, parse_pipeline, run_pipeline

log = logging.getLogger(__name__)

TARGETS = ("cpu", "npu", "mlir")
STAGES = ("load", "trace", "lift", "passes", "emit", "qnn")


@dataclasses.dataclass
class CompileSummary:
    bundle: Path
    pipeline: str
    graphs: int  # the static subgraphs of the programs
    graph_files: int
    weight_bytes: int
    seconds: dict[str, float]
    qnn: str | None = None  # what happened to the QNN part, for the CLI
    decode_graph: bool = False  # the bundle also has the one-graph decode (fuse_decode_graph)


# Compile options that passes read: the option, its flag, the passes that read it, where it applies.
_CALIBRATION = ("calibrate", "calibrate_ranges")
_NPU = "it applies to --target npu"
_COST = "the default pipelines of every target have it"
_READ_BY = {
    "shadow": ("--no-shadow", ("extract_shadow_outliers",), _NPU),
    "clip_percentile": ("--clip-percentile", ("extract_shadow_outliers",), _NPU),
    "shadow_keep": ("--shadow-keep", ("extract_shadow_outliers",), _NPU),
    "pruned_percentile": ("--pruned-percentile", ("extract_shadow_outliers",), _NPU),
    "hot_budget": ("--hot-budget", ("extract_shadow_outliers",), _NPU),
    "smooth_alpha": ("--smooth-alpha", ("smooth_activations",), _NPU),
    "weight_granularity": ("--weight-granularity", ("quantize",), _NPU),
    "weight_bits": ("--weight-bits", ("quantize",), _NPU),
    "calib_file": ("--calib", _CALIBRATION, _NPU + " and --kv-cache int8"),
    "calib_tokens": ("--calib-tokens", _CALIBRATION, _NPU + " and --kv-cache int8"),
    "memory_budget": ("--memory-budget", ("plan_offload",), _COST),
    "placement": ("--placement", ("place",), _COST),
    "profile": ("--profile", ("place",), _COST),
    "prompt_len": ("--prompt-len", ("schedule",), _COST),
    "cpu_kernels": ("--cpu-kernels", ("extract_shadow_outliers", "quantize", "fuse_decode_graph"), _COST),
}
CPU_KERNELS = ("onnx", "native")  # stock ONNX Runtime ops or llmc's native ones in the CPU's graphs (--cpu-kernels)


def check_early(options: CompileOptions, names: list[str], target: str, soc: str | None, explicit: Iterable[str],
                qnn_skip: str | None = None) -> None:
    """Option errors that would otherwise surface after loading, tracing and calibrating: an unreadable
    --memory-budget, a missing --calib file, a cache directory that cannot be made, and options that
    nothing in this compile reads (``explicit``: the ones the user set)."""
    from llmc.units import parse_size

    explicit = set(explicit)
    if options.memory_budget is not None:
        parse_size(options.memory_budget, total=1)  # the syntax only: a percentage is of the weight bytes, known later
    for key, (flag, readers, where) in _READ_BY.items():
        if key in explicit and not set(readers) & set(names):
            raise CompileError(f"{flag} has no effect here: the pipeline has no {readers[0]} pass",
                               hint=f"{where}; add {readers[0]} to --pipeline, or drop {flag}")
    if options.weight_bits != 8 and options.memory_budget is not None:
        raise CompileError(f"--weight-bits {options.weight_bits} gains nothing under --memory-budget: a budgeted bundle's weights are fed "
                           "at run time as uint8 and run on the uint8 x uint8 kernels on every CPU",
                           hint="drop --weight-bits (8-bit codes are more precise), or compile without --memory-budget")
    if options.prompt_len is not None and options.prompt_len > options.max_context:
        raise CompileError(f"--prompt-len {options.prompt_len} is longer than --max-context {options.max_context}",
                           hint="predictions are for prompts the bundle accepts: give at most --max-context, or raise --max-context")
    if options.calib_file is not None:
        from llmc.passes.calibrate import read_calib_file

        read_calib_file(options.calib_file)  # missing, unreadable or not UTF-8: before loading the model
    if target == "npu" and soc is not None and not qnn_skip and "calibrate_ranges" not in names:
        raise CompileError("the QNN context binaries (--soc) need the ranges of calibrate_ranges, which the pipeline does not have",
                           hint="add calibrate_ranges to --pipeline (after quantize), or drop --soc")
    if explicit & {"qnn_shard_mb", "qnn_shard_graphs"} and (target != "npu" or soc is None):
        raise CompileError("--qnn-shard-mb and --qnn-shard-graphs apply to the QNN context binaries: --target npu --soc SOC")
    if explicit & {"mlir_dialect", "repro_dir"} and target != "mlir":
        raise CompileError("--mlir-dialect and --repro-dir apply to --target mlir")
    if "prefetch_depth" in explicit and options.memory_budget is None:
        raise CompileError("--prefetch-depth applies to bundles compiled with --memory-budget")


def default_pipeline(target: str) -> str:
    from llmc.passes import DEFAULT_PIPELINES

    return DEFAULT_PIPELINES[target]


KV_CACHE_FORMATS = ("float32", "int8", "float16")
KV_CACHE_CHOICES = ("auto", *KV_CACHE_FORMATS)
PLAN_ONLY = ("assume_shadow_plan", "assume_kv_cache")  # placeholder analyses for planning from a config: never in a bundle
_BEFORE_CALIBRATION = ("dce", "select_logit_rows", "calibrate")  # passes that may run before calibrate (it needs float Linears)


def check_kv_cache_format(fmt: str) -> None:
    if fmt not in KV_CACHE_CHOICES:
        raise CompileError(f"unknown KV cache format {fmt!r}", hint="choose one of: " + ", ".join(KV_CACHE_CHOICES))


def resolve_kv_cache(fmt: str, target: str, cpu_kernels: str, pipeline: str | None, memory_budget: str | None,
                     soc: str | None = None) -> str:
    """The KV cache format ``fmt`` stands for: itself, or for ``auto`` float16 where llmc's native attention reads the
    cache of a model that is quantized already (``--target npu --cpu-kernels native``, the default pipeline, no
    --memory-budget and no --soc: half the cache's bytes and faster decode, perplexity within its noise,
    docs/quantization.md; ``float16_kv_cache`` then still keeps float32 for a model whose attention the native op
    does not take), else float32 (the float32 path stays exact to HF eager; a --pipeline runs the passes it names; a
    QNN bundle's prompt attends on the CPU between NPU graphs, where a float32 cache keeps ONNX Runtime's attention)."""
    if fmt != "auto":
        return fmt
    native_npu = target == "npu" and cpu_kernels == "native" and pipeline is None and memory_budget is None and soc is None
    return "float16" if native_npu else "float32"


def with_smoothing(names: list[str]) -> list[str]:
    """The pass names of ``names`` with ``smooth_activations`` and a second ``calibrate`` (the
    smoothed model's statistics) right after the first ``calibrate``; unchanged when there is no
    ``calibrate`` or the pipeline smooths already."""
    if "smooth_activations" in names or "calibrate" not in names:
        return list(names)
    i = names.index("calibrate") + 1
    return names[:i] + ["smooth_activations", "calibrate"] + names[i:]


def with_kv_cache(names: list[str], assume: bool = False) -> list[str]:
    """The pass names of ``names`` with ``quantize_kv_cache`` right after the last ``calibrate``; without
    ``calibrate``, both go before the first pass that rewrites the model's Linears. With ``assume``
    (``llmc plan``, no weights), ``assume_kv_cache`` goes there instead."""
    if "quantize_kv_cache" in names or "assume_kv_cache" in names:
        return list(names)
    if "calibrate" in names and not assume:
        i, added = len(names) - names[::-1].index("calibrate"), ["quantize_kv_cache"]
    else:
        i = next((j for j, n in enumerate(names) if n not in _BEFORE_CALIBRATION), len(names))
        added = ["assume_kv_cache"] if assume else ["calibrate", "quantize_kv_cache"]
    return names[:i] + added + names[i:]


def with_float16_kv_cache(names: list[str]) -> list[str]:
    """The pass names of ``names`` with ``float16_kv_cache`` first (it needs no analysis, and every later pass,
    calibration included, then sees the float16 cache)."""
    return list(names) if "float16_kv_cache" in names else ["float16_kv_cache", *names]


def check_float16_kv_cache(cpu_kernels: str, memory_budget: str | None) -> None:
    """--kv-cache float16 needs llmc's native attention, which reads float16 caches in the decode graph (ONNX Runtime's
    GroupQueryAttention takes them only with float16 queries), and no --memory-budget (a budgeted bundle attends in its
    chunk program, whose float16 layers the numpy kernel would run)."""
    if cpu_kernels != "native":
        raise CompileError("--kv-cache float16 needs --cpu-kernels native: llmc's attention op reads a float16 cache, "
                           "ONNX Runtime's GroupQueryAttention takes one only with float16 queries",
                           hint="add --cpu-kernels native (see `llmc kernels build`), or use --kv-cache int8 or float32")
    if memory_budget is not None:
        raise CompileError("--kv-cache float16 does not combine with --memory-budget: a budgeted bundle attends in its chunk program, "
                           "where a float16 cache would run numpy's attention",
                           hint="use --kv-cache int8 (a quarter of the float32 cache) with --memory-budget")


def resolve_profile(profile: str | None, soc: str | None) -> str:
    """The device profile the cost model plans for: ``--profile``, else the ``--soc``,
    else this machine's measured ``host`` profile, else Snapdragon 8 Gen 3."""
    from llmc import device_profile

    if profile:
        device_profile.load(profile)  # fail fast on a bad name
        return profile
    if soc:
        return soc
    if "host" in device_profile.available():
        return "host"
    log.info("no host profile measured (llmc profile-host); the cost model plans for 8gen3")
    return "8gen3"


def compile_model(
    source: str,
    out: str | Path,
    *,
    target: str = "cpu",
    chunk: int = 256,
    max_context: int = 2048,
    pipeline: str | None = None,
    instruments: Iterable[Instrument] = (),
    progress: Callable[[str], None] | None = None,
    mlir_dialect: str = "tosa",
    repro_dir: str | Path | None = None,
    soc: str | None = None,
    qnn_shard_bytes: int | None = None,
    qnn_shard_graphs: int | None = None,
    weight_format: str = "float32",
    kv_cache: str = "auto",
    cpu_kernels: str = "onnx",
    explicit: Iterable[str] = (),
    **quant_options: Any,
) -> CompileSummary:
    """Compile ``source`` into the bundle directory ``out``.

    ``target="mlir"`` compiles the float32 pipeline, writes the runnable ONNX
    bundle and, next to it, every static subgraph as ``mlir_dialect`` MLIR.
    ``quant_options`` are the quantization fields of :class:`CompileOptions`
    (calib_file, calib_tokens, cache_dir, shadow, clip_percentile, shadow_keep,
    pruned_percentile, hot_budget, weight_granularity, weight_bits); they matter for ``target="npu"``.
    ``weight_format="int4"`` (``target="cpu"`` only) runs the ``cpu-int4`` pipeline: weight-only
    int4 Linears (``quantize_int4``). ``kv_cache="auto"`` is float16 for npu bundles with native kernels
    (except with ``soc``), else float32 (:func:`resolve_kv_cache`); ``kv_cache="int8"`` adds ``quantize_kv_cache`` (and
    ``calibrate`` where the pipeline has none, see :func:`with_kv_cache`): an int8 KV cache; ``kv_cache="float16"``
    adds ``float16_kv_cache`` (first, :func:`with_float16_kv_cache`) and needs ``cpu_kernels="native"``.
    ``cpu_kernels="native"`` writes the shadow corrections (over float16 weight tables), the decode graph's
    attention (one row, and chunks, over int8 caches and in sliding windows too), gated MLP activations, the
    norms before W8A8 projections and int4's one-row 4-bit projections as llmc's native ops
    (:mod:`llmc.runtime.native`); the bundle then needs the kernels built where it runs.
    ``explicit`` names the options the user set (the CLI's); one that nothing in this compile
    reads is refused (:func:`check_early`).
    """
    from llmc import lift as lift_mod
    from llmc import model_source
    from llmc.backends import bundle as bundle_mod
    from llmc.backends import onnx_backend
    from llmc.passes import REGISTRY
    from llmc.passes.quantize_int4 import check_options, check_weight_format

    if target not in TARGETS:
        raise CompileError(f"target {target!r} is not available in this version", hint="available targets: " + ", ".join(TARGETS))
    if chunk < 1 or max_context < 1 or chunk > max_context:
        raise CompileError(f"--chunk {chunk} must be between 1 and --max-context {max_context}")
    if target == "mlir":
        from llmc.backends.mlir_backend import DIALECTS, MlirBackendError, require_torch_mlir

        require_torch_mlir()  # fail before the slow stages
        if mlir_dialect not in DIALECTS:
            raise MlirBackendError(f"unknown MLIR dialect {mlir_dialect!r}", hint="choose one of: " + ", ".join(DIALECTS))
    if soc is not None and target != "npu":
        raise CompileError(f"--soc applies to --target npu, not {target}")
    bundle_mod.check_output(out)  # a bad -o fails now, not after loading and compiling
    qnn_skip = None
    if target == "npu":
        from llmc.backends.qnn_backend import SOCS, check_soc
        from llmc.runtime.qnn import qnn_available

        if soc is None:
            qnn_skip = "no --soc given (choose one of: " + ", ".join(SOCS) + ")"
        elif soc not in SOCS:
            raise CompileError(f"unknown SoC {soc!r}", hint="choose one of: " + ", ".join(SOCS))
        else:
            qnn_skip = qnn_available()
            if not qnn_skip:
                check_soc(soc)  # this QNN build prepares for the SoC (a tiny graph, well under a second), else fail before the slow stages
    default = "npu-qnn" if target == "npu" and not qnn_skip else "cpu-int4" if weight_format == "int4" else target
    check_kv_cache_format(kv_cache)
    auto_kv_cache = kv_cache == "auto"
    kv_cache = resolve_kv_cache(kv_cache, target, cpu_kernels, pipeline, quant_options.get("memory_budget"), soc)
    from llmc.passes.quantize import check_weight_bits

    check_weight_bits(quant_options.get("weight_bits", 8))
    if cpu_kernels not in CPU_KERNELS:
        raise CompileError(f"unknown --cpu-kernels {cpu_kernels!r}", hint="choose one of: " + ", ".join(CPU_KERNELS))
    if pipeline is not None and not pipeline.strip():
        raise CompileError("--pipeline is empty", hint="name the passes (see `llmc passes`), or leave --pipeline out for the target's default")
    passes = parse_pipeline(pipeline or default_pipeline(default), REGISTRY)  # fail fast on a bad --pipeline
    if target == "npu" and pipeline is None:
        from llmc.passes.smooth_activations import NO_SHADOW_ALPHA

        if quant_options.get("smooth_alpha") is None and quant_options.get("shadow") is False:
            quant_options["smooth_alpha"] = NO_SHADOW_ALPHA  # plain W8A8 needs it most (docs/quantization.md)
        if quant_options.get("smooth_alpha") is not None:
            passes = parse_pipeline(",".join(with_smoothing([p.name for p in passes])), REGISTRY)
    if kv_cache == "int8":
        passes = parse_pipeline(",".join(with_kv_cache([p.name for p in passes])), REGISTRY)
    if kv_cache == "float16":
        check_float16_kv_cache(cpu_kernels, quant_options.get("memory_budget"))
        passes = parse_pipeline(",".join(with_float16_kv_cache([p.name for p in passes])), REGISTRY)
    names = [p.name for p in passes]
    placeholders = [n for n in names if n in PLAN_ONLY]
    if placeholders:
        raise CompileError(f"pass {placeholders[0]} is for `llmc plan` only: its values are placeholders",
                           hint="compile with calibrate and quantize_kv_cache (--kv-cache int8) or extract_shadow_outliers instead")
    check_weight_format(weight_format, target, names)
    if qnn_skip:
        log.warning("QNN context binaries skipped: %s; the bundle has the ONNX graphs only", qnn_skip)
    quant_options["profile"] = resolve_profile(quant_options.get("profile"), soc)
    cache = quant_options.get("cache_dir")
    if cache is not None and ("calibrate" in names or str(source) in model_source.BUNDLED or str(source).endswith(".gguf")):
        try:  # calibration results and dequantized GGUF models go there
            Path(cache).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            if "cache_dir" in explicit:
                raise CompileError(f"cannot use the cache directory {cache}: {e.strerror or e}",
                                   hint="pass --cache-dir a writable directory, or --no-cache") from e
            log.warning("cannot use the cache directory %s (%s); compiling without a cache", cache, e.strerror or e)
            quant_options["cache_dir"] = None
    try:
        options = CompileOptions(target=target, chunk=chunk, max_context=max_context, cpu_kernels=cpu_kernels,
                                 kv_cache_auto=auto_kv_cache and kv_cache == "float16", **quant_options)
    except TypeError as e:
        raise CompileError(f"unknown compile option: {e}") from None
    if "quantize_int4" in names:
        check_options(options)  # before loading the model
    check_early(options, names, target, soc, explicit, qnn_skip)
    if cpu_kernels == "native":
        from llmc.runtime import native as native_mod

        if native_mod.library_path() is None:
            log.warning("--cpu-kernels native: llmc's native kernels are not built on this machine; the bundle will not run "
                        "here until `llmc kernels build` has built them")
    seconds: dict[str, float] = {}
    notify = progress or (lambda stage: None)

    def stage(name: str):
        notify(name)
        return time.perf_counter()

    t = stage("load")
    loaded = model_source.load(source, cache_dir=quant_options.get("cache_dir"))
    limit = getattr(loaded.model.config, "max_position_embeddings", None)
    if limit and max_context > limit:
        log.warning("--max-context %d exceeds the model's max_position_embeddings %d; quality past %d tokens is not guaranteed", max_context, limit, limit)
    seconds["load"] = time.perf_counter() - t

    t = stage("trace")
    ep = lift_mod.trace(loaded.model, chunk)
    seconds["trace"] = time.perf_counter() - t

    t = stage("lift")
    graph = lift_mod.lift(ep, loaded.model, name=type(loaded.model).__name__, checkpoint=loaded.checkpoint)
    del ep
    seconds["lift"] = time.perf_counter() - t

    t = stage("passes")
    tok = loaded.tokenizer
    encode = (lambda text: tok(text, add_special_tokens=True)["input_ids"]) if tok is not None else None
    ctx = PassContext(options, ModelInputs(encode, loaded.fingerprint))
    run_pipeline(graph, passes, ctx, instruments)
    if not ctx.has(ChunkPlan):
        raise CompileError("the pipeline did not produce a ChunkPlan", hint="end the pipeline with chunk_static_graphs")
    plan = ctx.get(ChunkPlan)
    seconds["passes"] = time.perf_counter() - t

    t = stage("emit")
    with bundle_mod.atomic_directory(out) as root:
        order = _weight_order(graph, plan)
        weights = onnx_backend.write_weights(graph, order, root)
        for name, part in weight_parts(graph).items():
            if name in weights:
                weights[name]["part"] = part
        offload = _offload_section(ctx, weights)
        # codes only a correction reads (not a projection's own) are inputs of the CPU's graphs: ONNX Runtime reads every
        # initializer when it loads a graph, which would page in all of them; fed by pointer, only the outliers' rows are
        shadows = graph.find("ShadowOutliers")
        shadow_t = frozenset(n.weights["codes"].name for n in shadows) - {n.weights["qweight"].name for n in graph.find("QLinear")}
        decode_graph = ctx.get(DecodeGraph) if ctx.has(DecodeGraph) else None  # decode as one graph (fuse_decode_graph)
        # the library is needed only where its ops are: shadow corrections, the decode graph's attention (and SwiGLU)
        native = cpu_kernels == "native" and (bool(shadows) or decode_graph is not None)
        # the npu target's chunk graphs are the NPU's (QNN): stock ops only
        graphs = onnx_backend.emit_graphs(graph, plan, weights, root, placement="npu" if target == "npu" else "cpu",
                                          streamed=frozenset(offload["streamed"]) if offload else frozenset(),
                                          fed=frozenset(offload["resident"]) if offload else frozenset(), native=native and target != "npu")
        decode_plan = ctx.get(DecodePlan) if ctx.has(DecodePlan) else None  # none under a budget (fuse_cpu_decode)
        if decode_plan is not None:  # the CPU's program (decode, and CPU prefill) (fuse_cpu_decode)
            graphs.update(onnx_backend.emit_graphs(graph, decode_plan, weights, root, placement="cpu", fed=shadow_t, native=native))
        if decode_graph is not None:
            graphs.update(onnx_backend.emit_decode_graph(graph, decode_graph, weights, root, fed=shadow_t, native=native))
        tok = _write_tokenizer(loaded, root)
        qnn = None
        if target == "npu":
            if qnn_skip:
                qnn = {"skipped": qnn_skip}
            else:
                from llmc.analyses import ValueRanges
                from llmc.backends.qnn_backend import DEFAULT_SHARD_BYTES, DEFAULT_SHARD_GRAPHS, emit_qnn

                notify("qnn")
                qnn = emit_qnn(graph, plan, weights, ctx.get(ValueRanges), root, soc, qnn_shard_bytes or DEFAULT_SHARD_BYTES,
                               qnn_shard_graphs or DEFAULT_SHARD_GRAPHS)
        mlir = None
        if target == "mlir":
            from llmc.backends.mlir_backend import emit_mlir

            mlir = emit_mlir(graph, plan, root, mlir_dialect, Path(repro_dir) if repro_dir else Path(out).absolute().parent / "llmc-repro")
        manifest = {
            "llmc_version": __version__,
            "target": target,
            "chunk": chunk,
            "max_context": max_context,
            "model": {**graph.model_info, "source": loaded.description},
            "pipeline": format_pipeline(passes),
            "io": {"input_ids": graph.inputs[0].name, "positions": _positions(graph), "logits": graph.outputs[0].name},
            "weights": weights,
            "graphs": graphs,
            "program": _program(graph, plan),
            "tokenizer": tok,
        }
        if native:
            manifest["cpu_kernels"] = "native"
        if "quantize" in names:
            manifest["weight_bits"] = options.weight_bits  # the runtime's int8 kernels (llmc.runtime.cpu)
        if decode_plan is not None:
            manifest["decode_program"] = _program(graph, decode_plan)
        if decode_graph is not None:
            manifest["decode_graph"] = decode_graph.subgraph.name
        predicted = predictions(ctx)
        manifest.update(_plan_sections(ctx, predicted))
        if mlir is not None:
            manifest["mlir"] = mlir
        if qnn is not None:
            manifest["qnn"] = qnn
        if offload is not None:
            manifest["offload"] = offload
        report = build_report(graph, ctx, weights) or {}
        if ctx.has(KVCachePlan):
            report["kv_cache"] = _kv_cache_report(ctx)
        if predicted:
            report["predictions"] = predicted
        if report:
            (root / "report.json").write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
        bundle_mod.write_manifest(root, manifest)
    seconds["emit"] = time.perf_counter() - t
    return CompileSummary(
        Path(out),
        format_pipeline(passes),
        len(graphs) - (decode_graph is not None),
        sum(len(g["instances"]) for g in graphs.values()),
        sum(w["nbytes"] for w in weights.values()),
        seconds,
        None if qnn is None else (f"QNN part skipped: {qnn['skipped']}" if "skipped" in qnn else
                                  f"QNN HTP {qnn['htp_arch']} for {qnn['soc']}: {sum(len(b['files']) for b in qnn['binaries'])} context binaries, "
                                  f"{sum(b['bytes'] for b in qnn['binaries']) / 1e6:.1f} MB"),
        decode_graph is not None,
    )


def build_report(graph, ctx: PassContext, weights: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The quantization report: per Linear its range, shadow decision, hot channels and bytes."""
    from llmc.analyses import CalibrationStats, ShadowPlan, SmoothingPlan
    from llmc.passes.quantize import weight_qmax

    if not ctx.has(ShadowPlan):
        return None
    qmax = weight_qmax(ctx.options.weight_bits)
    plan = ctx.get(ShadowPlan)
    calib = ctx.get(CalibrationStats)
    total = sum(w["nbytes"] for w in weights.values())
    model_int8 = sum(w["nbytes"] for n, w in weights.items() if n.endswith(".q8"))
    linears = []
    resident = 0
    for node in graph.nodes:
        if node.op != "QLinear":
            continue
        x = node.inputs[0].name
        q = plan.inputs[x]
        name = node.name[: -len(".q")]
        hot_bytes = 0
        if q.shadow and q.hot_channels:  # this Linear's columns of the shared hot rows
            hot_bytes = len(q.hot_channels) * node.weights["qweight"].shape[1] * 4
            resident += hot_bytes
        linears.append({
            "linear": name,
            "input": x,
            "x_scale": q.scale,
            "clip": q.clip,
            "calib_absmax": q.absmax,
            "importance": q.importance,
            "outlier_rate": q.outlier_rate,
            "shadow": "kept" if q.shadow else "pruned",
            "hot_channels": len(q.hot_channels),
            "resident_shadow_bytes": hot_bytes,
            "weight_granularity": ctx.options.weight_granularity,
            "weight_bits": ctx.options.weight_bits,
        })
    kept = sum(1 for q in plan.inputs.values() if q.shadow)
    report = {
        "calibration": {"corpus": calib.corpus, "tokens": calib.tokens},
        "quantization": {
            "activations": "uint8 per tensor (zero point 128) at every Linear input; everything else float32 "
                           "(8-bit norms/residual/activations measured: +49% / unusable / x6 perplexity; docs/quantization.md)"
                           + ("; the KV cache int8 (kv_cache)" if ctx.has(KVCachePlan) else ""),
            "weights": f"int8 symmetric per {ctx.options.weight_granularity}, codes in [-{qmax}, {qmax}]"
                       + (f" (--weight-bits {ctx.options.weight_bits})" if ctx.options.weight_bits != 8 else ""),
            "shadow": plan.enabled,
            "clip_percentile": plan.percentile if plan.enabled else None,
            "shadow_keep_fraction": plan.keep_fraction,
            "pruned_percentile": ctx.options.pruned_percentile if plan.enabled else None,
            "hot_budget": ctx.options.hot_budget,
        },
        "summary": {
            "linear_inputs": len(plan.inputs),
            "shadow_kept": kept,
            "shadow_pruned": len(plan.inputs) - kept,
            "resident_shadow_bytes": resident,
            "weight_bytes": total,
            "int8_weight_bytes": model_int8,
            "resident_shadow_fraction_of_int8_weights": resident / model_int8 if model_int8 else 0.0,
        },
        "linears": linears,
    }
    if ctx.has(SmoothingPlan):
        report["smoothing"] = _smoothing_report(ctx.get(SmoothingPlan))
    return report


def _smoothing_report(sp) -> dict[str, Any]:
    """report.json's ``smoothing``: what smooth_activations did (docs/quantization.md)."""
    inputs = list(sp.inputs.values())
    sites: dict[str, int] = {}
    for i in inputs:
        sites[i.site] = sites.get(i.site, 0) + 1
    return {
        "alpha": sp.alpha,
        "inputs_smoothed": len(inputs),
        "by_site": sites,
        "largest_channel_spread_before": max((i.spread_before for i in inputs), default=None),
        "largest_channel_spread_after": max((i.spread_after for i in inputs), default=None),
        "inputs": {i.value: {"site": i.site, "exponents": [min(i.exponents), max(i.exponents)],
                             "channel_spread": [i.spread_before, i.spread_after]} for i in inputs},
    }


def _kv_cache_report(ctx: PassContext) -> dict[str, Any]:
    """report.json's ``kv_cache``: the int8 cache's calibration and, per layer, the bounds its scales come from."""
    from llmc.analyses import CalibrationStats

    plan = ctx.get(KVCachePlan)
    calib = ctx.get(CalibrationStats)
    return {
        "dtype": plan.dtype,
        "scales": "per channel: keys after rotary (bounded from the pre-rotary calibration maxima), values; codes saturate beyond",
        "calibration": {"corpus": calib.corpus, "tokens": calib.tokens},
        "bytes_per_position": plan.bytes_per_position,
        "float32_bytes_per_position": plan.float32_bytes_per_position,
        "layers": [{"layer": layer, "key_bound": k, "value_max": v} for layer, (k, v) in sorted(plan.layers.items())],
    }


def _offload_section(ctx: PassContext, weights: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The manifest's ``offload`` section: the :class:`OffloadPlan`'s fields, or None without a plan."""
    from llmc.analyses import OffloadPlan

    if not ctx.has(OffloadPlan):
        return None
    plan = ctx.get(OffloadPlan)
    section = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
    for key in ("resident", "streamed", "row_streamed"):
        section[key] = list(section[key])
        unknown = [n for n in section[key] if n not in weights]
        if unknown:
            raise CompileError(f"the offload plan's {key} weights {unknown[:3]} are not in the bundle's weight table",
                               hint="the pass that made the OffloadPlan named weights the pipeline removed; rerun it after the passes that rename weights")
    section.pop("resident_rows")
    if plan.resident_rows:  # optional in the format: bundles that keep no rows stay readable by older runtimes
        section["resident_rows"] = {name: [int(r) for r in rows] for name, rows in plan.resident_rows.items()}
    return section


def predictions(ctx: PassContext) -> dict[str, Any] | None:
    """The cost model's predictions for the compiled program (report.json, `llmc inspect`)."""
    from llmc.analyses import OffloadPlan, Schedule

    if not ctx.has(Schedule):
        return None
    s = ctx.get(Schedule)
    out: dict[str, Any] = {
        "profile": ctx.options.profile,
        "prompt_len": s.prompt_len,
        "prefill_s": s.prefill_s,
        "prefill_tok_s": s.prompt_len / s.prefill_s if s.prefill_s > 0 else 0.0,
        "prefill_in_order_s": s.in_order.makespan_s + s.head_s,
        "prefill_program": s.prefill_program,
        "prefill_out_of_order_s": s.out_of_order.makespan_s + s.head_s,
        "npu_bubble_rate_in_order": s.in_order.npu_bubble_rate,
        "npu_bubble_rate_out_of_order": s.out_of_order.npu_bubble_rate,
        "decode_s_per_token": s.decode_s,
        "decode_tok_s": 1.0 / s.decode_s if s.decode_s > 0 else 0.0,
    }
    if ctx.has(OffloadPlan):
        o = ctx.get(OffloadPlan)
        out["decode_tok_s_under_budget"] = 1.0 / o.predicted_decode_s
        out["decode_tok_s_under_budget_no_prefetch"] = 1.0 / o.predicted_decode_no_prefetch_s
    return out


def _plan_sections(ctx: PassContext, predicted: dict[str, Any] | None) -> dict[str, Any]:
    """Manifest sections of the placement and the schedule, when the pipeline made them."""
    from llmc.analyses import Placement, Schedule

    out: dict[str, Any] = {}
    if ctx.has(Placement):
        p = ctx.get(Placement)
        out["placement"] = {"profile": p.profile, "prefill": dict(p.prefill), "decode": dict(p.decode)}
    if ctx.has(Schedule):
        s = ctx.get(Schedule)
        out["schedule"] = {
            "policy": s.chosen.policy,
            "orders": {str(k): [list(t) for t in order] for k, order in sorted(s.orders.items())},
            "predicted": predicted,
        }
    return out


def _positions(graph) -> str:
    names = [v.name for v in graph.inputs if v.name.startswith("positions")]
    return names[0] if names else "positions"


def weight_parts(graph) -> dict[str, str]:
    """Each weight's part of the bundle: ``head`` (the LM head's, the last projection), ``codes`` (the other
    projections' quantized codes and scales), ``embedding``, ``shadow`` (what only the outlier corrections read:
    their hot channels' rows, the codes of an unmerged group) or ``float`` (norms, rotary tables, float Linears).
    A weight two parts read is the first's: a tied embedding that gathers the head's codes adds no bytes."""
    projections = ("Linear", "QLinear", "BlockQLinear")
    parts: dict[str, str] = {}
    head = next((n for n in reversed(graph.nodes) if n.op in projections), None)
    for r in head.weights.values() if head is not None else ():
        parts[r.name] = "head"
    for n in graph.nodes:
        if n.op in ("QLinear", "BlockQLinear"):
            for r in n.weights.values():
                parts.setdefault(r.name, "codes")
    for n in graph.nodes:
        part = "embedding" if n.op.endswith("Embedding") else "shadow" if n.op == "ShadowOutliers" else "float"
        for r in n.weights.values():
            parts.setdefault(r.name, part)
    return parts


def _weight_order(graph, plan: ChunkPlan) -> list[str]:
    """Weights in the order the program first touches them (good locality for streaming)."""
    order: list[str] = []
    subs = {s.name: s for s in plan.subgraphs}
    for step in plan.steps:
        names = subs[step.name].weights if step.kind == "graph" else [r.name for r in graph.node(step.name).weights.values()]
        for n in names:
            if n not in order:
                order.append(n)
    return order


def _program(graph, plan: ChunkPlan | DecodePlan) -> list[dict[str, Any]]:
    steps = []
    for s in plan.steps:
        d: dict[str, Any] = {"kind": s.kind, "name": s.name, "inputs": list(s.inputs), "outputs": list(s.outputs)}
        if s.kind == "op":
            node = graph.node(s.name)
            d["op"] = node.op
            d["attrs"] = dict(node.attrs)
            d["weights"] = {k: r.name for k, r in node.weights.items()}
        steps.append(d)
    return steps


def _write_tokenizer(loaded, root: Path) -> dict[str, Any]:
    tok = loaded.tokenizer
    info: dict[str, Any] = {"eos_token_ids": loaded.generation_eos}
    backend = getattr(tok, "backend_tokenizer", None) if tok is not None else None
    if backend is None:
        if tok is not None:
            log.warning("the tokenizer of %s is not a fast tokenizer; the bundle will accept token ids only", loaded.source)
        return info
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "tokenizer.json").write_text(backend.to_str(pretty=True))
    info["file"] = "tokenizer/tokenizer.json"
    info["bos_token_id"] = getattr(tok, "bos_token_id", None)
    template = getattr(tok, "chat_template", None)
    if isinstance(template, dict):  # named templates: the one apply_chat_template uses by default
        template = template.get("default")
    if isinstance(template, str):
        info["chat_template"] = template
        # the strings a template may write (bos_token, eos_token, ...), as apply_chat_template passes them
        info["special_tokens"] = {k: v for k in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
                                  if isinstance(v := getattr(tok, k, None), str)}
    return info
