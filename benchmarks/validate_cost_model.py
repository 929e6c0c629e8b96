"""Check the cost model on this machine: the ``host`` profile's predictions of a
compiled bundle's prefill and decode speed against what ``llmc bench`` measures.

    python benchmarks/validate_cost_model.py --prompt-len 512 --new-tokens 32

Steps, each in its own process: ``llmc profile-host`` (unless a host profile
exists and ``--reprofile`` is not given), ``llmc compile MODEL --target T
--profile host --prompt-len N`` for each target, ``llmc bench --json``. The
predictions come from the bundle's ``report.json``. Run it on an idle machine:
the micro-benchmarks and the bench must see the same machine.
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
        got = json.loads(llmc("bench", str(out), "--prompt-len", str(a.prompt_len), "--new-tokens", str(a.new_tokens), "--repeat",
                              str(a.repeat), "--json"))
        for what, p, m in (("prefill", pred["prefill_tok_s"], got["prefill_tok_s"]["median"]), ("decode", pred["decode_tok_s"], got["decode_tok_s"]["median"])):
            rows.append((target, what, p, m))
    print(f"{'bundle':<7} {'phase':<8} {'predicted':>10} {'measured':>10} {'measured/predicted':>19}")
    worst = 0.0
    for target, what, p, m in rows:
        r = m / p
        worst = max(worst, abs(r - 1))
        print(f"{target:<7} {what:<8} {p:10.1f} {m:10.1f} {r:19.2f}  {'ok' if abs(r - 1) <= 0.25 else 'OUTSIDE 25%'}")
    print(f"largest deviation {worst * 100:.0f}% (tok/s); bundles in {root}")


if __name__ == "__main__":
    main()
