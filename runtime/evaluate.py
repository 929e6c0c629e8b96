"""Quality measurements of a bundle: perplexity on text, greedy agreement with another bundle.

Both run through :class:`Session`, so they measure exactly what deployment runs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from llmc.runtime.session import Session


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


@dataclasses.dataclass
class Perplexity:
    perplexity: float
    nll: float  # mean negative log-likelihood per predicted token (nats)
    tokens: int  # predicted tokens
    windows: int
    window: int


def perplexity(session: Session, ids: Sequence[int], window: int | None = None) -> Perplexity:
    """Perplexity over ``ids`` in non-overlapping windows of ``window`` tokens (default: max context)."""
    window = min(window or session.max_context, session.max_context)
    ids = list(ids)
    total, count, windows = 0.0, 0, 0
    for s in range(0, len(ids) - 1, window):
        part = ids[s : s + window]
        if len(part) < 2:
            break
        session.reset()
        logits = session.prefill(part, all_logits=True)
        lp = _log_softmax(logits[:-1])
        total -= float(lp[np.arange(len(part) - 1), part[1:]].sum())
        count += len(part) - 1
        windows += 1
    if count == 0:
        raise ValueError("need at least two tokens to measure perplexity")
    nll = total / count
    return Perplexity(math.exp(nll), nll, count, windows, window)


@dataclasses.dataclass
class Agreement:
    teacher_forced: float  # share of positions where the candidate's argmax equals the reference's greedy token
    free_running: float  # share of positions where the candidate's own greedy continuation equals the reference's
    prompts: int
    positions: int
    per_prompt: list[dict]


def agreement(candidate: Session, reference: Session, prompts: Sequence[str | Sequence[int]], new_tokens: int = 32) -> Agreement:
    """Greedy-token agreement of ``candidate`` with ``reference`` over ``new_tokens`` per prompt.

    *Teacher-forced*: the reference generates greedily; the candidate reads the
    same prefix at every position and we count where its argmax picks the same
    token. *Free-running*: both generate on their own; we count equal tokens
    position by position (one early divergence changes everything after it).
    """
    tf_hits = fr_hits = positions = 0
    per = []
    for p in prompts:
        ids = reference.encode(p) if isinstance(p, str) else list(p)
        ref = reference.generate(ids, new_tokens, stop_at_eos=False).token_ids
        candidate.reset()
        logits = candidate.prefill(ids + ref[:-1], all_logits=True)
        pred = logits[len(ids) - 1 :].argmax(axis=-1)
        tf = int((pred == np.asarray(ref)).sum())
        own = candidate.generate(ids, new_tokens, stop_at_eos=False).token_ids
        fr = sum(int(a == b) for a, b in zip(own, ref))
        first = next((i for i, (a, b) in enumerate(zip(own, ref)) if a != b), len(ref))
        per.append({"prompt_tokens": len(ids), "teacher_forced": tf / len(ref), "free_running": fr / len(ref), "first_divergence": first})
        tf_hits += tf
        fr_hits += fr
        positions += len(ref)
    return Agreement(tf_hits / positions, fr_hits / positions, len(per), positions, per)


HELDOUT_MODULES = ("argparse", "textwrap", "logging", "doctest", "difflib", "heapq", "functools", "contextlib", "tarfile", "statistics")


def heldout_english() -> str:
    """English prose that no calibration corpus of llmc's holds (docstrings of stdlib modules): the held-out
    text of the tests' and benchmarks' perplexity figures, the same on every machine with this Python."""
    import importlib

    parts = []
    for name in HELDOUT_MODULES:
        mod = importlib.import_module(name)
        parts.append(mod.__doc__ or "")
        for attr in sorted(dir(mod)):
            doc = getattr(getattr(mod, attr), "__doc__", None)
            if isinstance(doc, str) and len(doc) > 300 and getattr(getattr(mod, attr), "__module__", "") == name:
                parts.append(doc)
    return "\n\n".join(parts)
