"""Errors the runtime raises on purpose (no torch, no compiler imports here)."""

from __future__ import annotations


class LlmcRuntimeError(Exception):
    exit_code = 1

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


class BundleError(LlmcRuntimeError):
    """The bundle is missing, incomplete, tampered with, or of another schema."""

    exit_code = 5


class PromptError(LlmcRuntimeError):
    """A prompt the bundle cannot take: text that is not UTF-8, text for a bundle without a tokenizer, ..."""

    exit_code = 6


class PromptTooLongError(PromptError):
    """The prompt does not fit the bundle's --max-context (or is empty)."""


class TokenIdError(PromptError):
    """A token id is outside the bundle's vocabulary."""


class ProviderError(LlmcRuntimeError):
    """The requested execution provider is not available for this bundle."""

    exit_code = 10


class ChatTemplateError(LlmcRuntimeError):
    """The bundle's chat template cannot render the conversation (or Jinja2 is missing)."""

    exit_code = 5


class NativeKernelError(LlmcRuntimeError):
    """llmc's native CPU kernels (``llmc kernels build``) cannot be built, or a bundle needs them unbuilt."""

    exit_code = 11
