"""Device profiles: the numbers the cost model reads, each with its source.

A profile is a JSON file (``compiler/profiles/<name>.json`` ships the Snapdragon
phones 8 Gen 2, 8 Gen 3, 8 Elite and 8 Elite Gen 5, the Snapdragon X Elite and X Plus
laptops and the Qualcomm Linux boards QCS6490 and QCS8550; ``llmc profiles`` lists them)::

    {"schema": 1, "name": "8gen3", "description": "...",
     "numbers": {"npu.weight_bytes_per_s": {"value": 11.2e9, "source": "..."}, ...}}

Every number carries the publication or measurement it comes from. The
``host`` profile is measured on the current machine by ``llmc profile-host``
and stored in the user's cache (``$LLMC_PROFILE_DIR`` or
``~/.cache/llmc/profiles``); a profile may also be given as a path to a file.

Keys (SI units: seconds, bytes, operations):

* ``cpu.*``: ``int8_ops_per_s``, ``fp32_flops_per_s`` (GEMM at chunk shape),
  ``attention_flops_per_s``, ``mem_bytes_per_s`` (streaming weights/activations),
  ``launch_s`` (fixed cost of one graph call) — required; ``op_launch_s``
  (fixed cost of a dynamic op such as attention; default ``launch_s``),
  ``int8_7bit_ops_per_s`` (``int8_ops_per_s`` for weight codes of 7 bits, ``--weight-bits 7``,
  where the CPU runs those on faster kernels; default ``int8_ops_per_s``),
  ``int8_gemv_ops_per_s`` (one-row int8 matmul rate, a floor on any int8
  weight pass; default: no floor), ``kv_bytes_per_s`` (one-row attention's
  K/V read rate; default ``mem_bytes_per_s``), ``node_s`` (fixed cost of each
  kernel inside a CPU graph; default 0) — optional;
* ``npu.*``: ``int8_ops_per_s`` (compute ceiling), ``weight_bytes_per_s`` (rate its
  matmuls stream int8 weights), ``fp16_ops_per_s``, ``mem_bytes_per_s``,
  ``launch_s`` — all or none (a profile without them has no NPU);
* ``sync_s``: one CPU<->NPU hand-off (required with an NPU);
* ``memory.ram_bytes``, ``memory.npu_addressable_bytes``, ``storage.read_bytes_per_s``;
  ``storage.small_read_s`` (one random 4 KiB read, the fixed cost of reading a
  table row; default 4 KiB at ``read_bytes_per_s``) — optional.

Optional SoC facts, each with its source (the shipped Snapdragon profiles have them)::

    "qnn": {"part": "SM8750", "htp_arch": "v79", "soc_model": 69, "source": "..."},
    "platforms": {"names": ["android-aarch64"], "source": "..."}

``qnn`` makes the profile a ``--soc`` choice: ``part`` is the chip's part number,
``htp_arch`` the Hexagon HTP architecture and ``soc_model`` the QNN ``soc_model``
id the QNN execution provider prepares context binaries for
(``llmc.backends.qnn_backend.SOCS`` is read from these); an optional
``requires`` names the QNN build the SoC needs where the one installed cannot
prepare for it. ``platforms`` are the operating systems the SoC ships in
(``android-aarch64``, ``linux-aarch64``, ``windows-arm64``).

Optional ``tables`` hold measured shape-dependent costs: ``cpu.int8_gemv_s`` rows
``[K, N, seconds]`` of one one-row int8 matmul with its weights coming from
memory (a small matmul's fixed cost dominates, so no single rate fits all sizes),
and ``cpu.int8_gemv_1t_s`` the same on one thread (the runtime runs small one-row
graphs on one thread).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

from llmc.errors import LlmcError

SCHEMA = 1
PROFILE_DIR = Path(__file__).parent / "profiles"
CPU_KEYS = ("cpu.int8_ops_per_s", "cpu.fp32_flops_per_s", "cpu.attention_flops_per_s", "cpu.mem_bytes_per_s", "cpu.launch_s")
NPU_KEYS = ("npu.int8_ops_per_s", "npu.weight_bytes_per_s", "npu.fp16_ops_per_s", "npu.mem_bytes_per_s", "npu.launch_s")
OTHER_KEYS = ("memory.ram_bytes", "storage.read_bytes_per_s")
# optional measured tables and their row widths
# K, N, seconds of one one-row QLinear [1,K]x[K,N] with weights from memory, on all threads / on one
TABLE_COLUMNS = {"cpu.int8_gemv_s": 3, "cpu.int8_gemv_1t_s": 3}
PLATFORMS = ("android-aarch64", "linux-aarch64", "windows-arm64")
HTP_ARCH = re.compile(r"v[0-9]{2}")


class ProfileError(LlmcError):
    """A device profile is unknown, not measured yet, or malformed (a usage error of --profile/--soc)."""

    exit_code = 2


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    name: str
    description: str
    values: dict[str, float]
    sources: dict[str, str]
    path: str
    # measured tables: name -> rows of numbers (e.g. ``cpu.int8_gemv_s``: [K, N, seconds]); sources in ``sources``
    tables: dict[str, list[list[float]]] = dataclasses.field(default_factory=dict)
    # SoC facts: {"part", "htp_arch" ("v79"), "soc_model" (int), "source"[, "requires"]}; None for a profile without them
    qnn: dict[str, Any] | None = None
    platforms: tuple[str, ...] = ()
    platforms_source: str = ""

    @property
    def has_npu(self) -> bool:
        return "npu.weight_bytes_per_s" in self.values

    def __getitem__(self, key: str) -> float:
        try:
            return self.values[key]
        except KeyError:
            raise ProfileError(f"device profile {self.name!r} has no number {key!r}", hint=f"add it to {self.path}") from None

    def get(self, key: str, default: float | None = None) -> float | None:
        return self.values.get(key, default)

    def as_json(self) -> dict[str, Any]:
        d = {"schema": SCHEMA, "name": self.name, "description": self.description,
             "numbers": {k: {"value": self.values[k], "source": self.sources[k]} for k in sorted(self.values)}}
        if self.tables:
            d["tables"] = {k: {"rows": self.tables[k], "source": self.sources[k]} for k in sorted(self.tables)}
        if self.qnn:
            d["qnn"] = dict(self.qnn)
        if self.platforms:
            d["platforms"] = {"names": list(self.platforms), "source": self.platforms_source}
        return d


def user_profile_dir() -> Path:
    return Path(os.environ.get("LLMC_PROFILE_DIR") or Path.home() / ".cache" / "llmc" / "profiles")


def available() -> list[str]:
    """Names of the shipped profiles, plus ``host`` when it has been measured."""
    names = sorted(p.stem for p in PROFILE_DIR.glob("*.json"))
    if (user_profile_dir() / "host.json").exists():
        names.append("host")
    return names


def _text(entry: dict, key: str) -> bool:
    return isinstance(entry.get(key), str) and bool(entry[key].strip())


def _parse_soc(data: dict, where: str) -> tuple[dict[str, Any] | None, tuple[str, ...], str]:
    """The optional ``qnn`` and ``platforms`` entries, checked."""
    qnn = data.get("qnn")
    if qnn is not None:
        if (not isinstance(qnn, dict) or not _text(qnn, "part") or not _text(qnn, "source")
                or not isinstance(qnn.get("htp_arch"), str) or not HTP_ARCH.fullmatch(qnn["htp_arch"])
                or not isinstance(qnn.get("soc_model"), int) or isinstance(qnn["soc_model"], bool) or qnn["soc_model"] <= 0
                or ("requires" in qnn and not _text(qnn, "requires")) or set(qnn) - {"part", "htp_arch", "soc_model", "source", "requires"}):
            raise ProfileError(f"{where}: \"qnn\" needs a \"part\" (e.g. \"SM8750\"), an \"htp_arch\" like \"v79\", a positive integer "
                               f"\"soc_model\" and a non-empty \"source\" (optionally \"requires\"), is {qnn!r}")
        qnn = {k: qnn[k] for k in ("part", "htp_arch", "soc_model", "source", "requires") if k in qnn}
    plat = data.get("platforms")
    names: tuple[str, ...] = ()
    psource = ""
    if plat is not None:
        if (not isinstance(plat, dict) or not _text(plat, "source") or not isinstance(plat.get("names"), list) or not plat["names"]
                or any(n not in PLATFORMS for n in plat["names"]) or len(set(plat["names"])) != len(plat["names"])):
            raise ProfileError(f"{where}: \"platforms\" needs \"names\" (a list of distinct: {', '.join(PLATFORMS)}) and a non-empty \"source\", is {plat!r}")
        names, psource = tuple(plat["names"]), plat["source"]
    return qnn, names, psource


def parse(data: Any, where: str) -> DeviceProfile:
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("numbers"), dict):
        raise ProfileError(f"{where} is not a device profile of schema {SCHEMA}", hint="see llmc/device_profile.py for the format")
    values, sources = {}, {}
    for key, entry in data["numbers"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("value"), (int, float)) or not isinstance(entry.get("source"), str) or not entry["source"].strip():
            raise ProfileError(f"{where}: number {key!r} needs a numeric \"value\" and a non-empty \"source\"")
        if entry["value"] <= 0:
            raise ProfileError(f"{where}: number {key!r} must be positive, is {entry['value']}")
        values[key] = float(entry["value"])
        sources[key] = entry["source"]
    tables = {}
    for key, entry in (data.get("tables") or {}).items():
        rows = entry.get("rows") if isinstance(entry, dict) else None
        if (key not in TABLE_COLUMNS or not isinstance(rows, list) or not rows or not isinstance(entry.get("source"), str)
                or any(not isinstance(r, list) or len(r) != TABLE_COLUMNS[key] or not all(isinstance(x, (int, float)) and x > 0 for x in r) for r in rows)):
            raise ProfileError(f"{where}: table {key!r} needs \"rows\" of {TABLE_COLUMNS.get(key, '?')} positive numbers and a \"source\"",
                               hint="known tables: " + ", ".join(TABLE_COLUMNS))
        tables[key] = [[float(x) for x in r] for r in rows]
        grid = {(r[0], r[1]) for r in tables[key]}
        if len(grid) != len({r[0] for r in grid}) * len({r[1] for r in grid}) or len(grid) != len(rows):
            raise ProfileError(f"{where}: table {key!r} must hold each (K, N) of a full grid once")
        sources[key] = entry["source"]
    missing = [k for k in CPU_KEYS + OTHER_KEYS if k not in values]
    npu = [k for k in NPU_KEYS if k in values]
    if npu and len(npu) != len(NPU_KEYS):
        missing += [k for k in NPU_KEYS if k not in values]
    if npu and "sync_s" not in values:
        missing.append("sync_s")
    if missing:
        raise ProfileError(f"{where} lacks {', '.join(missing)}", hint="every profile needs the cpu.*, memory.ram_bytes and storage.read_bytes_per_s numbers; an NPU needs all npu.* and sync_s")
    qnn, platforms, platforms_source = _parse_soc(data, where)
    return DeviceProfile(str(data.get("name") or Path(where).stem), str(data.get("description", "")), values, sources, where, tables,
                         qnn, platforms, platforms_source)


def qnn_socs() -> dict[str, DeviceProfile]:
    """The shipped profiles with QNN SoC facts (the ``--soc`` choices), by name, in name order."""
    out = {}
    for path in sorted(PROFILE_DIR.glob("*.json")):
        p = load(path.stem)
        if p.qnn:
            if not p.has_npu:
                raise ProfileError(f"{p.path} has \"qnn\" SoC facts but no npu.* numbers", hint="a --soc target needs the NPU numbers the cost model plans with")
            out[path.stem] = p
    return out


def load(name_or_path: str) -> DeviceProfile:
    """A shipped profile by name, ``host`` (measured), or a profile file by path."""
    p = Path(name_or_path)
    if name_or_path == "host":
        p = user_profile_dir() / "host.json"
        if not p.exists():
            raise ProfileError("the host profile has not been measured on this machine", hint="run `llmc profile-host` first (about 40 seconds)")
    elif not (p.suffix == ".json" and p.exists()):
        p = PROFILE_DIR / f"{name_or_path}.json"
        if not p.exists():
            raise ProfileError(f"unknown device profile {name_or_path!r}", hint="choose one of: " + ", ".join(available() + ["host"]) + ", or give a path to a profile .json")
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ProfileError(f"cannot read device profile {p}: {e}") from None
    return parse(data, str(p))


def save(profile: DeviceProfile, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(profile.as_json(), indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
