"""Frontend: what the lifter produces from a traced model, and how it refuses."""

from __future__ import annotations

import pytest


def _lift(family, model_dirs, rows=8):
    import torch
    import transformers as T

    from llmc.lift import lift, trace

    m = T.AutoModelForCausalLM.from_pretrained(model_dirs(family), dtype=torch.float32, attn_implementation="sdpa").eval()
    return lift(trace(m, rows), m), m


def test_llama_lifts_to_llm_ops(model_dirs):
    g, m = _lift("llama", model_dirs)
    counts = {}
    for n in g.nodes:
        counts[n.op] = counts.get(n.op, 0) + 1
    L = m.config.num_hidden_layers
    assert counts == {"Embedding": 1, "RotaryTable": 1, "RMSNorm": 2 * L + 1, "Linear": 7 * L + 1, "Attention": L,
                      "Add": 2 * L, "Act": L, "Mul": L}
    assert [v.shape for v in g.inputs] == [(8,), (8,)]
    assert g.outputs[0].shape == (8, m.config.vocab_size)
    assert g.model_info["family"] == "Llama"
    g.verify()


def test_phi3_fused_projections_become_slices(model_dirs):
    g, m = _lift("phi3", model_dirs)
    slices = g.find("Slice")
    assert len(slices) == 5 * m.config.num_hidden_layers  # q, k, v + gate, up per layer
    attn = g.find("Attention")[0]
    assert all(v.producer.op == "Slice" for v in attn.inputs[:3])


def test_qwen2_projection_bias(model_dirs):
    g, _ = _lift("qwen2", model_dirs)
    q = g.node("model.layers.0.self_attn.q_proj")
    assert "bias" in q.weights


def test_unsupported_architecture_is_named(tmp_path):
    import transformers as T

    from llmc.errors import UnsupportedModelError
    from llmc.model_source import load

    cfg = T.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    T.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(UnsupportedModelError, match=r"GPT2LMHeadModel.*gpt2"):
        load(str(tmp_path / "gpt2"))


def test_unsupported_op_is_named(model_dirs):
    """An op the lifter has no pattern for fails naming the aten op and the module."""
    import torch
    import transformers as T

    from llmc.errors import UnsupportedModelError
    from llmc.lift import lift, trace

    m = T.AutoModelForCausalLM.from_pretrained(model_dirs("llama"), dtype=torch.float32, attn_implementation="sdpa").eval()
    m.model.layers[0].mlp.act_fn = torch.nn.Softplus()
    with pytest.raises(UnsupportedModelError, match=r"aten\.softplus.*model\.layers\.0\.mlp\.act_fn"):
        lift(trace(m, 4), m)


def test_eager_attention_is_refused(model_dirs):
    import torch
    import transformers as T

    from llmc.errors import UnsupportedModelError
    from llmc.lift import lift, trace

    m = T.AutoModelForCausalLM.from_pretrained(model_dirs("llama"), dtype=torch.float32, attn_implementation="eager").eval()
    with pytest.raises(UnsupportedModelError, match="attention|unsupported op"):
        lift(trace(m, 4), m)
