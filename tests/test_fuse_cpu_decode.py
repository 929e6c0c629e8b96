"""fuse_cpu_decode: the shadow correction lowered to ONNX, and the CPU program (decode, and prefill on the CPU)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import CHUNK, MAX_CONTEXT, write_manifest


HOT = [3]  # the hot channel of _shadow_graph's correction: exact, its float row less the codes' (hot_delta)


def shadow_tables(W: np.ndarray, hot: list[int] = HOT) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """A correction's weights for float weights ``W`` [N, K] (``quantize``'s: int8 codes, column scales, the hot
    channels' rows of hot_delta), and the table it applies, [K, N]: the codes' values, the hot rows exact."""
    from llmc.passes.quantize import quantize_weight

    codes, scale = quantize_weight(W, per_channel=True)
    applied = codes.astype(np.float32) * scale
    delta = W[:, hot].T - applied[hot] if hot else np.zeros((1, W.shape[0]), np.float32)
    applied[hot] = W[:, hot].T
    return {"codes": codes, "scale": scale, "hot": np.ascontiguousarray(delta, np.float32)}, applied


def _shadow_graph(rows: int, K: int, splits: list[int], tables: dict[str, np.ndarray], lo: float, hi: float, sliced: bool = False,
                  dynamic: bool = False, hot_channels: list[int] = HOT):
    """One ShadowOutliers over inputs x and y0, y1, ...; with ``sliced``, the ys are consecutive column
    slices of one input y (a merged projection); with ``dynamic``, the instance takes any row count up to ``rows``."""
    from llmc.analyses import Subgraph
    from llmc.ir import Graph

    g = Graph("shadow")
    refs = {k: g.weights.add(k, v.shape, str(v.dtype), lambda v=v: v) for k, v in tables.items()}
    x = g.add_input("x", (rows, K), "float32")
    members = []
    if sliced:
        y = g.add_input("y", (rows, sum(splits)), "float32")
        ends = np.cumsum(splits).tolist()
        members = [g.add_node("Slice", [y], attrs={"start": a, "end": b}, name=f"y{i}") for i, (a, b) in enumerate(zip([0, *ends[:-1]], ends))]
        ys, ins = [n.outputs[0] for n in members], [x, y]
    else:
        ys = [g.add_input(f"y{i}", (rows, n), "float32") for i, n in enumerate(splits)]
        ins = [x, *ys]
    node = g.add_node("ShadowOutliers", [x, *ys], attrs={"lo": lo, "hi": hi, "hot_channels": hot_channels, "splits": splits, "w_zero_point": 0},
                      weights={"codes": refs["codes"], "scale": refs["scale"], "hot_delta": refs["hot"]})
    g.set_outputs(node.outputs)
    sub = Subgraph("s", tuple(n.name for n in [*members, node]), tuple(v.name for v in ins), tuple(v.name for v in node.outputs), tuple(tables),
                   (rows,), dynamic_rows=dynamic)
    return g, sub


@pytest.mark.parametrize("rows,sliced,dynamic,run", [(1, False, False, (1,)), (5, False, False, (5,)), (1, True, False, (1,)), (5, True, False, (5,)),
                                                     (130, False, False, (130,)), (128, True, False, (128,)),
                                                     (200, False, True, (200, 1, 64, 65, 129, 193, 196)), (256, True, True, (256, 255, 3))])
def test_onnx_shadow_matches_float_matmul(tmp_path, rows, sliced, dynamic, run):
    """clip(x) @ W (the NPU part) + the in-graph correction == x @ W where the outliers are in the hot channel,
    the codes' values in the others (as the runtime's kernel); no outliers leaves y as is. When
    the corrected results are slices of one projection (q/k/v merged), the correction adds into it
    whole: no Split, one Sum. A chunk's correction runs in equal blocks of about 64 rows, each with its
    own channels: at fixed row counts (130: two blocks of 65) and at any row count of a dynamic
    instance, with outliers in one block, in several, and in none."""
    import onnx
    import onnxruntime as ort

    from llmc.backends.onnx_backend import emit_graphs, write_weights
    from llmc.runtime import cpu

    rng = np.random.default_rng(rows)
    K, splits = 32, [24, 8]
    W = rng.standard_normal((sum(splits), K)).astype(np.float32)
    lo, hi = -2.0, 2.0
    tables, applied = shadow_tables(W)
    g, sub = _shadow_graph(rows, K, splits, tables, lo, hi, sliced, dynamic)

    class Plan:
        subgraphs = (sub,)

    weights = write_weights(g, list(tables), tmp_path)
    table = emit_graphs(g, Plan, weights, tmp_path)
    assert sorted(table["s"]["weights"]) == ["codes", "hot", "scale"]
    model = (tmp_path / table["s"]["instances"][str(rows)]["file"]).read_bytes()
    ops = [n.op_type for n in onnx.load_model_from_string(model).graph.node]
    assert (ops.count("Split"), ops.count("Add")) == ((0, 2) if sliced else (1, 3))  # (one Add: the hot channel's rows)
    if rows > 1:  # per block: its channels of the delta (GatherElements), their weight rows (Gather)
        assert ops.count("GatherElements") == 1 and ops.count("TopK") == 1
    so = ort.SessionOptions()
    values = [ort.OrtValue.ortvalue_from_numpy(v) for v in tables.values()]
    so.add_external_initializers(list(tables), values)  # as the runtime feeds weights
    sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"], **cpu.session_kwargs())
    for n in run:
        # in a chunk, column 5's two outliers are equal and opposite past the range: a detection that
        # summed the deltas without their sign dropped would miss the column; in the last rows, columns
        # 11 and 20 have outliers that no other block shares
        opposite = [(0, 5, hi + 1.5), (n - 1, 5, lo - 1.5), (n - 1, 11, 3.0), (n - 2, 20, -2.5)] if n > 1 else []
        for planted in ([(0, 3, 9.0), (n - 1, 17, -7.5), (0, 30, 4.0), *opposite], []):
            x = rng.uniform(-1.9, 1.9, (n, K)).astype(np.float32)
            for r, c, v in planted:
                x[r, c] = v
            ys = np.clip(x, lo, hi) @ W.T
            feeds = {"x": x, "y": ys} if sliced else {"x": x, "y0": ys[:, :24].copy(), "y1": ys[:, 24:].copy()}
            got = np.concatenate(sess.run(None, feeds), axis=1)
            assert got.shape == (n, sum(splits))
            np.testing.assert_allclose(got, ys + (x - np.clip(x, lo, hi)) @ applied, rtol=1e-5, atol=1e-4)
            if not planted:
                np.testing.assert_array_equal(got, ys)


@pytest.fixture(scope="module")
def npu_bundle(tmp_path_factory, model_dirs, calib_words):
    from llmc.compile import compile_model

    out = tmp_path_factory.mktemp("fused") / "npu"
    compile_model(str(model_dirs("llama")), out, target="npu", chunk=CHUNK, max_context=MAX_CONTEXT, calib_file=str(calib_words), calib_tokens=256)
    return out


def test_decode_program_shape(npu_bundle):
    """One graph between two attentions, the corrections inside it, at one row and at the chunk's rows,
    weights shared with the chunk program."""
    import json

    m = json.loads((npu_bundle / "manifest.json").read_text())
    dp, prog = m["decode_program"], m["program"]
    layers = sum(1 for s in prog if s.get("op") == "Attention")
    assert not [s for s in dp if s.get("op") == "ShadowOutliers"]
    assert sum(1 for s in prog if s.get("op") == "ShadowOutliers") > layers  # the cut it removes
    graphs = [s["name"] for s in dp if s["kind"] == "graph"]
    assert len(graphs) == layers + 2  # before each attention, after the last one, the head
    assert all(m["graphs"][g]["placement"] == "cpu" and set(m["graphs"][g]["instances"]) == {"1", str(CHUNK)} for g in graphs)
    assert "ShadowOutliers" in m["graphs"][graphs[1]]["ops"]
    chunk_weights = {w for s in prog if s["kind"] == "graph" for w in m["graphs"][s["name"]]["weights"]}
    shadow_weights = {w for s in prog if s.get("op") == "ShadowOutliers" for w in s["weights"].values()}
    assert {w for g in graphs for w in m["graphs"][g]["weights"]} <= chunk_weights | shadow_weights


def test_fused_decode_matches_ir_and_chunk_program(npu_bundle, model_dirs, calib_words):
    """Decode through the fused program gives the IR's logits (the interpreter runs the same
    quantized graph) and the chunk program's; the QNN-style program is still there."""
    from test_quantization import _ctx, _run

    from llmc.interpreter import Interpreter
    from llmc.runtime import Session

    ids = [int(t) for t in np.random.default_rng(7).integers(4, 120, size=CHUNK + 5)]
    g, ctx = _ctx(model_dirs("llama"), calib_file=str(calib_words))
    _run(g, ctx, "dce,select_logit_rows,calibrate,extract_shadow_outliers,quantize,quantize_embedding")
    ref = Interpreter(g).run(ids, select_rows=np.arange(len(ids)))
    fused, chunked = Session(npu_bundle, "cpu"), Session(npu_bundle, "cpu")
    assert fused._decode_program is not None
    chunked._decode_program, chunked._cpu_prefill = None, False
    for s in (fused, chunked):
        s.reset()
        s.prefill(ids[:CHUNK])
    got = []
    for i in range(CHUNK, len(ids)):
        a, b = fused.decode(ids[i]), chunked.decode(ids[i])
        got.append((a, a.copy()))
        np.testing.assert_allclose(a, ref[i], atol=2e-3 * np.abs(ref[i]).max())
        np.testing.assert_allclose(a, b, atol=2e-3 * np.abs(b).max())
    for a, kept in got:  # logits handed out are never a buffer a later step reuses
        np.testing.assert_array_equal(a, kept)


def test_cpu_prefill_runs_the_cpu_program(npu_bundle, model_dirs, calib_words, monkeypatch, tmp_path):
    """With the CPU provider, prefill runs the CPU program at chunk rows (no chunk-program graph and
    no Python shadow correction runs) and gives the IR's logits, for a prompt of two chunks and a
    partial one (run at its own 3 rows), scoring every row and only the last; without chunk-row instances (bundles before
    them) it falls back to the chunk program."""
    from test_quantization import _ctx, _run

    from llmc.interpreter import Interpreter
    from llmc.runtime import Session, kernels

    ids = [int(t) for t in np.random.default_rng(11).integers(4, 120, size=2 * CHUNK + 3)]
    g, ctx = _ctx(model_dirs("llama"), calib_file=str(calib_words))
    _run(g, ctx, "dce,select_logit_rows,calibrate,extract_shadow_outliers,quantize,quantize_embedding")
    ref = Interpreter(g).run(ids, select_rows=np.arange(len(ids)))
    s = Session(npu_bundle, "cpu", lazy=True)
    s._chunk_graph = False  # as a bundle whose decode graph has no chunk instance (an int8 KV cache; older bundles)
    s.warmup()
    assert s._cpu_prefill and s.prefill_path == "cpu program" and not s.counts_outliers
    assert {g for g, _, _ in s._sessions} == s._decode_graphs | {"decode_model"}  # warmup made no chunk-program session
    ran = []
    real_run_graph = s._run_graph
    monkeypatch.setattr(s, "_run_graph", lambda st, buf, phase: ran.append((st["name"], buf[st["inputs"][0]].shape[0])) or real_run_graph(st, buf, phase))
    monkeypatch.setattr(kernels, "shadow_outliers", lambda *a, **k: pytest.fail("a Python shadow correction ran"))
    s.reset()
    got = s.prefill(ids, all_logits=True)
    np.testing.assert_allclose(got, ref, atol=2e-3 * np.abs(ref).max())
    assert {name for name, _ in ran} <= s._decode_graphs and {rows for _, rows in ran} == {CHUNK, 3}  # the last chunk at its own length
    assert ("decode_head", 3) in ran  # the head scores the last chunk's rows as they are
    s.reset()
    ran.clear()
    np.testing.assert_allclose(s.prefill(ids), ref[-1], atol=2e-3 * np.abs(ref[-1]).max())
    assert "decode_head" not in [name for name, _ in ran]  # the last token's logits come from the decode graph
    s._decode_graph = None  # without one, the head runs only for the chunk with the last token
    s.reset()
    ran.clear()
    np.testing.assert_allclose(s.prefill(ids), ref[-1], atol=2e-3 * np.abs(ref[-1]).max())
    assert [name for name, _ in ran].count("decode_head") == 1
    monkeypatch.undo()
    import json
    import shutil

    copy = tmp_path / "one-row-cpu-program"
    shutil.copytree(npu_bundle, copy)
    m = json.loads((copy / "manifest.json").read_text())
    for name in [st["name"] for st in m["decode_program"] if st["kind"] == "graph"] + [m["decode_graph"]]:  # as bundles before the chunk-row instances were
        inst = m["graphs"][name]["instances"].pop(str(CHUNK))
        del m["files"][inst["file"]]
        (copy / inst["file"]).unlink()
    del m["graphs"][m["decode_graph"]]["logit_rows"]
    write_manifest(copy, m)
    old = Session(copy, "cpu")
    assert not old._cpu_prefill and old._decode_program is not None and old.counts_outliers
    old.reset()
    np.testing.assert_allclose(old.prefill(ids, all_logits=True), ref, atol=2e-3 * np.abs(ref).max())
    assert sum(old.outlier_counts.values()) > 0  # the chunk program's Python corrections ran


def test_plain_w8a8_gets_a_cpu_program_at_any_row_count(model_dirs, calib_words, tmp_path, monkeypatch):
    """Without shadow corrections (--no-shadow) the CPU program has the chunk program's cut, with chunk
    instances that take any row count: a prompt's last chunk runs at its own length on the CPU provider
    (the chunk program's graphs, which may run on the NPU, are fixed at C rows), same logits."""
    from llmc.compile import compile_model
    from llmc.runtime import Session, load_manifest

    out = tmp_path / "plain"
    compile_model(str(model_dirs("llama")), out, target="npu", chunk=CHUNK, max_context=MAX_CONTEXT, calib_file=str(calib_words), calib_tokens=256,
                  shadow=False)
    m = load_manifest(out)
    assert len(m["decode_program"]) == len(m["program"])
    assert all(m["graphs"][st["name"]]["instances"][str(CHUNK)].get("dynamic") for st in m["decode_program"] if st["kind"] == "graph")
    assert not any(m["graphs"][st["name"]]["instances"][str(CHUNK)].get("dynamic") for st in m["program"] if st["kind"] == "graph")
    ids = [int(t) for t in np.random.default_rng(5).integers(4, 120, size=2 * CHUNK + 3)]
    s = Session(out, "cpu", lazy=True)
    s._chunk_graph = False  # the CPU program's prefill (the decode graph's chunk instance is tested in test_fuse_decode_graph)
    s.warmup()
    assert s._cpu_prefill and s._exact_chunks
    ran = []
    real_run_graph = s._run_graph
    monkeypatch.setattr(s, "_run_graph", lambda st, buf, phase: ran.append((st["name"], buf[st["inputs"][0]].shape[0])) or real_run_graph(st, buf, phase))
    s.reset()
    got = s.prefill(ids, all_logits=True)
    assert {name for name, _ in ran} <= s._decode_graphs and {rows for _, rows in ran} == {CHUNK, 3}
    s._cpu_prefill = False  # the chunk program, its last chunk padded to C rows
    ran.clear()
    s.reset()
    ref = s.prefill(ids, all_logits=True)
    assert {rows for _, rows in ran} == {CHUNK}
    np.testing.assert_allclose(got, ref, atol=1e-5 * np.abs(ref).max())


def test_cpu_program_follows_the_placement_off_the_cpu_provider(npu_bundle):
    """With the QNN provider a phase runs the CPU program only when its placement keeps every graph on the CPU."""
    from llmc.runtime import Session

    s = Session(npu_bundle, "cpu", lazy=True)
    s.provider = "qnn"
    graphs = [st["name"] for st in s.program if st["kind"] == "graph"]
    s._placement = {"prefill": {g: "cpu" for g in graphs}, "decode": {g: "npu" for g in graphs}}
    assert s._on_cpu("prefill") and not s._on_cpu("decode")
    s._placement["prefill"][graphs[1]] = "npu"
    assert not s._on_cpu("prefill")


def test_pass_on_a_planned_model_and_when_it_stands_aside(tmp_path):
    from conftest import plan_small

    from llmc.analyses import ChunkPlan, DecodePlan
    from llmc.passes import FuseCpuDecode

    graph, ctx = plan_small(tmp_path)
    FuseCpuDecode().run(graph, ctx)
    dp, cp = ctx.get(DecodePlan), ctx.get(ChunkPlan)
    assert len(dp.steps) < len(cp.steps) and {s.row_counts for s in dp.subgraphs} == {(1, cp.chunk)}
    assert [s.name for s in dp.steps if s.kind == "op"] == [s.name for s in cp.steps if s.kind == "op" and graph.node(s.name).op != "ShadowOutliers"]

    graph, ctx = plan_small(tmp_path, memory_budget="50%")  # streamed per step of the chunk program
    FuseCpuDecode().run(graph, ctx)
    assert not ctx.has(DecodePlan)
    graph, ctx = plan_small(tmp_path, target="cpu")  # no shadow corrections: the chunk program is already maximal
    FuseCpuDecode().run(graph, ctx)
    assert not graph.find("ShadowOutliers") and not ctx.has(DecodePlan)


def test_inspect_shows_decode_program_placement_and_predictions(npu_bundle):
    import json

    from click.testing import CliRunner

    from llmc.cli import cli

    r = CliRunner().invoke(cli, ["inspect", str(npu_bundle)])
    assert r.exit_code == 0, r.output
    lines = {line.split()[0]: line for line in r.output.splitlines() if line and not line.startswith(" ")}
    m = json.loads((npu_bundle / "manifest.json").read_text())
    assert lines["decode"].startswith(f"decode     one call of {m['decode_graph']} per token")
    assert lines["prefill"].startswith(f"prefill    one call of {m['decode_graph']} per chunk of up to {CHUNK} tokens")
    assert f"(also in the bundle: the CPU program, fuse_cpu_decode, {len(m['decode_program'])} steps per chunk" in r.output
    assert "(8gen3) prefill:" in lines["placement"] and "decode: 0 on NPU" in lines["placement"]
    pred = m["schedule"]["predicted"]
    assert f"decode {pred['decode_tok_s']:.1f} tok/s" in lines["predicted"]
    summary = json.loads(CliRunner().invoke(cli, ["inspect", str(npu_bundle), "--json"]).output)
    assert summary["decode_program"][2] == "decode00" and summary["predicted"] == pred and summary["decode_graph"] == "decode_model"


def test_session_options_follow_the_graph_size(npu_bundle):
    """Small one-row graphs run on one thread with their own arena; chunk graphs on every
    thread with the shared arena."""
    from llmc.runtime import Session

    s = Session(npu_bundle, "cpu", threads=2)
    seen = set()
    for (name, rows, _), (sess, _) in s._sessions.items():
        so = sess.get_session_options()
        try:
            shared = so.get_session_config_entry("session.use_env_allocators") == "1"
        except RuntimeError:  # not set
            shared = False
        if rows == 1:
            assert so.intra_op_num_threads == 1 and not shared  # the tiny model's graphs are all small
        else:
            assert so.intra_op_num_threads == 2 and shared
        seen.add(rows)
    assert seen == {1, CHUNK}


def test_shadow_blocks():
    """Equal blocks of about 64 rows: a 256-row chunk in four, a prime row count whole."""
    from llmc.runtime.kernels import shadow_blocks

    assert [shadow_blocks(r) for r in (1, 5, 64, 128, 130, 196, 200, 251, 255, 256, 512)] == [1, 1, 1, 2, 2, 4, 4, 1, 5, 4, 8]
    assert all(r % shadow_blocks(r) == 0 for r in range(1, 600))


def test_chunk_correction_keeps_every_channel_beside_a_nan(tmp_path):
    """A NaN in a chunk counts as an outlier channel: ONNX Runtime's TopK ranks NaN first, so a count
    without it would leave a real outlier channel out of the block's selection."""
    import onnx
    import onnxruntime as ort

    from llmc.backends.onnx_backend import emit_graphs, write_weights
    from llmc.runtime import cpu

    rng = np.random.default_rng(0)
    K, splits, rows = 32, [24, 8], 64
    W = rng.standard_normal((sum(splits), K)).astype(np.float32)
    tables, _ = shadow_tables(W)
    g, sub = _shadow_graph(rows, K, splits, tables, -2.0, 2.0)

    class Plan:
        subgraphs = (sub,)

    table = emit_graphs(g, Plan, write_weights(g, list(tables), tmp_path), tmp_path)
    model = onnx.load_model_from_string((tmp_path / table["s"]["instances"][str(rows)]["file"]).read_bytes())
    chans = next(o for n in model.graph.node if n.op_type == "TopK" for o in n.output if o.endswith(".chans"))
    model.graph.output.append(onnx.helper.make_empty_tensor_value_info(chans))  # the block's selected channels
    so = ort.SessionOptions()
    so.add_external_initializers(list(tables), [ort.OrtValue.ortvalue_from_numpy(v) for v in tables.values()])
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"], **cpu.session_kwargs())
    x = rng.uniform(-1.9, 1.9, (rows, K)).astype(np.float32)
    x[3, 7], x[10, 20], x[40, 28], x[63, 30] = np.nan, 5.0, -4.0, 3.0
    ys = np.clip(np.nan_to_num(x), -2.0, 2.0) @ W.T
    *_, selected = sess.run(None, {"x": x, "y0": ys[:, :24].copy(), "y1": ys[:, 24:].copy()})
    assert {20, 28, 30} <= set(selected.ravel().tolist())
