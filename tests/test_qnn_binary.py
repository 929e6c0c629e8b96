"""Reading QNN context binaries back (QNN System library of onnxruntime-qnn) and refusing ones that do
not hold what the manifest records."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import onnx
import pytest

from conftest import CHUNK, MAX_CONTEXT

pytest.importorskip("onnxruntime_qnn", reason="onnxruntime-qnn is not installed (pip install 'llmc[qnn]')")


def _copy(bundle: Path, tmp_path: Path) -> tuple[Path, dict, str]:
    """A copy of ``bundle``, its manifest and its (only) context binary's path."""
    out = tmp_path / "copy"
    shutil.copytree(bundle, out)
    m = json.loads((out / "manifest.json").read_text())
    return out, m, m["qnn"]["binaries"][0]["files"][0]


def _rehash(bundle: Path, m: dict, rel: str) -> None:
    """Record ``rel``'s new bytes in the manifest, as an edit that also rewrites the hashes would."""
    from conftest import write_manifest
    from llmc.runtime.manifest import sha256_file

    m["files"][rel]["sha256"] = sha256_file(bundle / rel)
    m["files"][rel]["bytes"] = (bundle / rel).stat().st_size
    write_manifest(bundle, m)


def _edit(bundle: Path, rel: str, old: bytes, new: bytes) -> None:
    """Replace the first occurrence of ``old`` in ``rel`` (same length): the copy the binary's metadata is read from."""
    data = (bundle / rel).read_bytes()
    assert len(old) == len(new) and old in data
    i = data.index(old)
    (bundle / rel).write_bytes(data[:i] + new + data[i + len(old):])


def test_binary_info_matches_manifest(qnn_bundle):
    """The binary's graphs are the manifest's instances, by the EP-context node's name, with the QDQ graph's io."""
    import onnx

    from llmc.runtime.qnn_binary import read_binary_info
    from llmc.runtime import load_manifest

    m = load_manifest(qnn_bundle)
    q = m["qnn"]
    b = q["binaries"][0]
    info = read_binary_info(qnn_bundle / b["files"][0])
    assert info.backend_id == 6 and info.build_id.startswith("v2.") and info.build_id == q["qnn_sdk_build"] == b["info"]["build_id"]
    assert info.core_api == q["qnn_core_api"] and info.soc_model == 57 and info.htp_arch == 75
    assert b["info"]["soc_model"] == 57 and b["info"]["htp_arch"] == "v75"
    assert len(info.graphs) == len(b["graphs"]) == len(b["info"]["graphs"])
    for inst in b["graphs"]:
        name, rows = inst.split(".r")
        e = q["graphs"][name][rows]
        ctx = onnx.load(qnn_bundle / e["context"], load_external_data=False).graph
        qnn_graph = next(n.name for n in ctx.node if n.op_type == "EPContext")
        recorded = b["info"]["graphs"][inst]
        assert recorded["qnn_graph"] == qnn_graph
        g = info.graph(qnn_graph)
        qdq = onnx.load(qnn_bundle / e["qdq"], load_external_data=False).graph
        for kind, values, tensors in (("inputs", qdq.input, g.inputs), ("outputs", qdq.output, g.outputs)):
            assert [t.name for t in tensors] == [v.name for v in values]
            assert all(t.name.startswith(e["io_prefix"]) for t in tensors)
            assert [list(t.dims) for t in tensors] == [[d.dim_value for d in v.type.tensor_type.shape.dim] for v in values]
            assert {t.dtype for t in tensors} == {"FLOAT_32"}  # the QDQ graphs take and give float; uint16 inside
            assert recorded[kind] == [[t.name[len(e["io_prefix"]):], list(t.dims), t.dtype] for t in tensors]


def test_inspect_shows_and_rechecks_binaries(qnn_bundle):
    from click.testing import CliRunner

    from llmc.cli import cli
    from llmc.runtime import load_manifest

    q = load_manifest(qnn_bundle)["qnn"]
    r = CliRunner().invoke(cli, ["inspect", str(qnn_bundle)])
    assert r.exit_code == 0, r.output
    assert f"QNN {q['qnn_sdk_build']} (core API {q['qnn_core_api']}), SoC model 57, HTP v75, {len(q['binaries'][0]['graphs'])} graphs" in r.output
    assert "re-read: each binary holds the graphs, tensors and SoC the manifest records" in r.output
    r = CliRunner().invoke(cli, ["inspect", str(qnn_bundle), "--json"])
    s = json.loads(r.output)["qnn"]
    assert s["qnn_sdk_build"] == q["qnn_sdk_build"] and s["binaries"][0]["info"]["htp_arch"] == "v75"
    assert s["binaries_check"].startswith("re-read")
    r = CliRunner().invoke(cli, ["inspect", str(qnn_bundle), "--no-verify"])
    assert r.exit_code == 0 and "not re-read (--no-verify)" in r.output


def test_renamed_graph_is_refused(qnn_bundle, tmp_path, monkeypatch):
    """A graph renamed inside the binary, with the file's hash and the manifest's digest rewritten to match: the
    SHA-256 checks pass, the binary check refuses it (check_binaries, inspect, the runtime on the device)."""
    from click.testing import CliRunner

    from llmc.runtime.qnn_binary import QnnBinaryError, check_binaries
    from llmc.cli import cli
    from llmc.runtime import BundleError, Session, load_manifest

    b, m, rel = _copy(qnn_bundle, tmp_path)
    graph = m["qnn"]["binaries"][0]["info"]["graphs"]["block01.r8"]["qnn_graph"]
    renamed = graph[:-1] + ("7" if graph[-1] != "7" else "8")
    _edit(b, rel, graph.encode(), renamed.encode())
    _rehash(b, m, rel)
    q = load_manifest(b)["qnn"]  # the hashes match
    for graphs in (True, False):  # against the QDQ and EP-context graphs, and against the recorded info alone
        with pytest.raises(QnnBinaryError, match=f"binary {rel}: has no graph {graph}, which instance block01.r8 runs; "
                                                 f"it holds graph {renamed} instead") as e:
            check_binaries(b, q, load_onnx=onnx.load if graphs else None)
        assert e.value.exit_code == 5 and "tampered" in e.value.hint
    r = CliRunner().invoke(cli, ["inspect", str(b)])
    assert r.exit_code == 5 and f"has no graph {graph}" in r.output and "block01.r8" in r.output, r.output
    # the runtime checks each binary before it loads a context of it (on the device: not the x86_64 simulator's route)
    import llmc.runtime.qnn as rq

    monkeypatch.setattr(rq, "on_simulator", lambda: False)
    with pytest.raises(BundleError, match=f"has no graph {graph}"):
        Session(b, provider="qnn")


def test_changed_tensor_name_is_refused(qnn_bundle, tmp_path):
    from llmc.runtime.qnn_binary import QnnBinaryError, check_binaries
    from llmc.runtime import load_manifest

    b, m, rel = _copy(qnn_bundle, tmp_path)
    old = b"block00.r8/model.embed_tokens.q"
    _edit(b, rel, old, b"block00.r8/model.embed_tokens.x")
    _rehash(b, m, rel)
    with pytest.raises(QnnBinaryError, match=r"block00\.r8\) has inputs \['block00\.r8/model\.embed_tokens\.x'\] where the bundle "
                                             r"expects \['block00\.r8/model\.embed_tokens\.q'\]"):
        check_binaries(b, load_manifest(b)["qnn"])


def test_corrupt_binary_is_a_clear_error(qnn_bundle, tmp_path):
    """Flipped bytes in the metadata, a truncated file: a named error, never a crash of this process. (Byte 1326
    of this binary makes QNN 2.51's System library segfault; the reading runs in a child process for that.)"""
    from llmc.runtime.qnn_binary import QnnBinaryError, read_binary_info

    src = (qnn_bundle / json.loads((qnn_bundle / "manifest.json").read_text())["qnn"]["binaries"][0]["files"][0]).read_bytes()
    for what, data in (("flip3", src[:3] + bytes([src[3] ^ 0xFF]) + src[4:]), ("flip1326", src[:1326] + bytes([src[1326] ^ 0xFF]) + src[1327:]),
                       ("truncated", src[:len(src) // 2]), ("empty", b"")):
        p = tmp_path / f"{what}.bin"
        p.write_bytes(data)
        with pytest.raises(QnnBinaryError, match=f"{p} is (not a readable|empty, not a) QNN context binary") as e:
            read_binary_info(p)
        assert e.value.hint and "Traceback" not in str(e.value)


def test_corrupt_binary_refused_by_inspect(qnn_bundle, tmp_path):
    from click.testing import CliRunner

    from llmc.cli import cli

    b, m, rel = _copy(qnn_bundle, tmp_path)
    data = bytearray((b / rel).read_bytes())
    data[3] ^= 0xFF
    (b / rel).write_bytes(bytes(data))
    r = CliRunner().invoke(cli, ["inspect", str(b)])
    assert r.exit_code == 5 and "SHA-256" in r.output  # the hash catches it first
    _rehash(b, m, rel)
    r = CliRunner().invoke(cli, ["inspect", str(b)])
    assert r.exit_code == 5 and f"{rel} is not a readable QNN context binary" in r.output, r.output


def test_not_a_binary(qnn_bundle, tmp_path):
    from llmc.runtime.qnn_binary import QnnBinaryError, read_binary_info

    for name, data in (("model.bin", (qnn_bundle / "qnn" / "block00.r8.onnx").read_bytes()), ("text.bin", b"not a context binary\n" * 64)):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(QnnBinaryError, match=f"{tmp_path / name} is not a readable QNN context binary: the QNN System library reports"):
            read_binary_info(tmp_path / name)
    with pytest.raises(QnnBinaryError, match="missing"):
        read_binary_info(tmp_path / "absent.bin")


def test_soc_arch_shape_and_dtype_mismatches(qnn_bundle, monkeypatch):
    """What the reader says, altered: each mismatch names the binary and, for a graph's tensors, the graph."""
    from llmc.runtime import qnn_binary
    from llmc.runtime import load_manifest

    q = load_manifest(qnn_bundle)["qnn"]
    rel = q["binaries"][0]["files"][0]
    real = qnn_binary.read_binary_info(qnn_bundle / rel)
    head = q["binaries"][0]["info"]["graphs"]["head.r8"]["qnn_graph"]

    def with_head_output(**kw):
        def change(g):
            if g.name != head:
                return g
            return dataclasses.replace(g, outputs=(dataclasses.replace(g.outputs[0], **kw),) + g.outputs[1:])
        return dataclasses.replace(real, graphs=tuple(change(g) for g in real.graphs))

    cases = [(dataclasses.replace(real, soc_model=43), "prepared for SoC model 43, the bundle is for 8gen3 \\(SoC model 57\\)"),
             (dataclasses.replace(real, htp_arch=79), "prepared for HTP v79, the bundle is for 8gen3 \\(HTP v75\\)"),
             (dataclasses.replace(real, build_id="v2.99.0.0"), "written by QNN v2.99.0.0"),
             (with_head_output(dims=(8, 65)), f"graph {head} \\(head.r8\\): output head.r8/\\S+ has shape \\[8, 65\\]"),
             (with_head_output(dtype="UFIXED_POINT_16"), f"graph {head} \\(head.r8\\): output \\S+ has data type UFIXED_POINT_16, the bundle expects"),
             (dataclasses.replace(real, graphs=real.graphs + (dataclasses.replace(real.graphs[0], name="extra"),)),
              "holds graph extra that no instance of the bundle runs")]
    for info, msg in cases:
        monkeypatch.setattr(qnn_binary, "read_binary_infos", lambda paths, timeout=0, info=info: [info])
        with pytest.raises(qnn_binary.QnnBinaryError, match=f"QNN context binary {rel}: {msg}"):
            qnn_binary.check_binaries(qnn_bundle, q)


def test_compile_fails_on_a_mismatched_binary(qnn_bundle, model_dirs, calib_words, tmp_path, monkeypatch):
    """emit_qnn reads back what the EP wrote: a binary whose graph lacks an output the QDQ graph has fails the
    compile, naming the binary and the graph. (The EP's shards are taken from the fixture's bundle of the same
    model and options, so no QNN preparation runs again.)"""
    from llmc.backends import qnn_backend
    from llmc.runtime import qnn_binary
    from llmc.compile import compile_model

    def copy_shard(root, weights, soc, si, items, *a, **kw):
        for _, _, _, ctx_rel, _ in items:
            shutil.copy(qnn_bundle / ctx_rel, root / ctx_rel)
        for f in (qnn_bundle / "qnn" / "ctx" / f"shard{si:02d}").glob("*.bin"):
            shutil.copy(f, root / "qnn" / "ctx" / f"shard{si:02d}" / f.name)

    real = qnn_binary.read_binary_infos

    def dropped_output(paths, timeout=300.0):
        out = []
        for info in real(paths, timeout):
            g = next(g for g in info.graphs if g.inputs[0].name.startswith("block02.r1/"))
            out.append(dataclasses.replace(info, graphs=tuple(dataclasses.replace(x, outputs=x.outputs[:-1]) if x is g else x
                                                              for x in info.graphs)))
        return out

    monkeypatch.setattr(qnn_backend, "_run_shard_process", copy_shard)
    monkeypatch.setattr(qnn_binary, "read_binary_infos", dropped_output)
    with pytest.raises(qnn_backend.QnnBackendError, match=r"does not match its graphs: QNN context binary qnn/ctx/shard00/\S+\.bin: "
                                                          r"graph QNNExecutionProvider_\S+ \(block02\.r1\) has outputs") as e:
        compile_model(str(model_dirs("llama")), tmp_path / "b", target="npu", soc="8gen3", chunk=CHUNK, max_context=MAX_CONTEXT,
                      calib_tokens=512, calib_file=str(calib_words), placement="npu")
    assert e.value.exit_code == 9 and "onnxruntime_qnn" in e.value.hint
    monkeypatch.setattr(qnn_binary, "read_binary_infos", real)  # the same compile, read back as written: it passes
    compile_model(str(model_dirs("llama")), tmp_path / "ok", target="npu", soc="8gen3", chunk=CHUNK, max_context=MAX_CONTEXT,
                  calib_tokens=512, calib_file=str(calib_words), placement="npu")
    assert json.loads((tmp_path / "ok" / "manifest.json").read_text())["qnn"]["binaries"][0]["info"]["graphs"]


def test_missing_onnxruntime_qnn_is_said(monkeypatch, tmp_path):
    import sys

    from llmc.runtime.qnn_binary import QnnBinaryError, read_binary_info

    (tmp_path / "x.bin").write_bytes(b"x")
    monkeypatch.setitem(sys.modules, "onnxruntime_qnn", None)
    with pytest.raises(QnnBinaryError, match="needs onnxruntime-qnn, which is not installed") as e:
        read_binary_info(tmp_path / "x.bin")
    assert "llmc[qnn]" in e.value.hint


def test_binary_of_a_package_running_part_of_it_passes(qnn_bundle):
    """A device package runs some of a shared binary's instances (the rest on the CPU): the graphs it does not run
    are the recorded ones, not unexpected graphs; a graph no one recorded is still refused."""
    import copy

    from llmc.runtime import qnn_binary
    from llmc.runtime import load_manifest

    q = copy.deepcopy(load_manifest(qnn_bundle)["qnn"])
    for name in [n for i, n in enumerate(sorted(q["graphs"])) if i % 2]:
        del q["graphs"][name]
    for graphs in (True, False):
        qnn_binary.check_binaries(qnn_bundle, q, load_onnx=onnx.load if graphs else None)
    # a manifest that no longer lists head.r1 in the binary: its graph there is one no one recorded
    del q["binaries"][0]["info"]["graphs"]["head.r1"]
    q["binaries"][0]["graphs"].remove("head.r1")
    q["graphs"].pop("head", None)
    with pytest.raises(qnn_binary.QnnBinaryError, match="that no instance of the bundle runs"):
        qnn_binary.check_binaries(qnn_bundle, q, load_onnx=None)
