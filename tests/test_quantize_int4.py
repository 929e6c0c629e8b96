"""Weight-only int4 for the CPU (``--target cpu --weights int4``): the block format, the
quantize_int4 pass, the ONNX lowering (MatMulNBits over the input widened with its block sums, the offsets
folded into the codes by fold_block_offsets) and bundles end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import CHUNK, MAX_CONTEXT
from llmc.passes.quantize_int4 import BLOCK, quantize_blocks
from llmc.runtime.kernels import dequantize_blocks

IDS = [1, 5, 9, 17, 33, 4, 8, 12, 40, 41, 42, 7, 6, 30, 31, 11, 50, 60, 3, 22]  # 20 tokens: two full chunks and a partial one


@pytest.mark.parametrize("bits", [4, 8])
def test_blocks_round_trip_within_half_a_step(bits):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 3 * BLOCK)).astype(np.float32)
    w[3, :BLOCK] = 0.0  # an all-zero block
    w[4, BLOCK : 2 * BLOCK] = 0.25  # a constant block
    w[5, 2 * BLOCK :] = np.abs(w[5, 2 * BLOCK :]) + 2.0  # a block far from zero: its range does not hold 0
    codes, scales, offsets = quantize_blocks(w, bits)
    assert codes.shape == (40, 3, BLOCK * bits // 8) and codes.dtype == np.uint8
    assert scales.shape == (40 * 3,) and offsets.shape == (3, 40)
    back = dequantize_blocks(codes, scales, offsets, bits)
    step = scales.reshape(40, 3, 1)
    err = np.abs(back - w).reshape(40, 3, BLOCK)
    assert (err <= step / 2 * 1.0001 + 1e-6).all()
    assert np.array_equal(back[3, :BLOCK], w[3, :BLOCK]) and np.allclose(back[4, BLOCK : 2 * BLOCK], 0.25, rtol=0, atol=1e-7)
    # each block's minimum and maximum are on the grid
    blocks, got = w.reshape(40, 3, BLOCK), back.reshape(40, 3, BLOCK)
    assert np.allclose(got.min(axis=2), blocks.min(axis=2), atol=1e-5) and np.allclose(got.max(axis=2), blocks.max(axis=2), atol=1e-5)
    # the far-from-zero block keeps a fine step: an integer zero point would need one 1.7x+ coarser
    far = w[5, 2 * BLOCK :]
    assert scales.reshape(40, 3)[5, 2] == pytest.approx((far.max() - far.min()) / ((1 << bits) - 1), rel=1e-6)


def test_q4_1_weights_come_back_exactly():
    """Weights on llama.cpp's Q4_1 grid (d * q + m, codes 0 and 15 used in every block), as a
    Q4_1 GGUF dequantizes, re-quantize onto the same codes: nothing is lost twice."""
    rng = np.random.default_rng(1)
    n, nb = 24, 4
    q = rng.integers(0, 16, (n, nb, BLOCK)).astype(np.float32)
    q[..., 0], q[..., 1] = 0, 15
    d = rng.uniform(0.001, 0.05, (n, nb, 1)).astype(np.float16).astype(np.float32)
    m = rng.uniform(-0.4, 0.1, (n, nb, 1)).astype(np.float16).astype(np.float32)
    w = (d * q + m).reshape(n, nb * BLOCK)
    codes, scales, offsets = quantize_blocks(w, 4)
    lo = np.empty((n, nb, BLOCK), np.uint8)
    lo[..., 0::2], lo[..., 1::2] = codes & 15, codes >> 4
    assert np.array_equal(lo, q.astype(np.uint8))
    assert np.abs(dequantize_blocks(codes, scales, offsets, 4) - w).max() < 1e-6


def test_q8_0_weights_come_back_exactly_as_symmetric_codes():
    """Weights on llama.cpp's Q8_0 grid (d * q, |q| <= 127 with 127 reached in every block), as a GGUF's
    8-bit head dequantizes, re-quantize onto the same codes with no offsets; random weights stay
    within half a step, and an all-zero block is exact."""
    rng = np.random.default_rng(3)
    n, nb = 24, 4
    q = rng.integers(-127, 128, (n, nb, BLOCK)).astype(np.float32)
    q[..., 0] = np.where(rng.random((n, nb)) < 0.5, -127, 127)
    d = rng.uniform(0.001, 0.05, (n, nb, 1)).astype(np.float16).astype(np.float32)
    w = (d * q).reshape(n, nb * BLOCK)
    w[3, :BLOCK] = 0.0
    codes, scales, offsets = quantize_blocks(w, 8, symmetric=True)
    assert offsets is None and codes.shape == (n, nb, BLOCK)
    expect = q + 128
    expect[3, 0] = 128
    assert np.array_equal(codes, expect.astype(np.uint8))
    back = dequantize_blocks(codes, scales, None, 8)
    assert np.abs(back - w).max() <= 1e-6 * np.abs(w).max() and np.array_equal(back[3, :BLOCK], w[3, :BLOCK])
    r = rng.standard_normal((8, 2 * BLOCK)).astype(np.float32)
    for bits in (4, 8):
        c, s, _ = quantize_blocks(r, bits, symmetric=True)
        err = np.abs(dequantize_blocks(c, s, None, bits) - r).reshape(8, 2, BLOCK)
        assert (err <= s.reshape(8, 2, 1) / 2 * 1.0001 + 1e-7).all()


def test_bad_shapes_and_bits_are_refused():
    with pytest.raises(ValueError, match="multiple of the block size"):
        quantize_blocks(np.zeros((4, 48), np.float32))
    with pytest.raises(ValueError, match="3-bit"):
        quantize_blocks(np.zeros((4, 32), np.float32), bits=3)


def _lift(model_dir, chunk=CHUNK):
    import torch
    import transformers as T

    from llmc.lift import lift, trace

    m = T.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    return lift(trace(m, chunk), m)


def _quantized(graph, pipeline="dce,quantize_int4"):
    from llmc.pass_manager import CompileOptions, PassContext, parse_pipeline, run_pipeline
    from llmc.passes import REGISTRY

    run_pipeline(graph, parse_pipeline(pipeline, REGISTRY), PassContext(CompileOptions(chunk=CHUNK, max_context=MAX_CONTEXT)))
    return graph


def test_pass_quantizes_every_linear_and_the_head_at_8_bits(model_dirs):
    g = _quantized(_lift(model_dirs("llama")))
    assert not g.find("Linear")
    qs = g.find("BlockQLinear")
    assert len(qs) == 2 * 7 + 1
    head = g.outputs[0].producer
    assert head.op == "BlockQLinear" and head.attrs["bits"] == 8
    assert {q.attrs["bits"] for q in qs if q is not head} == {4}
    # the head's 8-bit codes are symmetric (Q8_0): no offsets; the 4-bit ones have them (Q4_1)
    assert "offsets" not in head.weights and all("offsets" in q.weights for q in qs if q is not head)
    assert head.weights["qweight"].shape == (128, 64 // BLOCK, BLOCK)
    g.verify()


def test_pass_keeps_linears_whose_width_is_not_a_multiple_of_32(tmp_path, caplog):
    """hidden 48: q/k/v, gate/up and the head read 48 features and stay float; o_proj and down_proj
    (64 and 96 inputs) are quantized."""
    import logging

    import torch
    import transformers as T

    from conftest import COMMON

    torch.manual_seed(0)
    cfg = T.LlamaConfig(**{**COMMON, "hidden_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16})
    d = tmp_path / "w48"
    T.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    with caplog.at_level(logging.WARNING, logger="llmc.passes.quantize_int4"):
        g = _quantized(_lift(d))
    assert sorted({n.name.split(".")[-2] for n in g.find("BlockQLinear")}) == ["down_proj", "o_proj"]
    assert len(g.find("Linear")) == 2 * 5 + 1
    assert "11 Linear(s) stay float32" in caplog.text and "and 6 more" in caplog.text


@pytest.fixture(scope="module")
def int4_bundles(tmp_path_factory, model_dirs):
    from llmc.compile import compile_model

    root = tmp_path_factory.mktemp("int4")
    out = {}
    for fam in ("llama", "qwen2", "phi"):
        out[fam] = root / fam
        compile_model(str(model_dirs(fam)), out[fam], target="cpu", weight_format="int4", chunk=CHUNK, max_context=MAX_CONTEXT)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi"])
def test_bundle_computes_what_the_quantized_ir_says(int4_bundles, model_dirs, family):
    """Prefill (chunk graphs: float32 compute, except the 8-bit head's int8 activations) matches the
    interpreter on the quantized IR to within 1% of the logits' range (0.3% measured); decode (one-row
    graphs, int8 activations per block everywhere) to within 3% (0.6-1.6% measured).
    Qwen2 and Phi have biases; Phi a parallel block and partial rotary."""
    from llmc.interpreter import Interpreter
    from llmc.runtime import Session

    ref = Interpreter(_quantized(_lift(model_dirs(family)))).run(IDS)
    span = float(ref.max() - ref.min())
    s = Session(int4_bundles[family])
    got = s.prefill(IDS, all_logits=True)
    assert np.abs(got - ref).max() < 1e-2 * span
    s.reset()
    s.prefill(IDS[:12])
    steps = np.stack([s.decode(t) for t in IDS[12:]])
    err = np.abs(steps - ref[12:]).max() / span
    agree = np.mean([int(a.argmax()) == int(b.argmax()) for a, b in zip(steps, ref[12:])])
    print(f"{family}: decode error {err:.4f} of the logits' range, argmax agreement {agree:.3f}")
    assert err < 3e-2 and agree >= 7 / 8


def test_bundle_stays_close_to_the_float_model(int4_bundles, model_dirs):
    """A gross error (a wrong nibble order, offsets transposed) would leave no correlation; Gaussian
    random weights are 4 bits' worst case (0.95 measured), the real model's bound is in test_smollm2."""
    from conftest import hf_logits
    from llmc.runtime import Session

    ref = hf_logits(model_dirs("llama"), IDS)
    got = Session(int4_bundles["llama"]).prefill(IDS, all_logits=True)
    corr = np.corrcoef(got.ravel(), ref.ravel())[0, 1]
    assert corr > 0.9, corr


def test_lowering_is_matmulnbits_with_accuracy_by_rows(int4_bundles):
    """One-row graphs compute with int8 activations (accuracy_level 4), 4-bit chunk graphs in float32 (0),
    the 8-bit head always with int8 activations (ONNX Runtime has no packed float kernel for 8 bits);
    no float copy of a quantized weight is in any graph, and ONNX Runtime keeps MatMulNBits."""
    import onnx
    import onnxruntime as ort

    root = int4_bundles["llama"]
    m = json.loads((root / "manifest.json").read_text())
    assert "quantize_int4" in m["pipeline"]
    tables = {s["weights"]["table"] for s in m["program"] if s.get("op") == "Embedding"}  # an untied embedding stays float32
    float_weights = {n for n, w in m["weights"].items() if w["dtype"] == "float32" and len(w["shape"]) == 2 and not n.endswith(".offset")} - tables
    seen = {1: 0, CHUNK: 0}
    for name, g in m["graphs"].items():
        assert not float_weights & set(g["weights"]), (name, float_weights & set(g["weights"]))
        for rows, inst in g["instances"].items():
            model = onnx.load(root / inst["file"], load_external_data=False)
            mm = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
            for n in mm:
                attrs = {a.name: a.i for a in n.attribute}
                assert attrs["accuracy_level"] == (4 if int(rows) == 1 or attrs["bits"] == 8 else 0) and attrs["bits"] in (4, 8)
            seen[int(rows)] += len(mm) if name != m["decode_graph"] else 0
    assert seen[1] == seen[CHUNK] == 2 * 4 + 1  # q/k/v and gate/up merged (fuse_sibling_linears)
    decode_ops = [n.op_type for n in onnx.load(root / m["graphs"][m["decode_graph"]]["instances"]["1"]["file"], load_external_data=False).graph.node]
    # the offsets folded into the codes (fold_block_offsets): no Gemm, one widened input per 4-bit matmul's input
    assert decode_ops.count("MatMulNBits") == 9 and "Gemm" not in decode_ops and decode_ops.count("Concat") == 8
    # after ONNX Runtime's optimisations the MatMulNBits nodes are still there (no float fallback)
    from llmc.runtime import Session

    s = Session(root)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opt = root.parent / "opt.onnx"
    so.optimized_model_filepath = str(opt)
    inst = m["graphs"]["block01"]["instances"]["1"]["file"]
    names = [n for n in m["graphs"]["block01"]["weights"]]
    so.add_external_initializers(names, [ort.OrtValue.ortvalue_from_numpy(s._weights[n]) for n in names])
    ort.InferenceSession((root / inst).read_bytes(), so, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(opt, load_external_data=False).graph.node]
    assert ops.count("MatMulNBits") == 4 and "DequantizeLinear" not in ops


def test_constant_blocks_stay_exact_at_one_row(model_dirs, tmp_path):
    """A constant block gets scale 0: with a nonzero scale, MatMulNBits' int8 rounding of the
    activations would leave (q - 2^(bits-1)) x uncancelled by the offset term, and all-zero head rows
    (padded vocabulary) scored far from 0 at decode."""
    import torch
    import transformers as T

    from llmc.compile import compile_model
    from llmc.runtime import Session

    m = T.AutoModelForCausalLM.from_pretrained(model_dirs("llama"), dtype=torch.float32)
    with torch.no_grad():
        m.lm_head.weight[100:110] = 0.0
        m.model.layers[0].mlp.down_proj.weight[:, :BLOCK] = 0.25  # a constant block in every output row
    d = tmp_path / "padded"
    m.save_pretrained(d)
    out = tmp_path / "b"
    compile_model(str(d), out, target="cpu", weight_format="int4", chunk=CHUNK, max_context=MAX_CONTEXT)
    s = Session(out)
    s.prefill(IDS[:12])
    steps = np.stack([s.decode(t) for t in IDS[12:]])
    assert np.all(steps[:, 100:110] == 0.0), np.abs(steps[:, 100:110]).max()


def test_int4_is_refused_where_it_cannot_work(model_dirs, tmp_path):
    """--memory-budget (streamed MatMulNBits weights are dequantized to float32 on every call), a
    --pipeline without quantize_int4, and quantize_int4 on the npu target are errors before any work."""
    from llmc.compile import compile_model
    from llmc.errors import CompileError

    src = str(model_dirs("llama"))
    kw = dict(chunk=CHUNK, max_context=MAX_CONTEXT)
    with pytest.raises(CompileError, match="--memory-budget"):
        compile_model(src, tmp_path / "a", target="cpu", weight_format="int4", memory_budget="50%", **kw)
    with pytest.raises(CompileError, match="no quantize_int4 pass"):
        compile_model(src, tmp_path / "b", target="cpu", weight_format="int4", pipeline="dce,select_logit_rows,chunk_static_graphs,place,schedule,plan_offload", **kw)
    with pytest.raises(CompileError, match="does not apply to --target npu"):
        compile_model(src, tmp_path / "c", target="npu", pipeline="dce,select_logit_rows,quantize_int4,chunk_static_graphs,place,schedule,plan_offload", **kw)
    assert not any(tmp_path.iterdir())


def test_forced_npu_placement_keeps_int4_graphs_on_the_cpu(model_dirs, tmp_path, caplog):
    import logging

    from llmc.compile import compile_model

    out = tmp_path / "p"
    with caplog.at_level(logging.WARNING, logger="llmc.passes.place"):
        compile_model(str(model_dirs("llama")), out, target="cpu", weight_format="int4", placement="npu", profile="8gen3", chunk=CHUNK, max_context=MAX_CONTEXT)
    placement = json.loads((out / "manifest.json").read_text())["placement"]
    assert set(placement["prefill"].values()) == set(placement["decode"].values()) == {"cpu"}
    assert "stays on the CPU" in caplog.text


def test_cli_weights_option(model_dirs, tmp_path):
    from click.testing import CliRunner

    from llmc.cli import cli

    r = CliRunner().invoke(cli, ["compile", str(model_dirs("llama")), "--target", "npu", "--weights", "int4", "-o", str(tmp_path / "x")])
    assert r.exit_code != 0 and "--weights int4 applies to --target cpu" in r.output
    assert not (tmp_path / "x").exists()
    out = tmp_path / "ok"
    r = CliRunner().invoke(cli, ["compile", str(model_dirs("llama")), "--weights", "int4", "--chunk", "8", "--max-context", "64", "-o", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    assert "quantize_int4" in r.output
    r = CliRunner().invoke(cli, ["run", str(out), "--prompt", "the cat saw a", "--max-new-tokens", "4", "--no-eos", "--json"])
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.output)["token_ids"]) == 4


def test_plan_predicts_the_int4_program_from_a_config(tmp_path):
    """`llmc plan --target cpu --weights int4`: no weight is read (meta tensors); the int4 program reads
    fewer bytes per token than float32, so the cost model predicts faster decode."""
    from conftest import SMALL
    from llmc.errors import CompileError
    from llmc.plan import plan_model

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(SMALL))
    kw = dict(profile="8gen3", prompt_len=512, target="cpu", chunk=256)
    f32, q4 = plan_model(str(cfg), **kw), plan_model(str(cfg), weight_format="int4", **kw)
    assert "quantize_int4" in q4.pipeline and "quantize_int4" not in f32.pipeline
    assert q4.weight_bytes < 0.5 * f32.weight_bytes
    assert q4.as_dict()["decode"]["tok_s"] > 2 * f32.as_dict()["decode"]["tok_s"]
    with pytest.raises(CompileError, match="does not apply to --target npu"):
        plan_model(str(cfg), profile="8gen3", prompt_len=512, target="npu", weight_format="int4")


@pytest.mark.parametrize("bits,symmetric", [(4, False), (8, False), (8, True)])
def test_block_embedding_kernel_gathers_dequantized_rows(bits, symmetric):
    from llmc.runtime import kernels

    rng = np.random.default_rng(2)
    w = rng.standard_normal((50, 3 * BLOCK)).astype(np.float32)
    codes, scales, offsets = quantize_blocks(w, bits, symmetric=symmetric)
    ids = np.array([7, 0, 49, 7, 13])
    got = kernels.block_embedding(ids, codes, scales, offsets, bits, 2.0)
    assert np.allclose(got, 2.0 * dequantize_blocks(codes, scales, offsets, bits)[ids], rtol=1e-6, atol=1e-6)


def test_tied_embedding_reads_the_head_codes(model_dirs, tmp_path):
    """A tied embedding gathers from the LM head's 8-bit codes: the float table leaves the bundle and the
    logits match the interpreter on the quantized IR."""
    from llmc.compile import compile_model
    from llmc.interpreter import Interpreter
    from llmc.runtime import Session

    d = model_dirs("llama_tied_mha")
    g = _quantized(_lift(d))
    (emb,) = g.find("BlockEmbedding")
    head = g.outputs[0].producer
    assert not g.find("Embedding") and emb.weights["qweight"] is head.weights["qweight"] and emb.attrs["bits"] == 8
    ref = Interpreter(g).run(IDS)
    out = tmp_path / "tied"
    compile_model(str(d), out, target="cpu", weight_format="int4", chunk=CHUNK, max_context=MAX_CONTEXT)
    m = json.loads((out / "manifest.json").read_text())
    assert not [n for n, w in m["weights"].items() if w["dtype"] == "float32" and len(w["shape"]) == 2 and not n.endswith(".offset")]
    assert m["program"][0]["op"] == "BlockEmbedding"
    got = Session(out).prefill(IDS, all_logits=True)
    assert np.abs(got - ref).max() < 1e-2 * float(ref.max() - ref.min())
