"""Parsing and printing of byte sizes (``--memory-budget 300MB``, ``50%``)."""

from __future__ import annotations

import re

from llmc.errors import CompileError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, total: int | None = None) -> int:
    """Bytes from ``"300MB"``, ``"1.5GiB"``, ``"123456"`` or, given ``total``, ``"50%"`` of it."""
    s = str(text).strip().lower().replace(" ", "")
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)(%|[a-z]*)", s)
    if not m or (m.group(2) != "%" and m.group(2) not in _UNITS):
        raise CompileError(f"cannot read the size {text!r}", hint="write it like 300MB, 1.5GB, 512MiB or 50% (of the weights the graphs read whole)")
    value, unit = float(m.group(1)), m.group(2)
    if unit == "%":
        if total is None:
            raise CompileError(f"the size {text!r} is a percentage, but there is nothing it is a percentage of here")
        return int(total * value / 100.0)
    return int(value * _UNITS[unit])


def format_size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
