"""Repeatable timing of a bundle: TTFT, prefill and decode tokens/s, peak RSS.

Runs a warm-up generation, then ``repeat`` measured ones on the same prompt, and
reports the median and the spread (min..max) of each figure.

The prompt is natural English (:func:`default_text`), not a repeated sentence: a
W8A8 bundle's shadow corrections do work in proportion to the outliers they meet,
and repetitive text has far fewer of them. SmolLM2's default npu bundle, 512
tokens, one process: 1,175 tok/s on a sentence repeated, 1,021 on random ids,
864 on CPython's ``LICENSE.txt``; the plain (``--no-shadow``) bundle 1,636-1,675
on all three.
"""

from __future__ import annotations

import dataclasses
import statistics
import sysconfig
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from llmc.runtime.session import Session, peak_rss_mb


@dataclasses.dataclass
class Figure:
    median: float
    min: float
    max: float

    @classmethod
    def of(cls, xs: Sequence[float]) -> "Figure":
        return cls(statistics.median(xs), min(xs), max(xs))


@dataclasses.dataclass
class BenchResult:
    bundle: str
    provider: str
    prompt_tokens: int
    new_tokens: int
    repeat: int
    ttft_s: Figure
    prefill_tok_s: Figure
    decode_tok_s: Figure
    peak_rss_mb: float
    decode_path: str = ""  # Session.decode_path: what ran each decode step
    offload: dict | None = None  # memory-budgeted bundles: residency and streaming figures over all runs
    kv_cache: str = ""  # the KV cache's element type: "float32", "float16" or "int8" (--kv-cache)
    kv_cache_bytes: int = 0  # allocated for the bundle's max context
    int8_kernels: str | None = None  # Session.int8_kernels: "u8s8", "u8u8", or None without W8A8 weights
    prefill_path: str = ""  # Session.prefill_path: what ran the prompt's chunks
    prompt: str = ""  # where the prompt's tokens came from (Prompt.source)
    native_kernels: str | None = None  # the library of llmc's native ops a --cpu-kernels native bundle ran, else None
    packed_weight_bytes: int = 0  # Session.packed_weight_bytes: the decode graph's W8A8 weights copied into their ops' layout
    bf16_attention: bool = False  # Session.bf16_attention: a chunk's attention products in bfloat16
    graphs: dict | None = None  # Session.graphs_run: per phase, the graphs that ran on each provider
    requested_provider: str = ""  # the provider asked for; ``provider`` is the one that ran graphs


@dataclasses.dataclass(frozen=True)
class Prompt:
    ids: list[int]
    source: str  # what the ids are, for reports


def default_text() -> tuple[str, str] | None:
    """(name, text) of the default benchmark text: CPython's ``LICENSE.txt`` from the standard library
    (natural English, about 3,800 SmolLM2 tokens, which the default calibration does not read), else the
    calibration's own text (``pydoc_data.topics``) on a Python installed without it; None without either."""
    path = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    try:
        return f"CPython's {path.name}", path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        pass
    try:
        from pydoc_data import topics
    except ImportError:
        return None
    return "pydoc_data.topics (the default calibration text)", "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def bench_prompt(session: Session, n: int, text: tuple[str, str] | None = None, seed: int = 0) -> Prompt:
    """The first ``n`` tokens of ``text`` (``(name, text)``, default :func:`default_text`), the text
    repeated when it is shorter; random ids (from ``seed``) when the bundle has no tokenizer or, without
    ``text``, this Python has no default text."""
    text = text or (default_text() if session.tokenizer is not None else None)
    if text is None:
        rng = np.random.default_rng(seed)
        vocab = int(session.manifest["model"]["vocab_size"])
        why = "the bundle has no tokenizer" if session.tokenizer is None else "this Python has neither LICENSE.txt nor pydoc_data"
        return Prompt([int(t) for t in rng.integers(0, vocab, size=n)], f"random token ids ({why})")
    name, body = text
    ids, times = first_tokens(session.encode, body, n, name)
    return Prompt(ids, f"the first {n} tokens of {name}" + (f" ({times} copies)" if times > 1 else ""))


def first_tokens(encode: Callable[[str], list[int]], body: str, n: int, name: str = "the text") -> tuple[list[int], int]:
    """The first ``n`` tokens of ``body`` by ``encode``, and how many copies of it (joined by blank lines) that took."""
    ids = encode(body)
    if not ids:
        raise ValueError(f"{name} has no tokens")
    times = -(-n // len(ids))
    if times > 1:
        ids = encode("\n\n".join([body] * times))
    return ids[:n], times


def bench(session: Session, prompt_len: int = 512, new_tokens: int = 32, repeat: int = 3, warmup: int = 1,
          text: tuple[str, str] | None = None) -> BenchResult:
    """Time ``session`` on a ``prompt_len``-token prompt from ``text`` (see :func:`bench_prompt`)."""
    prompt = bench_prompt(session, prompt_len, text)
    ids = prompt.ids
    for _ in range(warmup):
        session.generate(ids, min(new_tokens, 4), stop_at_eos=False)
    runs = [session.generate(ids, new_tokens, stop_at_eos=False).metrics for _ in range(repeat)]
    return BenchResult(
        str(session.bundle),
        session.provider_used,
        prompt_len,
        new_tokens,
        repeat,
        Figure.of([m.ttft_s for m in runs]),
        Figure.of([m.prefill_tok_s for m in runs]),
        Figure.of([m.decode_tok_s for m in runs]),
        peak_rss_mb(),
        session.decode_path,
        offload_figures(session),
        *_kv_cache(session),
        session.int8_kernels,
        prefill_path=session.prefill_path,
        prompt=prompt.source,
        native_kernels=str(session.native_kernels) if session.native_kernels is not None else None,
        packed_weight_bytes=session.packed_weight_bytes,
        bf16_attention=session.bf16_attention,
        graphs=session.graphs_run(),
        requested_provider=session.requested_provider,
    )


def _kv_cache(session: Session) -> tuple[str, int]:
    cache = session.cache
    if cache is None:
        return "", 0
    kinds = {str(a.dtype) for a in cache.k.values()}
    return (kinds.pop() if len(kinds) == 1 else "mixed"), cache.nbytes


def offload_figures(session: Session) -> dict | None:
    """Residency and streaming figures of a memory-budgeted session (None for an unbudgeted one)."""
    r = session.residency
    if r is None:
        return None
    st = r.streaming.stats
    return {
        "budget_bytes": r.plan["budget_bytes"],
        "resident_bytes": r.resident_bytes,
        "buffer_bytes": r.plan["buffer_bytes"],
        "peak_buffer_bytes": st.peak_buffer_bytes,
        "prefetch": r.streaming.prefetch,
        "prefetch_depth": r.streaming.depth,
        "o_direct": r.file.direct,
        "streamed_bytes_read": st.bytes_read,
        "read_MB_s": st.read_bandwidth / 1e6,
        "main_thread_wait_s": st.wait_s,
    }
