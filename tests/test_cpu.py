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


@pytest.mark.parametrize("machine, flags, exact", [
    ("x86_64", "avx512f avx512bw avx512_vnni", True),  # Ice Lake and later, Zen 4
    ("x86_64", "avx_vnni", True),                       # Alder Lake
    ("x86_64", "avx512f avx512bw", False),              # Skylake-X: u8 x s8 saturates
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


@pytest.mark.skipif(not any(f in cpu.cpu_flags() for f in cpu.VNNI_FLAGS), reason="needs a CPU with VNNI (u8 x s8 saturates without)")
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
