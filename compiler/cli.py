"""The ``llmc`` command line. The CLI owns the terminal; library code only logs."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import click

from llmc import __version__

log = logging.getLogger(__name__)


def _fail(e: Exception) -> None:
    click.echo(f"error: {e}", err=True)
    hint = getattr(e, "hint", None)
    if hint:
        click.echo(f"hint: {hint}", err=True)
    sys.exit(getattr(e, "exit_code", 1))


def _guard(fn):
    """Turn llmc's own errors into a message, a hint and a non-zero exit code."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from llmc.errors import LlmcError
        from llmc.runtime.errors import LlmcRuntimeError

        try:
            return fn(*args, **kwargs)
        except (LlmcError, LlmcRuntimeError) as e:
            _fail(e)
        except KeyboardInterrupt:  # a compile has removed its partial output by now
            click.echo("interrupted", err=True)
            sys.exit(130)

    return wrapper


def _soc_names() -> list[str]:
    """The ``--soc`` choices: the shipped device profiles with QNN SoC facts (as ``llmc.backends.qnn_backend.SOCS``)."""
    from llmc.device_profile import qnn_socs

    return list(qnn_socs())


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="llmc")
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
def cli(verbose: int) -> None:
    """llmc: compile HuggingFace decoder-only LLMs into chunked static-graph bundles and run them.

    \b
    llmc compile smollm2-135m --target cpu -o out/
    llmc run out/ --prompt "The capital of France is"
    llmc chat out/
    """
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


@cli.command()
@click.argument("model")
@click.option("-o", "--output", "out", required=True, type=click.Path(file_okay=False), help="Bundle directory to write (replaced atomically).")
@click.option("--target", type=click.Choice(["cpu", "npu", "mlir"]), default="cpu", show_default=True,
              help="cpu: float32 static graphs. npu: W8A8 QDQ graphs with shadow outliers. "
                   "mlir: the cpu bundle plus every static subgraph as MLIR (needs llmc[mlir]).")
@click.option("--soc", type=click.Choice(_soc_names()), default=None,
              help="[npu] Also build QNN HTP context binaries for this Qualcomm SoC (the profiles with QNN SoC facts; "
                   "`llmc profiles` lists their HTP arch and QNN soc_model); needs llmc[qnn].")
@click.option("--qnn-shard-mb", type=click.IntRange(1), default=None, help="[npu] Largest weights per QNN context binary (default 2048 MB).")
@click.option("--qnn-shard-graphs", type=click.IntRange(1), default=None,
              help="[npu] Most graph instances per QNN context binary (default 64; bounds the host memory of preparing it).")
@click.option("--weights", type=click.Choice(["float32", "int4"]), default="float32", show_default=True,
              help="[cpu] Weight format: float32, or int4 (weight-only, blocks of 32 weights with a scale and an offset, llama.cpp's Q4_1 grid, "
                   "the LM head at 8 bits; float activations; not with --memory-budget).")
@click.option("--kv-cache", type=click.Choice(["auto", "float32", "int8", "float16"]), default="auto", show_default=True,
              help="KV cache format: float32, float16 (half the bytes, no calibration; needs --cpu-kernels native), or int8 with per-channel scales from calibration (adds the calibrate pass; "
                   "a quarter of the cache's bytes; docs/quantization.md). auto: float16 for --target npu --cpu-kernels native "
                   "(without --pipeline, --memory-budget or --soc, and where llmc's attention op takes every layer), else float32.")
@click.option("--mlir-dialect", type=click.Choice(["tosa", "linalg"]), default="tosa", show_default=True, help="[mlir] Dialect of the emitted modules.")
@click.option("--repro-dir", type=click.Path(file_okay=False), default=None, help="[mlir] Where lowering reproducers go (default: llmc-repro/ next to -o).")
@click.option("--chunk", type=click.IntRange(1), default=256, show_default=True, help="Prefill chunk length C (rows of the shared static graphs).")
@click.option("--max-context", type=click.IntRange(1), default=2048, show_default=True, help="Longest prompt + generation the bundle accepts (KV cache size).")
@click.option("--pipeline", default=None, help="Comma-separated passes to run (see `llmc passes`); default depends on --target.")
@click.option("--dump-ir", type=click.Path(file_okay=False), default=None, help="Write the IR before and after every pass into this directory.")
@click.option("--time-passes", is_flag=True, help="Print how long each pass took.")
@click.option("--calib", "calib_file", type=click.Path(dir_okay=False), default=None, help="[npu, --kv-cache int8] Calibration text file (default: Python's bundled reference docs).")
@click.option("--calib-tokens", type=click.IntRange(16), default=2048, show_default=True, help="[npu, --kv-cache int8] Calibration tokens to run.")
@click.option("--no-shadow", is_flag=True, help="[npu] Plain per-tensor W8A8: no shadow outlier paths, ranges at the calibration max (smoothed: see --smooth-alpha).")
@click.option("--clip-percentile", type=click.FloatRange(50, 100, max_open=True), default=99.0, show_default=True, help="[npu] Activation clip (percentile of |x|) for shadow-enabled Linears.")
@click.option("--shadow-keep", type=click.FloatRange(0, 1), default=1.0, show_default=True, help="[npu] Fraction of Linear inputs (most important first) that keep a shadow path.")
@click.option("--pruned-percentile", type=click.FloatRange(50, 100), default=99.999, show_default=True, help="[npu] Clip of inputs whose shadow is pruned (100 = calibration max).")
@click.option("--hot-budget", type=click.FloatRange(0, 1), default=0.01, show_default=True, help="[npu] Exact float rows for the hot channels' outliers (the rest come from the int8 codes), as a fraction of the int8 weight bytes.")
@click.option("--smooth-alpha", type=click.FloatRange(0, 1, min_open=True), default=None,
              help="[npu] Smooth activation outliers into the weights (SmoothQuant, power-of-two factors; adds "
                   "smooth_activations and a second calibrate) with this strength. Default: 0.8 with --no-shadow, else off.")
@click.option("--cpu-kernels", type=click.Choice(["onnx", "native"]), default="onnx", show_default=True,
              help="How the CPU's graphs compute the shadow outlier corrections (npu), the decode graph's attention, a gated MLP's "
                   "activation, the norms before W8A8 projections, the one-row graphs' W8A8 projections (npu) and 4-bit ones (int4): "
                   "ONNX Runtime's stock ops, or llmc's native ops (faster: fused "
                   "quantization and residual adds; the decode graph then also prefills in chunks over an int8 KV cache or in a "
                   "sliding window; the bundle needs `llmc kernels build` run where it runs).")
@click.option("--weight-granularity", type=click.Choice(["channel", "tensor"]), default="channel", show_default=True, help="[npu] int8 weight scales per output channel or per tensor.")
@click.option("--weight-bits", type=click.Choice(["8", "7"]), default="8", show_default=True,
              help="[npu] Bits of the int8 weights' codes: 8 ([-127, 127]), or 7 ([-63, 63]), which ONNX Runtime's fast uint8 x int8 "
                   "kernels compute exactly on x86 CPUs without VNNI (where 8-bit codes need its slower uint8 x uint8 ones): faster CPU "
                   "prefill for a little accuracy (docs/quantization.md).")
@click.option("--profile", "profile", default=None,
              help="Device profile the cost model plans for (see `llmc profiles`; a name or a .json path). Default: the --soc, "
                   "else this machine's `host` profile when measured, else 8gen3.")
@click.option("--placement", type=click.Choice(["auto", "npu", "cpu"]), default="auto", show_default=True,
              help="Processor of the static subgraphs: chosen by the cost model (auto), or all on the NPU / CPU.")
@click.option("--prompt-len", type=click.IntRange(1), default=None, help="Prompt length the schedule's predictions are reported for (default: --max-context).")
@click.option("--memory-budget", default=None,
              help="Keep at most this many bytes of weights resident (e.g. 300MB, 1.5GB, or 50%: of the weights the graphs read whole, "
                   "not the tables read by row); the rest streams from the bundle.")
@click.option("--prefetch-depth", type=click.IntRange(0), default=2, show_default=True, help="[--memory-budget] Steps of streamed weights read ahead.")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None, help="Cache for calibration results and dequantized GGUF models (default: $LLMC_CACHE_DIR or ~/.cache/llmc).")
@click.option("--no-cache", is_flag=True, help="Do not read or write the cache (a GGUF is then dequantized into a temporary directory under $TMPDIR, deleted once loaded).")
@click.option("--quiet", is_flag=True, help="No progress display.")
@_guard
def compile(model, out, target, weights, kv_cache, soc, qnn_shard_mb, qnn_shard_graphs, mlir_dialect, repro_dir, chunk, max_context, pipeline, dump_ir, time_passes, calib_file, calib_tokens, no_shadow, clip_percentile,
            shadow_keep, pruned_percentile, hot_budget, smooth_alpha, cpu_kernels, weight_granularity, weight_bits, profile, placement, prompt_len, memory_budget, prefetch_depth, cache_dir, no_cache, quiet):
    """Compile MODEL into a bundle.

    MODEL is the bundled name `smollm2-135m`, a HuggingFace model directory, a .gguf
    file, or a hub id that is already in the local HuggingFace cache (llmc never downloads).
    """
    from llmc.compile import STAGES, compile_model
    from llmc.pass_manager import IRDump, PassTiming

    instruments = []
    timing = PassTiming()
    instruments.append(timing)
    if dump_ir:
        try:
            Path(dump_ir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise click.BadParameter(f"cannot create {dump_ir}: {e.strerror or e}", param_hint="--dump-ir") from e
        instruments.append(IRDump(Path(dump_ir)))
    # the options the user gave: compile refuses those nothing in this compile reads
    ctx = click.get_current_context()
    explicit = {"shadow" if p.name == "no_shadow" else p.name for p in ctx.command.params
                if ctx.get_parameter_source(p.name) is not click.core.ParameterSource.DEFAULT}
    t0 = time.perf_counter()

    def progress(stage: str) -> None:
        if not quiet:
            i = STAGES.index(stage) + 1
            click.echo(f"[{i}/{len(STAGES)}] {stage:<7} {time.perf_counter() - t0:6.1f}s", err=True)

    if no_cache:
        cache_dir = None
    elif cache_dir is None:
        cache_dir = os.environ.get("LLMC_CACHE_DIR") or str(Path.home() / ".cache" / "llmc")
    summary = compile_model(
        model, out, target=target, chunk=chunk, max_context=max_context, pipeline=pipeline, instruments=instruments, progress=progress,
        mlir_dialect=mlir_dialect, repro_dir=repro_dir, soc=soc, qnn_shard_bytes=qnn_shard_mb << 20 if qnn_shard_mb else None,
        qnn_shard_graphs=qnn_shard_graphs, weight_format=weights, kv_cache=kv_cache, cpu_kernels=cpu_kernels,
        calib_file=calib_file, calib_tokens=calib_tokens, cache_dir=cache_dir, shadow=not no_shadow, clip_percentile=clip_percentile,
        shadow_keep=shadow_keep, pruned_percentile=None if pruned_percentile >= 100 else pruned_percentile, hot_budget=hot_budget,
        smooth_alpha=smooth_alpha, weight_granularity=weight_granularity, weight_bits=int(weight_bits), profile=profile, placement=placement, prompt_len=prompt_len, memory_budget=memory_budget, prefetch_depth=prefetch_depth,
        explicit=explicit,
    )
    if time_passes:
        click.echo("pass timings:", err=True)
        for name, secs, changed in timing.rows:
            click.echo(f"  {name:<24} {secs * 1000:9.1f} ms  {'changed' if changed else 'unchanged'}", err=True)
    if summary.qnn:
        click.echo(summary.qnn, err=True)
    click.echo(
        f"wrote {summary.bundle}: {summary.graphs} static subgraphs{' and the decode graph' if summary.decode_graph else ''} ({summary.graph_files} ONNX files), "
        f"{summary.weight_bytes / 1e6:.1f} MB of weights, pipeline {summary.pipeline}, {time.perf_counter() - t0:.1f}s, "
        f"peak RSS {_peak_rss_mb():.0f} MB"
    )


def _peak_rss_mb() -> float:
    """Peak resident memory so far of this process or of its largest child (the QNN shard processes);
    Linux reports KiB, macOS bytes."""
    import resource

    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    return peak / 1e6 if sys.platform == "darwin" else peak * 1024 / 1e6


@cli.command()
@click.argument("model")
@click.option("--soc", "--profile", "profile", default="8gen3", show_default=True,
              help="Device profile: a shipped one (see `llmc profiles`: 8gen3, 8elite, xelite, qcs6490, ...), host (after `llmc profile-host`) or a profile .json.")
@click.option("--prompt-len", type=click.IntRange(1), default=1024, show_default=True, help="Prompt length to predict prefill for.")
@click.option("--target", type=click.Choice(["npu", "cpu"]), default="npu", show_default=True, help="Program shape to plan: W8A8 with shadow outliers (npu) or float32 (cpu).")
@click.option("--weights", type=click.Choice(["float32", "int4"]), default="float32", show_default=True, help="[cpu] Plan the int4 weight-only program (as compile --weights int4).")
@click.option("--kv-cache", type=click.Choice(["float32", "int8", "float16"]), default="float32", show_default=True, help="Plan with an int8 or float16 KV cache (as compile --kv-cache; plan's default is float32, the stock kernels' cache).")
@click.option("--weight-bits", type=click.Choice(["8", "7"]), default="8", show_default=True,
              help="[npu] Plan 7-bit weight codes (as compile --weight-bits 7): CPU matmuls at the profile's cpu.int8_7bit_ops_per_s.")
@click.option("--chunk", type=click.IntRange(1), default=256, show_default=True, help="Prefill chunk length C.")
@click.option("--memory-budget", default=None,
              help="Plan weight offloading under this budget (e.g. 2GB, or 50%: of the weights the graphs read whole, not the tables read by row).")
@click.option("--prefetch-depth", type=click.IntRange(0), default=2, show_default=True, help="Steps of streamed weights read ahead.")
@click.option("--shadow-keep", type=click.FloatRange(0, 1), default=1.0, show_default=True,
              help="Fraction of Linear inputs that keep a shadow path (llm.npu prunes 85%: 0.15).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@_guard
def plan(model, profile, prompt_len, target, weights, kv_cache, weight_bits, chunk, memory_budget, prefetch_depth, shadow_keep, as_json):
    """Predict MODEL's prefill and decode speed and memory on a device, from its config alone.

    MODEL is a shipped config name (qwen1.5-1.8b, gemma-2b, phi-2, llama-2-7b, mistral-7b),
    smollm2-135m, a config.json, a model directory or a .gguf file. No weight is loaded and
    nothing is downloaded: the model is built with meta tensors.
    """
    from llmc.plan import plan_model
    from llmc.units import format_size

    r = plan_model(model, profile=profile, prompt_len=prompt_len, target=target, chunk=chunk, memory_budget=memory_budget,
                   prefetch_depth=prefetch_depth, shadow_keep=shadow_keep, weight_format=weights, kv_cache=kv_cache, weight_bits=int(weight_bits))
    d = r.as_dict()
    if as_json:
        click.echo(json.dumps(d, indent=1, sort_keys=True))
        return
    pre, dec, mem = d["prefill"], d["decode"], d["memory"]
    click.echo(f"model      {model} ({r.description}); {target}{' int4' if weights == 'int4' else ''} program, chunk {chunk}")
    click.echo(f"profile    {profile}")
    click.echo(f"prefill    {prompt_len} tokens: {pre['latency_s'] * 1e3:.0f} ms, {pre['tok_s']:.0f} tok/s ({pre['policy']}; "
               f"in-order {pre['in_order_s'] * 1e3:.0f} ms)")
    click.echo(f"npu        bubbles {pre['npu_bubble_rate_in_order'] * 100:.0f}% in order -> {pre['npu_bubble_rate_out_of_order'] * 100:.0f}% out of order; "
               f"busy NPU {pre['npu_busy_s'] * 1e3:.0f} ms, CPU {pre['cpu_busy_s'] * 1e3:.0f} ms")
    click.echo(f"placement  prefill {d['placement']['prefill']['npu']} steps on NPU / {d['placement']['prefill']['cpu']} on CPU; "
               f"decode {d['placement']['decode']['npu']} / {d['placement']['decode']['cpu']}")
    click.echo(f"decode     {dec['tok_s']:.1f} tok/s ({dec['s_per_token'] * 1e3:.1f} ms/token)")
    click.echo(f"memory     weights {format_size(mem['weight_bytes'])}, {kv_cache + ' ' if kv_cache != 'float32' else ''}KV cache "
               f"{format_size(mem['kv_cache_bytes'])} at {prompt_len} tokens")
    if "offload" in d:
        o = d["offload"]
        rows = f" incl. {o['resident_shadow_rows']} shadow rows" if o["resident_shadow_rows"] else ""
        click.echo(f"offload    budget {format_size(o['budget_bytes'])}: resident {format_size(o['resident_bytes'])}{rows}, streamed "
                   f"{format_size(o['streamed_bytes_per_token'])}/token, ring {format_size(o['buffer_bytes'])} (depth {o['prefetch_depth']}); "
                   + (f"decode {o['decode_tok_s_prefetch']:.1f} tok/s with prefetch, {o['decode_tok_s_no_prefetch']:.1f} without"
                      if o["prefetch_depth"] > 0 else f"decode {o['decode_tok_s_no_prefetch']:.1f} tok/s (no prefetch)"))


@cli.group()
def kernels() -> None:
    """llmc's native CPU kernels: an ONNX Runtime custom-op library that bundles compiled with
    `--cpu-kernels native` need where they run."""


@kernels.command("build")
@click.option("--ort-include", type=click.Path(file_okay=False), default=None,
              help="Directory holding ONNX Runtime's onnxruntime_c_api.h and onnxruntime_cxx_api.h (default: $LLMC_ORT_INCLUDE, "
                   "else /usr/include/onnxruntime, /usr/local/include/onnxruntime, /usr/local/include).")
@click.option("--cxx", default=None, help="C++ compiler: GCC, which the source is written for (default: $CXX, else g++).")
@click.option("--force", is_flag=True, help="Rebuild even when the library is up to date.")
@_guard
def kernels_build(ort_include, cxx, force):
    """Build the kernels for this CPU into $LLMC_CACHE_DIR/native (default ~/.cache/llmc/native)."""
    from llmc.runtime import native

    click.echo(f"built {native.build(ort_include, cxx, force)}")


@kernels.command("path")
@_guard
def kernels_path():
    """Print the built library's path (exit 11 when it is not built)."""
    from llmc.runtime import native
    from llmc.runtime.errors import NativeKernelError

    path = native.library_path()
    if path is None:
        raise NativeKernelError("llmc's native CPU kernels are not built on this machine", hint="build them with `llmc kernels build`")
    click.echo(path)


@cli.command("profile-host")
@click.option("-o", "--output", "out", type=click.Path(dir_okay=False), default=None,
              help="Where to write the profile (default: the user profile directory, where --profile host finds it).")
@click.option("--threads", type=click.IntRange(1), default=None, help="Threads for ONNX Runtime (default: all cores, as `llmc run`).")
@click.option("--json", "as_json", is_flag=True, help="Also print the profile as JSON.")
@_guard
def profile_host(out, threads, as_json):
    """Measure this machine's device profile (`host`) with micro-benchmarks (about 40 seconds)."""
    from llmc.device_profile import save, user_profile_dir
    from llmc.host_profile import measure

    path = Path(out) if out else user_profile_dir() / "host.json"
    try:  # before the measuring, not after it
        path.parent.mkdir(parents=True, exist_ok=True)
        probe = path.parent / f".{path.name}.probe"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise click.BadParameter(f"cannot write {path}: {e.strerror or e}", param_hint="--output") from e
    prof = measure(threads=threads, progress=lambda s: click.echo(f"measuring {s}", err=True))
    save(prof, path)
    if as_json:
        click.echo(json.dumps(prof.as_json(), indent=1, sort_keys=True))
    for k in sorted(prof.values):
        click.echo(f"  {k:<28} {prof.values[k]:.4g}")
    for k, rows in sorted(prof.tables.items()):
        click.echo(f"  {k:<28} table of {len(rows)} measurements")
    click.echo(f"wrote {path}")


@cli.command()
@click.argument("name", required=False)
@_guard
def profiles(name):
    """List the device profiles, or show NAME's numbers with their sources."""
    from llmc import device_profile

    if name is None:
        names = device_profile.available()
        w = max(len(n) for n in names + ["host"]) + 1
        for n in names:
            p = device_profile.load(n)
            soc = (f"{p.qnn['part']}, HTP {p.qnn['htp_arch']}, soc_model {p.qnn['soc_model']}" if p.qnn else "no --soc (no QNN SoC facts)")
            click.echo(f"{n:<{w}} {soc}; platforms: {', '.join(p.platforms) or '-'}\n{'':<{w}} {p.description}")
        if "host" not in names:
            click.echo(f"{'host':<{w}} (not measured yet: run `llmc profile-host`)")
        return
    p = device_profile.load(name)
    click.echo(f"{p.name}: {p.description}  [{p.path}]")
    if p.qnn:
        click.echo(f"  {'qnn':<28} {p.qnn['part']}, HTP {p.qnn['htp_arch']}, soc_model {p.qnn['soc_model']}\n      source: {p.qnn['source']}")
        if p.qnn.get("requires"):
            click.echo(f"      requires: {p.qnn['requires']}")
    if p.platforms:
        click.echo(f"  {'platforms':<28} {', '.join(p.platforms)}\n      source: {p.platforms_source}")
    for k in sorted(p.values):
        click.echo(f"  {k:<28} {p.values[k]:.4g}\n      source: {p.sources[k]}")
    for k, rows in sorted(p.tables.items()):
        click.echo(f"  {k:<28} " + ", ".join(f"{' x '.join(f'{x:g}' for x in r[:-1])}: {r[-1]:.3g}" for r in rows) + f"\n      source: {p.sources[k]}")


def _npu_note(sess) -> None:
    """Say on stderr when the qnn provider was asked for but the bundle's plan runs no graph on the NPU."""
    if sess.requested_provider == "qnn" and not any(sess.npu_graphs_planned.values()):
        soc = (sess.manifest.get("qnn") or {}).get("soc", "the SoC")
        click.echo(f"[--provider qnn: the plan of this bundle places no graph on the NPU of {soc}, so every graph runs on the CPU; "
                   "compile with --placement npu to run them on the HTP]", err=True)


def _make_session(bundle, provider, threads, prefetch=True):
    from llmc.runtime import Session

    sess = Session(bundle, provider=provider, threads=threads, prefetch=prefetch)
    _npu_note(sess)
    return sess


_NO_PREFETCH = click.option("--no-prefetch", is_flag=True,
                            help="Memory-budgeted bundles: read each streamed weight when its step runs, not ahead (no effect otherwise).")


def _generation_options(fn):
    """The options ``run`` and ``chat`` share: sampling, stopping, provider and threads."""
    for opt in reversed([
        click.option("--greedy", "mode", flag_value="greedy", default=True, help="Pick the most likely token (default)."),
        click.option("--sample", "mode", flag_value="sample", help="Sample with --temperature/--top-k/--top-p and --seed."),
        click.option("--temperature", type=click.FloatRange(0, min_open=True), default=None, help="Sampling temperature (implies --sample)."),
        click.option("--top-k", type=click.IntRange(0), default=0, help="Sample from the k most likely tokens (0: all; k > 0 implies --sample)."),
        click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0,
                     help="Sample from the smallest set of tokens holding this probability (below 1 implies --sample)."),
        click.option("--seed", type=int, default=None, help="Seed for sampling (same seed, same tokens; greedy decoding ignores it)."),
        click.option("--no-eos", is_flag=True, help="Do not stop at the end-of-sequence token."),
        click.option("--provider", type=click.Choice(["auto", "cpu", "qnn"]), default="auto", show_default=True,
                     help="qnn: NPU graphs on the QNN HTP backend (simulator on x86_64); auto: qnn when available and built, else cpu."),
        click.option("--threads", type=click.IntRange(1), default=None, help="ONNX Runtime intra-op threads (default: all cores)."),
        _NO_PREFETCH,
    ]):
        fn = opt(fn)
    return fn


def _sampling(mode, temperature, top_k, top_p, seed, no_eos) -> dict:
    """The keyword arguments of ``Session.stream`` for these options (warns about a lone --seed)."""
    sampling = [f for f, on in (("--temperature", temperature is not None), ("--top-k", bool(top_k)), ("--top-p", top_p < 1.0)) if on]
    explicit = click.get_current_context().get_parameter_source("mode") == click.core.ParameterSource.COMMANDLINE
    if sampling and mode == "greedy" and explicit:
        raise click.UsageError(f"--greedy conflicts with {', '.join(sampling)}, which sample; give one or the other")
    if sampling:
        mode = "sample"
    elif mode == "greedy" and seed is not None:
        click.echo("warning: --seed has no effect with greedy decoding; add --sample (or --temperature) to sample", err=True)
    kw = dict(stop_at_eos=not no_eos)
    if mode == "sample":
        kw.update(temperature=temperature or 1.0, top_k=top_k, top_p=top_p, seed=seed)
    return kw


@cli.command()
@click.argument("bundle", type=click.Path())
@click.option("--prompt", default=None, help="Prompt text.")
@click.option("--prompt-ids", default=None, help="Prompt as comma-separated token ids (for bundles without a tokenizer).")
@click.option("--chat", is_flag=True, help="Format --prompt as a user turn with the model's chat template (instruct models).")
@click.option("--system", default=None, help="[--chat] A system message before the user turn.")
@click.option("--max-new-tokens", type=click.IntRange(1), default=64, show_default=True)
@_generation_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (ids, text, timings) instead of streaming text.")
@_guard
def run(bundle, prompt, prompt_ids, chat, system, max_new_tokens, mode, temperature, top_k, top_p, seed, no_eos, provider, threads, no_prefetch,
        as_json):
    """Generate text from a compiled BUNDLE."""
    from llmc.runtime import Metrics

    if (prompt is None) == (prompt_ids is None):
        raise click.UsageError("give exactly one of --prompt or --prompt-ids")
    if chat and prompt is None:
        raise click.UsageError("--chat formats --prompt text; it does not take --prompt-ids")
    if system is not None and not chat:
        raise click.UsageError("--system needs --chat")
    kw = _sampling(mode, temperature, top_k, top_p, seed, no_eos)
    sess = _make_session(bundle, provider, threads, prefetch=not no_prefetch)
    if prompt_ids is not None:
        try:
            source = [int(t) for t in prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise click.BadParameter("token ids must be integers separated by commas", param_hint="--prompt-ids")
    elif chat:
        from llmc.runtime.chat import Conversation

        source = Conversation(sess, system=system).prompt_ids(prompt)
    else:
        source = prompt
    if as_json:
        res = sess.generate(source, max_new_tokens, **kw)
        click.echo(json.dumps({
            "prompt_ids": res.prompt_ids,
            "token_ids": res.token_ids,
            "text": res.text,
            "finish_reason": res.finish_reason,
            "provider": sess.provider_used,
            "requested_provider": provider,
            "graphs": sess.graphs_run(),
            "timings": res.metrics.as_dict(),
        }))
        return
    metrics = Metrics()
    for ev in sess.stream(source, max_new_tokens, metrics=metrics, **kw):
        click.echo(ev.text, nl=False)
    click.echo()
    _stop_note(sess, metrics, max_new_tokens)
    click.echo(
        f"[{metrics.prompt_tokens} prompt tokens, {metrics.generated_tokens} generated; TTFT {metrics.ttft_s * 1000:.0f} ms, "
        f"prefill {metrics.prefill_tok_s:.1f} tok/s, decode {metrics.decode_tok_s:.1f} tok/s, peak RSS {metrics.peak_rss_mb:.0f} MB]",
        err=True,
    )


def _stop_note(sess, metrics, max_new_tokens) -> None:
    if metrics.generated_tokens < max_new_tokens and sess.position >= sess.max_context:
        click.echo(f"[stopped: the context is full ({sess.max_context} tokens, the bundle's --max-context)]", err=True)


@cli.command()
@click.argument("bundle", type=click.Path())
@click.option("--system", default=None, help="A system message that opens the conversation.")
@click.option("--max-new-tokens", type=click.IntRange(1), default=256, show_default=True, help="Longest reply.")
@_generation_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per turn (reply text, ids, finish reason, timings) instead of streaming text.")
@_guard
def chat(bundle, system, max_new_tokens, mode, temperature, top_k, top_p, seed, no_eos, provider, threads, no_prefetch, as_json):
    """Chat with an instruct model's BUNDLE: one user turn per line of standard input.

    Replies stream to standard output (with --json, one JSON object per line
    and turn). The KV cache is kept across turns, so a turn prefills only its
    own tokens. A line "/reset" starts a new conversation; "/exit" or the end
    of input quits.
    """
    from llmc.runtime import Metrics, PromptError, PromptTooLongError
    from llmc.runtime.chat import Conversation

    kw = _sampling(mode, temperature, top_k, top_p, seed, no_eos)
    sess = _make_session(bundle, provider, threads, prefetch=not no_prefetch)
    conv = Conversation(sess, system=system)
    tty = sys.stdin.isatty()
    if tty:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    turns = tokens = 0
    while True:
        try:
            if tty:
                try:
                    line = input("> ") + "\n"
                except EOFError:
                    line = ""
            elif hasattr(sys.stdin, "buffer"):  # bytes that are not UTF-8 reach encode(), which names them
                line = sys.stdin.buffer.readline().decode("utf-8", "surrogateescape")
            else:
                line = sys.stdin.readline()
        except UnicodeDecodeError as e:
            click.echo(f"error: the line is not valid UTF-8 (byte {e.start})", err=True)
            continue
        if not line or line.strip() == "/exit":
            break
        user = line.rstrip("\n")
        if user.strip() == "/reset":
            conv.reset()
            click.echo("[new conversation]", err=True)
            continue
        if not user.strip():
            continue
        metrics = Metrics()
        try:
            events = conv.say(user, max_new_tokens, metrics=metrics, **kw)
        except PromptError as e:  # the conversation is unchanged: at a terminal the user can go on (or /reset)
            if not tty and isinstance(e, PromptTooLongError):
                e.hint = "put a /reset line before this turn, or recompile with a larger --max-context"
            if not tty:
                _fail(e)
            click.echo(f"error: {e}", err=True)
            click.echo(f"hint: {e.hint}", err=True)
            continue
        ids = []
        for ev in events:
            ids.append(ev.token_id)
            if not as_json:
                click.echo(ev.text, nl=False)
        turns += 1
        if as_json:
            stopped = sess.finish_reason(ids, max_new_tokens, kw["stop_at_eos"])
            click.echo(json.dumps({"turn": turns, "user": user, "text": conv.messages[-1]["content"], "token_ids": ids, "finish_reason": stopped,
                                   "context_tokens": sess.position, "timings": metrics.as_dict()}))
        else:
            click.echo()
            _stop_note(sess, metrics, max_new_tokens)
        tokens += metrics.generated_tokens
        log.info("turn %d: %d new prompt tokens, %d generated; TTFT %.0f ms, decode %.1f tok/s", turns, metrics.prompt_tokens,
                 metrics.generated_tokens, metrics.ttft_s * 1000, metrics.decode_tok_s)
    if turns:
        click.echo(f"[{turns} turn{'s' * (turns != 1)}, {tokens} tokens generated, {sess.position} tokens in the context at the end]", err=True)


def _kv_cache_summary(m: dict) -> dict:
    """The KV cache a session of bundle manifest ``m`` allocates: element type and bytes."""
    from llmc.ops import KV_CACHE_ITEMSIZE, kv_cache_dtype

    attn = [s for s in m["program"] if s["kind"] == "op" and s["op"] == "Attention"]
    kinds = [kv_cache_dtype(s["attrs"], s.get("weights", {})) for s in attn]
    per_pos = sum(2 * s["attrs"]["num_kv_heads"] * s["attrs"]["head_dim"] * KV_CACHE_ITEMSIZE.get(k, 4) for s, k in zip(attn, kinds))
    dtype = kinds[0] if kinds and len(set(kinds)) == 1 else "float32" if not kinds else "mixed"
    return {"dtype": dtype, "bytes_per_position": per_pos, "bytes": per_pos * m["max_context"]}


@cli.command()
@click.argument("bundle", type=click.Path())
@click.option("--device", required=True, help="The device the package is for: the SoC the bundle was compiled for (--soc).")
@click.option("-o", "--output", "out", required=True, type=click.Path(file_okay=False), help="Package directory to write (replaced atomically).")
@click.option("--contexts", type=click.Choice(["shared", "unshared"]), default="shared", show_default=True,
              help="The bundle's weight-shared context binaries (for the device), or each NPU graph instance prepared again "
                   "as a binary of its own (bigger; loadable by the x86_64 HTP simulator, for checks).")
@click.option("--json", "as_json", is_flag=True, help="Print the package summary as JSON.")
@_guard
def package(bundle, device, out, contexts, as_json):
    """Write the files a DEVICE's run of BUNDLE reads into a package directory.

    Only what a generation on that device reads: the context binaries of the graphs the plan runs on the NPU,
    the CPU graphs it runs on the CPU, the weights the CPU side reads and the tokenizer, under a manifest of
    their own (hashes, the SoC and HTP arch, the ONNX Runtime and QNN versions the binaries need, the bytes
    per kind of file). `llmc run PACKAGE` runs it as a bundle. See docs/deploy.md.
    """
    from llmc.backends.package import package_bundle

    s = package_bundle(bundle, device, out, contexts)
    if as_json:
        click.echo(json.dumps({"package": str(s.path), "device": s.device, "files": s.files, "bytes": s.bytes_by_kind,
                               "total_bytes": s.total_bytes, "npu_instances": s.npu_instances, "cpu_instances": s.cpu_instances,
                               "left_out_bytes": s.dropped_bytes, "notes": s.notes}))
        return
    for note in s.notes:
        click.echo(f"note: {note}", err=True)
    than = f"{s.dropped_bytes / 1e6:.1f} MB less" if s.dropped_bytes >= 0 else f"{-s.dropped_bytes / 1e6:.1f} MB more"
    click.echo(f"wrote {s.path}: package for {s.device}, {s.files} files, {s.total_bytes / 1e6:.1f} MB ({than} than the bundle); "
               f"{s.npu_instances} graph instances on the NPU, {s.cpu_instances} on the CPU")
    for kind, n in sorted(s.bytes_by_kind.items(), key=lambda kv: -kv[1]):
        click.echo(f"  {kind:<17}{n / 1e6:10.2f} MB")


@cli.command()
@click.argument("bundle", type=click.Path())
@click.option("--qnn", "check_qnn", is_flag=True,
              help="Also run every NPU graph instance on the HTP simulator (as a context binary of its own) against ONNX Runtime's "
                   "CPU provider on the same QDQ graph, and the logits of a few prompts end to end.")
@click.option("--prompts", type=click.IntRange(1), default=5, show_default=True, help="[--qnn] Prompts to run (held-out English, or random ids).")
@click.option("--tolerance", type=click.FloatRange(0, min_open=True), default=0.05, show_default=True,
              help="[--qnn] Largest HTP-vs-CPU difference of a graph's output, as a fraction of its largest magnitude (exit 12 beyond).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@_guard
def verify(bundle, check_qnn, prompts, tolerance, as_json):
    """Check a BUNDLE (or package): every file's SHA-256, the manifest, that the runtime loads it; with --qnn the HTP's numerics.

    With --qnn, a table per graph instance: `htp` is the HTP against the CPU provider on the same fully quantized
    graph (what the HTP computes differently), `qdq` that graph on the CPU against the bundle's CPU instance (what
    the 16-bit activations cost), both relative to the output's largest magnitude. Exit 12 when an `htp` figure
    exceeds --tolerance.
    """
    from llmc.runtime import Session, load_manifest

    m = load_manifest(bundle)  # every file's hash, the manifest's digest, paths inside the bundle
    if "package" not in m:  # a package's graphs may all be for its device's NPU
        Session(bundle, provider="cpu", lazy=True, verify=False)  # the hashes are checked above
    result = {"bundle": bundle, "files": "every file matches its SHA-256 in the manifest"}
    if not check_qnn:
        click.echo(json.dumps(result) if as_json else f"{bundle}: ok ({result['files']})")
        return
    from llmc.backends.qnn_verify import VerificationFailed, verify_qnn

    r = verify_qnn(bundle, prompts=prompts, tolerance=tolerance)
    if as_json:
        click.echo(json.dumps({**result, "qnn": r.as_dict()}))
    else:
        click.echo(f"{bundle}: {len(r.instances)} NPU graph instances on the {r.soc} HTP simulator against the CPU provider "
                   f"(fraction of each output's largest magnitude)")
        click.echo(f"  {'graph':<14}{'rows':>5}{'htp':>9}{'qdq':>9}")
        for c in r.instances:
            click.echo(f"  {c.graph:<14}{c.rows:>5}{c.htp:9.4f}{c.qdq:9.4f}" + ("   over the tolerance" if c.htp > tolerance else ""))
        click.echo(f"  logits of {len(r.logits_gap)} prompts, every graph on the HTP against the CPU provider: "
                   f"max {max(r.logits_gap):.4f}, mean {sum(r.logits_gap) / len(r.logits_gap):.4f} of the largest logit")
    if not r.ok:
        w = r.worst
        raise VerificationFailed(f"graph {w.graph} ({w.rows} rows) differs on the HTP from the CPU provider by {w.htp:.4f} of its largest "
                                 f"output, over --tolerance {tolerance}", hint="see docs/qnn.md on the HTP's numerics")


@cli.command()
@click.argument("bundle", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print the manifest summary as JSON.")
@click.option("--no-verify", is_flag=True, help="Skip the SHA-256 check of every file.")
@_guard
def inspect(bundle, as_json, no_verify):
    """Summarise a compiled BUNDLE: graphs, shapes, sizes, schedule."""
    from llmc.runtime import load_manifest
    from llmc.runtime.manifest import SHAPE_ERRORS, shape_error

    m = load_manifest(bundle, verify=not no_verify)
    try:
        _inspect(bundle, m, as_json, _check_qnn_binaries(bundle, m, no_verify))
    except SHAPE_ERRORS as e:
        raise shape_error(bundle, e) from e


def _onnx_load():
    """``onnx.load`` where onnx is installed (the compile extra), else None."""
    try:
        import onnx
    except ImportError:
        return None
    return onnx.load


def _check_qnn_binaries(bundle: str, m: dict, no_verify: bool) -> str | None:
    """Re-read the bundle's QNN context binaries and check them against the manifest (``llmc.runtime.qnn_binary``):
    a mismatch raises (a bad bundle); else what was checked, or why not. None: the bundle has no context binaries."""
    import importlib.util

    q = m.get("qnn") or {}
    if not q.get("binaries"):
        return None
    if no_verify:
        return "not re-read (--no-verify); the metadata shown is what the compile recorded"
    if importlib.util.find_spec("onnxruntime_qnn") is None:
        return "not re-read: onnxruntime-qnn is not installed (pip install 'llmc[qnn]'); the metadata shown is what the compile recorded"
    from llmc.runtime.qnn_binary import check_binaries

    check_binaries(Path(bundle), q, load_onnx=_onnx_load())
    recorded = all(b.get("info") for b in q["binaries"])
    return ("re-read: each binary holds the graphs, tensors and SoC the manifest records" if recorded else
            "re-read: each binary holds the graphs its EP-context models name; the manifest records no binary metadata")


def _inspect(bundle: str, m: dict, as_json: bool, qnn_check: str | None = None) -> None:
    """Print the summary of ``bundle`` (manifest ``m``; ``qnn_check``: what re-reading its context binaries found)."""
    from llmc.runtime.manifest import weight_part_bytes

    files = m["files"]
    weight_bytes = sum(w["nbytes"] for w in m["weights"].values())
    graph_bytes = sum(files[i["file"]]["bytes"] for g in m["graphs"].values() for i in g["instances"].values() if "file" in i)
    summary = {
        "model": m["model"],
        "target": m["target"],
        "chunk": m["chunk"],
        "max_context": m["max_context"],
        "pipeline": m["pipeline"],
        "cpu_kernels": m.get("cpu_kernels", "onnx"),
        "weight_bits": m.get("weight_bits"),  # of the W8A8 weights' codes (None: no quantize pass)
        "weights": {"count": len(m["weights"]), "bytes": weight_bytes, "files": sorted({w["file"] for w in m["weights"].values()})},
        "graphs": {
            name: {"instances": sorted(int(r) for r in g["instances"]), "inputs": [f"{i['name']}[{i['features']}]" for i in g["inputs"]],
                   "outputs": [f"{o['name']}[{o['features']}]" for o in g["outputs"]], "weight_bytes": g["weight_bytes"], "ops": g["ops"]}
            for name, g in m["graphs"].items()
        },
        "graph_file_bytes": graph_bytes,
        "parts": weight_part_bytes(m),
        "program": [s["name"] if s["kind"] == "graph" else f"{s['op']}:{s['name']}" for s in m["program"]],
        "decode_program": [s["name"] if s["kind"] == "graph" else f"{s['op']}:{s['name']}" for s in m["decode_program"]] if "decode_program" in m else None,
        "decode_graph": m.get("decode_graph"),
        "total_bytes": sum(f["bytes"] for f in files.values()),
        "qnn": _qnn_summary(m.get("qnn"), qnn_check),
        "mlir": sorted({e["dialect"] for g in (m.get("mlir") or {}).values() for e in g.values()}),
        "offload": {k: v for k, v in m["offload"].items() if not isinstance(v, (list, dict))}
        | {k: len(m["offload"][k]) for k in ("resident", "streamed", "row_streamed")}
        | {"resident_rows": sum(len(r) for r in m["offload"].get("resident_rows", {}).values())}
        if "offload" in m else None,
        "placement": None,
        "predicted": (m.get("schedule") or {}).get("predicted"),
        "kv_cache": _kv_cache_summary(m),
        "package": m.get("package"),
    }
    if m.get("placement"):
        pl = m["placement"]
        summary["placement"] = {"profile": pl["profile"], **{ph: {p: sorted(s for s, q in pl[ph].items() if q == p and s in m["graphs"]) for p in ("npu", "cpu")}
                                                             for ph in ("prefill", "decode")}}
    if as_json:
        click.echo(json.dumps(summary, indent=1))
        return
    mi = m["model"]
    click.echo(f"bundle     {bundle}")
    click.echo(f"model      {mi['architecture']} ({mi['family']}), {mi['num_layers']} layers, hidden {mi['hidden_size']}, vocab {mi['vocab_size']}")
    click.echo(f"source     {mi['source']}")
    click.echo(f"target     {m['target']}   chunk {m['chunk']}   max-context {m['max_context']}")
    click.echo(f"pipeline   {m['pipeline']}")
    click.echo(f"weights    {len(m['weights'])} tensors, {weight_bytes / 1e6:.1f} MB, stored once in {', '.join(summary['weights']['files'])}"
               + (f"; W8A8 codes of {m['weight_bits']} bits" if m.get("weight_bits") else ""))
    parts = summary["parts"]
    click.echo("parts      " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in parts.items() if v or k in ("codes", "embedding", "head")))
    kvc = summary["kv_cache"]
    click.echo(f"kv cache   {kvc['dtype']}{' (per-channel scales, quantize_kv_cache)' if kvc['dtype'] == 'int8' else ''}, "
               f"{kvc['bytes_per_position'] / 1e3:.1f} kB per position, {kvc['bytes'] / 1e6:.1f} MB at max-context {m['max_context']}")
    if m.get("cpu_kernels") == "native":
        click.echo("kernels    llmc's native ops in the CPU's graphs (--cpu-kernels native): needs `llmc kernels build` where it runs")
    static = len(m["graphs"]) - (1 if m.get("decode_graph") else 0)
    click.echo(f"graphs     {static} static subgraphs{' and the decode graph' if m.get('decode_graph') else ''}, "
               f"{sum(len(g['instances']) for g in m['graphs'].values())} ONNX files, {graph_bytes / 1e3:.1f} kB (weights not included)")
    for name, g in summary["graphs"].items():
        click.echo(f"  {name:<10} rows {','.join(map(str, g['instances'])):<8} weights {g['weight_bytes'] / 1e6:8.2f} MB  "
                   f"in {', '.join(g['inputs'])}  out {', '.join(g['outputs'])}")
    steps = summary["program"]
    click.echo(f"program    {len(steps)} steps per chunk: {' -> '.join(steps[:8])}{' -> ...' if len(steps) > 8 else ''}")
    dsteps = summary["decode_program"]
    chunk_graph = False
    if summary["decode_graph"]:
        g = m["graphs"][summary["decode_graph"]]
        click.echo(f"decode     one call of {summary['decode_graph']} per token when the CPU decodes (fuse_decode_graph): {g['nodes']} nodes, "
                   f"attention over {len(g['kv'])} KV caches inside")
        chunk_graph = g["instances"].get(str(m["chunk"]), {}).get("dynamic", False)
        if chunk_graph:
            click.echo(f"prefill    one call of {summary['decode_graph']} per chunk of up to {m['chunk']} tokens when the CPU runs both phases "
                       f"(its chunk instance)")
    if dsteps and chunk_graph:
        click.echo(f"           (also in the bundle: the CPU program, fuse_cpu_decode, {len(dsteps)} steps per chunk: {' -> '.join(dsteps[:6])} -> ...)")
    elif dsteps and summary["decode_graph"]:
        click.echo(f"prefill    {len(dsteps)} steps per chunk when the CPU prefills (fuse_cpu_decode): {' -> '.join(dsteps[:6])} -> ...")
    elif dsteps:
        click.echo(f"decode     {len(dsteps)} steps per token when the CPU decodes, per chunk when it prefills (fuse_cpu_decode): {' -> '.join(dsteps[:6])} -> ...")
    q = summary["qnn"]
    if q is not None:
        if "skipped" in q:
            click.echo(f"qnn        skipped: {q['skipped']}")
        else:
            click.echo(f"qnn        {q['soc']} (HTP {q['htp_arch']}), {q['graphs']} graph instances in {len(q['binaries'])} context binaries:")
            for i, b in enumerate(q["binaries"]):
                click.echo(f"  shard {b.get('shard', i):<3} {', '.join(b['files'])}  {b['bytes'] / 1e6:.2f} MB  ({len(b['graphs'])} graphs share its weights)")
                info = b.get("info")
                if info:
                    click.echo(f"            QNN {info['build_id']} (core API {info['core_api']}), SoC model {info['soc_model']}, "
                               f"HTP {info['htp_arch']}, {len(info['graphs'])} graphs")
            if q.get("binaries_check"):
                click.echo(f"  binaries  {q['binaries_check']}")
    pk = summary["package"]
    if pk is not None:
        needs = ", ".join(f"{k.replace('_', '-')} {v}" for k, v in pk["requires"].items())
        click.echo(f"package    for {pk['device']} (HTP {pk['htp_arch']}, soc_model {pk['soc_model']}), {pk['contexts']} contexts: "
                   f"{len(pk['npu_instances'])} graph instances on the NPU, {len(pk['cpu_instances'])} on the CPU; needs {needs}")
    o = summary["offload"]
    if o is not None:
        click.echo(f"offload    budget {o['budget_bytes'] / 1e6:.1f} MB: {o['resident']} weights resident ({o['resident_bytes'] / 1e6:.1f} MB), "
                   f"{o['streamed']} streamed ({o['streamed_bytes'] / 1e6:.1f} MB per token), {o['row_streamed']} read by row "
                   f"({o['resident_rows']} of their rows resident); buffer {o['buffer_bytes'] / 1e6:.1f} MB, prefetch depth {o['prefetch_depth']}"
                   + ((f"; predicted decode {1 / o['predicted_decode_s']:.1f} tok/s with prefetch, {1 / o['predicted_decode_no_prefetch_s']:.1f} without"
                       if o["prefetch_depth"] > 0 else f"; predicted decode {1 / o['predicted_decode_no_prefetch_s']:.1f} tok/s (no prefetch)")
                      if o["predicted_decode_s"] > 0 and o["predicted_decode_no_prefetch_s"] > 0 else ""))
    if summary["mlir"]:
        click.echo(f"mlir       {', '.join(summary['mlir'])} modules for every subgraph instance (mlir/)")
    if summary["placement"]:
        pl = summary["placement"]
        click.echo(f"placement  ({pl['profile']}) prefill: {len(pl['prefill']['npu'])} graphs on NPU, {len(pl['prefill']['cpu'])} on CPU; "
                   f"decode: {len(pl['decode']['npu'])} on NPU, {len(pl['decode']['cpu'])} on CPU")
    pr = summary["predicted"]
    if pr:
        click.echo(f"predicted  ({pr['profile']}) prefill {pr['prompt_len']} tokens {pr['prefill_s'] * 1e3:.0f} ms ({pr['prefill_tok_s']:.0f} tok/s, "
                   f"in order {pr['prefill_in_order_s'] * 1e3:.0f} ms), NPU bubbles {pr['npu_bubble_rate_out_of_order'] * 100:.0f}%; "
                   f"decode {pr['decode_tok_s']:.1f} tok/s" + (" with every weight resident (the offload line has the budgeted figure)" if o is not None else ""))
    click.echo(f"total      {summary['total_bytes'] / 1e6:.1f} MB in {len(files)} files")


def _read_text(path: str, option: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise click.UsageError(f"{option} {path} is not UTF-8 text ({e.reason} at byte {e.start})") from e


@cli.command(name="eval")
@click.argument("bundle", type=click.Path())
@click.option("--text", "text_file", type=click.Path(dir_okay=False, exists=True), default=None, help="Measure perplexity on this UTF-8 text file.")
@click.option("--window", type=click.IntRange(2), default=None, help="Perplexity window in tokens (default: the bundle's max context).")
@click.option("--max-tokens", type=click.IntRange(2), default=None, help="Only score the first N tokens of --text.")
@click.option("--against", "reference", type=click.Path(), default=None, help="Reference bundle (e.g. the fp32 cpu bundle) for greedy agreement.")
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False, exists=True), default=None, help="One prompt per line, for --against.")
@click.option("--new-tokens", type=click.IntRange(1), default=32, show_default=True, help="Generated tokens per prompt, for --against.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--threads", type=click.IntRange(1), default=None)
@_guard
def evaluate(bundle, text_file, window, max_tokens, reference, prompts_file, new_tokens, as_json, threads):
    """Measure a BUNDLE: perplexity on --text, and/or greedy agreement --against another bundle on --prompts."""
    import dataclasses

    from llmc.runtime import evaluate as ev

    if text_file is None and reference is None:
        raise click.UsageError("give --text FILE (perplexity) and/or --against DIR --prompts FILE (agreement)")
    if (reference is None) != (prompts_file is None):
        raise click.UsageError("--against and --prompts go together")
    sess = _make_session(bundle, "auto", threads)
    result: dict = {"bundle": str(bundle)}
    if text_file is not None:
        if sess.tokenizer is None:
            raise click.UsageError(f"{bundle} has no tokenizer, so --text cannot be tokenized; compile it from a model with tokenizer files")
        ids = sess.encode(_read_text(text_file, "--text"))
        if max_tokens:
            ids = ids[:max_tokens]
        if len(ids) < 2:
            raise click.UsageError(f"--text {text_file} is {len(ids)} token{'s' if len(ids) != 1 else ''} long; perplexity needs at least two")
        if window and window > sess.max_context:
            click.echo(f"warning: --window {window} is longer than the bundle's max context; using {sess.max_context}", err=True)
        result["perplexity"] = dataclasses.asdict(ev.perplexity(sess, ids, window))
        if not as_json:
            p = result["perplexity"]
            click.echo(f"perplexity {p['perplexity']:.4f} over {p['tokens']} tokens ({p['windows']} windows of {p['window']})")
    if reference is not None:
        prompts = [line.strip() for line in _read_text(prompts_file, "--prompts").splitlines() if line.strip()]
        if not prompts:
            raise click.UsageError(f"{prompts_file} has no prompts")
        ref = _make_session(reference, "auto", threads)
        vocab = (sess.manifest["model"].get("vocab_size"), ref.manifest["model"].get("vocab_size"))
        if vocab[0] != vocab[1]:
            raise click.UsageError(f"{bundle} has a vocabulary of {vocab[0]} tokens and {reference} one of {vocab[1]}: "
                                   "agreement compares bundles of the same model")
        a = ev.agreement(sess, ref, prompts, new_tokens)
        result["agreement"] = dataclasses.asdict(a)
        result["agreement"]["reference"] = str(reference)
        if not as_json:
            scored = f"{a.prompts} prompts x {new_tokens} tokens" if a.positions == a.prompts * new_tokens else \
                f"{a.prompts} prompts, {a.positions} positions (generation stops at the max context)"
            click.echo(f"greedy agreement with {reference} over {scored}: "
                       f"teacher-forced {a.teacher_forced:.1%}, free-running {a.free_running:.1%}")
    if getattr(sess, "outlier_counts", None):  # a W8A8 bundle: null when its corrections ran inside the graphs, uncounted
        result["shadow_outliers_seen"] = int(sum(sess.outlier_counts.values())) if sess.counts_outliers else None
    if as_json:
        click.echo(json.dumps(result))


@cli.command()
@click.argument("bundle", type=click.Path())
@click.option("--prompt-len", type=click.IntRange(1), default=512, show_default=True)
@click.option("--new-tokens", type=click.IntRange(2), default=32, show_default=True)
@click.option("--repeat", type=click.IntRange(1), default=3, show_default=True, help="Measured runs (after one warm-up).")
@click.option("--prompt-file", type=click.Path(dir_okay=False, exists=True), default=None,
              help="UTF-8 text whose first --prompt-len tokens are the prompt (repeated when shorter). Default: CPython's "
                   "LICENSE.txt, natural English the default calibration does not read. A W8A8 bundle's prefill speed "
                   "depends on the text (its shadow corrections do work per outlier).")
@click.option("--provider", type=click.Choice(["auto", "cpu", "qnn"]), default="auto", show_default=True)
@click.option("--threads", type=click.IntRange(1), default=None)
@_NO_PREFETCH
@click.option("--json", "as_json", is_flag=True)
@_guard
def bench(bundle, prompt_len, new_tokens, repeat, prompt_file, provider, threads, no_prefetch, as_json):
    """Time a BUNDLE on a natural-English prompt (see --prompt-file): TTFT, prefill and decode tokens/s (median and spread),
    peak RSS, what ran prefill and decode, the KV cache, for W8A8 bundles which int8 kernels ran, and for native-kernel
    bundles the packed copy of the decode weights and whether a chunk's attention multiplies in bfloat16."""
    import dataclasses

    from llmc.runtime.bench import bench as run_bench

    text = (f"--prompt-file {prompt_file}", _read_text(prompt_file, "--prompt-file")) if prompt_file else None
    if text is not None and not text[1].strip():
        raise click.UsageError(f"--prompt-file {prompt_file} has no text")
    sess = _make_session(bundle, provider, threads, prefetch=not no_prefetch)
    if prompt_len + new_tokens > sess.max_context:
        raise click.BadParameter(f"prompt-len + new-tokens = {prompt_len + new_tokens} exceeds the bundle's max context {sess.max_context}")
    if text is not None and sess.tokenizer is None:
        raise click.UsageError(f"{bundle} has no tokenizer, so --prompt-file cannot be tokenized; leave it out (random ids) "
                               "or compile from a model with tokenizer files")
    r = run_bench(sess, prompt_len, new_tokens, repeat, text=text)
    if as_json:
        click.echo(json.dumps(dataclasses.asdict(r)))
        return
    click.echo(f"{bundle}: {prompt_len}-token prompt, {new_tokens} new tokens, median of {repeat} runs (min..max)")
    click.echo(f"  prompt   {r.prompt}")
    for label, f, unit in (("TTFT", r.ttft_s, "s"), ("prefill", r.prefill_tok_s, "tok/s"), ("decode", r.decode_tok_s, "tok/s")):
        click.echo(f"  {label:<8} {f.median:10.3f} {unit:<6} ({f.min:.3f}..{f.max:.3f})")
    click.echo(f"  peak RSS {r.peak_rss_mb:10.0f} MB")
    click.echo("  graphs   " + "; ".join(f"{phase} {by['qnn']} on the NPU (QNN HTP), {by['cpu']} on the CPU" for phase, by in r.graphs.items()))
    click.echo(f"  prefill  {_PREFILL_PATHS[r.prefill_path]}")
    click.echo(f"  decode   {_DECODE_PATHS[r.decode_path]}")
    click.echo(f"  kv cache {r.kv_cache}, {r.kv_cache_bytes / 1e6:.1f} MB for {sess.max_context} positions")
    if r.native_kernels:
        click.echo(f"  kernels  llmc's native ops (--cpu-kernels native) from {r.native_kernels}")
    if r.packed_weight_bytes:
        click.echo(f"  packed   the decode graph's W8A8 weights copied into their ops' layout (AVX-512 VNNI): "
                   f"{r.packed_weight_bytes / 1e6:.1f} MB; LLMC_W8_PACK=0 reads them as stored")
    if r.bf16_attention:
        click.echo("  bf16     a chunk's attention multiplies in bfloat16 with float32 sums (AVX512_BF16); LLMC_ATTN_BF16=0 keeps float32")
    if r.int8_kernels:
        click.echo(f"  int8     {_INT8_KERNELS[r.int8_kernels]}")
        if r.int8_kernels == "u8u8" and sess.weight_bits == 8 and not r.offload:
            click.echo("  hint     this CPU's uint8 x int8 kernels would saturate 8-bit weight codes: a bundle compiled with "
                       "--weight-bits 7 stays on them (faster prefill; docs/quantization.md)")
    if r.offload:
        o = r.offload
        click.echo(f"  offload  {o['resident_bytes'] / 1e6:.1f} MB resident, {o['buffer_bytes'] / 1e6:.1f} MB stream buffer "
                   f"(peak {o['peak_buffer_bytes'] / 1e6:.1f}), prefetch {'depth ' + str(o['prefetch_depth']) if o['prefetch'] else 'off'}; "
                   f"read {o['streamed_bytes_read'] / 1e6:.0f} MB at {o['read_MB_s']:.0f} MB/s ({'O_DIRECT' if o['o_direct'] else 'pread'}), "
                   f"waited {o['main_thread_wait_s']:.2f} s")


_INT8_KERNELS = {"u8s8": "uint8 x int8 weights (exact on this CPU: x86 with VNNI, or not x86, or 7-bit weight codes)",
                 "u8u8": "uint8 x uint8 weights (the exact kernels where u8 x s8 saturates, and for weights fed at run time)"}
_PREFILL_PATHS = {"graph": "one call of the decode graph's chunk instance per chunk",
                  "cpu program": "the CPU program at chunk rows: a graph and an attention call per layer",
                  "chunk program": "the chunk program in its compiled order"}
_DECODE_PATHS = {"graph": "one call of the decode graph per token", "cpu program": "the CPU program: a graph and an attention call per layer",
                 "chunk program": "the chunk program's one-row instances"}


def _qnn_summary(q, check: str | None = None):
    if q is None:
        return None
    if "skipped" in q:
        return {"skipped": q["skipped"]}
    return {"soc": q["soc"], "htp_arch": q["htp_arch"], "versions": q["versions"], "qnn_sdk_build": q.get("qnn_sdk_build"),
            "qnn_core_api": q.get("qnn_core_api"), "graphs": sum(len(g) for g in q["graphs"].values()), "binaries": q["binaries"],
            "binaries_check": check}


@cli.command()
def passes():
    """List the available passes and the default pipeline of each target."""
    from llmc.passes import ALL_PASSES, DEFAULT_PIPELINES, PIPELINE_USES

    for p in ALL_PASSES:
        click.echo(f"{p.name:<24} {p.summary}")
    click.echo()
    for key, pipe in DEFAULT_PIPELINES.items():
        click.echo(f"default pipeline of `{PIPELINE_USES[key]}`: {pipe}")
    click.echo("with `--kv-cache int8`: quantize_kv_cache right after calibrate (calibrate is added before the first pass that "
               "rewrites Linears when absent); `llmc plan --kv-cache int8` adds assume_kv_cache there instead")


@cli.command()
def ops():
    """List the IR's LLM-level operators."""
    from llmc.ops import OPS

    for d in OPS.values():
        click.echo(f"{d.name:<12} {d.kind:<8} {d.summary}")


def _terminate(signum, frame) -> None:
    """SIGTERM/SIGHUP (a cancelled CI job, ``timeout``, a closed terminal) unwind like Ctrl-C, so a
    compile removes its partial output; the exit code is the shell's 128 + signal."""
    raise SystemExit(128 + signum)


def main() -> None:
    import signal

    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:  # nohup ignores SIGHUP: keep it so
            signal.signal(sig, _terminate)
    cli(prog_name="llmc")


if __name__ == "__main__":
    main()
