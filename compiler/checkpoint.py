"""Tensors of a HuggingFace checkpoint, read one at a time from its safetensors files.

The compiler traces a model whose parameters have no storage (PyTorch's meta
device) and reads each weight from the checkpoint only when a pass or the
backend asks for it. Files are memory-mapped: a float32 tensor is a view of the
file's pages (nothing copied, and the kernel can drop the pages again), a
bfloat16 or float16 tensor is widened to float32 on each read. So the host
memory a compile needs does not grow with the model's weights, which is what
lets a machine compile a model larger than its RAM in float32.

The safetensors format (https://github.com/huggingface/safetensors): an
8-byte little-endian header length, a JSON header mapping names to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the
end of the header), then the data.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from llmc.errors import ModelLoadError

# safetensors dtype -> numpy dtype of the stored bits (bfloat16 is widened by hand)
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}

_MAX_HEADER = 100 * 1024 * 1024  # the format's own limit on the JSON header


def _checkpoint_files(directory: Path) -> list[Path]:
    """The model's safetensors files: those its index lists, else ``model.safetensors``, else every one.

    (Some repositories also carry the weights in another layout, such as
    Mistral's ``consolidated.safetensors``; the index says which files are the
    HuggingFace model.)
    """
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as e:
            raise ModelLoadError(f"{index} is not a safetensors index ({type(e).__name__}: {e})", hint="the file is damaged; save the model again") from None
        missing = [n for n in names if not (directory / n).is_file()]
        if missing:
            raise ModelLoadError(f"{directory}: files {missing[:3]} named by model.safetensors.index.json are missing", hint="copy the complete checkpoint")
        return [directory / n for n in names]
    if (directory / "model.safetensors").is_file():
        return [directory / "model.safetensors"]
    return sorted(directory.glob("*.safetensors"))


class Checkpoint:
    """Name -> float32 array for the tensors in ``directory``'s ``*.safetensors`` files.

    ``aliases`` maps the names the compiler asks for (a traced module's parameter
    names) to the names stored in the files, for tied weights stored once.
    """

    def __init__(self, directory: str | Path, aliases: Mapping[str, str] | None = None) -> None:
        self.directory = Path(directory)
        self.aliases = dict(aliases or {})
        self._entries: dict[str, tuple[Path, str, tuple[int, ...], int, int]] = {}
        self._maps: dict[Path, np.memmap] = {}
        files = _checkpoint_files(self.directory)
        if not files:
            raise ModelLoadError(f"{self.directory} has no .safetensors files", hint="save the model with save_pretrained(safe_serialization=True)")
        for f in files:
            self._read_header(f)

    def _read_header(self, path: Path) -> None:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ModelLoadError(f"{path} is not a safetensors file (shorter than its header)", hint="the file is truncated; save the model again")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER:
                raise ModelLoadError(f"{path} is not a safetensors file (header of {n} bytes)", hint="the file is damaged; save the model again")
            try:
                header = json.loads(f.read(n))
            except ValueError as e:
                raise ModelLoadError(f"{path} has an unreadable safetensors header: {e}", hint="the file is damaged; save the model again") from None
        size = path.stat().st_size
        if not isinstance(header, dict):
            raise ModelLoadError(f"{path} has an unreadable safetensors header (not a JSON object)", hint="the file is damaged; save the model again")
        for name, e in header.items():
            if name == "__metadata__":
                continue
            try:
                begin, end = (8 + n + int(o) for o in e["data_offsets"])
                shape = tuple(int(d) for d in e["shape"])
                dtype = str(e["dtype"])
            except (KeyError, TypeError, ValueError):
                raise ModelLoadError(f"{path}: the header entry of tensor {name} is malformed", hint="the file is damaged; save the model again") from None
            if end > size or begin > end:
                raise ModelLoadError(f"{path}: tensor {name} lies past the end of the file", hint="the file is truncated; save the model again")
            if dtype in _DTYPES and int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[dtype]).itemsize != end - begin:
                raise ModelLoadError(f"{path}: tensor {name} has {end - begin} bytes for shape {list(shape)} of {dtype}",
                                     hint="the file is damaged; save the model again")
            self._entries[name] = (path, dtype, shape, begin, end)

    def map_files(self) -> None:
        """Memory-map every file now: the tensors stay readable after the files are unlinked
        (``--no-cache`` deletes its temporary float32 copy of a GGUF once it is mapped)."""
        for path, *_ in self._entries.values():
            if path not in self._maps:
                self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")

    def names(self) -> list[str]:
        """The stored tensor names, in file order."""
        return list(self._entries)

    def resolve(self, name: str) -> str | None:
        """The stored name of ``name`` (itself or its alias), or None."""
        for n in (name, self.aliases.get(name)):
            if n is not None and n in self._entries:
                return n
        return None

    def dtype(self, name: str) -> str:
        return self._entries[self._stored(name)][1]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[self._stored(name)][2]

    def missing(self, names: Iterable[str]) -> list[str]:
        """Those of ``names`` the files do not hold in a dtype this reader widens to float32."""
        out = []
        for n in names:
            s = self.resolve(n)
            if s is None or self._entries[s][1] not in _DTYPES:
                out.append(n)
        return out

    def _stored(self, name: str) -> str:
        s = self.resolve(name)
        if s is None:
            raise ModelLoadError(f"weight {name} is not in the safetensors files of {self.directory}", hint="check that the checkpoint is complete")
        return s

    def load(self, name: str) -> np.ndarray:
        """The tensor ``name`` as a C-contiguous float32 array (a read-only view of the file when stored as float32)."""
        path, dtype, shape, begin, end = self._entries[self._stored(name)]
        if dtype not in _DTYPES:
            raise ModelLoadError(f"weight {name} is stored as {dtype}; llmc reads F32, F16 and BF16 checkpoints")
        m = self._maps.get(path)
        if m is None:
            m = self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        count = int(np.prod(shape, dtype=np.int64))  # sizes were checked against the header in _read_header
        raw = np.ndarray((count,), dtype=_DTYPES[dtype], buffer=m, offset=begin) if count else np.zeros(0, _DTYPES[dtype])
        if begin % raw.itemsize:  # a hand-written file's unaligned tensor: an aligned copy keeps numpy on its fast paths
            raw = raw.copy()
        if dtype == "BF16":
            out = raw.astype(np.uint32)
            out <<= 16
            return out.view(np.float32).reshape(shape)
        if dtype == "F16":
            return raw.astype(np.float32).reshape(shape)
        return raw.reshape(shape)


class CheckpointWriter:
    """Writes float32 tensors one at a time into a safetensors file.

    The header's size is reserved up front from the tensors' names and shapes
    (given to the constructor) and filled in by :meth:`close`, padded with
    spaces as the format allows; so a model is written without ever being in
    memory as a whole.
    """

    def __init__(self, path: str | Path, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.path = Path(path)
        self._shapes = {n: tuple(int(d) for d in s) for n, s in shapes.items()}
        self._offsets: dict[str, tuple[int, int]] = {}
        self._reserved = len(self._header({n: (10**15, 10**15) for n in self._shapes}))  # room for the largest offsets
        self._reserved += -self._reserved % 8  # data starts 8-aligned
        self._f = open(self.path, "wb")
        self._f.write(b"\0" * (8 + self._reserved))
        self._pos = 0

    def _header(self, offsets: Mapping[str, tuple[int, int]]) -> bytes:
        entries = {n: {"dtype": "F32", "shape": list(self._shapes[n]), "data_offsets": list(offsets[n])} for n in offsets}
        return json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()

    def add(self, name: str, array: np.ndarray) -> None:
        if name not in self._shapes or name in self._offsets:
            raise ValueError(f"tensor {name} was not announced or is written twice")
        a = np.asarray(array, np.float32, order="C")  # (ascontiguousarray would make a scalar 1-D)
        if a.shape != self._shapes[name]:
            raise ValueError(f"tensor {name} has shape {a.shape}, announced {self._shapes[name]}")
        self._f.write(a.data if a.size else b"")
        self._offsets[name] = (self._pos, self._pos + a.nbytes)
        self._pos += a.nbytes

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._f.close()  # the caller removes the partial file

    def close(self) -> None:
        missing = [n for n in self._shapes if n not in self._offsets]
        if missing:
            self._f.close()
            raise ValueError(f"{len(missing)} announced tensors were not written, e.g. {missing[:3]}")
        header = self._header(self._offsets)
        self._f.seek(0)
        self._f.write(struct.pack("<Q", self._reserved) + header + b" " * (self._reserved - len(header)))
        self._f.close()
