"""Bundle integrity: determinism, atomic writes, hashes, paths, schema version."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import CHUNK, MAX_CONTEXT, write_manifest


def _files(d):
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_rebuild_is_byte_identical(model_dirs, bundles, tmp_path):
    from llmc.compile import compile_model

    first = bundles("qwen2")
    second = tmp_path / "again"
    compile_model(str(model_dirs("qwen2")), second, chunk=CHUNK, max_context=MAX_CONTEXT)
    a, b = _files(first), _files(second)
    assert a.keys() == b.keys()
    assert [k for k in a if a[k] != b[k]] == []


def test_layout_and_graph_sharing(bundles):
    import onnx

    from llmc.runtime import load_manifest

    d = bundles("llama")
    m = load_manifest(d)
    assert {p.name for p in d.iterdir()} == {"manifest.json", "graphs", "weights", "tokenizer", "report.json"}
    assert list((d / "weights").iterdir()) == [d / "weights" / "weights.bin"]
    total = sum(w["nbytes"] for w in m["weights"].values())
    assert (d / "weights" / "weights.bin").stat().st_size < total + 64 * len(m["weights"])  # each weight once
    for name, g in m["graphs"].items():
        assert sorted(g["instances"]) == ["1", str(CHUNK)]  # the decode graph's chunk instance prefills
        for inst in g["instances"].values():
            model = onnx.load(d / inst["file"], load_external_data=False)
            dim = model.graph.input[0].type.tensor_type.shape.dim[0]
            # a CPU bundle's chunk instances take any row count up to C (a symbolic first dimension)
            assert (dim.dim_param, dim.dim_value) == (("rows", 0) if inst["rows"] == CHUNK else ("", inst["rows"]))
            assert inst.get("dynamic", False) == (inst["rows"] == CHUNK)
            ext = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
            assert {t.name for t in ext} == set(g["weights"])
            for t in ext:
                kv = {e.key: e.value for e in t.external_data}
                assert kv["location"] == "weights/weights.bin"
                assert int(kv["offset"]) == m["weights"][t.name]["offset"]


def _copy(bundles, tmp_path, family="llama"):
    d = tmp_path / "b"
    shutil.copytree(bundles(family), d)
    return d


def test_tampered_weights_refused_before_inference(bundles, tmp_path):
    from llmc.runtime import BundleError, Session

    d = _copy(bundles, tmp_path)
    w = d / "weights" / "weights.bin"
    data = bytearray(w.read_bytes())
    data[100] ^= 0xFF
    w.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"weights/weights.bin does not match its SHA-256"):
        Session(d)


def test_edited_manifest_refused(bundles, tmp_path):
    """An edit to manifest.json is caught by its digest. Edits that come with a matching digest (a
    hand-made or foreign manifest) still fail as named bundle errors, exit 5, never a traceback:
    missing sections, bad sizes, a graph file that is not ONNX (its hash updated too)."""
    import hashlib

    from click.testing import CliRunner

    from llmc.cli import cli
    from llmc.runtime import BundleError, Session

    d = _copy(bundles, tmp_path)
    m = json.loads((d / "manifest.json").read_text())
    edited = dict(m, chunk=m["chunk"] + 1)
    (d / "manifest.json").write_text(json.dumps(edited))
    with pytest.raises(BundleError, match="manifest.json was changed after the bundle was compiled"):
        Session(d)

    def resealed(edit, name):
        out = tmp_path / name
        shutil.copytree(d, out)
        mm = json.loads(json.dumps(m))
        edit(mm, out)
        write_manifest(out, mm)
        return out

    def garbage_graph(mm, out):
        f = mm["graphs"][mm["decode_graph"]]["instances"]["1"]["file"]
        (out / f).write_bytes(b"not a model")
        mm["files"][f] = {"bytes": 11, "sha256": hashlib.sha256(b"not a model").hexdigest()}

    cases = {
        "no-program": (lambda mm, out: mm.pop("program"), "has no program list"),
        "chunk-0": (lambda mm, out: mm.update(chunk=0), "chunk 0 and max_context"),
        "graphs-list": (lambda mm, out: mm.update(graphs=[]), "has no graphs dict"),
        "bad-dtype": (lambda mm, out: next(iter(mm["weights"].values())).update(dtype="float99"), "does not describe a bundle"),
        "bad-decode-graph": (lambda mm, out: mm.update(decode_graph="nope"), "does not describe a bundle"),
        "garbage-graph": (garbage_graph, "ONNX Runtime cannot load graphs/decode_model.r1.onnx"),
    }
    def unsealed(mm, out):  # as a manifest of a bundle compiled before the digest, edited
        mm.pop("manifest_sha256")
        mm["graphs"][mm["decode_graph"]].pop("instances")

    out = tmp_path / "unsealed"
    shutil.copytree(d, out)
    mm = json.loads(json.dumps(m))
    unsealed(mm, out)
    (out / "manifest.json").write_text(json.dumps(mm))
    for args in (["run", str(out), "--prompt-ids", "5,6"], ["inspect", str(out)]):
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 5 and "does not describe a bundle" in r.output and "hint:" in r.output, (args[0], r.output)
    for name, (edit, message) in cases.items():
        out = resealed(edit, name)
        with pytest.raises(BundleError, match=message):
            Session(out)
        r = CliRunner().invoke(cli, ["run", str(out), "--prompt-ids", "5,6", "--max-new-tokens", "2"])
        assert r.exit_code == 5 and "hint:" in r.output, (name, r.output)
        if name in ("no-program", "bad-decode-graph", "graphs-list"):
            r = CliRunner().invoke(cli, ["inspect", str(out)])
            assert r.exit_code == 5 and "hint:" in r.output, (name, r.output)


def test_missing_file_refused(bundles, tmp_path):
    from llmc.runtime import BundleError, Session

    d = _copy(bundles, tmp_path)
    (d / "graphs" / "head.r1.onnx").unlink()
    with pytest.raises(BundleError, match="head.r1.onnx is missing"):
        Session(d)


def test_path_outside_bundle_refused(bundles, tmp_path):
    from llmc.runtime import BundleError, Session

    d = _copy(bundles, tmp_path)
    m = json.loads((d / "manifest.json").read_text())
    m["files"]["../escape.bin"] = {"bytes": 1, "sha256": "0"}
    write_manifest(d, m)
    with pytest.raises(BundleError, match="outside the bundle"):
        Session(d)


def test_schema_version_checked(bundles, tmp_path):
    from llmc.runtime import BundleError, Session

    d = _copy(bundles, tmp_path)
    m = json.loads((d / "manifest.json").read_text())
    m["schema_version"] = 999
    write_manifest(d, m)
    with pytest.raises(BundleError, match="schema version 999, this runtime reads versions 1, 2"):
        Session(d)
    m["schema_version"] = 1  # bundles of earlier versions of llmc still run
    write_manifest(d, m)
    assert len(Session(d).generate([5, 6, 7], 3, stop_at_eos=False).token_ids) == 3


def test_failed_compile_leaves_nothing(model_dirs, tmp_path, monkeypatch):
    from llmc.backends import onnx_backend
    from llmc.compile import compile_model

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(onnx_backend, "emit_graphs", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        compile_model(str(model_dirs("llama")), tmp_path / "out", chunk=CHUNK, max_context=MAX_CONTEXT)
    assert list(tmp_path.iterdir()) == []


def test_full_disk_is_a_named_error_and_leaves_nothing(model_dirs, tmp_path, monkeypatch):
    """A full disk while writing the bundle: `llmc compile` names the directory, says what to do,
    exits with 7 and leaves no partial bundle; an -o that cannot be created is the same error."""
    import errno

    from click.testing import CliRunner

    from llmc.backends import onnx_backend
    from llmc.cli import cli

    real = onnx_backend.write_weights

    def full(graph, names, root):
        real(graph, list(names)[:1], root)  # some bytes are written before the disk fills up
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(onnx_backend, "write_weights", full)
    out = tmp_path / "bundles" / "b"
    r = CliRunner().invoke(cli, ["compile", str(model_dirs("llama")), "-o", str(out), "--chunk", str(CHUNK), "--max-context", str(MAX_CONTEXT)])
    assert r.exit_code == 7, r.output
    assert f"the disk of {out.parent} is full" in r.output and "hint: free space there" in r.output
    assert list((tmp_path / "bundles").iterdir()) == []
    (tmp_path / "file").write_text("")
    r = CliRunner().invoke(cli, ["compile", str(model_dirs("llama")), "-o", str(tmp_path / "file" / "b")])
    assert r.exit_code == 7 and "cannot create the bundle" in r.output, r.output
    assert "[1/6] load" not in r.output  # refused before the slow stages


def test_os_errors_around_the_bundle_are_output_errors(tmp_path, monkeypatch):
    """A parent that cannot be searched, and a full disk when the finished bundle is renamed into
    place, are OutputErrors too; the partial bundle is removed."""
    import errno
    from pathlib import Path

    from llmc.backends import bundle
    from llmc.errors import OutputError

    real_exists = Path.exists

    def unsearchable(self, *a, **k):
        if self == tmp_path / "locked" / "b":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_exists(self, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(Path, "exists", unsearchable)
        with pytest.raises(OutputError, match="cannot write the bundle .*Permission denied"):
            bundle.check_output(tmp_path / "locked" / "b")

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(bundle.os, "rename", full)
    with pytest.raises(OutputError, match="is full"):
        with bundle.atomic_directory(tmp_path / "out") as root:
            (root / "x").write_text("x")
    assert list(tmp_path.iterdir()) == []


def _wait(p, seconds: float):
    """``p``'s exit code, or (it still runs after ``seconds``) "still running" and its stderr once killed."""
    import subprocess

    try:
        return p.wait(seconds)
    except subprocess.TimeoutExpired:
        p.kill()
        return ("still running", p.communicate()[1].decode(errors="replace")[-2000:])


def test_killed_compiles_leave_nothing(model_dirs, tmp_path):
    """SIGTERM (a cancelled CI job, `timeout`) unwinds like Ctrl-C: exit 143 (Ctrl-C 130) and no partial
    bundle; under nohup SIGHUP stays ignored. What a compile killed outright (SIGKILL) left behind, the
    next compile of that output on this host removes; running compiles' and other outputs' stay."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from llmc.backends import bundle

    out = tmp_path / "b"
    code = ("import sys, time; from llmc.backends import onnx_backend; real = onnx_backend.write_weights\n"
            "def slow(*a, **k):\n    r = real(*a, **k); time.sleep(60); return r\n"
            "onnx_backend.write_weights = slow; from llmc.cli import main; sys.argv = sys.argv[:1] + sys.argv[1:]; main()")

    def signals(nohup: bool):
        # The compile starts as from a terminal: SIGINT and SIGTERM at their defaults, whatever this process has (a
        # suite started in the background by a shell without job control ignores SIGINT, and so would the compile:
        # the SIGINT case then failed in such CI runs). Under nohup, SIGHUP is ignored.
        def preexec():
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if nohup:
                signal.signal(signal.SIGHUP, signal.SIG_IGN)
        return preexec

    def start(nohup=False):
        p = subprocess.Popen([sys.executable, "-c", code, "compile", str(model_dirs("llama")), "-o", str(out), "--chunk", str(CHUNK),
                              "--max-context", str(MAX_CONTEXT), "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             preexec_fn=signals(nohup))
        deadline = time.time() + 120
        while not list(tmp_path.glob(".b.*.partial/weights/weights.bin")) and time.time() < deadline and p.poll() is None:
            time.sleep(0.2)
        assert list(tmp_path.glob(".b.*.partial")), p.communicate()
        return p

    for sig, code_ in ((signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, 130)):
        p = start()
        p.send_signal(sig)
        assert _wait(p, 60) == code_, (sig, p.communicate())
        assert list(tmp_path.iterdir()) == []
    p = start(nohup=True)  # nohup: a closed terminal does not stop the compile
    p.send_signal(signal.SIGHUP)
    time.sleep(1.0)
    assert p.poll() is None
    p.send_signal(signal.SIGTERM)
    assert _wait(p, 60) == 128 + signal.SIGTERM, p.communicate()
    assert list(tmp_path.iterdir()) == []

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = bundle._HOST
    (tmp_path / f".b.{host}-{dead.pid}.x1.partial" / "weights").mkdir(parents=True)  # a killed compile's leftovers
    kept = [f".b.{host}-{os.getpid()}.x2.partial",  # a compile that is running (this process)
            f".bb.{host}-{dead.pid}.x3.partial",  # another output's (bb)
            f".b.9.{host}-{dead.pid}.x4.partial",  # another output's (b.9), whose name starts like b's
            f".b.otherhost-{dead.pid}.x5.partial"]  # another host's, on a shared disk: its pid means nothing here
    for name in kept:
        (tmp_path / name).mkdir()
    with bundle.atomic_directory(out) as root:
        (root / "x").write_text("x")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["b", *kept])


def test_refuses_to_replace_foreign_directory(model_dirs, tmp_path):
    from llmc.compile import compile_model
    from llmc.errors import CompileError

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "precious.txt").write_text("keep me")
    with pytest.raises(CompileError, match="not an llmc bundle"):
        compile_model(str(model_dirs("llama")), tmp_path / "out", chunk=CHUNK, max_context=MAX_CONTEXT)
    assert (tmp_path / "out" / "precious.txt").read_text() == "keep me"
