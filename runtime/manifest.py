"""Reading and checking a bundle's ``manifest.json``.

The runtime owns the manifest schema; the compiler writes what this module
reads. Before anything runs, :func:`load_manifest` checks the schema version,
that the manifest itself is unchanged (``manifest_sha256``, a digest of the rest
of it), that every path stays inside the bundle, and the SHA-256 of every file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from llmc.runtime.errors import BundleError

# The version bundles are written with, and the versions this runtime reads. 2: a BlockQLinear or
# BlockEmbedding may have no offsets (symmetric codes), and the tokenizer section may carry
# special_tokens; a runtime that reads only 1 refuses such bundles instead of failing inside them.
# 3: W8A8 weights are int8 (zero point 0), not uint8 + 128; a runtime before 3 would run them on
# u8 x s8 kernels that saturate on x86 CPUs without VNNI (llmc.runtime.cpu), so it refuses them.
# 4: a --cpu-kernels native decode graph may feed ai.llmc.DecodeAttention [rows, F] (no leading 1) and give
# ai.llmc.BlockQMatMul residual and norm inputs; a runtime before 4 builds a kernel library that takes none, so it
# refuses them instead of failing when ONNX Runtime loads or runs the graph.
# 5: a --cpu-kernels native one-row graph may run its W8A8 projections as ai.llmc.W8A8MatMul, which a runtime before
# 5 does not build, so it refuses them.
# 6: a --cpu-kernels native one-row graph's W8A8MatMul may compute the SwiGLU before it (attributes gate and up, x the
# gate/up projection's result), which the kernel of a runtime before 6 does not, so it refuses them.
# 7: a --cpu-kernels native graph of more than one row may have an ai.llmc.ShadowCorrection that computes the SwiGLU
# after it (attributes gate, up and width, a second output of codes), which the kernel of a runtime before 7 does not,
# so it refuses them.
# 8: a ShadowOutliers reads its outliers' rows from int8 codes (weights codes, scale, hot_delta; attribute
# w_zero_point) and an embedding may be a QEmbedding; a runtime before 8 refuses them. This runtime refuses the float
# tables (weight_t) of the corrections before 8 by name (Session), and reads those bundles' other steps.
SCHEMA_VERSION = 8
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8)
MANIFEST = "manifest.json"
# A weight's part of a bundle (its table entry's "part", llmc.compile.weight_parts), for `llmc inspect`'s sizes.
WEIGHT_PARTS = ("codes", "shadow", "embedding", "head", "float")


def weight_part_bytes(manifest: dict) -> dict[str, int]:
    """Bytes per part of a bundle: its weights by ``part`` (``unlabelled`` for a manifest without parts) and its
    QNN context binaries, from the manifest's tables."""
    out = dict.fromkeys(WEIGHT_PARTS, 0)
    for w in manifest["weights"].values():
        part = w.get("part", "unlabelled")
        out[part] = out.get(part, 0) + int(w["nbytes"])
    q = manifest.get("qnn") or {}
    out["context binaries"] = sum(manifest["files"][f]["bytes"] for b in q.get("binaries", []) for f in b["files"] if f in manifest["files"])
    return out


def sha256_file(path: Path, block: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(block)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def manifest_digest(manifest: dict[str, Any]) -> str:
    """SHA-256 of the manifest's canonical JSON, without its own ``manifest_sha256`` entry."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def resolve_inside(bundle: Path, rel: str) -> Path:
    """``bundle / rel``, refusing absolute paths and paths that leave the bundle."""
    if not isinstance(rel, str) or not rel or rel.startswith(("/", "\\")) or Path(rel).is_absolute():
        raise BundleError(f"{bundle}: manifest path {rel!r} is not a relative path inside the bundle", hint="the bundle was edited by hand or is corrupt; recompile it")
    root = bundle.resolve()
    p = (root / rel).resolve()
    if p != root and root not in p.parents:
        raise BundleError(f"{bundle}: manifest path {rel!r} points outside the bundle", hint="refusing to read it; recompile the bundle")
    return p


def map_weights(bundle: str | Path, table: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Read-only numpy views of every weight in ``table``, one memory map per file."""
    import numpy as np

    bundle = Path(bundle)
    maps: dict[str, Any] = {}
    out = {}
    for name, w in table.items():
        rel = w["file"]
        if rel not in maps:
            maps[rel] = np.memmap(resolve_inside(bundle, rel), dtype=np.uint8, mode="r")
        buf = maps[rel]
        off, nbytes, dtype = int(w["offset"]), int(w["nbytes"]), np.dtype(w["dtype"])
        if off + nbytes > buf.size:
            raise BundleError(f"{bundle}: weight {name} lies past the end of {rel}", hint="the bundle is corrupt; recompile it")
        out[name] = np.frombuffer(buf, dtype=dtype, count=nbytes // dtype.itemsize, offset=off).reshape(w["shape"])
    return out


# what reading a manifest of the right version but the wrong shape raises
SHAPE_ERRORS = (KeyError, TypeError, ValueError, IndexError, AttributeError, StopIteration, ZeroDivisionError)


def shape_error(bundle: str | Path, e: Exception) -> BundleError:
    """The named error for a manifest that does not describe a bundle this llmc can use (``e`` one of ``SHAPE_ERRORS``)."""
    return BundleError(f"{bundle}: manifest.json does not describe a bundle this llmc can use ({type(e).__name__}: {e})",
                       hint="the manifest was edited or made by another llmc; recompile the bundle")


def _check_layout(bundle: Path, m: dict[str, Any]) -> None:
    """The manifest's top-level entries have the types and ranges the runtime relies on."""
    def bad(what: str) -> BundleError:
        return BundleError(f"{bundle}: manifest.json {what}", hint="the manifest was edited or is corrupt; recompile the bundle")

    for key, kind in (("program", list), ("graphs", dict), ("weights", dict), ("io", dict), ("model", dict)):
        if not isinstance(m.get(key), kind):
            raise bad(f"has no {key} {kind.__name__}")
    vocab = m["model"].get("vocab_size")
    if vocab is not None and (not isinstance(vocab, int) or vocab < 1):
        raise bad(f"says vocab_size {vocab!r}")
    chunk, ctx = m.get("chunk"), m.get("max_context")
    if not isinstance(chunk, int) or not isinstance(ctx, int) or not 1 <= chunk <= ctx:
        raise bad(f"says chunk {chunk!r} and max_context {ctx!r}; they must be whole numbers with 1 <= chunk <= max_context")


def load_manifest(bundle: str | Path, verify: bool = True) -> dict[str, Any]:
    bundle = Path(bundle)
    mpath = bundle / MANIFEST
    if not bundle.is_dir():
        raise BundleError(f"bundle {bundle} does not exist or is not a directory", hint="compile one with `llmc compile MODEL -o DIR`")
    if not mpath.is_file():
        raise BundleError(f"{bundle} has no {MANIFEST}, so it is not an llmc bundle", hint="compile one with `llmc compile MODEL -o DIR`")
    try:
        manifest = json.loads(mpath.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise BundleError(f"{mpath} is not valid JSON: {e}", hint="the bundle is corrupt; recompile it") from e
    version = manifest.get("schema_version") if isinstance(manifest, dict) else None
    if version not in READABLE_VERSIONS:
        raise BundleError(
            f"{bundle}: manifest schema version {version!r}, this runtime reads versions {', '.join(map(str, READABLE_VERSIONS))}",
            hint="recompile the bundle with this version of llmc, or run it with the llmc that built it",
        )
    try:
        digest = manifest.get("manifest_sha256")  # bundles compiled before the digest existed have none
        if digest is not None and digest != manifest_digest(manifest):
            raise BundleError(f"{mpath} was changed after the bundle was compiled (it does not match its manifest_sha256)",
                              hint="refusing to run it; recompile the bundle or restore the original manifest.json")
        _check_layout(bundle, manifest)
        files = manifest.get("files")
        if not isinstance(files, dict) or not files:
            raise BundleError(f"{bundle}: the manifest lists no files", hint="the bundle is corrupt; recompile it")
        for rel, meta in sorted(files.items()):
            p = resolve_inside(bundle, rel)
            if not p.is_file():
                raise BundleError(f"{bundle}: {rel} is missing", hint="copy the whole bundle directory, or recompile it")
            if p.stat().st_size != meta.get("bytes"):
                raise BundleError(f"{bundle}: {rel} has {p.stat().st_size} bytes, the manifest says {meta.get('bytes')}",
                                  hint="the file was truncated or modified; recompile the bundle")
            if verify and sha256_file(p) != meta.get("sha256"):
                raise BundleError(f"{bundle}: {rel} does not match its SHA-256 in the manifest (tampered or corrupt)",
                                  hint="refusing to run it; recompile the bundle or restore the original file")
        # Every path the runtime will open must be one of the checked files.
        referenced = [w["file"] for w in manifest.get("weights", {}).values()]
        for g in manifest.get("graphs", {}).values():
            referenced += [inst["file"] for inst in g["instances"].values() if "file" in inst]  # a package omits some
        for g in (manifest.get("mlir") or {}).values():
            referenced += [inst["file"] for inst in g.values()]
        for g in ((manifest.get("qnn") or {}).get("graphs") or {}).values():
            for inst in g.values():
                referenced += [inst[k] for k in ("qdq", "context", "binary") if k in inst]
        if "offload" not in manifest and any(g.get("streamed") for g in manifest.get("graphs", {}).values()):
            raise BundleError(f"{bundle}: graphs take streamed weights as inputs, but the manifest has no offload section",
                              hint="the manifest was edited or truncated; recompile the bundle")
        tok = manifest.get("tokenizer") or {}
        if tok.get("file"):
            referenced.append(tok["file"])
        for rel in referenced:
            resolve_inside(bundle, rel)
            if rel not in files:
                raise BundleError(f"{bundle}: {rel} is used but not covered by the manifest's hashes", hint="the bundle is corrupt; recompile it")
    except SHAPE_ERRORS as e:  # a manifest of the right version, wrongly shaped
        raise shape_error(bundle, e) from e
    return manifest
