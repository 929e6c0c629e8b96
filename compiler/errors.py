"""Errors the compiler raises on purpose.

Each carries a message that names the offending thing and a ``hint`` that says
what to do. The CLI prints both and exits with the class's ``exit_code``.
"""

from __future__ import annotations


class LlmcError(Exception):
    exit_code = 1

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


class ModelLoadError(LlmcError):
    """The model source is missing, malformed or not available offline."""

    exit_code = 3


class UnsupportedModelError(LlmcError):
    """The architecture, or an op inside it, is not something llmc can lower."""

    exit_code = 4


class IRVerificationError(LlmcError):
    """The IR broke an invariant: a bug in a pass or in the frontend."""

    exit_code = 70


class PassError(LlmcError):
    """A pass failed; the message names it and the passes that ran before it."""

    exit_code = 70


class PipelineError(LlmcError):
    """A --pipeline string names an unknown pass or is malformed."""

    exit_code = 2


class CompileError(LlmcError):
    """The compile options are inconsistent (chunk larger than context, ...)."""

    exit_code = 2


class OutputError(LlmcError):
    """The bundle cannot be written: the disk is full, or the directory is not writable."""

    exit_code = 7
