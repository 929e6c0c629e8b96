"""``llmc profile-host``: measure this machine's device profile with micro-benchmarks.

Each number of the ``host`` profile comes from a small benchmark of the same
kernels a bundle runs here (ONNX Runtime's CPU provider with the runtime's
session settings, the runtime's numpy attention kernel), never from running a
model end to end:

* ``cpu.fp32_flops_per_s``: ``Gemm`` (transB, as the ONNX backend emits Linear)
  of ``[256, K] x [K, N]`` over LLM-like shapes, median;
* ``cpu.int8_ops_per_s``: the backend's QLinear pattern (QuantizeLinear,
  DequantizeLinear, per-channel uint8 weights, MatMul; ONNX Runtime fuses it
  into an integer matmul) over the same shapes, median;
* ``cpu.int8_gemv_ops_per_s``: the same QLinear pattern at one row (decode): on
  CPUs without a fast integer GEMV this, not memory, bounds int8 decode;
* ``cpu.mem_bytes_per_s``: one-row ``Gemm`` against 64 MB of float32 weights
  (what decode does: stream every weight once);
* ``cpu.kv_bytes_per_s``: the one-row attention's cost per cached key, as bytes
  of K and V read per second (the slope between 128 and 2048 keys);
* ``cpu.attention_flops_per_s``: the runtime's attention path
  (:class:`llmc.runtime.ort_attention.OrtAttention`), 256 new rows over 1024
  keys, 16 heads of 64 (4 KV heads);
* ``cpu.launch_s``: one ``run`` of a one-node graph from Python, as the
  runtime calls every graph step;
* ``cpu.op_launch_s``: the fixed cost of a dynamic op step: the runtime's
  attention for one row over 8 keys;
* ``storage.read_bytes_per_s``: reading a 256 MB file with ``O_DIRECT``
  (bypassing the page cache, like weights streamed from flash);
* ``memory.ram_bytes``: ``MemTotal`` of ``/proc/meminfo``.

Every benchmark warms up, then reports the median of repeated runs.
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

log = logging.getLogger(__name__)

GEMM_SHAPES = ((576, 1536), (1536, 576), (1024, 1024), (2048, 2048), (2048, 5632))
ROWS = 256


def _median_seconds(fn: Callable[[], object], min_time: float = 0.2, min_runs: int = 5) -> float:
    fn()
    times = []
    t_end = time.perf_counter() + min_time
    while len(times) < min_runs or time.perf_counter() < t_end:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _session(model, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _model(nodes, inputs, outputs, inits):
    from onnx import helper

    g = helper.make_graph(nodes, "probe", inputs, outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])
    m.ir_version = 10
    return m


def gemm_seconds(rows: int, k: int, n: int, threads: int) -> float:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((n, k), dtype=np.float32) * 0.05, "w")
    m = _model([helper.make_node("Gemm", ["x", "w"], ["y"], transB=1)], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, k])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, n])], [w])
    s = _session(m, threads)
    x = rng.standard_normal((rows, k), dtype=np.float32)
    return _median_seconds(lambda: s.run(None, {"x": x}))


def qlinear_seconds(rows: int, k: int, n: int, threads: int) -> float:
    """The ONNX backend's QLinear lowering: uint8 activations (zero point 128), per-channel uint8 weights."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.integers(1, 256, size=(k, n), dtype=np.uint8), "wq"),
        numpy_helper.from_array(np.full(n, 0.01, np.float32), "ws"),
        numpy_helper.from_array(np.full(n, 128, np.uint8), "wz"),
        numpy_helper.from_array(np.array(0.05, np.float32), "xs"),
        numpy_helper.from_array(np.array(128, np.uint8), "xz"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xdq"]),
        helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"], axis=1),
        helper.make_node("MatMul", ["xdq", "w"], ["y"]),
    ]
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, k])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, n])], inits)
    s = _session(m, threads)
    x = rng.standard_normal((rows, k), dtype=np.float32)
    return _median_seconds(lambda: s.run(None, {"x": x}))


def launch_seconds(threads: int) -> float:
    from onnx import TensorProto, helper

    m = _model([helper.make_node("Add", ["x", "x"], ["y"])], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [])
    s = _session(m, threads)
    x = np.zeros((1, 64), np.float32)
    return _median_seconds(lambda: dict(zip(["y"], s.run(["y"], {"x": x}))), min_runs=200)


def _attention_runner(threads: int, h: int, kvh: int, d: int, n: int, keys: int):
    """A call of the runtime's attention path (ONNX Runtime GroupQueryAttention over the bound
    cache, as :class:`llmc.runtime.session.Session` runs it) for ``n`` rows ending at ``keys``."""
    import onnxruntime as ort

    from llmc.runtime import kernels
    from llmc.runtime.ort_attention import OrtAttention

    rng = np.random.default_rng(0)
    cache = kernels.KVCache({0: (kvh, d)}, keys)
    start = keys - n
    cache.k[0][:, :start] = rng.standard_normal((kvh, start, d), dtype=np.float32)
    cache.v[0][:, :start] = rng.standard_normal((kvh, start, d), dtype=np.float32)
    att = OrtAttention(ort, cache, threads)
    q = rng.standard_normal((n, h * d), dtype=np.float32)
    k = rng.standard_normal((n, kvh * d), dtype=np.float32)
    v = rng.standard_normal((n, kvh * d), dtype=np.float32)
    return lambda: att(q, k, v, None, None, layer=0, start=start, n=n, num_heads=h, num_kv_heads=kvh, head_dim=d, scale=d ** -0.5,
                       rotary_dim=0, sliding_window=0)


def op_launch_seconds(threads: int) -> float:
    return _median_seconds(_attention_runner(threads, 16, 4, 64, 1, 8), min_runs=200)


def attention_flops_per_s(threads: int) -> float:
    h, kvh, d, n, keys = 16, 4, 64, 256, 1024
    return 4.0 * n * keys * h * d / _median_seconds(_attention_runner(threads, h, kvh, d, n, keys))


def storage_read_bytes_per_s(directory: Path, size: int = 256 << 20) -> tuple[float, str]:
    """Sequential 1 MiB reads of a fresh file, bypassing the page cache where the OS allows."""
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
            return size / (time.perf_counter() - t), how
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
    n["cpu.int8_ops_per_s"] = {"value": statistics.median(rates), "source": f"{where}: the QLinear QDQ pattern [256,K]x[K,N] uint8, median over the same shapes"}
    rates = [2.0 * k * m / qlinear_seconds(1, k, m, threads) for k, m in GEMM_SHAPES]
    n["cpu.int8_gemv_ops_per_s"] = {"value": statistics.median(rates), "source": f"{where}: the QLinear QDQ pattern at one row [1,K]x[K,N], median over the same shapes"}
    say("memory bandwidth")
    bw = 4.0 * 4096 * 4096 / gemm_seconds(1, 4096, 4096, threads)
    n["cpu.mem_bytes_per_s"] = {"value": bw, "source": f"{where}: one-row Gemm streaming 64 MB of float32 weights"}
    say("attention")
    n["cpu.attention_flops_per_s"] = {"value": attention_flops_per_s(threads), "source": f"{where}: the runtime's attention (ONNX Runtime GroupQueryAttention over the bound cache), 256 rows over 1024 keys, 16x64 heads, 4 KV heads"}
    say("launch")
    n["cpu.launch_s"] = {"value": launch_seconds(threads), "source": f"{where}: one InferenceSession.run of a one-node graph from Python"}
    t_short = _median_seconds(_attention_runner(threads, 16, 4, 64, 1, 128), min_runs=100)
    t_long = _median_seconds(_attention_runner(threads, 16, 4, 64, 1, 2048), min_runs=100)
    n["cpu.kv_bytes_per_s"] = {"value": (2048 - 128) * 2 * 4 * 64 * 4 / max(t_long - t_short, 1e-9),
                               "source": f"{where}: the runtime's one-row attention over 2048 vs 128 keys (4 KV heads of 64), K and V bytes per second"}
    n["cpu.op_launch_s"] = {"value": op_launch_seconds(threads), "source": f"{where}: the runtime's attention for one row over 8 keys"}
    say("storage")
    rate, how = storage_read_bytes_per_s(scratch or Path(tempfile.gettempdir()))
    n["storage.read_bytes_per_s"] = {"value": rate, "source": f"{where}: sequential 1 MiB reads of a 256 MB file, {how}"}
    n["memory.ram_bytes"] = {"value": ram_bytes(), "source": f"{where}: MemTotal"}
    data = {"schema": SCHEMA, "name": "host", "description": f"this machine ({platform.node()}), CPU only", "numbers": n}
    return parse(data, "host (measured)")
