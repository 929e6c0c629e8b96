"""Repeatable timing of a bundle: TTFT, prefill and decode tokens/s, peak RSS.

Runs a warm-up generation, then ``repeat`` measured ones on the same prompt, and
reports the median and the spread (min..max) of each figure.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Sequence

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
    kv_cache: str = ""  # the KV cache's element type: "float32", or "int8" (--kv-cache int8)
    kv_cache_bytes: int = 0  # allocated for the bundle's max context
    int8_kernels: str | None = None  # Session.int8_kernels: "u8s8", "u8u8", or None without W8A8 weights
    prefill_path: str = ""  # Session.prefill_path: what ran the prompt's chunks


def prompt_ids(session: Session, n: int, seed: int = 0) -> list[int]:
    """``n`` deterministic token ids: tokenized English if the bundle has a tokenizer, else random ids."""
    vocab = int(session.manifest["model"]["vocab_size"])
    if session.tokenizer is not None:
        text = ("The quick brown fox jumps over the lazy dog while the river runs to the sea. " * (n // 8 + 8))
        ids = session.encode(text)
        if len(ids) >= n:
            return ids[:n]
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, vocab, size=n)]


def bench(session: Session, prompt_len: int = 512, new_tokens: int = 32, repeat: int = 3, warmup: int = 1) -> BenchResult:
    ids = prompt_ids(session, prompt_len)
    for _ in range(warmup):
        session.generate(ids, min(new_tokens, 4), stop_at_eos=False)
    runs = [session.generate(ids, new_tokens, stop_at_eos=False).metrics for _ in range(repeat)]
    return BenchResult(
        str(session.bundle),
        session.provider,
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
