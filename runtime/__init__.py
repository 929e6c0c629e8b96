"""llmc's runtime: executes a compiled bundle.

Depends only on numpy, onnxruntime, tokenizers and the standard library — never
on torch, transformers or the compiler — so a bundle runs on a machine that has
none of them.
"""

from llmc.runtime.errors import BundleError, LlmcRuntimeError, PromptTooLongError, ProviderError
from llmc.runtime.manifest import SCHEMA_VERSION, load_manifest
from llmc.runtime.session import GenerationResult, Metrics, Session, TokenEvent

__all__ = [
    "BundleError", "GenerationResult", "LlmcRuntimeError", "Metrics", "PromptTooLongError", "ProviderError",
    "SCHEMA_VERSION", "Session", "TokenEvent", "load_manifest",
]
