"""Runtime behaviour: no torch needed, chunking, sampling, limits."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import CHUNK, MAX_CONTEXT

ROOT = Path(__file__).resolve().parents[1]

BLOCKER = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {'torch', 'transformers', 'onnx', 'networkx', 'gguf', 'safetensors'}:
            raise ImportError('blocked for this test: ' + name)
        return None
sys.meta_path.insert(0, Block())
"""


def test_runtime_runs_without_torch(bundles):
    code = BLOCKER + f"""
from llmc.runtime import Session
s = Session({str(bundles('llama'))!r})
r = s.generate('the cat saw a dog', 5, stop_at_eos=False)
assert len(r.token_ids) == 5
bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'onnx')]
bad += [m for m in sys.modules if m.startswith('llmc.') and not m.startswith('llmc.runtime')]
assert not bad, bad
print('ok', r.token_ids)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


def _imports(folder: str) -> set[str]:
    found = set()
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
    return found


def test_layering():
    """runtime imports only numpy/onnxruntime(+qnn)/tokenizers/jinja2/stdlib + itself; passes and backends don't import each other."""
    allowed_third_party = {"numpy", "onnxruntime", "onnxruntime_qnn", "tokenizers", "jinja2"}
    for mod in _imports("runtime"):
        top = mod.split(".")[0]
        if top == "llmc":
            assert mod.startswith("llmc.runtime"), mod
        else:
            assert top in allowed_third_party or top in sys.stdlib_module_names, mod
    assert not any(m.startswith("llmc.backends") for m in _imports("passes"))
    assert not any(m.startswith("llmc.passes") for m in _imports("backends"))


def test_one_row_chunks_score_every_row(model_dirs, tmp_path):
    """--chunk 1: every prompt token is its own chunk; scoring all rows must not hand every chunk the
    same reused output buffer (decode's one-row buffers), which scored all rows as the last."""
    from conftest import hf_logits
    from llmc.compile import compile_model
    from llmc.runtime import Session

    compile_model(str(model_dirs("llama")), tmp_path / "c1", target="cpu", chunk=1, max_context=MAX_CONTEXT)
    ids = [1, 5, 9, 17, 33, 4, 8]
    ref = hf_logits(model_dirs("llama"), ids)
    s = Session(tmp_path / "c1")
    np.testing.assert_allclose(s.prefill(ids, all_logits=True), ref, atol=1e-4 * np.abs(ref).max())
    np.testing.assert_allclose(s.decode(3), hf_logits(model_dirs("llama"), ids + [3])[-1], atol=1e-4 * np.abs(ref).max())


def test_chunked_prefill_equals_token_by_token(bundles):
    """Prefill in chunks (with a padded tail) and feeding tokens one at a time give the same logits."""
    from llmc.runtime import Session

    s = Session(bundles("llama"))
    ids = list(range(5, 5 + 2 * CHUNK + 3))
    s.reset()
    chunked = s.prefill(ids, all_logits=True)
    s.reset()
    single = np.stack([s.prefill([t]) for t in ids])
    np.testing.assert_allclose(chunked, single, atol=1e-4)


def test_seeded_sampling_is_reproducible(bundles):
    from llmc.runtime import Session

    s = Session(bundles("llama"))
    a = s.generate("the cat", 12, temperature=1.0, seed=7, stop_at_eos=False).token_ids
    b = s.generate("the cat", 12, temperature=1.0, seed=7, stop_at_eos=False).token_ids
    c = s.generate("the cat", 12, temperature=1.0, seed=8, stop_at_eos=False).token_ids
    assert a == b and a != c


def test_streaming_yields_tokens_as_generated(bundles):
    from llmc.runtime import Session

    s = Session(bundles("llama"))
    events = list(s.stream("the dog", 6, stop_at_eos=False))
    assert len(events) == 6
    assert [e.token_id for e in events] == s.generate("the dog", 6, stop_at_eos=False).token_ids
    assert "".join(e.text for e in events).strip() == s.decode_text([e.token_id for e in events]).strip()


def test_prompt_longer_than_context_refused(bundles):
    from llmc.runtime import PromptTooLongError, Session

    s = Session(bundles("llama"))
    with pytest.raises(PromptTooLongError, match=f"--max-context {MAX_CONTEXT}"):
        s.generate(list(range(4, 4 + MAX_CONTEXT + 1)), 4)


def test_generation_stops_at_context_end(bundles):
    from llmc.runtime import Session

    s = Session(bundles("llama"))
    r = s.generate(list(range(4, 4 + MAX_CONTEXT - 3)), 10, stop_at_eos=False)
    assert r.finish_reason == "context"
    assert len(r.prompt_ids) + len(r.token_ids) <= MAX_CONTEXT + 1


def test_kernels_attention_matches_reference():
    """The vectorised GQA kernel equals a per-head loop, with a sliding window."""
    from llmc.runtime import kernels

    rng = np.random.default_rng(0)
    h, kvh, d, n = 4, 2, 8, 6
    cache = kernels.KVCache({0: (kvh, d)}, 16)
    q = rng.standard_normal((n, h * d)).astype(np.float32)
    k = rng.standard_normal((n, kvh * d)).astype(np.float32)
    v = rng.standard_normal((n, kvh * d)).astype(np.float32)
    out = kernels.attention(q, k, v, None, None, cache=cache, layer=0, start=0, n=n, num_heads=h, num_kv_heads=kvh,
                            head_dim=d, scale=0.3, rotary_dim=0, sliding_window=3)
    ref = np.zeros_like(out)
    for head in range(h):
        kv = head // (h // kvh)
        for i in range(n):
            js = [j for j in range(n) if j <= i and j > i - 3]
            s = np.array([q[i, head * d:(head + 1) * d] @ k[j, kv * d:(kv + 1) * d] * 0.3 for j in js])
            p = np.exp(s - s.max())
            p /= p.sum()
            ref[i, head * d:(head + 1) * d] = sum(pj * v[j, kv * d:(kv + 1) * d] for pj, j in zip(p, js))
    np.testing.assert_allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("d, rotary_dim", [(8, 8), (16, 16), (16, 8)])
def test_ort_attention_matches_numpy_kernel(d, rotary_dim):
    """The ONNX Runtime GQA path equals the numpy kernel over chunked prefill (with padding) and decode, cache included.

    With full rotary on a head size ONNX Runtime's kernel rotates (a multiple of
    16) the node rotates q and k itself, for chunks and one row: equal up to rounding.
    """
    import onnx
    import onnxruntime as ort

    from llmc.runtime import kernels
    from llmc.runtime.ort_attention import ONE_THREAD_KV_BYTES, OrtAttention, gqa_model

    onnx.checker.check_model(onnx.load_from_string(gqa_model(4, 2, d, 32, 0.3)))
    onnx.checker.check_model(onnx.load_from_string(gqa_model(4, 2, d, 32, 0.3, rotary=True)))
    node_rotates = d == rotary_dim == 16
    rng = np.random.default_rng(0)
    h, kvh, cap = 4, 2, 32
    ref, cache = kernels.KVCache({0: (kvh, d)}, cap), kernels.KVCache({0: (kvh, d)}, cap)
    attn = OrtAttention(ort, cache, threads=2)
    inv_freq = (1.0 / 10000 ** (np.arange(0, rotary_dim, 2) / rotary_dim)).astype(np.float32)
    start = 0
    for rows, n in [(8, 8), (8, 5), (1, 1), (1, 1), (8, 8), (1, 1)]:
        q, k, v = (rng.standard_normal((rows, f)).astype(np.float32) for f in (h * d, kvh * d, kvh * d))
        cos, sin = kernels.rotary_table(np.arange(start, start + rows), inv_freq, 1.3)
        kw = dict(layer=0, start=start, n=n, num_heads=h, num_kv_heads=kvh, head_dim=d, scale=0.3, rotary_dim=rotary_dim, sliding_window=0)
        want = kernels.attention(q, k, v, cos, sin, cache=ref, **kw)
        got = attn(q, k, v, cos, sin, **kw)
        np.testing.assert_allclose(got, want, atol=1e-5)
        np.testing.assert_array_equal(got[n:], 0.0)
        if node_rotates:
            np.testing.assert_allclose(cache.k[0], ref.k[0], rtol=1e-6, atol=1e-6)
        else:
            np.testing.assert_array_equal(cache.k[0], ref.k[0])
        np.testing.assert_array_equal(cache.v[0], ref.v[0])
        if start == 0:  # the first chunk: its session rotates iff the node can, from the chunk's rows of the tables
            assert [key[4] for key in attn._sessions] == [node_rotates]
            assert (d in attn._tables and attn._tables[d]._written[:n].all()) == node_rotates
        if rows == 1:  # decode: the one-row binding's own output buffer, bound once and reused
            assert got is attn._one[0].out
            assert (attn._one[0]._tables is not None) == node_rotates
        start += n
    # decode runs on one thread while the layer's cache holds at most ONE_THREAD_KV_BYTES, then on all
    one = attn._one[0]
    switch = ONE_THREAD_KV_BYTES // (2 * kvh * d * 4)
    assert [s.get_session_options().intra_op_num_threads for s, _ in one._runs] == [1, 2]
    assert one.run_for(0) == one._runs[0] and one.run_for(switch - 1) == one._runs[0] and one.run_for(switch) == one._runs[1]


def test_ort_attention_decode_switches_to_all_threads_with_the_same_numbers(monkeypatch):
    """Decode attends on one thread below the switch position and on all threads from it; both equal the numpy kernel."""
    import onnxruntime as ort

    from llmc.runtime import kernels, ort_attention

    h, kvh, d, cap = 4, 2, 16, 32
    monkeypatch.setattr(ort_attention, "ONE_THREAD_KV_BYTES", 2 * kvh * d * 4 * 10)  # one thread below position 10
    rng = np.random.default_rng(1)
    ref, cache = kernels.KVCache({0: (kvh, d)}, cap), kernels.KVCache({0: (kvh, d)}, cap)
    attn = ort_attention.OrtAttention(ort, cache, threads=2)
    attn.prepare(h, kvh, d, 0.25, rotary_dim=d, layer=0)
    used = []
    for sess in attn._sessions.values():  # record which session each call runs on
        def spy(binding, run=sess.run_with_iobinding, threads=sess.get_session_options().intra_op_num_threads):
            used.append(threads)
            return run(binding)
        sess.run_with_iobinding = spy
    inv_freq = (1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    for start, rows in [(0, 8)] + [(p, 1) for p in range(8, 16)]:
        q, k, v = (rng.standard_normal((rows, f)).astype(np.float32) for f in (h * d, kvh * d, kvh * d))
        cos, sin = kernels.rotary_table(np.arange(start, start + rows), inv_freq, 1.0)
        kw = dict(layer=0, start=start, n=rows, num_heads=h, num_kv_heads=kvh, head_dim=d, scale=0.25, rotary_dim=d, sliding_window=0)
        np.testing.assert_allclose(attn(q, k, v, cos, sin, **kw), kernels.attention(q, k, v, cos, sin, cache=ref, **kw), atol=1e-5)
    assert used == [2] + [1, 1] + [2] * 6  # the chunk, then decode at positions 8, 9 | 10..15


def _metaspace_tokenizer():
    """A SentencePiece-style tokenizer: words as "▁word" pieces, whose decoder drops the first one's space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"[UNK]": 0, "[EOS]": 1, "▁the": 2, "▁cat": 3, "▁dog": 4, "▁and": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens(["[EOS]"])
    return tok


@pytest.mark.parametrize("kind", ["byte-level", "word-level", "metaspace"])
def test_text_stream_gives_the_whole_text_from_short_windows(kind):
    """Streamed text: the deltas join to the decoding of all the tokens, including characters split over byte
    tokens, bytes that make no character, special tokens (skipped) and a decoder that treats the first token
    apart, while each step decodes only a few of the last tokens."""
    from conftest import make_tokenizer

    from llmc.runtime.session import TextStream

    byte_level = kind == "byte-level"
    tok = _metaspace_tokenizer() if kind == "metaspace" else make_tokenizer(byte_level).backend_tokenizer
    text = " ".join(["the cat", "é", "dog", "€ 日本", "and the", "ü", "cat"] * 40)
    ids = tok.encode(text).ids
    eos = tok.token_to_id("[EOS]")
    ids = ids[:20] + [eos] + ids[20:60] + [eos, eos] + ids[60:]  # special tokens amid the text: decoded as nothing
    if byte_level:
        stray = tok.encode("é").ids[-1]  # a continuation byte alone: no character, U+FFFD
        ids = ids[:50] + [stray] + ids[50:]
    windows = []

    def decode(window):
        windows.append(len(window))
        return tok.decode(list(window), skip_special_tokens=True)

    stream = TextStream(decode)
    deltas = [stream.push(t) for t in ids]
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert len(ids) > 300 and max(windows) <= 8  # not the whole generation at each step
    assert not byte_level or "" in deltas  # a partial character waited for its other bytes
