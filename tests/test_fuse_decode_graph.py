"""fuse_decode_graph: decode as one graph per token, attention over the bound KV cache inside."""

from __future__ import annotations

import json

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
        s.prefill(ids[:prompt])
    runner = one._decode_graph_runner()
    real = runner.__call__
    one._decode_runner = lambda t, p: calls.append(p) or real(t, p)
    for i in range(prompt, len(ids)):
        out.append((one.decode(ids[i]), steps.decode(ids[i])))
    assert calls == list(range(prompt, len(ids)))  # every decode step was one graph call at its position
    return out


@pytest.mark.parametrize("family", ["llama", "llama_tied_mha", "qwen2", "phi3"])
def test_decode_graph_matches_hf_and_the_program(bundles, model_dirs, family):
    """fp32 bundles: one call per token gives HF eager's logits and the per-graph program's, over a
    prompt of more than one chunk; phi3's fused qkv projection goes to the attention node packed."""
    ids = _ids(CHUNK + 9)
    ref = hf_logits(model_dirs(family), ids)
    prompt = CHUNK + 3
    for i, (a, b) in enumerate(_decode_both(bundles(family), ids, prompt)):
        np.testing.assert_allclose(a, ref[prompt + i], atol=1e-4 * max(1.0, np.abs(ref[prompt + i]).max()))
        np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, np.abs(b).max()))


def test_decode_graph_lowering(bundles):
    """One graph, one GroupQueryAttention per layer with its caches as inputs and outputs of the same
    shape, no positions input; the per-graph programs stay in the bundle."""
    import onnx

    b = bundles("phi3")
    m = json.loads((b / "manifest.json").read_text())
    entry = m["graphs"][m["decode_graph"]]
    layers = sum(1 for s in m["program"] if s.get("op") == "Attention")
    assert len(entry["kv"]) == layers and set(entry["instances"]) == {"1"}
    model = onnx.load(b / entry["instances"]["1"]["file"], load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == layers and all(list(n.input)[1:3] == ["", ""] for n in gqa)  # phi3's fused q/k/v goes in packed
    assert ops.count("Slice") == 2 * layers  # only gate and up are sliced
    ins = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    outs = {o.name: [d.dim_value for d in o.type.tensor_type.shape.dim] for o in model.graph.output}
    assert m["io"]["positions"] not in ins and ins[m["io"]["input_ids"]] == [1]
    for kv in entry["kv"]:
        assert ins[kv["past_key"]] == outs[kv["present_key"]] and ins[kv["past_key"]][2] == MAX_CONTEXT
    assert {s["name"] for s in m["program"] if s["kind"] == "graph"} <= set(m["graphs"])


@pytest.mark.parametrize("family,reason", [("mistral", "sliding window"), ("phi", "rotates 8 of 16"), ("gemma", "head size a multiple of 16")])
def test_pass_stands_aside_with_a_reason(bundles, model_dirs, family, reason):
    """Models whose attention the fused node cannot run keep the per-graph decode, and say why."""
    from test_quantization import _ctx

    from llmc.passes.fuse_decode_graph import why_not

    assert "decode_graph" not in json.loads((bundles(family) / "manifest.json").read_text())
    g, _ = _ctx(model_dirs(family))
    assert reason in why_not(g)


def test_int4_bundle_decodes_in_one_graph(model_dirs, tmp_path):
    """Block-quantized weights, merged q/k/v and gate/up, the tied embedding gathered from the head's
    8-bit codes inside the graph: the same logits as the per-graph program."""
    from llmc.compile import compile_model

    out = tmp_path / "int4"
    compile_model(str(model_dirs("llama_tied_mha")), out, target="cpu", weight_format="int4", chunk=CHUNK, max_context=MAX_CONTEXT)
    m = json.loads((out / "manifest.json").read_text())
    assert "BlockEmbedding" in m["graphs"][m["decode_graph"]]["ops"]
    for a, b in _decode_both(out, _ids(CHUNK + 6, seed=5), CHUNK + 1):
        np.testing.assert_allclose(a, b, atol=1e-4 * max(1.0, np.abs(b).max()))


def test_npu_bundle_decode_graph_keeps_the_corrections(model_dirs, calib_words, tmp_path):
    """W8A8 with shadow corrections: the one graph computes what the CPU program computes."""
    from llmc.compile import compile_model

    out = tmp_path / "npu"
    compile_model(str(model_dirs("llama")), out, target="npu", chunk=CHUNK, max_context=MAX_CONTEXT, calib_file=str(calib_words), calib_tokens=256)
    m = json.loads((out / "manifest.json").read_text())
    assert "ShadowOutliers" in m["graphs"][m["decode_graph"]]["ops"] and m["graphs"][m["decode_graph"]]["fed"]
    for a, b in _decode_both(out, _ids(CHUNK + 6, seed=9), CHUNK + 2):
        np.testing.assert_allclose(a, b, atol=1e-4 * max(1.0, np.abs(b).max()))


@pytest.mark.parametrize("bits", [4, 8])
def test_block_embedding_lowering_matches_the_kernel(tmp_path, bits):
    """The graph's gather and dequantization of block-quantized rows == runtime.kernels.block_embedding."""
    import onnxruntime as ort

    from llmc.analyses import DecodeGraph, Subgraph
    from llmc.backends.onnx_backend import _DecodeBuilder, _check, write_weights
    from llmc.ir import Graph
    from llmc.passes.quantize_int4 import quantize_blocks
    from llmc.runtime import kernels

    rng = np.random.default_rng(bits)
    V, K = 12, 64
    codes, scales, offsets = quantize_blocks(rng.standard_normal((V, K)).astype(np.float32), bits)
    g = Graph("emb")
    ws = {k: g.weights.add(k, a.shape, str(a.dtype), lambda a=a: a) for k, a in (("qweight", codes), ("scales", scales), ("offsets", offsets))}
    ids = g.add_input("ids", (1,), "int64")
    node = g.add_node("BlockEmbedding", [ids], attrs={"scale": 0.5, "bits": bits, "block_size": 32}, weights=ws)
    g.set_outputs(node.outputs)
    weights = write_weights(g, list(ws), tmp_path)
    dg = DecodeGraph(Subgraph("emb", (node.name,), ("ids",), (node.outputs[0].name,), tuple(ws), (1,)), "", np.zeros((4, 8), np.float32),
                     np.zeros((4, 8), np.float32), ())
    model = _DecodeBuilder(g, dg, weights, frozenset()).build()
    _check(model, tmp_path)
    so = ort.SessionOptions()
    so.add_external_initializers(list(ws), [ort.OrtValue.ortvalue_from_numpy(a) for a in (codes, scales, offsets)])
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    for t in (0, 7, V - 1):
        want = kernels.block_embedding(np.array([t]), codes, scales, offsets, bits, 0.5)
        got = sess.run(None, {"ids": np.array([t], np.int64), "seqlens_k": np.zeros(1, np.int32), "total_len": np.array(1, np.int32)})[0]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
