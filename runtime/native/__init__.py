"""llmc's native CPU kernels: an ONNX Runtime custom-op library built from this package's C++ source.

The library (``llmc_kernels.cc``, domain ``ai.llmc``) holds:

- ``ShadowCorrection``: a W8A8 projection's float outlier correction, ``y = base + (x - clip(x, lo, hi)) @ wt``,
  visiting each row's own outliers. ONNX Runtime's stock ops can only do it per block of rows over the
  block's union of outlier channels (``llmc.backends.onnx_backend``).
- ``ShadowCorrection``'s weight table may be float16 (``--cpu-kernels native`` stores it so).
- ``DecodeAttention`` and ``DecodeAttentionInt8``: the decode graph's attention over its bound KV cache
  (float32, or int8 codes with per-channel scales), with ``GroupQueryAttention``'s inputs: one row, and
  a chunk of rows (causal, in a sliding window where the model has one); the query may be the projection's
  ``[rows, F]`` as it is (no Reshapes).
- ``SwiGLU``: a gated MLP's ``silu(gate) * up`` from the gate/up projection's one result.
- ``RMSNorm``: ONNX ``RMSNormalization``. It and SwiGLU may also write their result's uint8 codes for the W8A8
  projection that reads it (as ``QuantizeLinear`` computes them); ``ShadowCorrection`` may add the residual
  stream, or compute the SwiGLU after it (SwiGLU's attributes, and its codes) so that the corrected gate/up
  result is never written out. These fusions spare the graphs an Add and a QuantizeLinear per norm, and a
  SwiGLU per gated MLP in chunks.
- ``BlockQMatMul``: ``MatMulNBits`` (4-bit codes in blocks of 32, int8 activations per block) for the one-row
  graphs of int4 bundles, widening its input with the block sums of folded offsets itself; a block's last
  projection adds the residual stream too (no Add), and its first ones do the RMS norm before them.
- ``W8A8MatMul``: a W8A8 projection of the one-row graphs as one op: ``QuantizeLinear`` of its input, the QDQ
  ``MatMul`` (ONNX Runtime's ``MatMulIntegerToFloat``: exact int32 sums, the same float scaling, bit for bit), the
  shadow correction (``ShadowCorrection``'s), the residual Add after it and the RMS norm before it where only such
  ops read the norm, or the SwiGLU before it (attributes ``gate`` and ``up``) where only such ops read its result. Int8 weights, or uint8 with zero point 128, read as they are stored (``[K, N]``),
  in one range of rows per CPU (``$LLMC_W8_SPLITS``, 1 to 64, sets the count: for sessions with fewer threads than
  CPUs). With the attribute ``pack`` (the decode graph's) on a CPU with AVX-512 VNNI, the op instead keeps a copy of
  its constant weights in the layout its loop reads in address order (blocks of 64 columns, four rows' bytes of a
  column together, for ``vpdpbusd``), made by its first call: the same sums, bit for bit; SmolLM2's decode 15-20%
  faster for 135 MB more memory. ``$LLMC_W8_PACK=0`` turns it off.

Bundles compiled with ``--cpu-kernels native`` use these ops, and their sessions load the library.

:func:`build` compiles the source with the host's GCC against ONNX Runtime's C/C++ API
headers (``onnxruntime_cxx_api.h``: ONNX Runtime's release archives have them under ``include/``,
Debian's ``libonnxruntime-dev`` under ``/usr/include/onnxruntime``). The library is built for this
CPU (``-march=native``) into ``$LLMC_CACHE_DIR/native`` (default ``~/.cache/llmc/native``), under a
name keyed by the source, the flags and the CPU, so an edited source is rebuilt, and a cache shared by
machines of different CPUs holds one library for each.
It calls ONNX Runtime only through the API table it is handed when registered, so it links to no
ONNX Runtime library and any ONNX Runtime with that API version or a later one loads it.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from llmc.runtime.errors import NativeKernelError

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("llmc_kernels.cc")
DOMAIN = "ai.llmc"  # the ops' domain in the bundles' graphs
MAX_GROUP = 16  # query heads per KV head that DecodeAttention takes (kMaxGroup)
MAX_CHUNK_HEAD = 256  # the head size it takes at more than one row (kMaxHeadSize), a multiple of 16 there


def attention_takes(num_heads: int, num_kv_heads: int, head_dim: int, rows: int) -> bool:
    """Whether DecodeAttention (or DecodeAttentionInt8) takes an attention node of this shape at ``rows`` rows;
    nodes it does not take keep ONNX Runtime's GroupQueryAttention."""
    return num_heads // num_kv_heads <= MAX_GROUP and (rows == 1 or (head_dim % 16 == 0 and head_dim <= MAX_CHUNK_HEAD))
HEADER = "onnxruntime_cxx_api.h"
# where ONNX Runtime's headers are looked for when neither --ort-include nor $LLMC_ORT_INCLUDE names them
INCLUDE_DIRS = (Path("/usr/include/onnxruntime"), Path("/usr/local/include/onnxruntime"), Path("/usr/local/include"))
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden")


def cache_dir() -> Path:
    base = os.environ.get("LLMC_CACHE_DIR") or str(Path.home() / ".cache" / "llmc")
    return Path(base) / "native"


def _compiler(cxx: str | None) -> str:
    name = cxx or os.environ.get("CXX") or "g++"
    path = shutil.which(name)
    if path is None:
        raise NativeKernelError(f"no C++ compiler {name!r} on PATH to build llmc's native kernels",
                                hint="install one (Debian: apt-get install g++), or name it with --cxx or $CXX")
    return path


def cpu_signature() -> str:
    """What ``-march=native`` builds for: this CPU's vendor, model and feature flags (Linux), else its
    architecture. Part of the library's name, so a cache shared between machines never hands one CPU a
    library built for another."""
    try:
        with open("/proc/cpuinfo") as f:
            fields = {}
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("vendor_id", "model name", "flags", "Features", "CPU implementer", "CPU part") and key not in fields:
                    fields[key] = value.strip()
                if not line.strip() and fields:
                    break
        return repr(sorted(fields.items()))
    except OSError:
        return platform.machine()


def library_name() -> str:
    """The library's file name: keyed by the source, the flags and the CPU it is built for."""
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + cpu_signature().encode()).hexdigest()[:16]
    return f"libllmc_kernels-{key}.so"


def find_headers(include: str | Path | None = None) -> Path:
    """The directory holding ONNX Runtime's ``onnxruntime_cxx_api.h``: ``include`` if given, else
    ``$LLMC_ORT_INCLUDE``, else the usual system places."""
    given = include or os.environ.get("LLMC_ORT_INCLUDE")
    candidates = [Path(given)] if given else list(INCLUDE_DIRS)
    for d in candidates:
        if (d / HEADER).is_file():
            return d
    where = str(candidates[0]) if given else ", ".join(str(d) for d in INCLUDE_DIRS)
    raise NativeKernelError(f"ONNX Runtime's C++ API header {HEADER} is not in {where}",
                            hint="pass --ort-include DIR (or set $LLMC_ORT_INCLUDE) to the directory that holds "
                                 "onnxruntime_c_api.h and onnxruntime_cxx_api.h: an ONNX Runtime release's include/, "
                                 "or /usr/include/onnxruntime from Debian's libonnxruntime-dev")


def library_path() -> Path | None:
    """The built library for the current source and CPU, or None when it is not built (``$LLMC_KERNELS``
    names a library to use instead)."""
    given = os.environ.get("LLMC_KERNELS")
    if given:
        return Path(given) if Path(given).is_file() else None
    path = cache_dir() / library_name()
    return path if path.is_file() else None


@functools.lru_cache(maxsize=None)
def features(path: Path) -> frozenset[str]:
    """What the library at ``path`` was built to do beyond the portable paths (its ``llmc_features``): ``"w8_pack"``,
    W8A8MatMul's packed copy of its weights (``pack=1``; AVX-512 VNNI), and ``"bf16_chunks"``, chunk attention's
    bfloat16 products (``bf16=1``; AVX512_BF16). Empty for a library without the query (built from older source)."""
    import ctypes

    try:
        query = ctypes.CDLL(str(path)).llmc_features
    except (OSError, AttributeError):
        return frozenset()
    query.restype = ctypes.c_uint
    bits = query()
    return frozenset(name for bit, name in ((1, "w8_pack"), (2, "bf16_chunks")) if bits & bit)


X86_64 = ("x86_64", "amd64")  # the kernels' source is x86-64 code (immintrin.h, AVX2/AVX-512 paths)
ELF_MACHINES = {62: "x86_64", 183: "aarch64", 40: "arm", 3: "i386"}  # ELF e_machine -> platform.machine()


def elf_machine(path: str | Path) -> str | None:
    """The architecture an ELF library at ``path`` is built for (as ``platform.machine()`` names it), or None
    where ``path`` is no ELF file."""
    try:
        with open(path, "rb") as f:
            head = f.read(20)
    except OSError:
        return None
    if len(head) < 20 or head[:4] != b"\x7fELF":
        return None
    code = int.from_bytes(head[18:20], "little" if head[5] == 1 else "big")
    return ELF_MACHINES.get(code, f"ELF machine {code}")


def _other_arch_hint() -> str:
    return (f"llmc's native kernels are x86-64 code; on this {platform.machine()} machine compile the bundle "
            "with --cpu-kernels onnx (the same graphs with ONNX Runtime's stock ops)")


def require_library() -> Path:
    """The library, for a bundle compiled with ``--cpu-kernels native``; a named error when it is not built, or
    is built for another architecture (a library copied from an x86-64 machine to an aarch64 board)."""
    path = library_path()
    here = platform.machine().lower()
    if path is None:
        if os.environ.get("LLMC_KERNELS"):
            raise NativeKernelError(f"$LLMC_KERNELS names {os.environ['LLMC_KERNELS']}, which is not a file",
                                    hint="point it at a library built by `llmc kernels build`, or unset it")
        raise NativeKernelError("this bundle uses llmc's native CPU kernels (compiled with --cpu-kernels native), "
                                "which are not built on this machine",
                                hint="build them once with `llmc kernels build` (needs a C++ compiler and ONNX Runtime's "
                                     "headers, see `llmc kernels build --help`), or compile the bundle with --cpu-kernels onnx"
                                if here in X86_64 else _other_arch_hint())
    built_for = elf_machine(path)
    if built_for is not None and here in ELF_MACHINES.values() and built_for != here and not {built_for, here} <= set(X86_64):
        raise NativeKernelError(f"this bundle uses llmc's native CPU kernels, and {path} is a library for {built_for}, "
                                f"not for this {here} machine", hint=_other_arch_hint())
    return path


def build(include: str | Path | None = None, cxx: str | None = None, force: bool = False) -> Path:
    """Compile the kernels for this CPU into :func:`cache_dir`; return the library's path. An
    up-to-date library (same source, flags and CPU) is kept unless ``force``: rebuild with it after
    changing the compiler or ONNX Runtime's headers. The library appears whole or not at all. GCC is
    the compiler it is written for (vector extensions, ``__builtin_shuffle``)."""
    if platform.machine().lower() not in X86_64:
        raise NativeKernelError(f"llmc's native kernels cannot be built on this {platform.machine()} machine", hint=_other_arch_hint())
    compiler = _compiler(cxx)
    headers = find_headers(include)
    out = cache_dir() / library_name()
    if out.is_file() and not force:
        log.info("native kernels are up to date: %s", out)
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise NativeKernelError(f"cannot create {out.parent}: {e.strerror or e}",
                                hint="set $LLMC_CACHE_DIR to a writable directory") from e
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [compiler, *FLAGS, "-I", str(headers), str(SOURCE), "-o", tmp]
    log.info("building native kernels: %s", " ".join(cmd))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines()
            raise NativeKernelError(f"building llmc's native kernels failed ({Path(compiler).name} exit {done.returncode}): "
                                    + "\n".join(lines[:20]),
                                    hint=f"check that {headers} holds the headers of ONNX Runtime 1.21 or later")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
