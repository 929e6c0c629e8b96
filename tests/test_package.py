"""Device packages (llmc package): only the files a device's run reads, their own manifest, and the
runtime running them as it runs bundles."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

from conftest import write_manifest

pytest.importorskip("onnxruntime_qnn", reason="onnxruntime-qnn is not installed (pip install 'llmc[qnn]')")

PROMPT = [1, 5, 7, 9, 11, 13, 2, 40, 50, 60, 3]  # two chunks of 8


@pytest.fixture(scope="module")
def cpu_plan_bundle(qnn_bundle, tmp_path_factory):
    """The same bundle with a plan that places every graph on the CPU (the cost model's choice for small models)."""
    from llmc.runtime import load_manifest

    b = tmp_path_factory.mktemp("pkg-cpu") / "b"
    shutil.copytree(qnn_bundle, b)
    m = load_manifest(b)
    for phase in ("prefill", "decode"):
        m["placement"][phase] = {name: "cpu" for name in m["placement"][phase]}
    write_manifest(b, m)
    return b


def _tokens(bundle, provider: str) -> list[int]:
    from llmc.runtime import Session

    return Session(bundle, provider=provider).generate(PROMPT, 8, stop_at_eos=False).token_ids


def test_package_holds_only_the_files_the_device_reads(qnn_bundle, tmp_path):
    from llmc.backends.package import package_bundle
    from llmc.runtime import load_manifest

    s = package_bundle(qnn_bundle, "8gen3", tmp_path / "p")
    b, p = load_manifest(qnn_bundle), load_manifest(tmp_path / "p")  # the package's hashes check
    q = b["qnn"]
    expected = {"tokenizer/tokenizer.json", "weights/weights.bin"}
    for by_rows in q["graphs"].values():
        for inst in by_rows.values():
            expected |= {inst["context"], inst["binary"]}
    assert set(p["files"]) == expected  # no QDQ graph, no CPU instance of an NPU graph, no report
    assert not any(re.fullmatch(r"qnn/[^/]+\.onnx", f) or f.startswith("graphs/") for f in p["files"])
    pk = p["package"]
    assert (pk["device"], pk["soc"], pk["htp_arch"], pk["soc_model"], pk["contexts"]) == ("8gen3", "8gen3", "v75", 57, "shared")
    assert pk["platforms"] == ["android-aarch64"] and pk["requires"]["qnn_sdk_build"].startswith("v2.")
    assert set(pk["requires"]) >= {"onnxruntime", "onnxruntime_qnn"} and pk["bundle"]["manifest_sha256"] == b["manifest_sha256"]
    assert sum(pk["bytes"].values()) == sum(f["bytes"] for f in p["files"].values())
    assert s.npu_instances == sum(len(v) for v in q["graphs"].values()) and s.cpu_instances == 0
    assert s.total_bytes < sum(f["bytes"] for f in b["files"].values())


def test_package_weights_are_those_the_cpu_reads(qnn_bundle, tmp_path):
    from llmc.backends.package import package_bundle
    from llmc.runtime import load_manifest
    from llmc.runtime.manifest import map_weights

    package_bundle(qnn_bundle, "8gen3", tmp_path / "p")
    b, p = load_manifest(qnn_bundle), load_manifest(tmp_path / "p")
    op_weights = {w for st in b["program"] if st["kind"] == "op" for w in st.get("weights", {}).values()}
    assert set(p["weights"]) == op_weights  # every graph runs on the NPU: its context binaries hold the rest
    assert set(b["weights"]) - op_weights  # (the case is not vacuous: some weights only the NPU graphs read)
    ours, theirs = map_weights(tmp_path / "p", p["weights"]), map_weights(qnn_bundle, b["weights"])
    for name in p["weights"]:
        assert np.array_equal(ours[name], theirs[name]) and p["weights"][name]["offset"] % 64 == 0


def test_unshared_package_runs_like_the_bundle_and_reads_all_it_holds(qnn_bundle, tmp_path, monkeypatch):
    from llmc.backends.package import package_bundle
    from llmc.runtime import Session, load_manifest
    from llmc.runtime import session as session_module

    bundle_tokens = _tokens(qnn_bundle, "qnn")  # the x86_64 route: the QDQ graphs prepared in-session
    package_bundle(qnn_bundle, "8gen3", tmp_path / "p", contexts="unshared")
    p = load_manifest(tmp_path / "p")
    assert p["qnn"]["contexts"] == "unshared" and len(p["qnn"]["binaries"]) == sum(len(v) for v in p["qnn"]["graphs"].values())
    opened: set[str] = set()
    resolve, map_weights = session_module.resolve_inside, session_module.map_weights

    def recording_resolve(bundle, rel):
        opened.add(rel)
        return resolve(bundle, rel)

    def recording_map(bundle, table):
        opened.update(w["file"] for w in table.values())
        return map_weights(bundle, table)

    monkeypatch.setattr(session_module, "resolve_inside", recording_resolve)
    monkeypatch.setattr(session_module, "map_weights", recording_map)
    sess = Session(tmp_path / "p", provider="qnn")
    assert sess.generate(PROMPT, 8, stop_at_eos=False).token_ids == bundle_tokens  # the contexts themselves, on the simulator
    assert sess.graphs_run()["prefill"]["cpu"] == 0
    binaries = {inst["binary"] for by in p["qnn"]["graphs"].values() for inst in by.values()
                if inst["context"] in opened}  # ONNX Runtime opens a context model's binary
    assert opened | binaries == set(p["files"])


def test_shared_package_is_for_the_device(qnn_bundle, tmp_path):
    from click.testing import CliRunner

    from llmc.backends.package import package_bundle
    from llmc.cli import cli
    from llmc.runtime import ProviderError, Session

    package_bundle(qnn_bundle, "8gen3", tmp_path / "p")
    with pytest.raises(ProviderError, match="weight-shared context binaries load on the device"):
        Session(tmp_path / "p", provider="qnn", lazy=True)  # the simulator cannot load them, and no QDQ graph is there
    with pytest.raises(ProviderError, match="holds no CPU instance"):
        Session(tmp_path / "p", provider="cpu", lazy=True)
    r = CliRunner().invoke(cli, ["run", str(tmp_path / "p"), "--prompt-ids", "5", "--provider", "cpu"])
    assert r.exit_code == 10 and "package for 8gen3" in r.output and "Traceback" not in r.output


def test_package_of_a_cpu_plan_runs_on_the_cpu(cpu_plan_bundle, tmp_path):
    from click.testing import CliRunner

    from llmc.cli import cli
    from llmc.runtime import load_manifest

    r = CliRunner().invoke(cli, ["package", str(cpu_plan_bundle), "--device", "8gen3", "-o", str(tmp_path / "p"), "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output.strip().splitlines()[-1])
    assert summary["npu_instances"] == 0 and "no graph on the NPU" in summary["notes"][0]
    p = load_manifest(tmp_path / "p")
    assert not any(f.startswith("qnn/") for f in p["files"])
    assert {f for f in p["files"] if f.startswith("graphs/")} < {f for f in load_manifest(cpu_plan_bundle)["files"] if f.startswith("graphs/")}
    want = _tokens(cpu_plan_bundle, "cpu")
    assert _tokens(tmp_path / "p", "cpu") == want and _tokens(tmp_path / "p", "qnn") == want


def test_package_refusals(qnn_bundle, bundles, tmp_path):
    from click.testing import CliRunner

    from llmc.cli import cli

    def package(bundle, device, out):
        return CliRunner().invoke(cli, ["package", str(bundle), "--device", device, "-o", str(out)])

    r = package(qnn_bundle, "8elite", tmp_path / "a")
    assert r.exit_code == 2 and "context binaries for 8gen3" in r.output and "--soc 8elite" in r.output
    r = package(bundles("llama"), "8gen3", tmp_path / "b")
    assert r.exit_code == 2 and "no QNN context binaries" in r.output
    assert package(qnn_bundle, "8gen3", tmp_path / "p").exit_code == 0
    r = package(tmp_path / "p", "8gen3", tmp_path / "pp")
    assert r.exit_code == 2 and "already a package" in r.output
    other = tmp_path / "photos"
    other.mkdir()
    (other / "cat.jpg").write_bytes(b"\xff\xd8")
    r = package(qnn_bundle, "8gen3", other)
    assert r.exit_code == 2 and "not an llmc bundle" in r.output and (other / "cat.jpg").exists()
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists() and "Traceback" not in r.output
