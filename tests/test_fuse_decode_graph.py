"""fuse_decode_graph: decode as one graph per token, attention over the bound KV cache inside."""

from __future__ import annotations

import gc
import json
import os
import time

import numpy as np
import pytest

from conftest import CHUNK, MAX_CONTEXT, hf_logits


def _ids(n: int, seed: int = 3) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(4, 120, size=n)]


def _decode_both(bundle, ids: list[int], prompt: int):
    """(logits from the decode graph, from the per-graph program) for each token after the first ``prompt``."""
    from llmc.runtime import Session

    one, steps = Session(bundle, "cpu"), Session(bundle, "cpu")
    assert one._decode_graph == "decode_model"
    steps._decode_graph = None
    calls = []
    out = []
    for s in (one, steps):
        s.reset()
        s.prefill(ids[:prompt], all_logits=True)  # the same chunk path for both (prefill ends in the decode graph otherwise)
    runner = one._decode_graph_runner()
    real = runner.__call__
    one._decode_runner = lambda x, p: calls.append(p) or real(x, p)
    for i in range(prompt, len(ids)):
        out.append((one.decode(ids[i]), steps.decode(ids[i])))
    assert calls == list(range(prompt, len(ids)))  # every decode step was one graph call at its position
    return out


@pytest.mark.parametrize("family", ["llama", "llama_tied_mha", "qwen2", "phi3", "mistral", "gemma", "phi"])
def test_decode_graph_matches_hf_and_the_program(bundles, model_dirs, family):
    """fp32 bundles: one call per token gives HF eager's logits and the per-graph program's, over a
    prompt of more than one chunk; phi3's fused qkv projection goes to the attention node packed;
    mistral's sliding window (12) is shorter than the context; gemma's head size (24) and phi's partial
    rotary (8 of 16) are rotated by RotaryEmbedding before the attention node."""
    ids = _ids(CHUNK + 9)
    ref = hf_logits(model_dirs(family), ids)
    prompt = CHUNK + 3
    for i, (a, b) in enumerate(_decode_both(bundles(family), ids, prompt)):
        np.testing.assert_allclose(a, ref[prompt + i], atol=1e-4 * max(1.0, np.abs(ref[prompt + i]).max()))
        np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, np.abs(b).max()))


def test_decode_graph_lowering(bundles):
    """One graph, one GroupQueryAttention per layer with its caches as inputs and outputs of the same
    shape, the embedding row as its input (no ids, no positions); the per-graph programs stay in the bundle."""
    import onnx

    b = bundles("phi3")
    m = json.loads((b / "manifest.json").read_text())
    entry = m["graphs"][m["decode_graph"]]
    layers = sum(1 for s in m["program"] if s.get("op") == "Attention")
    assert len(entry["kv"]) == layers and set(entry["instances"]) == {"1", str(CHUNK)} and entry["instances"][str(CHUNK)]["dynamic"]
    model = onnx.load(b / entry["instances"]["1"]["file"], load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == layers and all(list(n.input)[1:3] == ["", ""] for n in gqa)  # phi3's fused q/k/v goes in packed
    assert ops.count("Slice") == 2 * layers  # only gate and up are sliced
    ins = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    outs = {o.name: [d.dim_value for d in o.type.tensor_type.shape.dim] for o in model.graph.output}
    (emb,) = [st for st in m["program"] if st.get("op") == "Embedding"]  # the runtime gathers the row and feeds it
    assert m["io"]["positions"] not in ins and m["io"]["input_ids"] not in ins and ins[emb["outputs"][0]] == [1, m["model"]["hidden_size"]]
    for kv in entry["kv"]:
        assert ins[kv["past_key"]] == outs[kv["present_key"]] and ins[kv["past_key"]][2] == MAX_CONTEXT
    assert {s["name"] for s in m["program"] if s["kind"] == "graph"} <= set(m["graphs"])
    # the chunk instance: the same nodes at any row count up to C, SelectRows a Gather of the rows that need logits
    chunk = onnx.load(b / entry["instances"][str(CHUNK)]["file"], load_external_data=False)
    assert [n.op_type for n in chunk.graph.node if n.op_type == "GroupQueryAttention"] == ["GroupQueryAttention"] * layers
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in list(chunk.graph.input) + list(chunk.graph.output)}
    assert dims[emb["outputs"][0]] == ["rows", m["model"]["hidden_size"]] and dims[entry["logit_rows"]] == [entry["logit_rows"]]
    assert dims[m["io"]["logits"]] == [entry["logit_rows"], m["model"]["vocab_size"]]
    (select,) = [n for n in chunk.graph.node if entry["logit_rows"] in n.input]
    assert select.op_type == "Gather"


def test_rotation_outside_the_node_and_the_sliding_window(bundles):
    """phi (partial rotary) rotates with RotaryEmbedding and passes q/k/v apart; mistral's window (12) is
    the node's local_window_size."""
    import onnx

    for family, check in (("phi", lambda ops, gqa: ops.count("RotaryEmbedding") == 2 * len(gqa) and all(n.input[1] for n in gqa)),
                          ("mistral", lambda ops, gqa: all({a.name: a.i for a in n.attribute}["local_window_size"] == 12 for n in gqa))):
        b = bundles(family)
        m = json.loads((b / "manifest.json").read_text())
        model = onnx.load(b / m["graphs"][m["decode_graph"]]["instances"]["1"]["file"], load_external_data=False)
        gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
        assert gqa and check([n.op_type for n in model.graph.node], gqa), family


def test_int4_bundle_decodes_in_one_graph(model_dirs, tmp_path):
    """Block-quantized weights, merged q/k/v and gate/up, the tied embedding gathered by the runtime from
    the head's 8-bit codes and fed to the graph: the same logits as the per-graph program."""
    from llmc.compile import compile_model

    out = tmp_path / "int4"
    compile_model(str(model_dirs("llama_tied_mha")), out, target="cpu", weight_format="int4", chunk=CHUNK, max_context=MAX_CONTEXT)
    m = json.loads((out / "manifest.json").read_text())
    entry = m["graphs"][m["decode_graph"]]
    assert "BlockEmbedding" not in entry["ops"] and [x["name"] for x in entry["inputs"]] == [s["outputs"][0] for s in m["program"][:1]]
    for a, b in _decode_both(out, _ids(CHUNK + 6, seed=5), CHUNK + 1):
        np.testing.assert_allclose(a, b, atol=1e-4 * max(1.0, np.abs(b).max()))


def test_npu_bundle_decode_graph_keeps_the_corrections(model_dirs, calib_words, tmp_path):
    """W8A8 with shadow corrections: the one graph computes what the CPU program computes."""
    from llmc.compile import compile_model

    out = tmp_path / "npu"
    compile_model(str(model_dirs("llama")), out, target="npu", chunk=CHUNK, max_context=MAX_CONTEXT, calib_file=str(calib_words), calib_tokens=256)
    m = json.loads((out / "manifest.json").read_text())
    entry = m["graphs"][m["decode_graph"]]
    # the corrections read the projections' own codes, constants of the graph: nothing fed, no table of their own
    assert "ShadowOutliers" in entry["ops"] and not entry.get("fed")
    (table,) = [s["weights"]["codes"] for s in m["program"] if s.get("op") == "QEmbedding"]
    assert m["weights"][table]["dtype"] == "int8" and table not in entry["weights"]  # the runtime gathers the embedding
    # q/k/v merged (fuse_sibling_linears): the correction adds into the projection whole and attention takes it packed
    import onnx

    graph = onnx.load(str(out / entry["instances"]["1"]["file"]), load_external_data=False).graph
    gqa = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert gqa and all(list(n.input[1:3]) == ["", ""] and n.input[0].endswith(".whole.bsd") for n in gqa)
    assert not [n for n in graph.node if n.op_type == "Split"]
    for a, b in _decode_both(out, _ids(CHUNK + 6, seed=9), CHUNK + 2):
        np.testing.assert_allclose(a, b, atol=1e-4 * max(1.0, np.abs(b).max()))


def test_chunk_1_bundle_warms_up_every_prefill_session(model_dirs, tmp_path):
    """With --chunk 1 the one-row instances are prefill's: warmup creates them, so a first prefill
    prepares no session; decode is still the one graph."""
    from llmc.compile import compile_model
    from llmc.runtime import Session

    out = tmp_path / "c1"
    compile_model(str(model_dirs("llama")), out, target="cpu", chunk=1, max_context=MAX_CONTEXT)
    s = Session(out, "cpu")
    before = set(s._sessions)
    assert ("decode_model", 1, False) in before and ("head", 1, False) not in before  # the decode graph scores the last token
    s.prefill(_ids(5))
    s.decode(7)
    assert set(s._sessions) == before


@pytest.fixture(scope="module")
def c32_bundle(model_dirs, tmp_path_factory):
    """The tiny llama, cpu target, chunk 32 (a tail of up to 2 tokens goes through the decode graph)."""
    from llmc.compile import compile_model

    out = tmp_path_factory.mktemp("c32") / "llama"
    compile_model(str(model_dirs("llama")), out, target="cpu", chunk=32, max_context=MAX_CONTEXT)
    return out


@pytest.mark.parametrize("n,exact,graph_calls,chunks", [(33, True, 1, 1), (35, True, 1, 2), (36, True, 1, 2), (1, True, 1, 0),
                                                       (33, False, 1, 1), (35, False, 3, 1), (36, False, 1, 2), (1, False, 1, 0)])
def test_prefill_ends_in_the_decode_graph(c32_bundle, model_dirs, monkeypatch, n, exact, graph_calls, chunks):
    """The last prompt token runs through the decode graph, and prefill gives HF's logits; all_logits
    keeps the chunks. A cpu bundle's graphs take the last chunk at its own length (``exact``); where it
    would be padded (the NPU's graphs), a tail of up to C/16 tokens after the last whole chunk runs
    through the decode graph too (chunk 32: up to 2)."""
    from llmc.runtime import Session

    out = c32_bundle
    ids = _ids(n, seed=n)
    ref = hf_logits(model_dirs("llama"), ids)
    s = Session(out, "cpu", lazy=True)
    s._chunk_graph = False  # as a decode graph without a chunk instance (no rotation in the node, a sliding window, an int8 cache)
    s.warmup()
    assert s._exact_chunks
    if not exact:  # pad the last chunk to C, as programs with fixed shapes do
        monkeypatch.setattr(s, "_dynamic", lambda graph: False)
    assert not any(rows == 1 and name != "decode_model" for name, rows, _ in s._sessions)  # no one-row head session
    runner = s._decode_graph_runner()
    calls, chunk_starts = [], []
    monkeypatch.setattr(s, "_decode_runner", lambda x, p: calls.append(p) or runner(x, p))
    real = s._prefill_scheduled
    monkeypatch.setattr(s, "_prefill_scheduled", lambda ids, rows: chunk_starts.append(len(rows)) or real(ids, rows))
    got = s.prefill(ids)
    assert len(calls) == graph_calls and sum(chunk_starts) == chunks and s.position == n
    np.testing.assert_allclose(got, ref[-1], atol=1e-4 * np.abs(ref[-1]).max())
    s.reset()
    s.position = 0
    np.testing.assert_allclose(s.prefill(ids, all_logits=True), ref, atol=1e-4 * np.abs(ref).max())


def test_empty_prompt_is_a_named_error(bundles):
    from llmc.runtime import PromptTooLongError, Session

    with pytest.raises(PromptTooLongError, match="empty"):
        Session(bundles("llama"), "cpu").prefill([])


def test_token_ids_outside_the_vocabulary_are_named_errors(bundles):
    """prefill, decode and `llmc run --prompt-ids` refuse an id past the vocabulary or below zero (exit 6),
    before anything runs."""
    from click.testing import CliRunner

    from llmc.cli import cli
    from llmc.runtime import Session, TokenIdError

    s = Session(bundles("llama"), "cpu")
    vocab = s.manifest["model"]["vocab_size"]
    for ids in ([5, vocab], [-1, 5]):
        with pytest.raises(TokenIdError, match=f"token id {ids[0] if ids[0] < 0 else vocab} is outside the vocabulary"):
            s.prefill(ids)
        assert s.position == 0
    s.prefill([5, 6])
    with pytest.raises(TokenIdError, match="outside the vocabulary"):
        s.decode(vocab + 3)
    r = CliRunner().invoke(cli, ["run", str(bundles("llama")), "--prompt-ids", f"5,{vocab}", "--max-new-tokens", "2"])
    assert r.exit_code == 6 and f"token id {vocab} is outside the vocabulary" in r.output and "hint:" in r.output, r.output


@pytest.mark.parametrize("n,chunks,steps", [(5, 1, 1), (257, 1, 1), (300, 2, 1)])
def test_schedule_prices_prefill_ending_in_the_decode_graph(tmp_path, monkeypatch, n, chunks, steps):
    """The schedule mirrors Session.prefill (chunk 256, CPU placement) with a decode graph that has no chunk
    instance: the timeline covers the chunked tokens (the last chunk at its own length) and head_s the
    decode-graph step of the last token."""
    from conftest import plan_small

    from llmc.analyses import Schedule
    from llmc.passes import DEFAULT_PIPELINES, fuse_decode_graph
    from llmc.passes.place import cost_model

    monkeypatch.setattr(fuse_decode_graph, "why_not_chunks", lambda graph, native=False: "a model whose attention cannot take a chunk")
    g, ctx = plan_small(tmp_path, pipeline=DEFAULT_PIPELINES["plan-cpu"], target="cpu", prompt_len=n)
    s = ctx.get(Schedule)
    assert len({t.chunk for t in s.chosen.tasks}) == chunks
    cm = cost_model(g, ctx)
    assert s.head_s == pytest.approx(sum(cm.decode_graph_seconds(n - steps + i + 1) for i in range(steps)))
    assert s.prefill_s > 0 and s.decode_s == pytest.approx(cm.decode_graph_seconds(n))


def test_npu_prefill_ends_in_the_graph_only_when_that_saves_a_chunk(c32_bundle, model_dirs):
    """When the CPU does not prefill (QNN), a CPU decode step costs more than the NPU head: prefill ends
    in the decode graph only for a short tail (chunk 32: up to 2 tokens), else the chunk's head scores."""
    from llmc.runtime import Session

    s = Session(c32_bundle, "cpu")
    s._ends_in_graph = s._chunk_graph = False  # as with the QNN provider and prefill on the NPU (fixed shapes)
    s._dynamic = lambda graph: False
    for n, in_graph in ((35, 3), (36, 0)):
        ids = _ids(n, seed=n)
        runner, calls = s._decode_graph_runner(), []
        s._decode_runner = lambda x, p, runner=runner: calls.append(p) or runner(x, p)
        s.reset()
        s.position = 0
        got = s.prefill(ids)
        s._decode_runner = runner
        assert len(calls) == in_graph
        ref = hf_logits(model_dirs("llama"), ids)[-1]
        np.testing.assert_allclose(got, ref, atol=1e-4 * np.abs(ref).max())


def test_npu_prefill_keeps_the_one_row_head_warm(c32_bundle, monkeypatch):
    """With decode on the CPU but prefill elsewhere (QNN), a longer last chunk is scored by the head at
    one row: warmup creates that session, so no prefill prepares a graph."""
    from llmc.runtime import Session

    monkeypatch.setattr(Session, "_on_cpu", lambda self, phase: phase == "decode")
    s = Session(c32_bundle, "cpu")
    assert s._decode_graph and not s._ends_in_graph
    before = set(s._sessions)
    assert ("head", 1, False) in before and ("decode_model", 1, False) in before
    assert ("decode_model", 32, False) not in before  # the chunk instance prefills only when the CPU runs both phases
    s.prefill(_ids(36))  # the last chunk holds 4 tokens: the head scores it
    assert set(s._sessions) == before


def test_only_the_decode_graph_session_spins(bundles):
    """The decode graph's workers spin between its kernels; every other session's sleep (they run in turn)."""
    from llmc.runtime import Session

    s = Session(bundles("llama"), "cpu", threads=2)
    spinning = {name for (name, _, _), (sess, _) in s._sessions.items()
                if sess.get_session_options().get_session_config_entry("session.intra_op.allow_spinning") == "1"}
    assert spinning == {"decode_model"} and len(s._sessions) > 1
    # the chunk instance stops spinning when a call returns, so it takes no core from the decode that follows
    def stops(sess) -> bool:
        try:
            return sess.get_session_options().get_session_config_entry("session.force_spinning_stop") == "1"
        except RuntimeError:  # not set
            return False

    assert {rows for (_, rows, _), (sess, _) in s._sessions.items() if stops(sess)} == {CHUNK}


def _threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _cpu_seconds(threads: set[int]) -> float:
    """The CPU time so far of these threads of this process (Linux: /proc/self/task/*/stat, in clock ticks)."""
    ticks = 0
    for t in threads:
        try:
            fields = open(f"/proc/self/task/{t}/stat").read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def _cpu_after_generation(bundle, monkeypatch, spin_us: int) -> float:
    """The CPU time the threads a Session started use in the 0.3 s after a generation, its decode graph's
    workers spinning at most ``spin_us``."""
    from llmc.runtime import Session, session

    monkeypatch.setattr(session, "ONE_THREAD_BYTES", 0)  # the small model's one-row graph on two threads, as a real one's
    monkeypatch.setattr(session, "DECODE_SPIN_US", spin_us)
    before = _threads()
    s = Session(bundle, "cpu", threads=2)
    one_row = [sess for (name, rows, _), (sess, _) in s._sessions.items() if name == "decode_model" and rows == 1]
    assert one_row and one_row[0].get_session_options().intra_op_num_threads == 2
    assert all(sess.get_session_options().get_session_config_entry("session.intra_op.spin_duration_us") == str(spin_us)
               for (name, _, _), (sess, _) in s._sessions.items() if name == "decode_model")
    s.generate(_ids(20), 8, stop_at_eos=False)  # warm
    gc.collect()
    gc.disable()  # no collection between the last token and the window, nor in it: what the workers use is spinning
    try:
        s.generate(_ids(20), 8, stop_at_eos=False)
        started = _threads() - before  # ONNX Runtime's workers (not the caller, nor other tests' threads)
        t0 = _cpu_seconds(started)
        time.sleep(0.3)
        used = _cpu_seconds(started) - t0
    finally:
        gc.enable()
    del s
    gc.collect()
    return used


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads threads' CPU time from Linux's /proc")
def test_the_decode_graph_workers_sleep_soon_after_the_last_token(bundles, monkeypatch):
    """After a generation the decode graph's workers spin at most DECODE_SPIN_US, not on into whatever runs next
    (ONNX Runtime's default spin, 2^20 rounds, kept a core busy for about 40 ms after the last token)."""
    import onnxruntime as ort

    from llmc.runtime.ort_attention import ort_version
    from llmc.runtime.session import DECODE_SPIN_US

    if ort_version(ort) < (1, 26):
        pytest.skip(f"onnxruntime {ort.__version__} has no session.intra_op.spin_duration_us (1.26 and later)")
    assert _cpu_after_generation(bundles("llama"), monkeypatch, DECODE_SPIN_US) < 0.025  # ticks of 10 ms: at most 2
    # the control: workers that may spin longer than the window are seen spinning through it
    assert _cpu_after_generation(bundles("llama"), monkeypatch, 1_000_000) > 0.05  # about 0.3 on an idle core


@pytest.mark.parametrize("n", [2, 10])
def test_a_one_row_last_chunk_runs_on_the_chunk_instance(bundles, model_dirs, n):
    """A prompt whose last chunk has one row (after the chunks, before the last token) runs it on the
    chunk instance: no one-row session of a block graph (its own copy of the weights) is made in
    prefill, and the logits are HF's, the last token's and every row's (the head at its own rows)."""
    from llmc.runtime import Session

    ids = _ids(n, seed=n)
    ref = hf_logits(model_dirs("llama"), ids)
    s = Session(bundles("llama"), "cpu")
    got = s.prefill(ids)
    assert not any(rows == 1 and name != "decode_model" for name, rows, _ in s._sessions), sorted(s._sessions)
    np.testing.assert_allclose(got, ref[-1], atol=1e-4 * np.abs(ref[-1]).max())
    s.reset()
    s.position = 0
    np.testing.assert_allclose(s.prefill(ids, all_logits=True), ref, atol=1e-4 * np.abs(ref).max())
    assert not any(rows == 1 and name != "decode_model" for name, rows, _ in s._sessions), sorted(s._sessions)


def test_schedule_prices_the_last_chunk_at_its_own_rows(tmp_path, monkeypatch):
    """A cpu bundle's graphs take the last chunk at its own length, and the schedule prices each of its
    steps at those rows (300 tokens, chunk 256, a decode graph without a chunk instance: the last token
    in the decode graph, a 43-row chunk)."""
    from conftest import plan_small

    from llmc.analyses import ChunkPlan, Schedule
    from llmc.passes import DEFAULT_PIPELINES, fuse_decode_graph
    from llmc.passes.place import cost_model

    monkeypatch.setattr(fuse_decode_graph, "why_not_chunks", lambda graph, native=False: "a model whose attention cannot take a chunk")
    g, ctx = plan_small(tmp_path, pipeline=DEFAULT_PIPELINES["plan-cpu"], target="cpu", prompt_len=300)
    plan, cm = ctx.get(ChunkPlan), cost_model(g, ctx)
    assert all(s.dynamic_rows for s in plan.subgraphs)
    last = [t for t in ctx.get(Schedule).chosen.tasks if t.chunk == 1]
    assert last
    for t in last:
        assert t.end - t.start == pytest.approx(cm.step_seconds(plan.steps[t.step], 43, 43, 256 + 43, "cpu"))


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3"])
def test_prefill_is_one_call_of_the_chunk_instance_per_chunk(bundles, model_dirs, monkeypatch, family):
    """With a chunk instance, prefill is one call of the decode graph per chunk of up to C tokens (the
    last at its own length, scoring only its last row) and gives HF's logits; decode goes on from the
    cache the chunks wrote; a second prompt continues after the cached positions, every row scored;
    no other session is made (per-layer graphs, attention calls, one-row heads)."""
    from llmc.runtime import Session

    n = 2 * CHUNK + 3
    ids = _ids(n + 4, seed=11)
    ref = hf_logits(model_dirs(family), ids)
    tol = 1e-4 * np.abs(ref).max()
    s = Session(bundles(family), "cpu")
    assert s.prefill_path == "graph" and {name for name, _, _ in s._sessions} == {"decode_model"}
    runner, calls = s._chunk_graph_runner(), []
    monkeypatch.setattr(s, "_chunk_runner", lambda x, p, rows: calls.append((p, x[0].shape[0], list(rows))) or runner(x, p, rows))
    got = s.prefill(ids[:n])
    assert calls == [(0, CHUNK, []), (CHUNK, CHUNK, []), (2 * CHUNK, 3, [2])] and s.position == n
    np.testing.assert_allclose(got, ref[n - 1], atol=tol)
    for i in range(n, n + 4):
        np.testing.assert_allclose(s.decode(ids[i]), ref[i], atol=tol)
    s.reset()
    np.testing.assert_allclose(s.prefill(ids[:5], all_logits=True), ref[:5], atol=tol)
    np.testing.assert_allclose(s.prefill(ids[5:n], all_logits=True), ref[5:n], atol=tol)
    assert {name for name, _, _ in s._sessions} == {"decode_model"}


@pytest.mark.parametrize("family", ["mistral", "gemma", "phi"])
def test_no_chunk_instance_where_the_node_cannot_take_a_chunk(bundles, model_dirs, family):
    """Only attention nodes that rotate q and k themselves, without a sliding window, prefill in the decode
    graph: mistral (window 12), gemma (heads of 24) and phi (8 of 16 dims rotated) keep one instance and
    prefill through the chunk program, still with HF's logits."""
    from llmc.runtime import Session

    m = json.loads((bundles(family) / "manifest.json").read_text())
    assert set(m["graphs"][m["decode_graph"]]["instances"]) == {"1"} and "logit_rows" not in m["graphs"][m["decode_graph"]]
    s = Session(bundles(family), "cpu")
    assert s.decode_path == "graph" and s.prefill_path == "chunk program"
    ids = _ids(CHUNK + 5, seed=4)
    ref = hf_logits(model_dirs(family), ids)
    np.testing.assert_allclose(s.prefill(ids), ref[-1], atol=1e-4 * np.abs(ref[-1]).max())


def test_npu_bundle_chunk_instance_computes_the_cpu_program(model_dirs, calib_words, tmp_path):
    """W8A8 with shadow corrections on the CPU: the chunk instance corrects a chunk in row blocks, and the
    head's inputs at the rows SelectRows keeps in their own blocks, as the CPU program does, so every
    row's logits are the CPU program's; the plan prices this prefill (``prefill_program`` "graph")."""
    from llmc.compile import compile_model
    from llmc.runtime import Session

    out = tmp_path / "npu"
    compile_model(str(model_dirs("llama")), out, target="npu", chunk=CHUNK, max_context=MAX_CONTEXT, calib_file=str(calib_words), calib_tokens=256)
    report = json.loads((out / "report.json").read_text())
    assert report["predictions"]["prefill_program"] == "graph"
    one = Session(out, "cpu")
    program = Session(out, "cpu", lazy=True)
    program._chunk_graph = False
    program.warmup()
    assert one.prefill_path == "graph" and program.prefill_path == "cpu program"
    ids = _ids(2 * CHUNK + 5, seed=13)
    a, b = one.prefill(ids, all_logits=True), program.prefill(ids, all_logits=True)
    np.testing.assert_allclose(a, b, atol=1e-4 * max(1.0, np.abs(b).max()))
    one.reset()
    np.testing.assert_allclose(one.prefill(ids), b[-1], atol=1e-4 * max(1.0, np.abs(b).max()))


@pytest.mark.parametrize("n", [300, 1000])
def test_schedule_prices_prefill_in_the_chunk_instance(tmp_path, n):
    """With a chunk instance and the CPU running both phases the runtime prefills one decode-graph call per
    chunk, the last at its own rows, scoring its last row inside: the schedule prices exactly that (no
    decode step, no separate head), below the CPU program's per-layer calls; the head is priced at the
    rows that need logits only."""
    from conftest import plan_small

    from llmc.analyses import DecodeGraph, Schedule
    from llmc.passes import DEFAULT_PIPELINES
    from llmc.passes.place import cost_model

    g, ctx = plan_small(tmp_path, pipeline=DEFAULT_PIPELINES["plan-cpu"], target="cpu", prompt_len=n)
    s, cm = ctx.get(Schedule), cost_model(g, ctx)
    assert ctx.get(DecodeGraph).subgraph.row_counts == (1, 256) and s.prefill_program == "graph"
    assert s.head_s > 0 and {t.chunk for t in s.chosen.tasks} == set(range(len(range(0, n, 256))))  # the chunk program's, whole
    rows = [min(256, n - i) for i in range(0, n, 256)]
    want = sum(cm.chunk_graph_seconds(r, i * 256 + r, int(i == len(rows) - 1)) for i, r in enumerate(rows))
    assert s.chunk_graph_s == pytest.approx(want) and s.prefill_s == pytest.approx(want)
    assert cm.chunk_graph_seconds(256, 256, 0) < cm.chunk_graph_seconds(256, 256, 1) < cm.chunk_graph_seconds(256, 256, 256)
    npu, npu_ctx = plan_small(tmp_path, placement="cpu", prompt_len=n)  # W8A8: the CPU program is priced too
    s = npu_ctx.get(Schedule)
    assert s.prefill_program == "graph" and s.chunk_graph_s < s.cpu_program_s


@pytest.mark.parametrize("n", [1, CHUNK, 2 * CHUNK])
def test_chunk_instance_prompt_lengths_and_rewind(bundles, model_dirs, n):
    """A one-token prompt, exactly one chunk and exactly two through the chunk instance give HF's logits;
    after decoding, a rewind and a second prompt across a chunk boundary continue from the cache."""
    from llmc.runtime import Session

    ids = _ids(n + CHUNK + 4, seed=n + 20)
    ref = hf_logits(model_dirs("llama"), ids)
    tol = 1e-4 * np.abs(ref).max()
    s = Session(bundles("llama"), "cpu")
    np.testing.assert_allclose(s.prefill(ids[:n]), ref[n - 1], atol=tol)
    np.testing.assert_allclose(s.decode(ids[n]), ref[n], atol=tol)
    s.rewind(n)  # forget the decoded token, then feed it again with a chunk's worth more
    np.testing.assert_allclose(s.prefill(ids[n:], all_logits=True), ref[n:], atol=tol)
    assert s.position == len(ids)
