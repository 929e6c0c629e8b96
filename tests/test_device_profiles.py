"""Device profiles and --soc names: every shipped number has a source, every --soc name is a
profile with QNN SoC facts, and this machine's QNN EP prepares a context for each SoC."""

from __future__ import annotations

import json

import pytest

NEW_SOCS = {"xelite": ("SC8380XP", "v73", 60), "xplus": ("SC8340XP", "v73", 120), "8elitegen5": ("SM8850", "v81", 87),
            "qcs6490": ("QCS6490", "v68", 93), "qcs8550": ("QCS8550", "v73", 66)}
OLD_SOCS = {"8gen2": ("SM8550", "v73", 43), "8gen3": ("SM8650", "v75", 57), "8elite": ("SM8750", "v79", 69)}


def test_every_shipped_profile_loads_with_sources():
    from llmc import device_profile

    names = [n for n in device_profile.available() if n != "host"]
    assert set(NEW_SOCS) | set(OLD_SOCS) <= set(names)
    for name in names:
        p = device_profile.load(name)
        raw = json.loads((device_profile.PROFILE_DIR / f"{name}.json").read_text())
        assert set(p.values) == set(raw["numbers"])
        for key in p.values:
            assert p.sources[key].strip(), (name, key)
        for key in device_profile.CPU_KEYS + device_profile.NPU_KEYS + device_profile.OTHER_KEYS + ("sync_s",):
            assert p[key] > 0, (name, key)
        assert p.has_npu and p.qnn and p.qnn["source"].strip() and p.platforms and p.platforms_source.strip(), name
        assert p.as_json()["qnn"] == raw["qnn"]


def test_soc_names_map_to_profiles():
    from click.testing import CliRunner

    from llmc.backends.qnn_backend import SOCS
    from llmc.cli import cli
    from llmc.device_profile import load

    assert {**OLD_SOCS, **NEW_SOCS}.keys() <= SOCS.keys()
    for name, (part, arch, model) in {**OLD_SOCS, **NEW_SOCS}.items():
        p = load(name)
        assert (p.qnn["part"], p.qnn["htp_arch"], p.qnn["soc_model"]) == (part, arch, model)
        assert SOCS[name] == (arch.lstrip("v"), str(model))
    r = CliRunner().invoke(cli, ["compile", "--help"])
    assert all(s in r.output for s in SOCS)
    r = CliRunner().invoke(cli, ["compile", "m", "-o", "x", "--target", "npu", "--soc", "9gen9"])
    assert r.exit_code == 2 and "9gen9" in r.output
    r = CliRunner().invoke(cli, ["profiles"])
    assert r.exit_code == 0 and "SC8380XP, HTP v73, soc_model 60" in r.output and "windows-arm64" in r.output
    r = CliRunner().invoke(cli, ["profiles", "qcs6490"])
    assert r.exit_code == 0 and "soc_model 93" in r.output
    assert "source:" in r.output and "linux-aarch64" in r.output


@pytest.mark.parametrize("bad", [
    {"qnn": {"part": "SM8750", "htp_arch": "79", "soc_model": 69, "source": "s"}},
    {"qnn": {"part": "SM8750", "htp_arch": "v79", "soc_model": "69", "source": "s"}},
    {"qnn": {"part": "SM8750", "htp_arch": "v79", "soc_model": 69, "source": ""}},
    {"qnn": {"part": "", "htp_arch": "v79", "soc_model": 69, "source": "s"}},
    {"qnn": {"part": "SM8750", "htp_arch": "v79", "soc_model": True, "source": "s"}},
    {"qnn": {"part": "SM8750", "htp_arch": "v79", "soc_model": 69, "source": "s", "extra": 1}},
    {"qnn": "SM8750"},
    {"platforms": {"names": ["ios"], "source": "s"}},
    {"platforms": {"names": [], "source": "s"}},
    {"platforms": {"names": ["linux-aarch64"]}},
    {"platforms": ["linux-aarch64"]},
])
def test_malformed_soc_facts_fail(tmp_path, bad):
    from llmc import device_profile
    from llmc.device_profile import ProfileError

    data = device_profile.load("8elite").as_json()
    data.update(bad)
    p = tmp_path / "p.json"
    p.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="qnn|platforms"):
        device_profile.load(str(p))


def test_soc_profiles_need_npu_numbers(tmp_path, monkeypatch):
    from llmc import device_profile
    from llmc.device_profile import ProfileError

    data = device_profile.load("8elite").as_json()
    data["numbers"] = {k: v for k, v in data["numbers"].items() if not k.startswith("npu.") and k != "sync_s"}
    (tmp_path / "cpuonly.json").write_text(json.dumps(data))
    assert not device_profile.load(str(tmp_path / "cpuonly.json")).has_npu  # a copied CPU-only profile still plans
    monkeypatch.setattr(device_profile, "PROFILE_DIR", tmp_path)
    with pytest.raises(ProfileError, match="no npu"):
        device_profile.qnn_socs()  # but cannot be a --soc target


def _binary_reader():
    for mod in ("llmc.runtime.qnn_binary", "llmc.backends.qnn_binary"):
        try:
            return __import__(mod, fromlist=["read_binary_info"]).read_binary_info
        except (ImportError, AttributeError):
            pass
    return None


@pytest.mark.parametrize("soc", sorted({**OLD_SOCS, **NEW_SOCS}))
def test_qnn_prepares_each_soc(soc, tmp_path):
    """The QNN EP prepares a uint16 QDQ MatMul for the SoC's soc_model into a context binary that
    is for that SoC: the binary's QNN system info names the soc_model and HTP arch, the HTP
    prepare configuration in it the part number."""
    pytest.importorskip("onnxruntime_qnn", reason="onnxruntime-qnn is not installed (pip install 'llmc[qnn]')")
    from llmc.backends.qnn_backend import check_soc, probe_soc

    part, arch, model = {**OLD_SOCS, **NEW_SOCS}[soc]
    got = probe_soc(soc, tmp_path)
    assert got["context"].is_file() and got["binary"].stat().st_size > 0
    assert (got["soc_type"], got["htp_arch"]) == (part, arch)
    read_binary_info = _binary_reader()
    if read_binary_info:  # the QNN System API's view of the same binary
        info = read_binary_info(got["binary"])
        assert (info.soc_model, info.htp_arch) == (model, int(arch[1:]))
    check_soc(soc)


def test_check_soc_refuses_an_unpreparable_soc(tmp_path, monkeypatch):
    """A SoC this QNN build cannot prepare for fails with the build's name and what the SoC needs."""
    pytest.importorskip("onnxruntime_qnn", reason="onnxruntime-qnn is not installed (pip install 'llmc[qnn]')")
    from llmc import device_profile
    from llmc.backends import qnn_backend

    data = device_profile.load("8elitegen5").as_json()
    data["qnn"] = {**data["qnn"], "soc_model": 9999, "requires": "QNN 9.99 or newer"}
    (tmp_path / "9gen9.json").write_text(json.dumps(data))
    monkeypatch.setattr(device_profile, "PROFILE_DIR", tmp_path)
    monkeypatch.setattr(qnn_backend, "SOCS", {"9gen9": ("81", "9999")})
    with pytest.raises(qnn_backend.QnnBackendError, match="cannot prepare") as e:
        qnn_backend.check_soc("9gen9")
    assert "QNN 2." in str(e.value) and "QNN 9.99 or newer" in e.value.hint
