"""Device packages: the files one device's run of a bundle reads, under a manifest of their own.

A bundle compiled with ``--target npu --soc S`` holds what every route needs: the
CPU instances of every graph, the fully quantized QDQ graphs the x86_64 route
prepares in-session, and the context binaries the device loads. ``llmc package
BUNDLE --device S -o DIR`` keeps what a generation on that device reads, as the
runtime itself decides it (:meth:`llmc.runtime.Session.planned_instances`):

* the context models and binaries of the graph instances the plan runs on the NPU;
* the CPU instances of the graphs it runs on the CPU (none of the NPU graphs');
* the weights the CPU side reads (op steps, CPU graphs), rewritten into a compact
  ``weights/weights.bin`` when the NPU's context binaries hold the others;
* the tokenizer.

The package's ``manifest.json`` is the bundle's, trimmed to those files and
re-hashed, with a ``package`` section: the device, SoC, HTP arch and QNN
``soc_model``, the ONNX Runtime and QNN versions the binaries need, the
bundle it was made from and the bytes per kind of file. The runtime runs a
package as it runs a bundle.

``contexts="unshared"`` prepares each NPU graph instance again as a context binary
of its own: bigger (an instance's weights are not shared with the others), but
loadable by the x86_64 HTP simulator, which cannot load weight-shared contexts.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from llmc.errors import CompileError
from llmc.runtime.manifest import load_manifest, map_weights, resolve_inside

log = logging.getLogger(__name__)

CONTEXTS = ("shared", "unshared")
ALIGN = 64  # weight offsets in the package's weights file, as in a bundle's


class PackageError(CompileError):
    """A package cannot be made from this bundle for this device (a usage error: exit 2)."""


@dataclass(frozen=True)
class PackageSummary:
    path: Path
    device: str
    files: int
    bytes_by_kind: dict[str, int]
    npu_instances: int
    cpu_instances: int
    dropped_bytes: int  # the bundle's bytes the package leaves out
    notes: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_kind.values())


# (path prefix, suffix, kind) of a package's files, first match wins
_KINDS = (("weights/", "", "weights"), ("qnn/", ".bin", "context binaries"), ("qnn/", "", "context models"),
          ("graphs/", "", "cpu graphs"), ("tokenizer/", "", "tokenizer"))


def _kind(rel: str) -> str:
    return next((kind for prefix, suffix, kind in _KINDS if rel.startswith(prefix) and rel.endswith(suffix)), "other")


def _platforms(device: str) -> tuple[str, ...]:
    """The operating systems the device's profile says the SoC ships in (none for a profile without them)."""
    from llmc.device_profile import ProfileError, load

    try:
        return load(device).platforms
    except ProfileError:
        return ()


def _weights_read_by_cpu(m: dict[str, Any], cpu_graphs: set[str]) -> set[str]:
    names: set[str] = set()
    for program in (m["program"], m.get("decode_program", [])):
        for st in program:
            if st["kind"] == "op":
                names.update(st.get("weights", {}).values())
    for g in cpu_graphs:
        spec = m["graphs"][g]
        names.update(spec["weights"])
        names.update(spec.get("fed", []))
        names.update(spec.get("streamed", []))
    return names


def _write_weights(bundle: Path, table: dict[str, dict[str, Any]], keep: set[str], root: Path) -> dict[str, dict[str, Any]]:
    """Copy the weights ``keep`` into ``root/weights/weights.bin`` (64-byte aligned, in their bundle order); their new table."""
    arrays = map_weights(bundle, {n: table[n] for n in keep})
    out: dict[str, dict[str, Any]] = {}
    (root / "weights").mkdir(parents=True, exist_ok=True)
    offset = 0
    with open(root / "weights" / "weights.bin", "wb") as f:
        for name in sorted(keep, key=lambda n: (table[n]["file"], int(table[n]["offset"]))):
            pad = (-offset) % ALIGN
            f.write(b"\0" * pad)
            offset += pad
            data = np.ascontiguousarray(arrays[name]).tobytes()
            f.write(data)
            out[name] = {**table[name], "file": "weights/weights.bin", "offset": offset}
            offset += len(data)
    return out


def _copy(bundle: Path, root: Path, rel: str) -> None:
    dst = root / rel
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(resolve_inside(bundle, rel), dst)


def prepare_unshared_contexts(bundle: Path, m: dict[str, Any], npu: list[tuple[str, int]], root: Path, soc: str) -> dict[str, dict[str, str]]:
    """Each NPU instance as an EP-context model with a binary of its own; (graph, rows) -> its context and binary paths."""
    import onnx

    from llmc.backends.qnn_backend import _run_shard_process

    q = m["qnn"]
    ctx_dir = root / "qnn" / "ctx"
    ctx_dir.mkdir(parents=True, exist_ok=True)
    items = []
    for name, rows in npu:
        names = [n for n in m["graphs"][name]["weights"] if n.endswith(".q8")]  # what the QDQ graph reads by name
        items.append((name, rows, q["graphs"][name][str(rows)]["qdq"], str(root / f"qnn/ctx/{name}.r{rows}_ctx.onnx"), names))
    if items:  # one process: without sharing, the EP keeps no context between the graphs
        _run_shard_process(bundle, m["weights"], soc, 0, items, share=False, job_dir=root)
    out: dict[str, dict[str, str]] = {}
    for name, rows in npu:
        ctx_rel = f"qnn/ctx/{name}.r{rows}_ctx.onnx"
        binary = None
        for node in onnx.load(root / ctx_rel, load_external_data=False).graph.node:
            for attr in node.attribute:
                if attr.name == "ep_cache_context":
                    binary = f"qnn/ctx/{attr.s.decode()}"
        out[f"{name}/{rows}"] = {"context": ctx_rel, "binary": binary}
    return out


def package_bundle(bundle: str | Path, device: str, out: str | Path, contexts: str = "shared") -> PackageSummary:
    """Write the package of ``bundle`` for ``device`` to ``out`` (atomically, as a bundle); return its summary."""
    from llmc.backends.bundle import atomic_directory, write_manifest
    from llmc.runtime import Session

    bundle = Path(bundle)
    if contexts not in CONTEXTS:
        raise PackageError(f"unknown --contexts {contexts!r}", hint="choose one of: " + ", ".join(CONTEXTS))
    m = load_manifest(bundle)
    if "package" in m:
        raise PackageError(f"{bundle} is already a package (for {m['package'].get('device')})", hint="package the bundle it was made from")
    q = m.get("qnn") or {}
    if not q.get("graphs"):
        why = q.get("skipped", "it was compiled without --soc")
        raise PackageError(f"{bundle} has no QNN context binaries to package: {why}", hint=f"compile it with --target npu --soc {device}")
    if q["soc"] != device:
        raise PackageError(f"{bundle} holds context binaries for {q['soc']} (HTP {q['htp_arch']}), not for {device}",
                           hint=f"compile the model with --target npu --soc {device}, and package that bundle")
    if "offload" in m:
        raise PackageError(f"{bundle} was compiled with a memory budget, which the QNN provider cannot honour (its context binaries hold every weight)",
                           hint="compile without --memory-budget to package it for the NPU")
    if Path(out).absolute() == bundle.absolute():
        raise PackageError("-o is the bundle itself", hint="write the package to another directory")
    planned = Session(bundle, provider="qnn", lazy=True, verify=False).planned_instances()  # verified above
    npu = sorted({(n, r) for n, r, on in planned if on})
    cpu = sorted({(n, r) for n, r, on in planned if not on})
    cpu_graphs = {n for n, _ in cpu}
    notes = []
    if not npu:
        notes.append(f"the plan places no graph on the NPU of {device}: the package runs every graph on the CPU (compile with --placement npu "
                     "to run them on the HTP)")
    keep_weights = _weights_read_by_cpu(m, cpu_graphs)
    with atomic_directory(out) as root:
        files: list[str] = []
        tok = m.get("tokenizer") or {}
        if tok.get("file"):
            _copy(bundle, root, tok["file"])
        weights = _write_weights(bundle, m["weights"], keep_weights, root) if keep_weights else {}
        graphs = {}
        for name, spec in m["graphs"].items():
            instances = {}
            for rows, inst in spec["instances"].items():
                inst = dict(inst)
                if (name, int(rows)) in cpu:
                    _copy(bundle, root, inst["file"])
                else:
                    inst.pop("file")
                instances[rows] = inst
            graphs[name] = {**spec, "instances": instances}
        qgraphs: dict[str, dict[str, Any]] = {}
        if contexts == "unshared":
            made = prepare_unshared_contexts(bundle, m, npu, root, device)
        for name, by_rows in q["graphs"].items():
            for rows, inst in by_rows.items():
                if (name, int(rows)) not in npu:
                    continue
                e = {"io_prefix": inst["io_prefix"]}
                if contexts == "unshared":
                    e.update(made[f"{name}/{rows}"])
                else:
                    e.update(context=inst["context"], binary=inst["binary"], shard=inst["shard"])
                    for rel in (inst["context"], inst["binary"]):
                        if not (root / rel).exists():
                            _copy(bundle, root, rel)
                qgraphs.setdefault(name, {})[rows] = e
        shipped_bins = {e["binary"] for by in qgraphs.values() for e in by.values()}
        if contexts == "unshared":
            binaries = [{"files": [b], "bytes": (root / b).stat().st_size, "graphs": [f"{n}.r{r}" for n, by in qgraphs.items()
                                                                                       for r, e in by.items() if e["binary"] == b]}
                        for b in sorted(shipped_bins)]
        else:
            binaries = [b for b in q["binaries"] if set(b["files"]) & shipped_bins]
        qnn = {k: v for k, v in q.items() if k not in ("graphs", "binaries", "x86_64_route")}
        qnn.update(graphs=qgraphs, binaries=binaries, contexts=contexts)
        if contexts == "unshared" and binaries:  # what the new binaries hold, read back, for the runtime's check
            import onnx

            from llmc.runtime.qnn_binary import check_binaries

            # checked against the bundle's QDQ graphs (absolute paths: they stay out of the package)
            with_qdq = {**qnn, "graphs": {n: {r: {**e, "qdq": str((bundle / q["graphs"][n][r]["qdq"]).absolute())} for r, e in by.items()}
                                          for n, by in qgraphs.items()}}
            for b, info in zip(binaries, check_binaries(root, with_qdq, load_onnx=onnx.load)["binaries"]):
                b["info"] = info
        by_kind: dict[str, int] = {}
        for p in sorted(root.rglob("*")):
            if p.is_file():
                rel = p.relative_to(root).as_posix()
                files.append(rel)
                by_kind[_kind(rel)] = by_kind.get(_kind(rel), 0) + p.stat().st_size
        package = {
            "device": device,
            "soc": q["soc"],
            "htp_arch": q["htp_arch"],
            "soc_model": q["soc_model"],
            "contexts": contexts,
            "platforms": list(_platforms(device)),
            "requires": {**q.get("versions", {}), **({"qnn_sdk_build": q["qnn_sdk_build"]} if "qnn_sdk_build" in q else {})},
            "bundle": {"manifest_sha256": m.get("manifest_sha256"), "files": len(m["files"]),
                       "bytes": sum(f["bytes"] for f in m["files"].values())},
            "npu_instances": [f"{n}.r{r}" for n, r in npu],
            "cpu_instances": [f"{n}.r{r}" for n, r in cpu],
            "bytes": by_kind,
            "notes": notes,
        }
        body = {k: v for k, v in m.items() if k not in ("files", "manifest_sha256", "schema_version", "mlir")}
        body.update(weights=weights, graphs=graphs, qnn=qnn, package=package)
        write_manifest(root, body)
        by_kind["manifest"] = (root / "manifest.json").stat().st_size
    total = sum(by_kind.values())
    return PackageSummary(Path(out).absolute(), device, len(files) + 1, by_kind, len(npu), len(cpu),
                          package["bundle"]["bytes"] - total, notes)
