"""Running under a memory budget: streamed graph inputs, the residency manager, the offload section.

The plans here are made by hand (``offload_plans.hand_offload``): they stream
the selected graph weights, read the embedding and shadow tables by row and
keep the rest resident, so these tests do not depend on the cost model.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from conftest import CHUNK, MAX_CONTEXT, write_manifest
from offload_plans import hand_offload

PIPE = {"cpu": "dce,select_logit_rows,chunk_static_graphs",
        "npu": "dce,select_logit_rows,calibrate,extract_shadow_outliers,quantize,quantize_embedding,chunk_static_graphs"}
IDS = [5, 9, 12, 40, 7, 3, 22, 19, 30, 31, 60, 11, 8, 70, 44, 17, 90]  # 3 chunks of 8, the last padded


def _compile(monkeypatch, model_dir, out, target="cpu", select=None, depth=2, extra_buffer=0, **kw):
    import llmc.passes
    from llmc.compile import compile_model

    pipe = PIPE[target]
    if select is not None:
        monkeypatch.setitem(llmc.passes.REGISTRY, "hand_offload", hand_offload(select, depth, extra_buffer))
        pipe += ",hand_offload"
    compile_model(str(model_dir), out, target=target, chunk=CHUNK, max_context=MAX_CONTEXT, pipeline=pipe, **kw)
    return out


def _matrices(n: str) -> bool:
    return bool(re.search(r"(proj\.weight|lm_head\.weight)(\.q8)?$", n))


def _layer1(n: str) -> bool:
    return ".layers.1." in n


NPU_KW = dict(clip_percentile=90.0, hot_budget=0.0, calib_tokens=256)  # many outliers, none hot: shadow rows come from the codes


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, model_dirs, calib_words):
    """(family, target, selection) -> (plain bundle, budgeted bundle)."""
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("offload")
    cache = {}

    def get(family, target, select):
        key = (family, target, select.__name__)
        if key not in cache:
            kw = dict(NPU_KW, calib_file=str(calib_words)) if target == "npu" else {}
            d = model_dirs(family)
            plain = root / f"{family}-{target}-plain"
            if not plain.exists():
                _compile(mp, d, plain, target, **kw)
            cache[key] = (plain, _compile(mp, d, root / "-".join(key), target, select, **kw))
        return cache[key]

    yield get
    mp.undo()


def _run(bundle, prefetch, n_new=10):
    from llmc.runtime import Session

    s = Session(bundle, provider="cpu", prefetch=prefetch)
    logits = s.prefill(IDS, all_logits=True)
    toks = s.generate(IDS, n_new, stop_at_eos=False).token_ids
    return s, logits, toks


def _run_without_prepacking(bundle, monkeypatch):
    """The unbudgeted bundle with ONNX Runtime's prepacking off, as budgeted sessions run."""
    import onnxruntime as ort

    real = ort.SessionOptions

    class NoPrepack(real):
        def __init__(self):
            super().__init__()
            self.add_session_config_entry("session.disable_prepacking", "1")

    monkeypatch.setattr(ort, "SessionOptions", NoPrepack)
    try:
        return _run(bundle, True)
    finally:
        monkeypatch.setattr(ort, "SessionOptions", real)


@pytest.mark.parametrize("family,target,select", [("llama", "cpu", _matrices), ("llama_tied_mha", "cpu", _matrices),
                                                  ("llama", "npu", _matrices), ("qwen2", "cpu", _layer1)])
def test_budgeted_bundle_gives_identical_logits_and_tokens(pairs, monkeypatch, family, target, select):
    """npu: bit-identical logits. cpu (float Gemm): bit-identical to the unbudgeted bundle run without
    prepacking (prepacked float Gemm sums in another order: ~1e-6 apart), same greedy tokens."""
    plain, budgeted = pairs(family, target, select)
    ref, ref_logits, ref_toks = _run(plain, True)
    assert ref.residency is None
    exact = ref_logits if target == "npu" else _run_without_prepacking(plain, monkeypatch)[1]
    for prefetch in (True, False):
        s, logits, toks = _run(budgeted, prefetch)
        try:
            st = s.residency.streaming.stats
            assert np.array_equal(logits, exact), f"prefetch={prefetch}: max diff {np.abs(logits - exact).max()}"
            np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=1e-4)
            assert toks == ref_toks
            assert st.uses > 0 and st.bytes_read > 0 and st.mispredicted == 0
            assert s.outlier_counts == ref.outlier_counts
            tables = [w for w in s._weights.values() if hasattr(w, "rows_read")]
            assert tables and all(t.rows_read >= 0 for t in tables)
            if target == "npu":  # the shadow path read its outliers' rows of the streamed codes from storage
                assert sum(t.rows_read for t in tables if t.name.endswith(".q8")) > 0
        finally:
            s.close()


def test_streamed_weights_are_graph_inputs(pairs):
    import onnx

    from llmc.runtime.cpu import u8s8_is_exact

    plain, budgeted = pairs("llama", "npu", _matrices)
    m = json.loads((budgeted / "manifest.json").read_text())
    streamed = set(m["offload"]["streamed"])
    assert streamed and all(n.endswith(".q8") for n in streamed)
    seen = set()
    for name, g in m["graphs"].items():
        assert g.get("streamed", []) == [w for w in g["weights"] if w in streamed]
        for inst in g["instances"].values():
            model = onnx.load(budgeted / inst["file"], load_external_data=False)
            inputs = {i.name: i for i in model.graph.input}
            inits = {t.name for t in model.graph.initializer}
            casts = {n.input[0]: n for n in model.graph.node if n.op_type == "Cast"}
            for w in g.get("streamed", []):
                assert w in inputs and w not in inits
                # int8 codes fed without a budget (a hand-made plan) become uint8 in the graph (exact everywhere)
                assert casts[w].attribute[0].i == onnx.TensorProto.INT16
                t = inputs[w].type.tensor_type
                assert [d.dim_value for d in t.shape.dim] == m["weights"][w]["shape"]
                assert t.elem_type == onnx.helper.np_dtype_to_tensor_dtype(np.dtype(m["weights"][w]["dtype"]))
                seen.add(w)
            # resident weights are inputs too (fed from memory): no weight is an initializer ORT could copy
            assert set(g.get("fed", [])) == set(g["weights"]) - streamed
            for w in g.get("fed", []):
                if m["weights"][w]["dtype"] == "int8":  # resident int8 codes are cast to uint8 too
                    assert casts[w].attribute[0].i == onnx.TensorProto.INT16
            assert set(g["weights"]) <= set(inputs) and not set(g["weights"]) & inits
            assert not (set(inputs) - set(g["weights"]) - {i["name"] for i in g["inputs"]})
    assert seen == streamed
    assert _int8_kernels(budgeted) == "u8u8" and _int8_kernels(plain) == ("u8s8" if u8s8_is_exact() else "u8u8")
    pm = json.loads((plain / "manifest.json").read_text())
    assert pm["weights"] == m["weights"] and "offload" not in pm
    assert not any("fed" in g or "streamed" in g for g in pm["graphs"].values())


def test_plan_covers_every_weight_the_program_reads(pairs):
    for key in (("llama", "npu", _matrices), ("llama_tied_mha", "cpu", _matrices)):
        _, budgeted = pairs(*key)
        m = json.loads((budgeted / "manifest.json").read_text())
        off = m["offload"]
        read = {w for g in m["graphs"].values() for w in g["weights"]}
        read |= {w for s in m["program"] if s["kind"] == "op" for w in s["weights"].values()}
        covered = set(off["resident"]) | set(off["streamed"]) | set(off["row_streamed"])
        assert read <= covered, sorted(read - covered)[:5]
        assert not set(off["resident"]) & (set(off["streamed"]) | set(off["row_streamed"]))


class _Recorder:
    """Wraps BufferPool.reserve to record live bytes after every reservation."""

    def __init__(self, monkeypatch):
        from llmc.runtime import residency

        self.live: list[tuple[int, int]] = []
        orig = residency.BufferPool.reserve

        def reserve(pool, sizes):
            out = orig(pool, sizes)
            self.live.append((pool.live_bytes, pool.capacity))
            return out

        monkeypatch.setattr(residency.BufferPool, "reserve", reserve)


@pytest.mark.parametrize("depth", [1, 3])
def test_pool_never_holds_more_than_buffer_bytes(tmp_path, model_dirs, monkeypatch, depth):
    """A buffer of exactly the largest step (so the prefetcher must wait for releases) and a deep one."""

    plain = _compile(monkeypatch, model_dirs("llama"), tmp_path / "plain")
    tight = _compile(monkeypatch, model_dirs("llama"), tmp_path / "tight", select=_matrices, depth=0)
    deep = _compile(monkeypatch, model_dirs("llama"), tmp_path / "deep", select=_matrices, depth=depth)
    _, ref_logits, ref_toks = _run_without_prepacking(plain, monkeypatch)
    for bundle in (tight, deep):
        rec = _Recorder(monkeypatch)
        m = json.loads((bundle / "manifest.json").read_text())
        if bundle is tight:  # prefetch `depth` steps ahead, but in a buffer that holds one step
            m["offload"]["prefetch_depth"] = depth
            write_manifest(bundle, m)
        for prefetch in (True, False):
            s, logits, toks = _run(bundle, prefetch)
            st = s.residency.streaming.stats
            s.close()
            assert np.array_equal(logits, ref_logits) and toks == ref_toks
            assert rec.live and max(live for live, _ in rec.live) <= m["offload"]["buffer_bytes"]
            assert all(cap == m["offload"]["buffer_bytes"] for _, cap in rec.live)
            assert 0 < st.peak_buffer_bytes <= m["offload"]["buffer_bytes"]
            rec.live.clear()
    # the tight buffer really is tight: one step's weights fill it
    m = json.loads((tight / "manifest.json").read_text())
    largest = max(sum(_buf(m["weights"][w]["nbytes"]) for w in g.get("streamed", [])) for g in m["graphs"].values())
    assert m["offload"]["buffer_bytes"] == largest


def _buf(n):
    from llmc.runtime.residency import buffer_size

    return buffer_size(n)


def test_pool_reuses_and_evicts_within_capacity():
    from llmc.runtime.residency import BLOCK, BufferPool

    p = BufferPool(6 * BLOCK)
    a = p.reserve([2 * BLOCK, 2 * BLOCK])
    assert a is not None and p.live_bytes == 4 * BLOCK
    assert p.reserve([3 * BLOCK]) is None  # 7 blocks would not fit while a is held
    p.give_back(a)
    b = p.reserve([2 * BLOCK])
    assert b[0] in a and p.live_bytes == 4 * BLOCK  # reused, nothing new mapped
    c = p.reserve([4 * BLOCK])  # needs the kept 2-block buffer dropped
    assert c is not None and p.live_bytes == 6 * BLOCK and p.peak_bytes == 6 * BLOCK


def test_row_table_reads_rows(tmp_path):
    from llmc.runtime.residency import RowTable, WeightFile

    table = np.arange(37 * 5, dtype=np.float32).reshape(37, 5)
    p = tmp_path / "w.bin"
    p.write_bytes(b"\0" * 100 + table.tobytes())
    f = WeightFile(p)
    rt = RowTable(f, "t", 100, table.shape, np.float32)
    idx = np.array([3, 0, 36, 3, -1])
    assert np.array_equal(rt[idx], table[idx])
    assert rt.rows_read == 3  # unique rows, each read once
    assert np.array_equal(rt[np.array([[1, 2], [2, 1]])], table[np.array([[1, 2], [2, 1]])])
    with pytest.raises(IndexError):
        rt[np.array([37])]
    f.close()
    g = WeightFile(p, direct=False)  # the pread + fadvise fallback
    assert not g.direct
    assert np.array_equal(RowTable(g, "t", 100, table.shape, np.float32)[idx], table[idx])
    g.close()


def test_row_table_keeps_planned_rows_and_reads_the_rest_in_parallel(tmp_path):
    from llmc.runtime.errors import BundleError
    from llmc.runtime.residency import RowReader, RowTable, WeightFile

    table = np.random.default_rng(0).standard_normal((300, 700)).astype(np.float32)  # rows span block edges
    p = tmp_path / "w.bin"
    p.write_bytes(b"\0" * 100 + table.tobytes())
    f = WeightFile(p)
    reader = RowReader(f, workers=4)
    rt = RowTable(f, "t", 100, table.shape, np.float32, reader=reader, keep=[5, 7, 299, 5])
    assert rt.resident_bytes == 3 * 700 * 4 and rt.rows_read == 0
    idx = np.array([[7, 1, 5], [299, 8, 1]])
    assert np.array_equal(rt[idx], table[idx])
    assert rt.rows_read == 2  # rows 1 and 8; the kept rows come from memory
    many = np.arange(0, 300, 7)
    assert np.array_equal(rt[many], table[many])  # split across the reader's threads
    with pytest.raises(BundleError, match="beyond"):
        RowTable(f, "t", 100, table.shape, np.float32, keep=[300])
    assert any(t.name.startswith("llmc-rows") for t in threading.enumerate())
    reader.close()
    assert not any(t.name.startswith("llmc-rows") for t in threading.enumerate())
    f.close()


def _tamper(bundle: Path, tmp_path: Path, edit) -> Path:
    out = tmp_path / f"t{len(list(tmp_path.iterdir()))}"
    shutil.copytree(bundle, out)
    m = json.loads((out / "manifest.json").read_text())
    edit(m)
    write_manifest(out, m)
    return out


def _first_streamed_graph(m):
    return next(g for g in m["graphs"].values() if g.get("streamed"))


@pytest.mark.parametrize("edit,match", [
    (lambda m: m["offload"].update(evict_policy="lru"), "does not know"),
    (lambda m: m["offload"].update(resident_rows=[1]), "'resident_rows' has the wrong type"),
    (lambda m: m["offload"].update(resident_rows={m["offload"]["streamed"][0]: [0]}), "not a table read by row"),
    (lambda m: m["offload"].update(resident_rows={m["offload"]["row_streamed"][0]: ["0"]}), "not distinct row numbers"),
    (lambda m: m["offload"].update(resident_rows={m["offload"]["row_streamed"][0]: [True]}), "not distinct row numbers"),
    (lambda m: m["offload"].update(resident_rows={m["offload"]["row_streamed"][0]: [1, 1]}), "not distinct row numbers"),
    (lambda m: m["offload"].update(resident_rows={m["offload"]["row_streamed"][0]: [10**6]}), "not distinct row numbers below"),
    (lambda m: m["offload"].pop("buffer_bytes"), "lacks 'buffer_bytes'"),
    (lambda m: m["offload"].update(prefetch_depth="2"), "lacks 'prefetch_depth' or it has the wrong type"),
    (lambda m: m.update(offload=[1, 2]), "not an object"),
    (lambda m: m["offload"]["streamed"].append("no.such.weight"), "not in the weight table"),
    (lambda m: m["offload"]["streamed"].pop(), "streams .* but the graph feeds"),
    (lambda m: m["offload"]["resident"].pop(), "neither keeps resident nor streams|reads whole"),
    (lambda m: m["offload"]["resident"].append(m["offload"]["streamed"][0]), "both resident and streamed"),
    (lambda m: m["offload"]["resident"].remove(_first_streamed_graph(m)["fed"][0]), "does not keep resident"),
    (lambda m: m["offload"].update(buffer_bytes=1024), "one step streams"),
    (lambda m: m["offload"]["row_streamed"].append("model.rotary_emb.inv_freq") or m["offload"]["resident"].remove("model.rotary_emb.inv_freq"),
     "reads by row weight model.rotary_emb.inv_freq"),
])
def test_offload_section_it_cannot_honour_fails_clearly(pairs, tmp_path, edit, match):
    from llmc.runtime import BundleError, Session

    _, budgeted = pairs("llama", "cpu", _matrices)
    with pytest.raises(BundleError, match=match):
        Session(_tamper(budgeted, tmp_path, edit), provider="cpu")


def test_streamed_graph_without_offload_section_fails(pairs, tmp_path):
    from llmc.runtime import BundleError, Session

    _, budgeted = pairs("llama", "cpu", _matrices)
    with pytest.raises(BundleError, match="no offload section"):
        Session(_tamper(budgeted, tmp_path, lambda m: m.pop("offload")), provider="cpu")


def test_qnn_provider_refuses_a_budgeted_bundle(pairs):
    from llmc.runtime import ProviderError, Session

    _, budgeted = pairs("llama", "cpu", _matrices)
    with pytest.raises(ProviderError, match="memory budget"):
        Session(budgeted, provider="qnn")


def test_cli_no_prefetch(pairs):
    from click.testing import CliRunner

    from llmc.cli import cli

    _, budgeted = pairs("llama", "cpu", _matrices)
    ids = ",".join(map(str, IDS))
    outs = []
    for flag in ([], ["--no-prefetch"]):
        r = CliRunner().invoke(cli, ["run", str(budgeted), "--prompt-ids", ids, "--max-new-tokens", "5", "--no-eos", "--json", *flag])
        assert r.exit_code == 0, r.output
        outs.append(json.loads(r.output)["token_ids"])
    assert outs[0] == outs[1]
    r = CliRunner().invoke(cli, ["bench", str(budgeted), "--prompt-len", "12", "--new-tokens", "4", "--repeat", "1", "--no-prefetch", "--json"])
    assert r.exit_code == 0, r.output
    o = json.loads(r.output)["offload"]
    assert o["prefetch"] is False and o["streamed_bytes_read"] > 0 and o["peak_buffer_bytes"] <= o["buffer_bytes"]
    r = CliRunner().invoke(cli, ["inspect", str(budgeted)])
    assert r.exit_code == 0 and "offload    budget" in r.output


# Runtime overhead on SmolLM2-135M (Python, numpy, ONNX Runtime, sessions, KV cache, activations,
# alignment slack): docs/memory-budget.md measures 120-170 MiB at chunk 256 / max-context 2048 and
# states peak RSS <= resident bytes + buffer bytes + 250 MiB (a full KV cache included).
SMOL_OVERHEAD_MB = 250


@pytest.mark.slow
def test_smollm2_peak_rss_under_budget(smol_bundles, tmp_path, monkeypatch):
    def odd_layers(n):
        m = re.search(r"layers\.(\d+)\.", n)
        return m is not None and int(m.group(1)) % 2 == 1 and _matrices(n)

    import llmc.passes
    from llmc.compile import compile_model

    monkeypatch.setitem(llmc.passes.REGISTRY, "hand_offload", hand_offload(odd_layers, 2))
    out = tmp_path / "smol-half"
    compile_model("smollm2-135m", out, target="cpu", chunk=64, max_context=512, pipeline=PIPE["cpu"] + ",hand_offload",
                  cache_dir=str(smol_bundles["cache"]))
    code = textwrap.dedent(f"""
        import json
        from llmc.runtime import Session
        from llmc.runtime.bench import bench_prompt
        s = Session({str(out)!r}, provider="cpu")
        r = s.generate(bench_prompt(s, 100).ids, 16, stop_at_eos=False)
        # VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the forked (large) pytest process
        hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) / 1024
        print(json.dumps({{"peak_rss_mb": hwm, "resident": s.residency.resident_bytes,
                          "buffer": s.residency.plan["buffer_bytes"], "read": s.residency.streaming.stats.bytes_read}}))
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    limit_mb = (r["resident"] + r["buffer"]) / 2**20 + SMOL_OVERHEAD_MB
    assert r["read"] > 0
    assert r["peak_rss_mb"] <= limit_mb, r
    print(f"SmolLM2 budgeted: peak RSS {r['peak_rss_mb']:.0f} MiB, overhead {r['peak_rss_mb'] - limit_mb + SMOL_OVERHEAD_MB:.0f} MiB")


def _int8_kernels(bundle) -> str | None:
    from llmc.runtime import Session

    s = Session(bundle, provider="cpu")
    try:
        return s.int8_kernels
    finally:
        s.close()


def _compile_npu_budgeted(model_dirs, calib_words, out: Path, budget: str) -> dict:
    """The tiny llama compiled for npu by the compiler's own plan under ``budget``; its offload section."""
    from llmc.compile import compile_model

    compile_model(str(model_dirs("llama")), out, target="npu", chunk=CHUNK, max_context=MAX_CONTEXT, memory_budget=budget,
                  calib_file=str(calib_words), **NPU_KW)
    return json.loads((out / "manifest.json").read_text())["offload"]


def test_plan_offload_bundle_runs_like_the_unbudgeted_one(pairs, tmp_path, model_dirs, calib_words):
    """The compiler's own plan (plan_offload under --memory-budget) end to end: compile, honour, same tokens."""
    plain, _ = pairs("llama", "npu", _matrices)
    out = tmp_path / "budget"
    off = _compile_npu_budgeted(model_dirs, calib_words, out, "80%")
    assert off["streamed"] and off["resident_bytes"] + off["buffer_bytes"] <= off["budget_bytes"]
    m = json.loads((out / "manifest.json").read_text())
    assert "decode_graph" not in m  # weights stream per step of the chunk program
    # fed W8A8 weights are stored as uint8 + 128 (exact u8 x u8 kernels on every CPU, no cast per call);
    # the unbudgeted bundle keeps int8 (llmc.runtime.cpu)
    q8 = [w for n, w in m["weights"].items() if n.endswith(".q8")]
    assert q8 and {w["dtype"] for w in q8} == {"uint8"}
    assert {w["dtype"] for n, w in json.loads((plain / "manifest.json").read_text())["weights"].items() if n.endswith(".q8")} == {"int8"}
    assert _int8_kernels(out) == "u8u8"
    _, ref_logits, ref_toks = _run(plain, True)
    for prefetch in (True, False):
        s, logits, toks = _run(out, prefetch)
        st = s.residency.streaming.stats
        assert s.decode_path == "chunk program"
        s.close()
        assert np.array_equal(logits, ref_logits) and toks == ref_toks
        assert 0 < st.peak_buffer_bytes <= off["buffer_bytes"]


def test_budget_above_the_matrices_keeps_shadow_rows_resident(pairs, tmp_path, model_dirs, calib_words):
    """A budget with room for the matrices keeps the codes the corrections read resident with them: no correction
    reads a row from storage (the embedding's rows are the only ones read by row), and logits stay bit-identical."""
    plain, _ = pairs("llama", "npu", _matrices)
    out = tmp_path / "rows"
    off = _compile_npu_budgeted(model_dirs, calib_words, out, "130%")
    assert not off["streamed"] and off["resident_bytes"] + off["buffer_bytes"] <= off["budget_bytes"]
    assert off["row_streamed"] and all("embed" in n for n in off["row_streamed"]) and not off.get("resident_rows")
    _, ref_logits, ref_toks = _run(plain, True)
    s, logits, toks = _run(out, True)
    try:
        read = {n: t.rows_read for n, t in s.residency.weights.items() if hasattr(t, "rows_read")}
        assert read and all("embed" in n for n in read)
        assert s.residency.resident_bytes == off["resident_bytes"]
    finally:
        s.close()
    assert np.array_equal(logits, ref_logits) and toks == ref_toks
    from click.testing import CliRunner

    from llmc.cli import cli

    r = CliRunner().invoke(cli, ["inspect", str(out)])
    kept = 0
    assert r.exit_code == 0 and f"({kept} of their rows resident)" in r.output and "predicted decode" in r.output


def test_tied_embedding_streamed_for_the_head_and_read_by_row(tmp_path, model_dirs, monkeypatch):
    """An embedding tied to the LM head: plan_offload streams it for the head graph and the
    Embedding op reads its rows; the bundle runs and matches the unbudgeted one."""
    from llmc.compile import compile_model

    d = model_dirs("llama_tied_mha")
    plain, out = tmp_path / "plain", tmp_path / "budget"
    compile_model(str(d), plain, target="cpu", chunk=CHUNK, max_context=MAX_CONTEXT)
    compile_model(str(d), out, target="cpu", chunk=CHUNK, max_context=MAX_CONTEXT, memory_budget="60%", prefetch_depth=0)  # below 70% the head no longer fits resident
    m = json.loads((out / "manifest.json").read_text())
    off = m["offload"]
    table = next(s["weights"]["table"] for s in m["program"] if s.get("op") == "Embedding")
    assert table in off["streamed"] and table in off["row_streamed"] and table not in off["resident"]
    _, ref_logits, ref_toks = _run_without_prepacking(plain, monkeypatch)
    s, logits, toks = _run(out, True)
    s.close()
    assert toks == ref_toks
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=1e-5 * np.abs(ref_logits).max())


def test_prefetch_depth_0_reads_each_step_when_it_runs(model_dirs, tmp_path):
    """--prefetch-depth 0 sizes the ring for the running step only: the runtime does not read ahead, the
    plan predicts the no-prefetch time, and the logits are the unbudgeted bundle's."""
    from llmc.compile import compile_model
    from llmc.runtime import Session

    plain = tmp_path / "plain"
    compile_model(str(model_dirs("llama")), plain, chunk=CHUNK, max_context=MAX_CONTEXT)
    out = tmp_path / "d0"
    compile_model(str(model_dirs("llama")), out, chunk=CHUNK, max_context=MAX_CONTEXT, memory_budget="60%", prefetch_depth=0)
    o = json.loads((out / "manifest.json").read_text())["offload"]
    assert o["prefetch_depth"] == 0 and o["predicted_decode_s"] == pytest.approx(o["predicted_decode_no_prefetch_s"])
    s = Session(out, provider="cpu")
    assert s.residency.streaming.prefetch is False and s.residency.streaming.depth == 0
    from click.testing import CliRunner

    from llmc.cli import cli

    r = CliRunner().invoke(cli, ["inspect", str(out)])
    assert r.exit_code == 0 and "tok/s (no prefetch)" in r.output and "with prefetch" not in r.output, r.output
    r = CliRunner().invoke(cli, ["plan", str(model_dirs("llama")), "--target", "cpu", "--memory-budget", "60%", "--prefetch-depth", "0"])
    assert r.exit_code == 0 and "tok/s (no prefetch)" in r.output and "with prefetch" not in r.output, r.output
    ref = Session(plain, provider="cpu").prefill(IDS, all_logits=True)
    np.testing.assert_allclose(s.prefill(IDS, all_logits=True), ref, atol=1e-4 * np.abs(ref).max())

