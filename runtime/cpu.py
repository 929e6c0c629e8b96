"""What this CPU's int8 matrix kernels compute exactly.

ONNX Runtime's x86 int8 GEMM (MLAS) multiplies uint8 activations by int8 weights
with ``vpdpbusd`` where the CPU has VNNI (AVX512-VNNI or AVX-VNNI), which sums
into 32 bits, and with ``vpmaddubsw`` elsewhere, which sums pairs into 16 bits
and saturates (errors of 13% of the output range measured on SmolLM2 without
VNNI). Its uint8 x uint8 kernels are exact on every CPU but 2-3x slower than
the VNNI ones at a prefill chunk's rows (SmolLM2 shapes, 256 rows).

The ONNX backend emits W8A8 weights as int8; a session on a CPU without VNNI
sets ``session.x64quantprecision``, so that ONNX Runtime turns each constant
int8 weight back into uint8 (its ``Avx2WeightS8ToU8Transformer``) and keeps the
exact kernels. ONNX Runtime's own test for that option
(``MlasPlatformU8S8Overflow``) is true on every x86 CPU with AVX2, VNNI or not,
so the runtime decides itself, from the CPU flags the kernel reports. A bundle
compiled with ``--weight-bits 7`` has codes in [-63, 63], whose pairs of products
cannot saturate (2 * 255 * 63 = 32130): its sessions keep the int8 weights on the
fast kernels on every CPU. Weights fed at run time are uint8 already (a
memory-budgeted bundle's) or cast to uint8 in the graph. Off x86 there is no
such rewrite and no need for one: ONNX Runtime's other int8 kernels do not
saturate.
"""

from __future__ import annotations

import functools
import os
import platform

X86 = ("x86_64", "amd64", "i386", "i686", "x86")
# MLAS's choice (onnxruntime/core/mlas/lib/platform.cpp): AVX-VNNI's kernel first; then, where the CPU has
# these four, its AVX-512 core kernel (vpmaddubsw: saturates) replaces it, and only AVX512-VNNI brings
# back a VNNI one.
AVX512_CORE = ("avx512f", "avx512bw", "avx512dq", "avx512vl")
ENV = "LLMC_INT8_EXACT_KERNELS"  # "vnni" or "u8u8": override the detection (a CPU this reads wrongly)
CPUINFO = "/proc/cpuinfo"


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The first processor's flags from ``cpuinfo`` (default ``/proc/cpuinfo``; empty where there is none, as off Linux)."""
    try:
        with open(cpuinfo or CPUINFO, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


@functools.lru_cache(maxsize=1)
def u8s8_is_exact() -> bool:
    """Whether ONNX Runtime's uint8 x int8 matrix kernels are exact on this CPU.

    True off x86 (the transform that would apply does not exist there) and on x86
    CPUs with VNNI; False on other x86 CPUs and where the flags cannot be read."""
    forced = os.environ.get(ENV, "").strip().lower()
    if forced in ("vnni", "u8u8"):
        return forced == "vnni"
    if platform.machine().lower() not in X86:
        return True
    return vnni_kernels(cpu_flags())


def vnni_kernels(flags: frozenset[str]) -> bool:
    """Whether MLAS runs u8 x s8 on a VNNI kernel on a CPU with these flags (see ``AVX512_CORE``)."""
    if all(f in flags for f in AVX512_CORE):
        return "avx512_vnni" in flags
    return "avx_vnni" in flags


# ONNX Runtime's MatMulAddFusion turns MatMul + Add into a float Gemm before its QDQ fusion runs, so an
# Add after a W8A8 matmul (a bias, the residual stream, a shadow correction) would dequantize the int8
# weights on every call. The graphs use Add (Sum, which the fusion skips, is about 2x slower than Add in
# ONNX Runtime's CPU kernels) and every session of a bundle turns the fusion off: the Linears of float
# graphs are Gemm already, and MatMulNBits is not a MatMul.
DISABLED_OPTIMIZERS = ("MatMulAddFusion",)


def session_kwargs() -> dict:
    """Keyword arguments of every ``InferenceSession`` of a bundle's graphs (``DISABLED_OPTIMIZERS``)."""
    return {"disabled_optimizers": list(DISABLED_OPTIMIZERS)}


def u8s8_exact_for(weight_bits: int = 8) -> bool:
    """Whether ONNX Runtime's uint8 x int8 kernels are exact on this CPU for int8 weights of ``weight_bits``
    bits: always for 7 (no pair of products reaches the int16 limit), else as :func:`u8s8_is_exact`."""
    return weight_bits <= 7 or u8s8_is_exact()


def int8_session_options(so, weight_bits: int = 8) -> None:
    """Keep a session's int8 weights (codes of ``weight_bits`` bits) on this CPU's exact kernels, the
    fastest exact ones (see the module docstring)."""
    so.add_session_config_entry("session.x64quantprecision", "0" if u8s8_exact_for(weight_bits) else "1")
