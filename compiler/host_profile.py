"""``llmc profile-host``: measure this machine's device profile with micro-benchmarks.

Each number of the ``host`` profile comes from a small benchmark of the same
kernels a bundle runs here (ONNX Runtime's CPU provider with the runtime's
session settings, the runtime's attention path), never from running a
model end to end:

* ``cpu.fp32_flops_per_s``: ``Gemm`` (transB, as the ONNX backend emits Linear)
  of ``[256, K] x [K, N]`` over LLM-like shapes, median;
* ``cpu.int8_ops_per_s``: the backend's QLinear pattern (QuantizeLinear,
  DequantizeLinear, per-channel int8 weights, MatMul; ONNX Runtime fuses it
  into an integer matmul, on the kernels the runtime picks for this CPU:
  :mod:`llmc.runtime.cpu`) over the same shapes, median;
* ``cpu.int8_7bit_ops_per_s``: the same with weight codes in [-63, 63] (``--weight-bits
  7``), which the runtime keeps on the uint8 x int8 kernels on every CPU; measured only
  where those are not exact for 8-bit codes (x86 without VNNI: elsewhere the rate is
  ``cpu.int8_ops_per_s``'s);
* ``cpu.int8_gemv_ops_per_s``: the same QLinear pattern at one row (decode), with
  96 MB of weights per run so they come from memory: on CPUs without a fast
  integer GEMV this, not memory bandwidth, bounds int8 decode;
* ``cpu.node_s``: the fixed cost of one more small kernel inside a graph (a
  chain of one-row shadow corrections, nine dynamically shaped kernels each): a
  decode graph is dozens of kernels on tiny tensors;
* tables ``cpu.int8_gemv_s`` and ``cpu.int8_gemv_1t_s``: the one-row QLinear's
  seconds on a grid of (K, N), weights from memory, on all threads and on one
  (the runtime runs small one-row graphs on one thread): small matmuls are
  dominated by fixed costs, large ones by the kernel's streaming rate, and no
  single rate fits both;
* ``cpu.mem_bytes_per_s``: one-row ``Gemm`` of the same shapes, copies with at
  least 96 MB of float32 weights per run (what decode does: stream every weight
  once), median;
* ``cpu.kv_bytes_per_s``: the one-row attention's cost per cached key, as bytes
  of K and V read per second (the slope between 128 and 2048 keys, calls going
  round 32 layers' caches so K/V come from memory);
* ``cpu.attention_flops_per_s``: the runtime's attention path
  (:class:`llmc.runtime.ort_attention.OrtAttention`), 256 new rows over 1024
  keys, 16 heads of 64 (4 KV heads);
* ``cpu.launch_s``: one ``run`` of a one-node graph from Python, as the
  runtime calls every graph step;
* ``cpu.op_launch_s``: the fixed cost of a dynamic op step: the runtime's
  attention (rotary embedding included) for one row over 8 keys;
* ``storage.read_bytes_per_s``: reading a 256 MB file with ``O_DIRECT``
  (bypassing the page cache, like weights streamed from flash);
* ``storage.small_read_s``: one random 4 KiB read of that file (a table row), the mean of 512;
* ``memory.ram_bytes``: ``MemTotal`` of ``/proc/meminfo``.

Every kernel benchmark warms up, then reports the median of repeated runs
(``cpu.node_s`` is a difference of two such medians; the sequential storage read is timed once).
"""

from __future__ import annotations

import logging
import mmap
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

from llmc.device_profile import SCHEMA, DeviceProfile, parse
from llmc.runtime.cpu import int8_session_options, session_kwargs, u8s8_exact_for

log = logging.getLogger(__name__)

GEMM_SHAPES = ((576, 1536), (1536, 576), (1024, 1024), (2048, 2048), (2048, 5632))
ROWS = 256
GEMV_BYTES = 96 << 20  # one-row probes stream this much weight per run: several times a CPU's last-level cache
GEMV_K = (576, 1536, 4096)  # the one-row int8 tables' grid (covers 135M to 7B models' Linears)
GEMV_N = (192, 576, 1536, 5632, 11008)


def _median_seconds(fn: Callable[[], object], min_time: float = 0.2, min_runs: int = 5) -> float:
    fn()
    times = []
    t_end = time.perf_counter() + min_time
    while len(times) < min_runs or time.perf_counter() < t_end:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _session(model, threads: int, weight_bits: int = 8):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    int8_session_options(so, weight_bits)  # as the runtime: int8 weights (of weight_bits) on this CPU's exact kernels
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"], **session_kwargs())


def _model(nodes, inputs, outputs, inits):
    from onnx import helper

    g = helper.make_graph(nodes, "probe", inputs, outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])
    m.ir_version = 10
    return m


def gemm_seconds(rows: int, k: int, n: int, threads: int, copies: int = 1) -> float:
    """ONNX Runtime ``Gemm`` (transB, as the ONNX backend emits Linear) ``[rows, K] x [K, N]``;
    with ``copies`` > 1, that many independent ones in one graph, per Gemm."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    base = rng.standard_normal((n, k), dtype=np.float32) * 0.05
    ws = [numpy_helper.from_array(np.roll(base, c, axis=1), f"w{c}") for c in range(copies)]  # distinct copies, cheaply
    m = _model([helper.make_node("Gemm", ["x", f"w{c}"], [f"y{c}"], transB=1) for c in range(copies)],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, k])],
               [helper.make_tensor_value_info(f"y{c}", TensorProto.FLOAT, [rows, n]) for c in range(copies)], ws)
    s = _session(m, threads)
    x = rng.standard_normal((rows, k), dtype=np.float32)
    return _median_seconds(lambda: s.run(None, {"x": x})) / copies


def qlinear_seconds(rows: int, k: int, n: int, threads: int, copies: int = 1, weight_bits: int = 8) -> float:
    """The ONNX backend's QLinear lowering: uint8 activations (zero point 128), per-channel int8 weights (codes of
    ``weight_bits``, on the kernels the runtime picks for them).

    With ``copies`` > 1 the graph holds that many independent QLinears of the shape and the
    result is per QLinear: enough copies that their weights exceed the caches make each one
    stream its weights from memory, as a decode step does.
    """
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.array(0.05, np.float32), "xs"), numpy_helper.from_array(np.array(128, np.uint8), "xz")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]), helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xdq"])]
    outputs = []
    from llmc.passes.quantize import weight_qmax

    qmax = weight_qmax(weight_bits)
    base = rng.integers(-qmax, qmax + 1, size=(k, n), dtype=np.int8)
    for c in range(copies):
        # each copy its own weight scales and zero points, as each QLinear of a bundle: on a CPU without VNNI ONNX
        # Runtime rewrites every int8 weight's zero point to uint8 in place, and fails on one that two weights share
        inits += [numpy_helper.from_array(np.roll(base, c, axis=1), f"wq{c}"), numpy_helper.from_array(np.full(n, 0.01, np.float32), f"ws{c}"),
                  numpy_helper.from_array(np.zeros(n, np.int8), f"wz{c}")]
        nodes += [helper.make_node("DequantizeLinear", [f"wq{c}", f"ws{c}", f"wz{c}"], [f"w{c}"], axis=1),
                  helper.make_node("MatMul", ["xdq", f"w{c}"], [f"y{c}"])]
        outputs.append(helper.make_tensor_value_info(f"y{c}", TensorProto.FLOAT, [rows, n]))
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, k])], outputs, inits)
    s = _session(m, threads, weight_bits)
    x = rng.standard_normal((rows, k), dtype=np.float32)
    return _median_seconds(lambda: s.run(None, {"x": x})) / copies


def node_seconds(threads: int, links: int = 16, k: int = 576) -> float:
    """The fixed cost of one more small kernel inside a graph, from a chain of the ONNX
    backend's one-row shadow correction (``y + (x - clip(x))[chans] @ W_t[chans]`` with
    ``chans = NonZero(...)``: nine kernels on tiny, dynamically shaped tensors), per kernel."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)

    def chain(count: int) -> float:
        inits = [numpy_helper.from_array(np.array(-1.0, np.float32), "lo"), numpy_helper.from_array(np.array(1.0, np.float32), "hi"),
                 numpy_helper.from_array(np.array([-1], np.int64), "flat")]
        nodes, prev = [], "x"
        for i in range(count):
            p = f"s{i}."
            inits.append(numpy_helper.from_array(rng.standard_normal((k, k), dtype=np.float32) * 0.01, p + "wt"))
            nodes += [helper.make_node("Clip", [prev, "lo", "hi"], [p + "c"]), helper.make_node("Sub", [prev, p + "c"], [p + "d"]),
                      helper.make_node("Reshape", [p + "d", "flat"], [p + "a"]), helper.make_node("NonZero", [p + "a"], [p + "nz"]),
                      helper.make_node("Reshape", [p + "nz", "flat"], [p + "ch"]), helper.make_node("Gather", [p + "d", p + "ch"], [p + "g"], axis=1),
                      helper.make_node("Gather", [p + "wt", p + "ch"], [p + "w"], axis=0), helper.make_node("MatMul", [p + "g", p + "w"], [p + "corr"]),
                      helper.make_node("Sum", [prev, p + "corr"], [p + "y"])]
            prev = p + "y"
        m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])], [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [1, k])], inits)
        s = _session(m, threads)
        x = rng.uniform(-0.9, 0.9, (1, k)).astype(np.float32)
        x[0, [3, k // 5, k // 2]] = (5.0, -7.0, 9.0)
        return _median_seconds(lambda: s.run(None, {"x": x}), min_runs=100)

    return max(chain(links) - chain(1), 0.0) / ((links - 1) * 9)


def launch_seconds(threads: int) -> float:
    from onnx import TensorProto, helper

    m = _model([helper.make_node("Add", ["x", "x"], ["y"])], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [])
    s = _session(m, threads)
    x = np.zeros((1, 64), np.float32)
    return _median_seconds(lambda: dict(zip(["y"], s.run(["y"], {"x": x}))), min_runs=200)


def _attention_runner(threads: int, h: int, kvh: int, d: int, n: int, keys: int, layers: int = 1):
    """A call of the runtime's attention path (rotary embedding, then ONNX Runtime
    GroupQueryAttention over the bound cache, as :class:`llmc.runtime.session.Session` runs it)
    for ``n`` rows ending at ``keys``; successive calls go round ``layers`` caches, so with
    enough of them each call reads its K/V from memory, as a decode step does."""
    import onnxruntime as ort

    from llmc.runtime import kernels
    from llmc.runtime.ort_attention import OrtAttention

    rng = np.random.default_rng(0)
    cache = kernels.KVCache({i: (kvh, d) for i in range(layers)}, keys)
    start = keys - n
    for i in range(layers):
        cache.k[i][:, :start] = rng.standard_normal((kvh, start, d), dtype=np.float32)
        cache.v[i][:, :start] = rng.standard_normal((kvh, start, d), dtype=np.float32)
    att = OrtAttention(ort, cache, threads)
    q = rng.standard_normal((n, h * d), dtype=np.float32)
    k = rng.standard_normal((n, kvh * d), dtype=np.float32)
    v = rng.standard_normal((n, kvh * d), dtype=np.float32)
    cos, sin = kernels.rotary_table(np.arange(start, keys), 1.0 / 10000 ** (np.arange(0, d, 2, dtype=np.float32) / d), 1.0)
    turn = iter(range(1 << 62))
    return lambda: att(q, k, v, cos, sin, layer=next(turn) % layers, start=start, n=n, num_heads=h, num_kv_heads=kvh, head_dim=d,
                       scale=d ** -0.5, rotary_dim=d, sliding_window=0)


def op_launch_seconds(threads: int) -> float:
    return _median_seconds(_attention_runner(threads, 16, 4, 64, 1, 8, layers=32), min_runs=200)


def attention_flops_per_s(threads: int) -> float:
    h, kvh, d, n, keys = 16, 4, 64, 256, 1024
    return 4.0 * n * keys * h * d / _median_seconds(_attention_runner(threads, h, kvh, d, n, keys))


def storage_read_bytes_per_s(directory: Path, size: int = 256 << 20) -> tuple[float, float, str]:
    """Sequential 1 MiB reads of a fresh file, bypassing the page cache where the OS allows,
    then the mean of 512 random 4 KiB reads of it (a token pays the slow ones too); returns
    (bytes/s, seconds per small read, how)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=directory, prefix="llmc-probe-")
    try:
        block = np.random.default_rng(0).integers(0, 255, size=1 << 20, dtype=np.uint8).tobytes()
        with os.fdopen(fd, "wb") as f:
            for _ in range(size >> 20):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        buf = mmap.mmap(-1, 1 << 20)  # page-aligned, as O_DIRECT needs
        how = "O_DIRECT"
        try:
            rfd = os.open(name, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            os.preadv(rfd, [buf], 0)
        except OSError:
            how = "buffered after posix_fadvise(DONTNEED)"
            rfd = os.open(name, os.O_RDONLY)
        try:
            if how != "O_DIRECT" and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(rfd, 0, 0, os.POSIX_FADV_DONTNEED)
            t = time.perf_counter()
            off = 0
            while off < size:
                off += os.preadv(rfd, [buf], off)
            rate = size / (time.perf_counter() - t)
            small = memoryview(buf)[:4096]
            times = []
            for page in np.random.default_rng(0).integers(0, size // 4096, 512):
                t = time.perf_counter()
                os.preadv(rfd, [small], int(page) * 4096)
                times.append(time.perf_counter() - t)
            return rate, statistics.fmean(times), how
        finally:
            os.close(rfd)
    finally:
        os.unlink(name)


def ram_bytes() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def measure(threads: int | None = None, scratch: Path | None = None, progress: Callable[[str], None] | None = None) -> DeviceProfile:
    """Run every micro-benchmark and return the ``host`` profile."""
    import onnxruntime as ort

    threads = threads or os.cpu_count() or 1
    say = progress or (lambda s: None)
    where = f"measured by llmc profile-host on {platform.node()} ({platform.processor() or platform.machine()}, {threads} threads, onnxruntime {ort.__version__})"
    n: dict[str, dict[str, object]] = {}

    say("fp32 GEMM")
    rates = [2.0 * ROWS * k * m / gemm_seconds(ROWS, k, m, threads) for k, m in GEMM_SHAPES]
    n["cpu.fp32_flops_per_s"] = {"value": statistics.median(rates), "source": f"{where}: ONNX Runtime Gemm [256,K]x[K,N], median over (K,N) in {list(GEMM_SHAPES)}"}
    say("int8 QLinear")
    rates = [2.0 * ROWS * k * m / qlinear_seconds(ROWS, k, m, threads) for k, m in GEMM_SHAPES]
    n["cpu.int8_ops_per_s"] = {"value": statistics.median(rates), "source": f"{where}: the QLinear QDQ pattern [256,K]x[K,N] (int8 weights, this CPU's exact kernels), median over the same shapes"}
    if not u8s8_exact_for(8):  # 7-bit codes run on other (faster) kernels here
        rates = [2.0 * ROWS * k * m / qlinear_seconds(ROWS, k, m, threads, weight_bits=7) for k, m in GEMM_SHAPES]
        n["cpu.int8_7bit_ops_per_s"] = {"value": statistics.median(rates), "source": f"{where}: the QLinear QDQ pattern [256,K]x[K,N] with "
                                        "7-bit weight codes (--weight-bits 7: the uint8 x int8 kernels), median over the same shapes"}
    rates = [2.0 * k * m / qlinear_seconds(1, k, m, threads, copies=-(-GEMV_BYTES // (k * m))) for k, m in GEMM_SHAPES]
    n["cpu.int8_gemv_ops_per_s"] = {"value": statistics.median(rates), "source": f"{where}: the QLinear QDQ pattern at one row [1,K]x[K,N], "
                                    f"copies of each shape with {GEMV_BYTES >> 20} MB of weights in one graph (weights from memory, as in decode), median over the same shapes"}
    n["cpu.node_s"] = {"value": node_seconds(threads), "source": f"{where}: a chain of 16 vs 1 one-row shadow corrections (Clip, Sub, NonZero, "
                       "Gather, MatMul, Sum: 9 kernels each, 3 outlier channels of 576) in one graph, per kernel"}
    say("int8 one-row table")
    tables = {}
    for key, t in (("cpu.int8_gemv_s", threads), ("cpu.int8_gemv_1t_s", 1)):
        rows = [[k, m, qlinear_seconds(1, k, m, t, copies=-(-GEMV_BYTES // (k * m)))] for k in GEMV_K for m in GEMV_N]
        tables[key] = {"rows": rows, "source": f"{where.replace(f'{threads} threads', f'{t} thread' + ('s' if t > 1 else ''))}: the QLinear QDQ pattern at one "
                       f"row [1,K]x[K,N], copies with {GEMV_BYTES >> 20} MB of weights in one graph (weights from memory, as in decode), per QLinear, "
                       f"K in {list(GEMV_K)}, N in {list(GEMV_N)}"}
    say("memory bandwidth")
    rates = [4.0 * k * m / gemm_seconds(1, k, m, threads, copies=-(-GEMV_BYTES // (4 * k * m))) for k, m in GEMM_SHAPES]
    n["cpu.mem_bytes_per_s"] = {"value": statistics.median(rates), "source": f"{where}: one-row Gemm, copies of each shape with at least "
                                f"{GEMV_BYTES >> 20} MB of float32 weights in one graph (what decode does: stream every weight once), median over the same shapes"}
    say("attention")
    n["cpu.attention_flops_per_s"] = {"value": attention_flops_per_s(threads), "source": f"{where}: the runtime's attention (ONNX Runtime GroupQueryAttention over the bound cache), 256 rows over 1024 keys, 16x64 heads, 4 KV heads"}
    say("launch")
    n["cpu.launch_s"] = {"value": launch_seconds(threads), "source": f"{where}: one InferenceSession.run of a one-node graph from Python"}
    t_short = _median_seconds(_attention_runner(threads, 16, 4, 64, 1, 128, layers=32), min_runs=100)
    t_long = _median_seconds(_attention_runner(threads, 16, 4, 64, 1, 2048, layers=32), min_runs=100)
    n["cpu.kv_bytes_per_s"] = {"value": (2048 - 128) * 2 * 4 * 64 * 4 / max(t_long - t_short, 1e-9),
                               "source": f"{where}: the runtime's one-row attention over 2048 vs 128 keys (4 KV heads of 64, 32 layers' caches in turn), "
                                         "K and V bytes per second"}
    n["cpu.op_launch_s"] = {"value": op_launch_seconds(threads), "source": f"{where}: the runtime's attention (with rotary embedding) for one row over 8 keys"}
    say("storage")
    rate, small, how = storage_read_bytes_per_s(scratch or Path(tempfile.gettempdir()))
    n["storage.read_bytes_per_s"] = {"value": rate, "source": f"{where}: sequential 1 MiB reads of a 256 MB file, {how}"}
    n["storage.small_read_s"] = {"value": small, "source": f"{where}: random 4 KiB reads of the same file, {how}, mean of 512"}
    n["memory.ram_bytes"] = {"value": ram_bytes(), "source": f"{where}: MemTotal"}
    data = {"schema": SCHEMA, "name": "host", "description": f"this machine ({platform.node()}), CPU only", "numbers": n, "tables": tables}
    return parse(data, "host (measured)")
