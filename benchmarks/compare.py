"""Compare compiled bundles with HF transformers eager and llama.cpp, in one run.

Every engine runs in its own child process (one process tree, one run, no
thread pools fighting each other), on the same token ids (the first tokens of
``llmc bench``'s natural-English text, CPython's LICENSE.txt, or of
``--prompt-file``), after a warm-up, and
reports the median of ``--repeat`` runs. The parent prints a table and the
ratios against HF eager fp32 (and llama.cpp when ``llama-cpp-python`` is
installed; it is skipped with a note otherwise).

With ``--rounds R`` every engine runs R times, the engines taking turns (each
round in a rotated order): a VM whose speed drifts over minutes then moves all
engines alike. Each ratio is then the median of its R per-round ratios, shown
with their range; speeds are medians over the rounds.

    python benchmarks/compare.py --bundle cpu=out/cpu --bundle npu=out/npu \
        --prompt-lens 128,512,2048 --new-tokens 32 --rounds 3

The reference engines load the bundled SmolLM2-135M GGUF (``--gguf`` for another file).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time, statistics
cfg = json.load(open(sys.argv[1]))
ids, n_new, repeat, engine = cfg["ids"], cfg["new_tokens"], cfg["repeat"], cfg["engine"]

def med(xs):
    return statistics.median(xs)

def peak_mb():
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

out = {"engine": engine}
if engine == "llmc":
    from llmc.runtime import Session
    s = Session(cfg["bundle"])
    s.generate(ids[:64], 2, stop_at_eos=False)
    runs = [s.generate(ids, n_new, stop_at_eos=False).metrics for _ in range(repeat)]
    out.update(prefill_tok_s=med([m.prefill_tok_s for m in runs]), decode_tok_s=med([m.decode_tok_s for m in runs]),
               ttft_s=med([m.ttft_s for m in runs]))
elif engine == "hf":
    import torch, transformers as T
    torch.set_num_threads(cfg["threads"])
    p = cfg["gguf"]
    import os
    m = T.AutoModelForCausalLM.from_pretrained(os.path.dirname(p), gguf_file=os.path.basename(p), dtype=torch.float32,
                                               attn_implementation="eager").eval()
    x = torch.tensor([ids])
    pre, dec = [], []
    with torch.no_grad():
        m(x[:, :64])
        for _ in range(repeat):
            t = time.perf_counter()
            o = m(x, use_cache=True)
            pre.append(time.perf_counter() - t)
            past, tok = o.past_key_values, o.logits[:, -1:].argmax(-1)
            t = time.perf_counter()
            for _ in range(n_new - 1):
                o = m(tok, past_key_values=past, use_cache=True)
                past, tok = o.past_key_values, o.logits[:, -1:].argmax(-1)
            dec.append(time.perf_counter() - t)
    out.update(prefill_tok_s=len(ids) / med(pre), decode_tok_s=(n_new - 1) / med(dec), ttft_s=med(pre))
elif engine == "llama.cpp":
    from llama_cpp import Llama
    llm = Llama(model_path=cfg["gguf"], n_ctx=len(ids) + n_new + 8, n_threads=cfg["threads"], n_batch=512, verbose=False)
    pre, dec = [], []
    for _ in range(repeat + 1):
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        pre.append(time.perf_counter() - t)
        t = time.perf_counter()
        tok = 0
        for _ in range(n_new - 1):
            llm.eval([tok])
        dec.append(time.perf_counter() - t)
    pre, dec = pre[1:], dec[1:]
    out.update(prefill_tok_s=len(ids) / med(pre), decode_tok_s=(n_new - 1) / med(dec), ttft_s=med(pre))
out["peak_rss_mb"] = peak_mb()
print(json.dumps(out))
"""


def token_ids(bundle: Path, n: int, text: str | None = None) -> list[int]:
    """The first ``n`` tokens of ``text`` (default: ``llmc bench``'s text, CPython's LICENSE.txt), repeated when
    shorter, by the bundle's tokenizer: every engine gets the same ids. Natural text, because a W8A8 shadow
    bundle's prefill speed depends on it (see ``llmc.runtime.bench``); HF and llama.cpp do not care."""
    from tokenizers import Tokenizer

    from llmc.runtime.bench import default_text, first_tokens

    tok = Tokenizer.from_file(str(bundle / "tokenizer" / "tokenizer.json"))
    return first_tokens(lambda t: tok.encode(t).ids, text if text is not None else default_text()[1], n)[0]


def run_child(cfg: dict) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(cfg, f)
    r = subprocess.run([sys.executable, "-c", CHILD, f.name], capture_output=True, text=True)
    Path(f.name).unlink()
    if r.returncode != 0:
        return {"engine": cfg["engine"], "error": (r.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def rotated(names: list[str], r: int) -> list[str]:
    """Round ``r``'s engine order: ``names`` rotated by ``r``."""
    k = r % len(names) if names else 0
    return names[k:] + names[:k]


def aggregate(rounds: list[dict[str, dict]], refs: tuple[str, ...] = ("hf-eager", "llama.cpp")) -> dict[str, dict]:
    """Per engine over the rounds (each a {engine: child result}): median speeds, the largest peak RSS,
    and for every reference engine the median and range of the per-round prefill and decode ratios.
    An engine that failed in any round keeps that round's error."""
    import statistics

    out: dict[str, dict] = {}
    for name in rounds[0]:
        runs = [r[name] for r in rounds]
        bad = next((x for x in runs if "error" in x), None)
        if bad is not None:
            out[name] = {"error": bad["error"]}
            continue
        res = {k: statistics.median(x[k] for x in runs) for k in ("prefill_tok_s", "decode_tok_s", "ttft_s")}
        res["peak_rss_mb"] = max(x["peak_rss_mb"] for x in runs)
        res["ratios"] = {}
        for ref in refs:
            if ref not in rounds[0] or any("error" in r[ref] for r in rounds):
                continue
            for k in ("prefill_tok_s", "decode_tok_s"):
                xs = [r[name][k] / r[ref][k] for r in rounds]
                res["ratios"][f"{k.split('_')[0]}/{ref}"] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
        out[name] = res
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", action="append", default=[], metavar="NAME=DIR", help="a compiled bundle to measure (repeatable)")
    ap.add_argument("--prompt-lens", default="128,512,2048")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="run every engine this many times, taking turns; ratios per round, then median")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gguf", default=None, help="GGUF for the reference engines (default: the bundled SmolLM2)")
    ap.add_argument("--prompt-file", default=None, help="UTF-8 text the prompts are cut from (default: llmc bench's, CPython's LICENSE.txt)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not args.bundle:
        ap.error("give at least one --bundle NAME=DIR")
    from llmc.runtime.bench import default_text

    bundles = dict(b.split("=", 1) for b in args.bundle)
    source = (args.prompt_file, Path(args.prompt_file).read_text(encoding="utf-8")) if args.prompt_file else default_text()
    if source is None:
        sys.exit("this Python has neither LICENSE.txt nor pydoc_data to cut prompts from: pass --prompt-file")
    text_name, text = source
    gguf = args.gguf
    if gguf is None:
        from llmc.model_source import bundled_model_path

        gguf = str(bundled_model_path("smollm2-135m"))
    try:
        import llama_cpp  # noqa: F401

        have_llama = True
    except ImportError:
        have_llama = False
    first = Path(next(iter(bundles.values())))
    max_ctx = json.loads((first / "manifest.json").read_text())["max_context"]
    rows = []
    for n in [int(x) for x in args.prompt_lens.split(",")]:
        n_eff = min(n, max_ctx - args.new_tokens)
        ids = token_ids(first, n_eff, text)
        base = {"ids": ids, "new_tokens": args.new_tokens, "repeat": args.repeat, "threads": args.threads, "gguf": gguf}
        engines = {name: {"engine": "llmc", "bundle": d} for name, d in bundles.items()}
        engines["hf-eager"] = {"engine": "hf"}
        if have_llama:
            engines["llama.cpp"] = {"engine": "llama.cpp"}
        rounds = []
        for r in range(max(args.rounds, 1)):
            got = {name: run_child({**base, **engines[name]}) for name in rotated(list(engines), r)}
            rounds.append({name: got[name] for name in engines})
        rows.append({"prompt_tokens": n_eff, "results": aggregate(rounds), "rounds": rounds})
    if args.json:
        print(json.dumps({"runs": rows, "llama_cpp": have_llama, "prompt_text": text_name}))
        return
    if not have_llama:
        print("note: llama-cpp-python is not installed; llama.cpp skipped (pip install llama-cpp-python builds it from source)")
    print(f"prompts: the first tokens of {text_name}")
    for row in rows:
        res = row["results"]
        hf = res["hf-eager"]
        lc = res.get("llama.cpp")
        rounds = len(row["rounds"])
        print(f"\nprompt {row['prompt_tokens']} tokens, {args.new_tokens} new tokens, median of {args.repeat}"
              + (f"; {rounds} rounds, ratios: median of the per-round ratios" if rounds > 1 else ""))
        print(f"  {'engine':<12} {'prefill tok/s':>14} {'decode tok/s':>13} {'peak RSS MB':>12} {'prefill/HF':>11} {'decode/HF':>10}"
              + (f" {'prefill/llama':>14} {'decode/llama':>13}" if lc and "error" not in lc else ""))
        for name, r in res.items():
            if "error" in r:
                print(f"  {name:<12} error: {r['error']}")
                continue
            line = f"  {name:<12} {r['prefill_tok_s']:14.1f} {r['decode_tok_s']:13.1f} {r['peak_rss_mb']:12.0f}"
            q = r["ratios"]
            if "error" not in hf:
                line += f" {q['prefill/hf-eager']['median']:10.2f}x {q['decode/hf-eager']['median']:9.2f}x"
            if lc and "error" not in lc:
                line += f" {q['prefill/llama.cpp']['median']:13.2f}x {q['decode/llama.cpp']['median']:12.2f}x"
            print(line)
        if rounds > 1:
            print("  per-round ratio ranges (min..max):")
            for name, r in res.items():
                if "error" not in r and name not in ("hf-eager", "llama.cpp"):
                    print(f"  {name:<12} " + ", ".join(f"{k} {v['min']:.2f}..{v['max']:.2f}" for k, v in r["ratios"].items()))


if __name__ == "__main__":
    main()
