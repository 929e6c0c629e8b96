"""Writing a bundle directory atomically, and its manifest.

Everything is written into a hidden temporary folder next to the destination
and renamed into place at the end, so an interrupted or failed compile never
leaves a half bundle. Output is deterministic: the same inputs give
byte-identical files (sorted JSON, no timestamps).
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import logging
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any, Iterator

from llmc.errors import CompileError, OutputError
from llmc.runtime.manifest import MANIFEST, SCHEMA_VERSION, manifest_digest, sha256_file

log = logging.getLogger(__name__)


_FULL = (errno.ENOSPC, errno.EDQUOT)


def check_output(out: str | Path) -> Path:
    """``out`` made absolute, once it is known that a bundle can be written there (compile_model
    checks this before its slow stages; atomic_directory again when it writes)."""
    out = Path(out).absolute()
    try:
        if out.exists() and not out.is_dir():
            raise CompileError(f"output {out} exists and is not a directory", hint="choose another -o")
        if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST).is_file():
            raise CompileError(f"output {out} is a non-empty directory that is not an llmc bundle; refusing to replace it",
                               hint="choose another -o, or remove the directory")
        existing = next(p for p in (out.parent, *out.parent.parents) if p.exists())
    except OSError as e:  # e.g. a parent directory that cannot be searched
        raise _output_error(out, e) from e
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise OutputError(f"cannot create the bundle {out}: {existing} is not a writable directory", hint="choose an -o in a writable directory")
    return out


def _output_error(out: Path, e: OSError) -> OutputError:
    if e.errno in _FULL:
        return OutputError(f"the disk of {out.parent} is full: writing {e.filename or 'the bundle'} failed ({e.strerror}); nothing was written",
                           hint="free space there, or choose an -o on a disk with room")
    return OutputError(f"cannot write the bundle {out}: {e.strerror} ({e.filename})", hint="choose an -o in a writable directory")


@contextlib.contextmanager
def atomic_directory(out: str | Path) -> Iterator[Path]:
    out = check_output(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _sweep_partials(out)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.{_HOST}-{os.getpid()}.", suffix=".partial", dir=out.parent))
    except OSError as e:
        raise _output_error(out, e) from e
    try:
        try:
            yield tmp
        except OSError as e:
            if e.errno in _FULL:
                raise _output_error(out, e) from e
            raise  # an error of the compile itself, not of the disk
        try:
            os.chmod(tmp, 0o755)
            if out.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
                os.rename(out, old / "bundle")
                os.rename(tmp, out)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, out)
        except OSError as e:
            raise _output_error(out, e) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname().split(".")[0]) or "host"


def _sweep_partials(out: Path) -> None:
    """Remove what compiles of ``out`` on this host that were killed outright (SIGKILL, power loss) left
    behind: the ``.NAME.HOST-PID.XXXXXXXX.partial`` directories whose process no longer runs. Another
    output's partial directories (``.NAME.9...`` of ``NAME.9``), other hosts' (a shared disk) and live
    processes' stay."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.{re.escape(_HOST)}-(\d+)\.[A-Za-z0-9_]+\.partial")
    for p in out.parent.glob(f".{glob.escape(out.name)}.*.partial"):
        m = pattern.fullmatch(p.name)
        if m is None or not p.is_dir():
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            log.info("removing %s, left by a compile that was killed", p)
            shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass  # it runs (as another user): leave it


def write_manifest(root: Path, manifest: dict[str, Any]) -> None:
    """Hash every file under ``root`` into the manifest and write it last."""
    files = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            rel = p.relative_to(root).as_posix()
            files[rel] = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
    body = {"schema_version": SCHEMA_VERSION, **manifest, "files": files}
    body["manifest_sha256"] = manifest_digest(body)
    (root / MANIFEST).write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
