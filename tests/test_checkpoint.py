"""Weights read one at a time from safetensors files, and a compile that never holds the model in memory."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest


def _save(path, tensors):
    from safetensors.torch import save_file

    save_file(tensors, str(path))


def test_reads_f32_as_a_view_and_widens_bf16_f16(tmp_path):
    import torch

    from llmc.checkpoint import Checkpoint

    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 7, generator=g)
    b = torch.randn(3, 4, generator=g).to(torch.bfloat16)
    c = torch.randn(6, generator=g).to(torch.float16)
    _save(tmp_path / "model-00001-of-00002.safetensors", {"a": a, "b": b})
    _save(tmp_path / "model-00002-of-00002.safetensors", {"c": c})
    _save(tmp_path / "consolidated.safetensors", {"a": torch.zeros(1)})  # another layout of the weights, not in the index
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors", "c": "model-00002-of-00002.safetensors"}}))
    ck = Checkpoint(tmp_path)
    ra = ck.load("a")
    assert ra.dtype == np.float32 and ra.shape == (5, 7) and not ra.flags.owndata and not ra.flags.writeable  # the file's pages
    np.testing.assert_array_equal(ra, a.numpy())
    np.testing.assert_array_equal(ck.load("b"), b.to(torch.float32).numpy())  # bfloat16 widening is exact
    np.testing.assert_array_equal(ck.load("c"), c.to(torch.float32).numpy())
    assert ck.dtype("b") == "BF16" and ck.shape("c") == (6,)
    ck.aliases = {"lm_head.weight": "a"}
    assert ck.resolve("lm_head.weight") == "a" and ck.missing(["lm_head.weight", "b", "nope"]) == ["nope"]


def test_damaged_files_name_the_file(tmp_path):
    import torch

    from llmc.checkpoint import Checkpoint
    from llmc.errors import ModelLoadError

    path = tmp_path / "model.safetensors"
    _save(path, {"w": torch.ones(64, 64)})
    data = path.read_bytes()
    path.write_bytes(data[:-100])  # truncated
    with pytest.raises(ModelLoadError, match="past the end of the file"):
        Checkpoint(tmp_path)
    header = json.dumps({"w": {"dtype": "F32", "shape": [64, 65], "data_offsets": [0, 64 * 64 * 4]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data[-64 * 64 * 4:])  # the shape claims more than the bytes
    with pytest.raises(ModelLoadError, match="has 16384 bytes for shape"):
        Checkpoint(tmp_path)
    header = json.dumps({"w": {"dtype": "F32", "data_offsets": [0, 4]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    with pytest.raises(ModelLoadError, match="header entry of tensor w is malformed"):
        Checkpoint(tmp_path)
    path.write_bytes(struct.pack("<Q", 10) + b"{not json}")
    with pytest.raises(ModelLoadError, match="unreadable safetensors header"):
        Checkpoint(tmp_path)
    path.unlink()
    with pytest.raises(ModelLoadError, match="no .safetensors files"):
        Checkpoint(tmp_path)


def test_load_keeps_parameters_on_meta_and_reads_the_files(model_dirs):
    """A checkpoint directory loads without its weights; tied weights resolve to the one stored tensor."""
    from llmc import model_source

    for family in ("llama", "llama_tied_mha"):
        loaded = model_source.load(str(model_dirs(family)))
        assert loaded.checkpoint is not None
        assert all(p.is_meta for p in loaded.model.parameters())
        assert not any(b.is_meta for b in loaded.model.buffers())  # rotary tables are computed, not read
    head = loaded.checkpoint.load("lm_head.weight")  # tied: stored once, as the embedding
    np.testing.assert_array_equal(head, loaded.checkpoint.load("model.embed_tokens.weight"))


def test_unreadable_dtype_falls_back_to_loading_the_model(model_dirs, tmp_path):
    """A checkpoint the reader cannot widen (float64 here) is loaded whole by transformers, and still compiles."""
    import shutil

    import torch
    from safetensors.torch import load_file

    from llmc import model_source

    d = tmp_path / "f64"
    shutil.copytree(model_dirs("llama"), d)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.float64)
    _save(d / "model.safetensors", tensors)
    loaded = model_source.load(str(d))
    assert loaded.checkpoint is None and not any(p.is_meta for p in loaded.model.parameters())


def test_streamed_compile_matches_the_loaded_model(model_dirs):
    """Lifting a meta model and reading weights from the files gives the IR of the fully loaded model, bit for bit."""
    import torch
    import transformers as T

    from llmc import model_source
    from llmc.interpreter import Interpreter
    from llmc.lift import lift, trace

    ids = [1, 5, 9, 13, 17, 21, 25, 29]
    for family in ("gemma", "phi3"):  # tied + scaled embedding; fused projections
        loaded = model_source.load(str(model_dirs(family)))
        streamed = Interpreter(lift(trace(loaded.model, 8), loaded.model, checkpoint=loaded.checkpoint), cache_weights=False).run(ids)
        m = T.AutoModelForCausalLM.from_pretrained(model_dirs(family), dtype=torch.float32, attn_implementation="sdpa").eval()
        whole = Interpreter(lift(trace(m, 8), m)).run(ids)
        np.testing.assert_array_equal(streamed, whole)


def test_interpreter_holds_one_layer_of_values(tmp_path):
    """Values are dropped after their last reader: the peak does not grow with depth."""
    import torch
    import transformers as T

    from llmc.interpreter import Interpreter
    from llmc.lift import lift, trace

    peaks = []
    for layers in (2, 6):
        torch.manual_seed(0)
        cfg = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=64)
        m = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()
        interp = Interpreter(lift(trace(m, 16), m))
        logits = interp.run(list(range(16)))
        with torch.no_grad():
            ref = m(torch.arange(16)[None]).logits[0].numpy()
        np.testing.assert_allclose(logits, ref, atol=1e-4)
        peaks.append(interp.peak_live_bytes)
    assert peaks[0] == peaks[1] > 0


def test_writer_streams_tensors_into_a_standard_safetensors_file(tmp_path):
    from safetensors.numpy import load_file

    from llmc.checkpoint import Checkpoint, CheckpointWriter

    rng = np.random.default_rng(0)
    tensors = {"b.weight": rng.standard_normal((3, 5)).astype(np.float32), "a.bias": rng.standard_normal(7).astype(np.float32),
               "empty": np.zeros((0, 4), np.float32), "scalar": np.array(2.5, np.float32)}
    w = CheckpointWriter(tmp_path / "model.safetensors", {n: t.shape for n, t in tensors.items()})
    with pytest.raises(ValueError, match="shape"):
        w.add("a.bias", np.zeros(6, np.float32))
    for n, t in tensors.items():
        w.add(n, t)
    w.close()
    theirs = load_file(str(tmp_path / "model.safetensors"))  # the reference reader accepts the padded header
    ours = Checkpoint(tmp_path)
    for n, t in tensors.items():
        np.testing.assert_array_equal(theirs[n], t)
        np.testing.assert_array_equal(ours.load(n), t)
    w = CheckpointWriter(tmp_path / "partial.safetensors", {"x": (2,), "y": (3,)})
    w.add("x", np.ones(2, np.float32))
    with pytest.raises(ValueError, match="not written"):
        w.close()


def test_hub_id_from_the_local_cache_is_streamed(model_dirs, tmp_path, monkeypatch):
    """A hub id found in the local HuggingFace cache is read from its snapshot directory like any checkpoint."""
    import shutil

    from huggingface_hub import constants

    from llmc import model_source
    from llmc.errors import ModelLoadError

    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(model_dirs("llama"), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    loaded = model_source.load("acme/tiny-llama")
    assert loaded.checkpoint is not None and loaded.checkpoint.directory == repo / "snapshots" / commit
    assert "hub id acme/tiny-llama" in loaded.description
    with pytest.raises(ModelLoadError, match="not in the local HuggingFace cache"):
        model_source.load("acme/not-cached")


def test_unaligned_tensor_reads_as_an_aligned_copy(tmp_path):
    """A hand-written file whose float32 data starts off a 4-byte boundary still reads right, into aligned memory."""
    from llmc.checkpoint import Checkpoint

    values = np.arange(6, dtype=np.float32)
    header = json.dumps({"u": {"dtype": "F32", "shape": [2, 3], "data_offsets": [2, 26]}}).encode()
    header += b" " * (-len(header) % 8)  # the data area starts 8-aligned, so the tensor starts 2 bytes off
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0" + values.tobytes())
    got = Checkpoint(tmp_path).load("u")
    assert got.flags.aligned and got.flags.c_contiguous
    np.testing.assert_array_equal(got, values.reshape(2, 3))


def test_stored_buffer_falls_back_to_loading_the_model(model_dirs, tmp_path, monkeypatch, caplog):
    """A checkpoint that stores one of the model's buffers is loaded whole (from_pretrained would read the
    stored value; the meta model keeps the computed one), with a warning naming the buffer."""
    import logging
    import shutil

    import torch
    from safetensors.torch import load_file

    from llmc import model_source

    real = model_source._empty_model

    def with_buffer(config):  # none of the supported families stores a buffer: give the model one
        m = real(config)
        m.model.register_buffer("extra_scale", torch.ones(4))
        return m

    monkeypatch.setattr(model_source, "_empty_model", with_buffer)
    d = tmp_path / "buffered"
    shutil.copytree(model_dirs("llama"), d)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.extra_scale"] = torch.full((4,), 2.0)
    _save(d / "model.safetensors", tensors)
    with caplog.at_level(logging.WARNING, logger="llmc.model_source"):
        loaded = model_source.load(str(d))
    assert loaded.checkpoint is None and not any(p.is_meta for p in loaded.model.parameters())
    assert "stores buffers ['model.extra_scale']" in caplog.text
