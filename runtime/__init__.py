"""llmc's runtime: executes a compiled bundle.

Depends only on numpy, onnxruntime, tokenizers, Jinja2 (chat templates) and the
standard library — never on torch, transformers or the compiler — so a bundle
runs on a machine that has none of them.
"""

import os as _os
import sys as _sys

# The CPU ops here are small matmuls interleaved with ONNX Runtime calls. A
# multi-threaded BLAS spin-waits between calls and fights ORT's own threads for
# the cores (measured: attention 40x slower, prefill 5x). Keep numpy's BLAS
# single-threaded unless the user chose otherwise or numpy is already loaded.
if "numpy" not in _sys.modules:
    for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        _os.environ.setdefault(_var, "1")

from llmc.runtime.errors import BundleError, LlmcRuntimeError, PromptError, PromptTooLongError, ProviderError, TokenIdError
from llmc.runtime.manifest import SCHEMA_VERSION, load_manifest
from llmc.runtime.session import GenerationResult, Metrics, Session, TokenEvent

__all__ = [
    "BundleError", "GenerationResult", "LlmcRuntimeError", "Metrics", "PromptError", "PromptTooLongError", "ProviderError", "TokenIdError",
    "SCHEMA_VERSION", "Session", "TokenEvent", "load_manifest",
]
