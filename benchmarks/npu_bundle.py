"""Size and quality of ``--target npu`` bundles: the weight bytes per part against perplexity and agreement.

Compiles the model for ``--target cpu`` (the float32 reference) and for ``--target npu`` in variants of the
outlier correction's float rows and of the embedding, then measures each on held-out English
(``llmc.runtime.evaluate.heldout_english``: stdlib docstrings, not the calibration text):

* perplexity over ``--tokens`` tokens (windows of the bundle's chunk program), and its ratio to fp32;
* greedy agreement with the fp32 bundle over six prompts of ``--new-tokens`` tokens (teacher-forced:
  the candidate's argmax on the reference's prefix; free-running: both generate on their own);
* the weight bytes per part (``llmc inspect``'s: codes, shadow, embedding, head, float).

Variants (``default`` is what ``llmc compile --target npu`` makes):

* ``default``: the corrections read the int8 codes, hot channels (``--hot-budget 0.01``) exact in float;
  the embedding gathers the tied LM head's codes (``quantize_embedding``);
* ``no-hot``: ``--hot-budget 0``, every outlier's weights from the int8 codes;
* ``hot-25``: ``--hot-budget 0.25``, float rows for many more channels;
* ``float-embedding``: the default without ``quantize_embedding`` (a float32 embedding table).

    python benchmarks/npu_bundle.py --out benchmarks/results/npu_bundle.json

Each compile takes 10-30 s and each measurement a minute or two on 2 CPUs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = ["The capital of France is", "Once upon a time, there was a", "Photosynthesis is the process by which",
           "To write a function in Python, you", "The history of the Roman Empire", "In mathematics, a prime number"]


def variants() -> dict[str, dict]:
    from llmc.passes import DEFAULT_PIPELINES

    no_embedding = ",".join(p for p in DEFAULT_PIPELINES["npu"].split(",") if p != "quantize_embedding")
    return {"default": {}, "no-hot": {"hot_budget": 0.0}, "hot-25": {"hot_budget": 0.25}, "float-embedding": {"pipeline": no_embedding}}


def parts(bundle: Path) -> dict[str, int]:
    from llmc.runtime.manifest import weight_part_bytes

    return {k: v for k, v in weight_part_bytes(json.loads((bundle / "manifest.json").read_text())).items() if v}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=4096, help="held-out tokens for perplexity")
    ap.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per agreement prompt")
    ap.add_argument("--only", default=None, help="comma-separated variants (default: all)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()

    from llmc import __version__
    from llmc.compile import compile_model
    from llmc.runtime import Session
    from llmc.runtime.evaluate import agreement, heldout_english, perplexity

    chosen = variants()
    if args.only:
        chosen = {k: v for k, v in chosen.items() if k in args.only.split(",")}
    rows = []
    with tempfile.TemporaryDirectory(prefix="llmc-npu-bundle-") as tmp:
        ref_dir = Path(tmp) / "fp32"
        compile_model(args.model, ref_dir, target="cpu")
        ref = Session(ref_dir)
        ids = ref.encode(heldout_english())[: args.tokens]
        p32 = perplexity(ref, ids).perplexity
        rows.append({"variant": "fp32", "weight_bytes": sum(parts(ref_dir).values()), "parts": parts(ref_dir), "perplexity": p32, "vs_fp32": 1.0})
        print(f"fp32             {sum(parts(ref_dir).values()) / 1e6:7.1f} MB  perplexity {p32:.4f}", flush=True)
        for name, kw in chosen.items():
            out = Path(tmp) / name
            t = time.perf_counter()
            compile_model(args.model, out, target="npu", **kw)
            compile_s = time.perf_counter() - t
            s = Session(out)
            p = perplexity(s, ids).perplexity
            a = agreement(s, ref, PROMPTS, new_tokens=args.new_tokens)
            b = parts(out)
            rows.append({"variant": name, "options": kw, "weight_bytes": sum(b.values()), "parts": b, "perplexity": p, "vs_fp32": p / p32,
                         "teacher_forced": a.teacher_forced, "free_running": a.free_running, "compile_s": compile_s})
            print(f"{name:<16} {sum(b.values()) / 1e6:7.1f} MB  perplexity {p:.4f} ({p / p32:.4f}x fp32)  agreement "
                  f"{a.teacher_forced:.3f} teacher-forced, {a.free_running:.3f} free-running  "
                  + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in b.items()), flush=True)
    result = {"model": args.model, "tokens": len(ids), "new_tokens": args.new_tokens, "prompts": len(PROMPTS), "llmc": __version__,
              "text": "llmc.runtime.evaluate.heldout_english", "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
