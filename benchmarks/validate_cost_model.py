"""Check the cost model on this machine: the ``host`` profile's predictions of a
compiled bundle's prefill and decode speed against what ``llmc bench`` measures.

    python benchmarks/validate_cost_model.py --prompt-len 512 --new-tokens 32

Steps, each in its own process: ``llmc profile-host`` (unless a host profile
exists and ``--reprofile`` is not given), ``llmc compile MODEL --target T
--profile host --prompt-len N`` for each target, ``llmc bench --json``. The
predictions come from the bundle's ``report.json``. Run it on an idle machine:
the micro-benchmarks and the bench must see the same machine. The verdict uses
each bench's best run (interference only ever slows a run down; the profile's
micro-benchmarks are medians of many short runs, which shrug it off); the median
is printed too, with the CPU time a hypervisor stole during each bench.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def llmc(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "llmc.cli", *args], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"llmc {' '.join(args)} failed:\n{r.stderr}")
    return r.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--targets", default="cpu,npu")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--reprofile", action="store_true", help="measure the host profile again")
    ap.add_argument("--out", default=None, help="where to put the bundles (default: a temporary folder)")
    ap.add_argument("--cache-dir", default=None, help="llmc compile --cache-dir")
    a = ap.parse_args()

    from llmc.device_profile import user_profile_dir

    if a.reprofile or not (user_profile_dir() / "host.json").exists():
        print("measuring the host profile ...", file=sys.stderr)
        llmc("profile-host")
    root = Path(a.out or tempfile.mkdtemp(prefix="llmc-validate-"))
    rows = []
    for target in a.targets.split(","):
        out = root / target
        args = ["compile", a.model, "--target", target, "-o", str(out), "--profile", "host", "--prompt-len", str(a.prompt_len), "--quiet"]
        if a.cache_dir:
            args += ["--cache-dir", a.cache_dir]
        print(f"compiling {target} ...", file=sys.stderr)
        llmc(*args)
        pred = json.loads((out / "report.json").read_text())["predictions"]
        print(f"benchmarking {target} ...", file=sys.stderr)
        steal0 = steal_seconds()
        got = json.loads(llmc("bench", str(out), "--prompt-len", str(a.prompt_len), "--new-tokens", str(a.new_tokens), "--repeat",
                              str(a.repeat), "--json"))
        steal = steal_seconds() - steal0
        for what in ("prefill", "decode"):
            m = got[f"{what}_tok_s"]
            rows.append((target, what, pred[f"{what}_tok_s"], m["median"], m["max"], steal))
    print(f"{'bundle':<7} {'phase':<8} {'predicted':>10} {'median':>10} {'best':>10} {'median/pred':>12} {'best/pred':>10} {'steal s':>8}")
    worst = 0.0
    for target, what, p, med, best, steal in rows:
        r = best / p
        worst = max(worst, abs(r - 1))
        print(f"{target:<7} {what:<8} {p:10.1f} {med:10.1f} {best:10.1f} {med / p:12.2f} {r:10.2f} {steal:8.1f}  {'ok' if abs(r - 1) <= 0.25 else 'OUTSIDE 25%'}")
    print(f"largest deviation of the best run {worst * 100:.0f}% (tok/s); bundles in {root}")
    if any(r[-1] > 1.0 for r in rows):
        print("the hypervisor took CPU time from this machine during the runs (steal): numbers are slower than the machine", file=sys.stderr)


def steal_seconds() -> float:
    """CPU time the hypervisor gave to others (``steal`` of /proc/stat, all CPUs), seconds; 0 where unknown."""
    import os

    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


if __name__ == "__main__":
    main()
