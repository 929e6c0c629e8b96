"""Access to the QNN execution provider (``onnxruntime-qnn``), shared by runtime and compiler."""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from typing import Iterator

# x86_64 hosts run HTP graphs in the simulator, which cannot load weight-shared
# context binaries; there the runtime uses the fully quantized QDQ graphs.
SIMULATOR_MACHINES = {"x86_64", "AMD64"}


def qnn_available() -> str | None:
    """None if onnxruntime-qnn can be used here, else the reason it cannot."""
    try:
        import onnxruntime_qnn  # noqa: F401
    except ImportError:
        return "onnxruntime-qnn is not installed (pip install 'llmc[qnn]')"
    return None


def register_qnn():
    """Register the QNN EP plugin once per process; return (onnxruntime, onnxruntime_qnn, devices)."""
    import onnxruntime as ort
    import onnxruntime_qnn as oq

    devices = [d for d in ort.get_ep_devices() if d.ep_name == "QNNExecutionProvider"]
    if not devices:
        ort.register_execution_provider_library("QNNExecutionProvider", oq.get_library_path())
        devices = [d for d in ort.get_ep_devices() if d.ep_name == "QNNExecutionProvider"]
    return ort, oq, devices


def provider_options(oq, htp_arch: str, soc_model: int | str) -> dict[str, str]:
    return {"backend_path": oq.get_qnn_htp_path(), "htp_arch": str(htp_arch).lstrip("v"), "soc_model": str(soc_model)}


def on_simulator() -> bool:
    return platform.machine() in SIMULATOR_MACHINES


@contextlib.contextmanager
def native_stdout_to_stderr() -> Iterator[None]:
    """Send what native code writes to file descriptor 1 to standard error meanwhile.

    The QNN HTP libraries print a ``# LIBNATIVE ...`` line on stdout when the first
    session loads them; stdout carries generated text and ``--json`` output.
    """
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no file descriptor 1 (an embedding host): nothing to protect
        yield
        return
    try:
        os.dup2(2, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def qnn_session(ort, model, so):
    """``ort.InferenceSession(model, so)`` for a session on the QNN EP, its libraries' stdout sent to stderr."""
    with native_stdout_to_stderr():
        return ort.InferenceSession(model, so)
