"""The runtime on aarch64 Linux: tiny bundles compiled here, run by an aarch64 CPython with aarch64 wheels of the
runtime's dependencies under qemu-user, give the token ids this x86_64 machine's Session gives.

$LLMC_AARCH64_PYTHON is the command prefix that runs that Python (the output of ``.ci/aarch64-runtime DIR``). Without
it these tests skip, unless $LLMC_REQUIRE_AARCH64=1 (CI), where they fail. Each qemu run costs a few seconds (Python,
numpy and ONNX Runtime start emulated), so the runs are few: one Session-API probe per emulated CPU, each over both
bundles, and three CLI runs.

The emulated CPUs pick ONNX Runtime's three aarch64 int8 GEMMs (MLAS, by the CPU's hwcaps): ``max`` has I8MM
(``ummla``; and SME, where ONNX Runtime's float GEMMs go to KleidiAI), ``cortex-a76`` has the dot product (``udot``),
``cortex-a72`` neither (plain NEON). All three sum in int32, so llmc's runtime keeps the int8 weights there
(``llmc.runtime.cpu``: no ``session.x64quantprecision`` rewrite off x86).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess

import pytest

from conftest import CHUNK, MAX_CONTEXT

PROMPT = [5, 9, 17, 30, 44, 12, 7, 60, 33, 21, 4]  # 11 ids: a full prefill chunk of 8, then a partial one
NEW = 8
TIMEOUT = 600  # s, for one emulated run (each takes about 5 s here)
# emulated CPU -> ONNX Runtime's int8 GEMM for it (MLAS on ARM64: I8MM first, then the dot product, then NEON)
CPUS = {"max": "ummla", "cortex-a76": "udot", "cortex-a72": "neon"}

PROBE = r"""
import ctypes, json, platform, sys
from llmc.runtime import Session, cpu

libc = ctypes.CDLL(None)
libc.getauxval.restype = ctypes.c_ulong
hwcap, hwcap2 = libc.getauxval(16), libc.getauxval(26)  # AT_HWCAP, AT_HWCAP2
gemm = "ummla" if hwcap2 & (1 << 13) else "udot" if hwcap & (1 << 20) else "neon"  # HWCAP2_I8MM, HWCAP_ASIMDDP
out = {"machine": platform.machine(), "u8s8_is_exact": cpu.u8s8_is_exact(), "gemm": gemm, "bundles": {}}
for name, path in json.loads(sys.argv[1]).items():
    s = Session(path, "cpu")
    out["bundles"][name] = {"token_ids": s.generate(PROMPT, NEW, stop_at_eos=False).token_ids, "int8_kernels": s.int8_kernels}
print(json.dumps(out))
""".replace("PROMPT", repr(PROMPT)).replace("NEW", str(NEW))


@pytest.fixture(scope="module")
def aarch64() -> list[str]:
    """The command that runs the aarch64 Python, checked once."""
    prefix = os.environ.get("LLMC_AARCH64_PYTHON", "").strip()
    required = os.environ.get("LLMC_REQUIRE_AARCH64") == "1"
    if not prefix:
        msg = "no aarch64 Python: set $LLMC_AARCH64_PYTHON to the output of `.ci/aarch64-runtime DIR`"
        pytest.fail(msg) if required else pytest.skip(msg)
    argv = shlex.split(prefix)
    try:
        r = subprocess.run([*argv, "-c", "import platform, numpy, onnxruntime, tokenizers, llmc.runtime; print(platform.machine())"],
                           capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    except OSError as e:
        r = subprocess.CompletedProcess(argv, 127, "", str(e))
    if r.returncode != 0 or r.stdout.strip() != "aarch64":
        msg = f"$LLMC_AARCH64_PYTHON does not run an aarch64 Python with llmc's runtime (exit {r.returncode}): {r.stderr[-2000:]}"
        pytest.fail(msg) if required else pytest.skip(msg)
    return argv


def _env(cpu: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("QEMU_CPU", "LLMC_KERNELS", "LLMC_INT8_EXACT_KERNELS")}
    if cpu:
        env["QEMU_CPU"] = cpu
    return env


def _run(argv: list[str], *args: str, cpu: str | None = None, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=TIMEOUT, env={**_env(cpu), **env})


@pytest.fixture(scope="module")
def arm_bundles(bundles, model_dirs, calib_words, tmp_path_factory):
    """name -> bundle: the cpu target (float32), the npu target (W8A8 with shadow outliers; its CPU graphs run the
    int8 kernels), and the npu target with --cpu-kernels native (x86-64 only)."""
    from llmc.compile import compile_model

    root = tmp_path_factory.mktemp("aarch64")
    out = {"cpu": bundles("llama"), "npu": root / "npu", "native": root / "native"}
    for name in ("npu", "native"):
        compile_model(str(model_dirs("llama")), out[name], target="npu", chunk=CHUNK, max_context=MAX_CONTEXT,
                      calib_file=str(calib_words), calib_tokens=256, cpu_kernels="native" if name == "native" else "onnx")
    return out


@pytest.fixture(scope="module")
def x86_tokens(arm_bundles):
    from llmc.runtime import Session

    return {name: Session(arm_bundles[name], "cpu").generate(PROMPT, NEW, stop_at_eos=False).token_ids for name in ("cpu", "npu")}


@pytest.mark.parametrize("cpu", list(CPUS))
def test_tokens_match_x86_64(aarch64, arm_bundles, x86_tokens, cpu):
    r = _run(aarch64, "-c", PROBE, json.dumps({name: str(arm_bundles[name]) for name in ("cpu", "npu")}), cpu=cpu)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["machine"] == "aarch64" and got["gemm"] == CPUS[cpu], got
    # off x86 the int8 weights stay int8 on ONNX Runtime's uint8 x int8 kernels (exact there)
    assert got["u8s8_is_exact"] is True and got["bundles"]["npu"]["int8_kernels"] == "u8s8", got
    assert got["bundles"]["cpu"]["int8_kernels"] is None, got
    for name in ("cpu", "npu"):
        assert got["bundles"][name]["token_ids"] == x86_tokens[name], (name, got)


def test_cli_run_matches_x86_64(aarch64, arm_bundles, x86_tokens):
    r = _run(aarch64, "-m", "llmc.cli", "run", str(arm_bundles["npu"]), "--prompt-ids", ",".join(map(str, PROMPT)),
             "--max-new-tokens", str(NEW), "--no-eos", "--provider", "cpu", "--json")
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout)
    assert got["token_ids"] == x86_tokens["npu"] and got["provider"] == "cpu", got


def test_native_kernels_bundle_is_a_named_error(aarch64, arm_bundles):
    """A --cpu-kernels native bundle does not run on aarch64 (the kernels are x86-64 code): the runtime's
    NativeKernelError and its exit code, not a crash, both where no library is built (a cache shared with this
    x86_64 machine holds only its library, under another CPU's name) and where $LLMC_KERNELS names an x86-64 one."""
    import _ctypes

    from llmc.runtime.errors import NativeKernelError

    args = ("-m", "llmc.cli", "run", str(arm_bundles["native"]), "--prompt-ids", ",".join(map(str, PROMPT)),
            "--max-new-tokens", "2", "--provider", "cpu")
    x86_library = _ctypes.__file__  # this Python's: an x86-64 ELF library
    for env, says in (({}, "not built"), ({"LLMC_KERNELS": x86_library}, "is a library for x86_64")):
        r = _run(aarch64, *args, **env)
        assert r.returncode == NativeKernelError.exit_code, (env, r.returncode, r.stderr[-4000:])
        assert "Traceback" not in r.stderr and says in r.stderr and "--cpu-kernels onnx" in r.stderr, r.stderr
