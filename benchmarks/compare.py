"""Compare compiled bundles with HF transformers eager and llama.cpp, in one run.

Every engine runs in its own child process (one process tree, one run, no
thread pools fighting each other) on the same token ids: the first tokens of
``llmc bench``'s natural-English text (CPython's LICENSE.txt) or of
``--prompt-file``. The parent prints the machine it ran on (CPU, flags, package
versions), a table and the ratios against HF eager
fp32 (and llama.cpp when ``llama-cpp-python`` is installed; it is skipped with a
note otherwise).

The engines take turns run by run. All children load and run once to warm up;
then, ``--repeat`` times, each in turn prefills the prompt and makes
``--new-tokens`` tokens (the first from the prefill, the rest decoded) while the
others wait idle, in an order that is reversed every other turn and rotated
every two (so that no engine always runs first or after the same one). A VM whose speed drifts over
seconds or minutes (this one's vector throughput does, by 20-35%) then moves the
engines of one turn alike: each ratio is the median of the per-turn ratios,
shown with their range; speeds are medians over the turns. ``--rounds R``
starts the children afresh R times (R x repeat turns in all). Every engine runs
on ``--threads`` threads.

    python benchmarks/compare.py --bundle cpu=out/cpu --bundle npu=out/npu \
        --prompt-lens 128,512,2048 --new-tokens 64 --repeat 6

The reference engines load the bundled SmolLM2-135M GGUF (``--gguf`` for another file).
"""

from __future__ import annotations

import argparse
import json
import select
import subprocess
import sys
import tempfile
from pathlib import Path

TIMEOUT = 1800.0  # seconds for a child's load and warm-up, or one run (HF eager's 2,048-token run takes about 20 s here)

# A child loads one engine, runs once to warm up and says it is ready; then every "run" line on its stdin
# is one measured run (prefill the prompt, decode new_tokens - 1 more), answered with one JSON line, and
# "quit" is answered with its peak RSS. Protocol lines go to a copy of the original stdout; anything the
# libraries print goes to stderr.
CHILD = r"""
import json, os, sys, time
cfg = json.load(open(sys.argv[1]))
ids, n_new, engine = cfg["ids"], cfg["new_tokens"], cfg["engine"]
proto = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)

def speeds(prefill_s, decode_s):
    return {"prefill_tok_s": len(ids) / prefill_s, "decode_tok_s": (n_new - 1) / decode_s if decode_s else 0.0,
            "ttft_s": prefill_s}

if engine == "llmc":
    from llmc.runtime import Session
    s = Session(cfg["bundle"], threads=cfg["threads"])

    def once():
        m = s.generate(ids, n_new, stop_at_eos=False).metrics
        return {"prefill_tok_s": m.prefill_tok_s, "decode_tok_s": m.decode_tok_s, "ttft_s": m.ttft_s}
elif engine == "hf":
    import torch, transformers as T
    torch.set_num_threads(cfg["threads"])
    p = cfg["gguf"]
    m = T.AutoModelForCausalLM.from_pretrained(os.path.dirname(p), gguf_file=os.path.basename(p), dtype=torch.float32,
                                               attn_implementation="eager").eval()
    x = torch.tensor([ids])

    def once():
        with torch.no_grad():
            t = time.perf_counter()
            o = m(x, use_cache=True)
            pre = time.perf_counter() - t
            past, tok = o.past_key_values, o.logits[:, -1:].argmax(-1)
            t = time.perf_counter()
            for _ in range(n_new - 1):
                o = m(tok, past_key_values=past, use_cache=True)
                past, tok = o.past_key_values, o.logits[:, -1:].argmax(-1)
            return speeds(pre, time.perf_counter() - t)
elif engine == "llama.cpp":
    from llama_cpp import Llama
    llm = Llama(model_path=cfg["gguf"], n_ctx=len(ids) + n_new + 8, n_threads=cfg["threads"], n_threads_batch=cfg["threads"],
                n_batch=512, verbose=False)

    def once():
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        pre = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(n_new - 1):
            llm.eval([0])
        return speeds(pre, time.perf_counter() - t)
else:
    raise SystemExit(f"unknown engine {engine!r}")

def say(d):
    proto.write(json.dumps(d) + "\n")
    proto.flush()

once()
say({"ready": True})
for line in sys.stdin:
    if line.strip() == "run":
        started = time.time()
        say({**once(), "started": started})
    else:
        import resource
        say({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
        break
"""


def token_ids(bundle: Path, n: int, text: str | None = None) -> list[int]:
    """The first ``n`` tokens of ``text`` (default: ``llmc bench``'s text, CPython's LICENSE.txt), repeated when
    shorter, by the bundle's tokenizer: every engine gets the same ids. Natural text, because a W8A8 shadow
    bundle's prefill speed depends on it (see ``llmc.runtime.bench``); HF and llama.cpp do not care."""
    from tokenizers import Tokenizer

    from llmc.runtime.bench import default_text, first_tokens

    tok = Tokenizer.from_file(str(bundle / "tokenizer" / "tokenizer.json"))
    return first_tokens(lambda t: tok.encode(t).ids, text if text is not None else default_text()[1], n)[0]


class Child:
    """One engine in its own process, measured run by run (see ``CHILD``). Made, it is loading; ``start`` waits for its
    warm-up; ``close`` ends it (``end`` without asking for its peak RSS)."""

    def __init__(self, cfg: dict, timeout: float = TIMEOUT):
        self.engine = cfg["engine"]
        self.timeout = timeout  # seconds a reply (the warm-up, a run) may take before the child is killed
        self.error: str | None = None
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(cfg, f)
        self._cfg = Path(f.name)
        self._err = tempfile.TemporaryFile("w+")
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", CHILD, str(self._cfg)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self._err, text=True)
        except BaseException:
            self._cfg.unlink(missing_ok=True)
            self._err.close()
            raise

    def start(self) -> None:
        """Wait for the child to load and warm up (or fail: ``error``)."""
        self._ask(None)
        self._cfg.unlink(missing_ok=True)  # read by now, or never

    def _ask(self, line: str | None) -> dict | None:
        if self.error is not None:
            return None
        try:
            if line is not None:
                self.proc.stdin.write(line + "\n")
                self.proc.stdin.flush()
            if not select.select([self.proc.stdout], [], [], self.timeout)[0]:
                self.proc.kill()
                self.proc.wait()
                self.error = f"no reply within {self.timeout:g} s: killed (--timeout)"
                return None
            reply = self.proc.stdout.readline()
        except OSError:  # a broken pipe: the child is gone
            reply = ""
        if not reply:
            rc = self.proc.wait()
            self._err.seek(0)
            last = (self._err.read().strip().splitlines() or [""])[-1]  # the child's own message, if it wrote one
            self.error = last if rc == 0 and last else f"exited with {rc}" + (f": {last}" if last else "")
            return None
        return json.loads(reply)

    def run(self) -> dict:
        """One measured run: prefill and decode speeds, TTFT, start time; or the child's error."""
        got = self._ask("run")
        return got if got is not None else {"engine": self.engine, "error": self.error}

    def close(self) -> float | None:
        """Stop the child; its peak RSS in MB (None if it failed)."""
        got = self._ask("quit")
        self.end()
        return got["peak_rss_mb"] if got else None

    def end(self) -> None:
        """End the child (killed if it has not exited within 30 s) and free its pipes and files."""
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        self._cfg.unlink(missing_ok=True)
        self._err.close()


def measure(engines: dict[str, dict], base: dict, turns: int, first_turn: int = 0, timeout: float = TIMEOUT) -> list[dict[str, dict]]:
    """Start every engine's child (one after another, each warmed up), then ``turns`` times let each run once,
    in ``turn_order``; one {engine: result} per turn, each result with the child's peak RSS."""
    kids: dict[str, Child] = {}
    try:
        for name, cfg in engines.items():
            kids[name] = Child({**base, **cfg}, timeout)
            kids[name].start()
        out = []
        for t in range(turns):
            got = {name: kids[name].run() for name in turn_order(list(engines), first_turn + t)}
            out.append({name: got[name] for name in engines})
        for name, kid in kids.items():
            rss = kid.close()
            for turn in out:
                if "error" not in turn[name]:
                    turn[name] = {**turn[name], "peak_rss_mb": rss} if rss is not None else {"engine": kid.engine, "error": kid.error}
    finally:
        for kid in kids.values():
            if kid.proc.poll() is None:  # an exception left it running
                kid.proc.kill()
            kid.end()
    return out


def turn_order(names: list[str], t: int) -> list[str]:
    """Turn ``t``'s engine order: ``names`` rotated by ``t // 2``, and reversed when ``t`` is odd. Over 2 x len(names)
    turns every engine runs at every place twice, after each of its two neighbours in ``names`` (any other engine when
    there are three)."""
    k = (t // 2) % len(names) if names else 0
    order = names[k:] + names[:k]
    return order[::-1] if t % 2 else order


def aggregate(turns: list[dict[str, dict]], refs: tuple[str, ...] = ("hf-eager", "llama.cpp")) -> dict[str, dict]:
    """Per engine over the turns (each a {engine: run result}): median speeds, the largest peak RSS,
    and for every reference engine the median and range of the per-turn prefill and decode ratios.
    An engine that failed in any turn keeps that turn's error."""
    import statistics

    out: dict[str, dict] = {}
    for name in turns[0]:
        runs = [r[name] for r in turns]
        bad = next((x for x in runs if "error" in x), None)
        if bad is not None:
            out[name] = {"error": bad["error"]}
            continue
        res = {k: statistics.median(x[k] for x in runs) for k in ("prefill_tok_s", "decode_tok_s", "ttft_s")}
        res["peak_rss_mb"] = max(x["peak_rss_mb"] for x in runs)
        res["ratios"] = {}
        for ref in refs:
            if ref not in turns[0] or any("error" in r[ref] for r in turns):
                continue
            for k in ("prefill_tok_s", "decode_tok_s"):
                xs = [r[name][k] / r[ref][k] for r in turns]
                res["ratios"][f"{k.split('_')[0]}/{ref}"] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
        out[name] = res
    return out


# the CPU features the engines' kernels choose by (MLAS's int8 kernels, llmc's native ops, llama.cpp's)
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_int8")
PACKAGES = ("llmc", "onnxruntime", "torch", "transformers", "llama_cpp_python")


def machine(cpuinfo: str = "/proc/cpuinfo") -> dict:
    """What the numbers were measured on: the CPU's model, its logical CPUs and the flags in ``FLAGS`` it has, and
    the versions of the packages in ``PACKAGES`` (None where one is not installed)."""
    import os
    import platform
    from importlib import metadata

    from llmc.runtime.cpu import cpu_flags

    model, flags = platform.processor() or platform.machine(), cpu_flags(cpuinfo)
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            model = next((v.strip() for k, _, v in (line.partition(":") for line in f) if k.strip() == "model name" and v.strip()), model)
    except OSError:
        pass

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {"cpu": model, "cpus": os.cpu_count(), "flags": [f for f in FLAGS if f in flags],
            "python": platform.python_version(), "packages": {name: version(name) for name in PACKAGES}}


def describe(m: dict) -> str:
    """``machine()``'s facts in one line."""
    packages = ", ".join(f"{k.replace('_python', '')} {v}" for k, v in m["packages"].items() if v)
    return f"machine: {m['cpu']}, {m['cpus']} CPUs ({' '.join(m['flags']) or 'none of ' + ' '.join(FLAGS)}); Python {m['python']}, {packages}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", action="append", default=[], metavar="NAME=DIR", help="a compiled bundle to measure (repeatable)")
    ap.add_argument("--prompt-lens", default="128,512,2048")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=5, help="measured turns: every engine runs once a turn, the engines taking turns")
    ap.add_argument("--rounds", type=int, default=1, help="start the engines' processes afresh this many times, --repeat turns each")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=TIMEOUT,
                    help=f"seconds an engine's load and warm-up, or one run, may take before it is killed and reported (default {TIMEOUT:g})")
    ap.add_argument("--gguf", default=None, help="GGUF for the reference engines (default: the bundled SmolLM2)")
    ap.add_argument("--prompt-file", default=None, help="UTF-8 text the prompts are cut from (default: llmc bench's, CPython's LICENSE.txt)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not args.bundle:
        ap.error("give at least one --bundle NAME=DIR")
    if args.new_tokens < 2:
        ap.error("--new-tokens must be at least 2 (the first token comes from the prefill; decode speed needs one more)")
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
        base = {"ids": ids, "new_tokens": args.new_tokens, "threads": args.threads, "gguf": gguf}
        engines = {name: {"engine": "llmc", "bundle": d} for name, d in bundles.items()}
        engines["hf-eager"] = {"engine": "hf"}
        if have_llama:
            engines["llama.cpp"] = {"engine": "llama.cpp"}
        turns = []
        for r in range(max(args.rounds, 1)):
            turns += measure(engines, base, max(args.repeat, 1), first_turn=len(turns), timeout=args.timeout)
        rows.append({"prompt_tokens": n_eff, "results": aggregate(turns), "turns": turns})
    if args.json:
        print(json.dumps({"runs": rows, "llama_cpp": have_llama, "prompt_text": text_name, "machine": machine()}))
        return
    if not have_llama:
        print("note: llama-cpp-python is not installed; llama.cpp skipped (pip install llama-cpp-python builds it from source)")
    print(describe(machine()))
    print(f"prompts: the first tokens of {text_name}")
    for row in rows:
        res = row["results"]
        hf = res["hf-eager"]
        lc = res.get("llama.cpp")
        turns = len(row["turns"])
        print(f"\nprompt {row['prompt_tokens']} tokens, {args.new_tokens} new tokens; medians of {turns} turns"
              + (f" ({args.rounds} rounds)" if args.rounds > 1 else "") + ", ratios: median of the per-turn ratios")
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
        if turns > 1:
            print("  per-turn ratio ranges (min..max):")
            for name, r in res.items():
                if "error" not in r and name not in ("hf-eager", "llama.cpp"):
                    print(f"  {name:<12} " + ", ".join(f"{k} {v['min']:.2f}..{v['max']:.2f}" for k, v in r["ratios"].items()))


if __name__ == "__main__":
    main()
