"""llmc.runtime.cpu: which int8 kernels the runtime keeps W8A8 weights on."""

from __future__ import annotations

import numpy as np
import pytest

from llmc.runtime import cpu


def _cpuinfo(tmp_path, flags: str):
    p = tmp_path / "cpuinfo"
    p.write_text(f"processor\t: 0\nvendor_id\t: X\nflags\t\t: fpu sse2 avx2 {flags}\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    return str(p)


def test_cpu_flags_reads_the_first_processor(tmp_path):
    assert cpu.cpu_flags(_cpuinfo(tmp_path, "avx512f avx512_vnni")) == {"fpu", "sse2", "avx2", "avx512f", "avx512_vnni"}
    assert cpu.cpu_flags(str(tmp_path / "missing")) == frozenset()


AVX512 = "avx512f avx512bw avx512dq avx512vl"


@pytest.mark.parametrize("machine, flags, exact", [
    ("x86_64", f"{AVX512} avx512_vnni", True),          # Ice Lake and later, Zen 4
    ("x86_64", "avx_vnni", True),                       # Alder Lake (no AVX-512)
    ("x86_64", f"{AVX512} avx_vnni", False),            # MLAS's AVX-512 core kernel replaces the AVX-VNNI one
    ("x86_64", "avx512f avx512_vnni", False),           # no AVX-512 core set: MLAS never reaches its VNNI kernel
    ("x86_64", AVX512, False),                          # Skylake-X: u8 x s8 saturates
    ("x86_64", "", False),                              # AVX2 only
    ("AMD64", "", False),
    ("aarch64", "", True),                              # no x86 kernels, no rewrite
])
def test_u8s8_exact_follows_the_cpu(tmp_path, monkeypatch, machine, flags, exact):
    info = _cpuinfo(tmp_path, flags)
    monkeypatch.setattr(cpu.platform, "machine", lambda: machine)
    monkeypatch.setattr(cpu, "CPUINFO", info)
    monkeypatch.delenv(cpu.ENV, raising=False)
    cpu.u8s8_is_exact.cache_clear()
    assert cpu.u8s8_is_exact() is exact


@pytest.mark.parametrize("value, exact", [("vnni", True), ("u8u8", False), (" VNNI ", True)])
def test_environment_overrides_detection(monkeypatch, value, exact):
    monkeypatch.setenv(cpu.ENV, value)
    assert cpu.u8s8_is_exact() is exact


class _Options:
    def __init__(self):
        self.entries = {}

    def add_session_config_entry(self, k, v):
        self.entries[k] = v


@pytest.mark.parametrize("value, setting", [("vnni", "0"), ("u8u8", "1")])
def test_session_options_follow_the_answer(monkeypatch, value, setting):
    monkeypatch.setenv(cpu.ENV, value)
    so = _Options()
    cpu.int8_session_options(so)
    assert so.entries == {"session.x64quantprecision": setting}


@pytest.mark.parametrize("value", ["vnni", "u8u8"])
def test_seven_bit_weights_stay_on_the_u8s8_kernels(monkeypatch, value):
    """Codes in [-63, 63] (--weight-bits 7) cannot saturate u8 x s8: int8 weights on every CPU; 8-bit ones as the CPU allows."""
    monkeypatch.setenv(cpu.ENV, value)
    so = _Options()
    cpu.int8_session_options(so, 7)
    assert so.entries == {"session.x64quantprecision": "0"}
    assert cpu.u8s8_exact_for(7) and cpu.u8s8_exact_for(8) is (value == "vnni")


VNNI = cpu.vnni_kernels(cpu.cpu_flags())


@pytest.mark.skipif(not VNNI, reason="needs a CPU with VNNI (u8 x s8 saturates without)")
def test_vnni_and_u8u8_kernels_give_identical_logits(tmp_path, model_dirs, calib_words, monkeypatch):
    """On a VNNI CPU the int8 weights' u8 x s8 kernels and the uint8 rewrite compute the same
    integers: a W8A8 bundle's prefill and decode logits are bit-identical either way."""
    from conftest import CHUNK, MAX_CONTEXT

    from llmc.compile import compile_model
    from llmc.runtime import Session

    root = tmp_path / "npu"
    compile_model(str(model_dirs("llama")), root, target="npu", chunk=CHUNK, max_context=MAX_CONTEXT, calib_file=str(calib_words), calib_tokens=256)
    ids = [int(t) for t in np.random.default_rng(7).integers(4, 120, size=CHUNK + 5)]
    out = {}
    for kernels in ("vnni", "u8u8"):
        monkeypatch.setenv(cpu.ENV, kernels)
        cpu.u8s8_is_exact.cache_clear()
        s = Session(root)
        logits = s.prefill(ids, all_logits=True)
        out[kernels] = np.concatenate([logits, np.stack([s.decode(t) for t in ids[:6]])])
    assert np.array_equal(out["vnni"], out["u8u8"])


@pytest.mark.parametrize("kernels, shown", [("vnni", "u8s8"), ("u8u8", "u8u8")])
def test_bench_says_which_int8_kernels_ran(tmp_path, model_dirs, calib_words, monkeypatch, kernels, shown):
    import json

    from click.testing import CliRunner
    from conftest import CHUNK, MAX_CONTEXT

    from llmc.cli import cli
    from llmc.compile import compile_model

    root = tmp_path / "npu"
    compile_model(str(model_dirs("llama")), root, target="npu", chunk=CHUNK, max_context=MAX_CONTEXT, calib_file=str(calib_words), calib_tokens=256)
    monkeypatch.setenv(cpu.ENV, kernels)
    r = CliRunner().invoke(cli, ["bench", str(root), "--prompt-len", "12", "--new-tokens", "2", "--repeat", "1", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["int8_kernels"] == shown
    r = CliRunner().invoke(cli, ["bench", str(root), "--prompt-len", "12", "--new-tokens", "2", "--repeat", "1"])
    assert r.exit_code == 0 and ("VNNI" in r.output) == (kernels == "vnni"), r.output


@pytest.mark.parametrize("kernels", ["vnni", "u8u8"])
def test_runtime_sessions_keep_the_chosen_weight_type(tmp_path, model_dirs, calib_words, monkeypatch, kernels):
    """Every W8A8 matmul the runtime's CPU sessions run has int8 weights where the u8 x s8 kernels are
    exact and uint8 ones (ONNX Runtime's rewrite, asked for by the runtime) where they are not: the
    weights arrive through add_external_initializers, as in every bundle."""
    import onnx
    import onnxruntime as ort
    from conftest import CHUNK, MAX_CONTEXT

    from llmc.compile import compile_model
    from llmc.runtime import Session

    root = tmp_path / "npu"
    compile_model(str(model_dirs("llama")), root, target="npu", chunk=CHUNK, max_context=MAX_CONTEXT, calib_file=str(calib_words), calib_tokens=256)
    monkeypatch.setenv(cpu.ENV, kernels)
    real, seen = ort.InferenceSession, []

    def recording(model, so=None, *a, **kw):
        if so is not None:
            so.optimized_model_filepath = str(tmp_path / f"opt{len(seen)}.onnx")
            seen.append(so.optimized_model_filepath)
        return real(model, so, *a, **kw)

    monkeypatch.setattr(ort, "InferenceSession", recording)
    s = Session(root, provider="cpu")
    s.prefill(list(range(4, 4 + CHUNK + 3)))
    s.decode(7)
    want = onnx.TensorProto.INT8 if kernels == "vnni" else onnx.TensorProto.UINT8
    matmuls = 0
    for path in seen:
        g = onnx.load(path, load_external_data=False).graph
        types = {t.name: t.data_type for t in g.initializer}
        # no Add after an int8 matmul (bias, residual, shadow correction) was fused into a float Gemm
        # that dequantizes the weights on every call (cpu.DISABLED_OPTIMIZERS)
        assert not {"Gemm", "FusedGemm", "DequantizeLinear"} & {n.op_type for n in g.node}, path
        for n in g.node:
            if n.op_type == "MatMulIntegerToFloat":
                assert types[n.input[1]] == want, (path, n.name)
                matmuls += 1
    assert matmuls > 0
    assert s.int8_kernels == ("u8s8" if kernels == "vnni" else "u8u8")
