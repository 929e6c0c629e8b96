"""What prefetching buys a memory-budgeted bundle, measured so that VM noise cancels.

    python benchmarks/prefetch_ab.py out/npu-50pct --rounds 6

Two sessions of one bundle live in one process, one prefetching and one not
(``Session(prefetch=False)``, like ``llmc run --no-prefetch``); each round runs a
256-token prompt and 32 decoded tokens on both, alternating which goes first.
Streamed weights are read with ``O_DIRECT``, so neither session leaves the other
a warm page cache. A slow spell of the machine (hypervisor steal, printed per
run) hits both sessions of a round alike, so the per-round ratio is the figure
to trust; separate ``llmc bench`` processes swing by more than the difference.
"""

from __future__ import annotations

import argparse
import statistics

from llmc.runtime import Session
from llmc.runtime.bench import bench_prompt


def steal_ticks() -> int:
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    sessions = {"prefetch": Session(args.bundle, prefetch=True), "no-prefetch": Session(args.bundle, prefetch=False)}
    if sessions["prefetch"].residency is None:
        raise SystemExit(f"{args.bundle} has no memory budget (compile it with --memory-budget)")
    ids = bench_prompt(sessions["prefetch"], args.prompt_len).ids
    for s in sessions.values():  # warm-up
        s.generate(ids, 4, stop_at_eos=False)
    runs: dict[str, list[float]] = {k: [] for k in sessions}
    for r in range(args.rounds):
        order = list(sessions) if r % 2 == 0 else list(reversed(list(sessions)))
        line = []
        for k in order:
            before = steal_ticks()
            tok_s = sessions[k].generate(ids, args.new_tokens + 1, stop_at_eos=False).metrics.decode_tok_s
            runs[k].append(tok_s)
            line.append(f"{k} {tok_s:.2f} tok/s (steal {steal_ticks() - before} ticks)")
        print(f"round {r}: " + ", ".join(line), flush=True)
    ratios = [a / b for a, b in zip(runs["prefetch"], runs["no-prefetch"])]
    print("median decode tok/s: " + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in runs.items()))
    print(f"prefetch / no-prefetch per round: {', '.join(f'{x:.2f}' for x in ratios)}; median {statistics.median(ratios):.2f}; "
          f"prefetch faster in {sum(x > 1 for x in ratios)} of {len(ratios)}")
    for s in sessions.values():
        s.close()


if __name__ == "__main__":
    main()
