"""benchmarks/compare.py's bookkeeping (the engines themselves need the real model: run it by hand)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def compare():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "compare.py"
    spec = importlib.util.spec_from_file_location("compare_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _res(pre, dec, rss=100.0):
    return {"prefill_tok_s": pre, "decode_tok_s": dec, "ttft_s": 1.0 / pre, "peak_rss_mb": rss}


def test_turn_orders(compare):
    """Forward then backward, rotated every two turns: over 2 x n turns every engine runs at every place twice, and
    never always after the same engine."""
    names = ["a", "b", "hf-eager", "llama.cpp"]
    orders = [compare.turn_order(names, t) for t in range(8)]
    assert orders[0] == names and orders[1] == names[::-1] and orders[2] == ["b", "hf-eager", "llama.cpp", "a"]
    assert all(sorted(o) == sorted(names) for o in orders)
    for place in range(4):
        assert sorted(o[place] for o in orders) == sorted(names * 2)
    for name in names:
        before = {o[o.index(name) - 1] for o in orders if o.index(name) > 0}
        assert len(before) == 2
    assert compare.turn_order(names, 8) == names


def test_ratios_are_medians_of_per_turn_ratios(compare):
    """A machine that slows down between turns moves every engine alike: the per-turn ratios stay
    put where ratios of the medians would not."""
    turns = [
        {"x": _res(400, 100), "hf-eager": _res(200, 10), "llama.cpp": _res(100, 50)},
        {"x": _res(300, 75), "hf-eager": _res(150, 7.5), "llama.cpp": _res(75, 37.5, rss=150)},  # 25% slower
        {"x": _res(330, 90), "hf-eager": _res(100, 9), "llama.cpp": _res(110, 45)},
    ]
    out = compare.aggregate(turns)
    x = out["x"]
    assert x["prefill_tok_s"] == 330 and x["decode_tok_s"] == 90
    assert x["ratios"]["prefill/hf-eager"] == {"median": 2.0, "min": 2.0, "max": 3.3}
    assert x["ratios"]["decode/llama.cpp"]["median"] == pytest.approx(2.0)
    assert out["llama.cpp"]["peak_rss_mb"] == 150
    assert out["hf-eager"]["ratios"]["prefill/hf-eager"]["median"] == 1.0


def test_a_failed_turn_is_reported(compare):
    turns = [{"x": _res(1, 1), "hf-eager": _res(1, 1)}, {"x": {"engine": "llmc", "error": "boom"}, "hf-eager": _res(1, 1)}]
    out = compare.aggregate(turns)
    assert out["x"] == {"error": "boom"} and "ratios" in out["hf-eager"]
    turns[1]["hf-eager"] = {"error": "no model"}
    assert compare.aggregate(turns)["x"] == {"error": "boom"}
    assert compare.aggregate([{"y": _res(2, 2), "hf-eager": {"error": "no model"}}])["y"]["ratios"] == {}


def test_prompts_are_llmc_bench_s_natural_text(compare, bundles, tmp_path):
    """compare.py gives every engine the tokens llmc bench prompts with (natural English, not a repeated
    sentence: a shadow bundle's prefill speed depends on the text), or those of --prompt-file, repeated when short."""
    from pathlib import Path

    from llmc.runtime import Session
    from llmc.runtime.bench import bench_prompt

    b = bundles("llama")
    s = Session(b)
    assert compare.token_ids(Path(b), 12) == bench_prompt(s, 12).ids
    text = "the cat sat on the mat"
    assert compare.token_ids(Path(b), 12, text) == bench_prompt(s, 12, ("f", text)).ids == s.encode(f"{text} {text}")


def test_engines_take_turns_run_by_run(compare, bundles):
    """Every engine's child loads once, then runs once a turn, in turn_order; a child that fails
    (here: no bundle) is reported in every turn without holding up the others."""
    b = str(bundles("llama"))
    base = {"ids": list(range(5, 17)), "new_tokens": 3, "threads": 1, "gguf": ""}
    engines = {"a": {"engine": "llmc", "bundle": b}, "b": {"engine": "llmc", "bundle": b},
               "gone": {"engine": "llmc", "bundle": b + "-missing"}}
    turns = compare.measure(engines, base, 3)
    assert len(turns) == 3 and all(list(t) == ["a", "b", "gone"] for t in turns)
    for t in turns:
        for name in ("a", "b"):
            r = t[name]
            assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["ttft_s"] > 0 and r["peak_rss_mb"] > 50
        assert "error" in t["gone"] and "missing" in t["gone"]["error"]
    # turn 0 runs a before b, turn 1 (reversed) b before a (the failed engine's turn is skipped)
    assert turns[0]["a"]["started"] < turns[0]["b"]["started"]
    assert turns[1]["b"]["started"] < turns[1]["a"]["started"]
    assert turns[0]["b"]["started"] < turns[1]["b"]["started"] < turns[2]["a"]["started"]
    out = compare.aggregate(turns, refs=("a",))
    assert out["gone"]["error"] == turns[0]["gone"]["error"]
    assert out["b"]["ratios"]["prefill/a"]["min"] <= out["b"]["ratios"]["prefill/a"]["median"]


def _child_cfg(bundle) -> dict:
    return {"ids": list(range(5, 17)), "new_tokens": 3, "threads": 1, "gguf": "", "engine": "llmc", "bundle": str(bundle)}


def test_a_child_that_dies_is_reported_and_cleaned_up(compare, bundles):
    kid = compare.Child(_child_cfg(bundles("llama")))
    kid.start()
    assert not kid._cfg.exists()  # read at start: nothing left in the temporary directory
    assert kid.run()["prefill_tok_s"] > 0
    kid.proc.kill()
    got = kid.run()
    assert got["error"].startswith("exited with -9") and kid.error == got["error"]
    assert kid.run() == got  # and stays failed
    assert kid.close() is None and kid.proc.returncode == -9 and kid.proc.stdin.closed and kid.proc.stdout.closed


def test_an_exception_in_the_parent_ends_every_child(compare, bundles, monkeypatch):
    made = []
    real_init, real_run = compare.Child.__init__, compare.Child.run

    def init(self, cfg, *args):
        real_init(self, cfg, *args)
        made.append(self)

    calls = []

    def run(self):
        calls.append(self)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_run(self)

    monkeypatch.setattr(compare.Child, "__init__", init)
    monkeypatch.setattr(compare.Child, "run", run)
    b = bundles("llama")
    base = {k: v for k, v in _child_cfg(b).items() if k not in ("engine", "bundle")}
    with pytest.raises(KeyboardInterrupt):
        compare.measure({"x": {"engine": "llmc", "bundle": str(b)}, "y": {"engine": "llmc", "bundle": str(b)}}, base, 2)
    assert len(made) == 2 and all(k.proc.returncode is not None and not k._cfg.exists() for k in made)


def test_new_tokens_below_two_is_refused():
    import subprocess
    import sys

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "compare.py"
    r = subprocess.run([sys.executable, str(path), "--bundle", "x=nowhere", "--new-tokens", "1"], capture_output=True, text=True)
    assert r.returncode == 2 and "--new-tokens must be at least 2" in r.stderr


def test_the_machine_is_recorded(compare, tmp_path):
    """The run's CPU (model, CPUs, the flags kernels choose by) and package versions go with the numbers."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14\n"
                    "flags\t\t: fpu sse2 avx2 fma f16c avx512f avx512_vnni avx512_bf16\n")
    m = compare.machine(str(info))
    assert m["cpu"] == "AMD EPYC 9R14" and m["flags"] == ["avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16"]
    import onnxruntime

    assert m["packages"]["onnxruntime"] == onnxruntime.__version__ and m["packages"]["llmc"]
    line = compare.describe(m)
    assert line.startswith("machine: AMD EPYC 9R14, ") and "avx512_vnni" in line and f"onnxruntime {onnxruntime.__version__}" in line
    bare = compare.machine(str(tmp_path / "missing"))
    assert bare["flags"] == [] and "none of avx2" in compare.describe(bare)


def test_a_child_that_does_not_answer_in_time_is_killed(compare, bundles):
    kid = compare.Child(_child_cfg(bundles("llama")), timeout=0.01)  # loading a bundle takes longer
    kid.start()
    assert kid.error == "no reply within 0.01 s: killed (--timeout)" and kid.proc.returncode == -9
    assert kid.run() == {"engine": "llmc", "error": kid.error} and kid.close() is None
