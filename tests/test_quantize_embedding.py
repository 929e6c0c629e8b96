"""quantize_embedding: the token embedding from int8 codes with a scale per token."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import CHUNK


@pytest.mark.parametrize("family,memory_budget", [("llama_tied_mha", None), ("llama", None), ("llama_tied_mha", "50%")])
def test_embedding_reads_int8_codes(model_dirs, calib_words, family, memory_budget):
    """A tied embedding gathers the LM head's own int8 codes (no weight of its own); an untied one, or a tied one
    whose head codes are uint8 (a memory budget), gets int8 codes by row. Each row is its float row to within half
    a code step, and the interpreter's logits stay close to the float embedding's."""
    from test_quantization import _ctx, _run

    from llmc.interpreter import Interpreter

    g, ctx = _ctx(model_dirs(family), calib_file=str(calib_words), memory_budget=memory_budget)
    _run(g, ctx, "dce,select_logit_rows,calibrate,extract_shadow_outliers,quantize")
    (emb,) = g.find("Embedding")
    table = g.weights.load(emb.weights["table"].name)
    ids = [int(t) for t in np.random.default_rng(2).integers(4, 120, size=CHUNK)]
    before = Interpreter(g).run(ids, select_rows=np.arange(len(ids)))
    head_codes = {n.weights["qweight"].name for n in g.find("QLinear")}
    _run(g, ctx, "quantize_embedding")
    g.verify()
    assert not g.find("Embedding")
    (q,) = g.find("QEmbedding")
    tied = family == "llama_tied_mha" and memory_budget is None
    assert q.attrs["transposed"] == tied and (q.weights["codes"].name in head_codes) == tied
    assert g.weights[q.weights["codes"].name].dtype == "int8"  # (a budget's uint8 head codes are not shared)
    rows = Interpreter(g).weight(q, "codes")
    scale = Interpreter(g).weight(q, "row_scale")
    got = (rows.T if tied else rows).astype(np.float32) * scale[:, None]
    assert np.all(np.abs(got - table) <= 0.5 * scale[:, None] + 1e-7)
    after = Interpreter(g).run(ids, select_rows=np.arange(len(ids)))
    assert not np.array_equal(after, before)
    # (a tiny random model: a row's rounding can move the next W8A8 input's codes; SmolLM2's figures are in
    # docs/quantization.md)
    assert np.abs(after - before).mean() < 0.03 * np.abs(before).max()
    np.testing.assert_allclose(after, before, atol=0.2 * np.abs(before).max())
