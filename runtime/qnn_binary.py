"""Read QNN context binaries offline and check them against the manifest.

``read_binary_info`` asks the QNN System library that ``onnxruntime-qnn`` ships
(``libQnnSystem.so``, ``QnnSystemContext_getBinaryInfo``) what a context binary
holds: the QNN build and API versions that wrote it, the SoC it was prepared
for, and every graph with its input and output tensors. ``check_binaries``
compares that with the manifest's ``qnn`` section and the fully quantized QDQ
graphs each instance was prepared from.

The library parses untrusted bytes; a corrupted binary can make it read out
of bounds, so the reading runs in a child process (``python -m
llmc.runtime.qnn_binary FILE...`` prints the info as JSON) and a crash there
becomes a :class:`QnnBinaryError` naming the file.

Struct layouts follow the QNN SDK headers vendored in chuzcjoe/qnnx
(external/QNN/include: QnnTypes.h, QnnDevice.h, System/QnnSystemContext.h,
System/QnnSystemInterface.h, HTP/QnnHtpDevice.h, HTP/QnnHtpSystemContext.h).
"""

from __future__ import annotations

import ctypes as C
import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

from llmc.runtime.errors import BundleError

log = logging.getLogger(__name__)


class QnnBinaryError(BundleError):
    """A QNN context binary that cannot be read, or that does not match the bundle's manifest."""


# ---------------------------------------------------------------- data


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]
    dtype: str  # Qnn_DataType_t without the prefix: "UFIXED_POINT_16", "FLOAT_32", ...
    # None, (scale, offset) per tensor, or ("axis", axis, ((scale, offset), ...)) per axis;
    # QNN's convention: real = (q + offset) * scale, so offset = -zero_point
    quantization: tuple | None = None


@dataclass(frozen=True)
class GraphInfo:
    name: str
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]


@dataclass(frozen=True)
class BinaryInfo:
    path: str
    backend_id: int  # 6 = HTP
    build_id: str  # the QNN SDK build that wrote the binary, "v2.51.0.260929181845"
    core_api: str  # QNN core API version, "2.40.0"
    backend_api: str  # HTP backend API version
    info_version: int  # QnnSystemContext_BinaryInfo_t version (1, 2, 3)
    context_blob_version: str
    soc_version: str | None  # free-form string the backend wrote, often empty
    soc_model: int | None  # Qnn_SocModel_t (57 = SM8650, 8 Gen 3), from the binary info or the platform info
    htp_arch: int | None  # QnnHtpDevice_Arch_t (75 = v75): the platform info's HTP device, else the HTP context metadata's dspArch
    vtcm_mb: int | None
    context_blob_bytes: int
    graphs: tuple[GraphInfo, ...]

    def graph(self, name: str) -> GraphInfo | None:
        return next((g for g in self.graphs if g.name == name), None)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "BinaryInfo":
        def tensor(t):
            q = t["quantization"]
            if q is not None and q[0] == "axis":
                q = ("axis", q[1], tuple(tuple(p) for p in q[2]))
            elif q is not None:
                q = tuple(q)
            return TensorInfo(t["name"], tuple(t["dims"]), t["dtype"], q)

        graphs = tuple(GraphInfo(g["name"], tuple(tensor(t) for t in g["inputs"]), tuple(tensor(t) for t in g["outputs"]))
                       for g in d["graphs"])
        return cls(**{**d, "graphs": graphs})


# ---------------------------------------------------------------- QNN structs (ctypes)

class _Version(C.Structure):  # Qnn_Version_t
    _fields_ = [("major", C.c_uint32), ("minor", C.c_uint32), ("patch", C.c_uint32)]

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"


class _ScaleOffset(C.Structure):  # Qnn_ScaleOffset_t: real = (q + offset) * scale
    _fields_ = [("scale", C.c_float), ("offset", C.c_int32)]


class _AxisScaleOffset(C.Structure):  # Qnn_AxisScaleOffset_t
    _fields_ = [("axis", C.c_int32), ("num", C.c_uint32), ("scaleOffset", C.POINTER(_ScaleOffset))]


class _BwScaleOffset(C.Structure):  # Qnn_BwScaleOffset_t
    _fields_ = [("bitwidth", C.c_uint32), ("scale", C.c_float), ("offset", C.c_int32)]


class _BwAxisScaleOffset(C.Structure):  # Qnn_BwAxisScaleOffset_t (the union's largest member)
    _fields_ = [("bitwidth", C.c_uint32), ("axis", C.c_int32), ("num", C.c_uint32), ("scales", C.POINTER(C.c_float)),
                ("offsets", C.POINTER(C.c_int32))]


class _QuantEncoding(C.Union):
    _fields_ = [("scaleOffset", _ScaleOffset), ("axisScaleOffset", _AxisScaleOffset), ("bwScaleOffset", _BwScaleOffset),
                ("bwAxisScaleOffset", _BwAxisScaleOffset), ("_pointers", C.c_void_p * 3)]


class _QuantizeParams(C.Structure):  # Qnn_QuantizeParams_t
    _fields_ = [("encodingDefinition", C.c_int32), ("quantizationEncoding", C.c_int32), ("u", _QuantEncoding)]


class _ClientBuffer(C.Structure):  # Qnn_ClientBuffer_t
    _fields_ = [("data", C.c_void_p), ("dataSize", C.c_uint32)]


class _TensorV1(C.Structure):  # Qnn_TensorV1_t
    _fields_ = [("id", C.c_uint32), ("name", C.c_char_p), ("type", C.c_int32), ("dataFormat", C.c_uint32),
                ("dataType", C.c_int32), ("quantizeParams", _QuantizeParams), ("rank", C.c_uint32),
                ("dimensions", C.POINTER(C.c_uint32)), ("memType", C.c_int32), ("clientBuf", _ClientBuffer)]


class _SparseParams(C.Structure):  # Qnn_SparseParams_t
    _fields_ = [("type", C.c_int32), ("numSpecifiedElements", C.c_uint32), ("numSparseDimensions", C.c_uint32)]


class _TensorV2(C.Structure):  # Qnn_TensorV2_t: V1's fields, then these
    _fields_ = _TensorV1._fields_ + [("isDynamicDimensions", C.POINTER(C.c_uint8)), ("sparseParams", _SparseParams),
                                     ("isProduced", C.c_uint8)]


class _TensorU(C.Union):
    _fields_ = [("v1", _TensorV1), ("v2", _TensorV2)]


class _Tensor(C.Structure):  # Qnn_Tensor_t
    _fields_ = [("version", C.c_int32), ("u", _TensorU)]


class _GraphInfoV1(C.Structure):  # QnnSystemContext_GraphInfoV1_t; V2 and V3 start the same way
    _fields_ = [("graphName", C.c_char_p), ("numGraphInputs", C.c_uint32), ("graphInputs", C.POINTER(_Tensor)),
                ("numGraphOutputs", C.c_uint32), ("graphOutputs", C.POINTER(_Tensor))]


class _GraphInfoV3(C.Structure):  # QnnSystemContext_GraphInfoV3_t (the union's largest member)
    _fields_ = _GraphInfoV1._fields_ + [("numUpdateableTensors", C.c_uint32), ("updateableTensors", C.POINTER(_Tensor)),
                                        ("graphBlobInfoSize", C.c_uint32), ("graphBlobInfo", C.c_void_p),
                                        ("startOpIndex", C.c_uint32), ("endOpIndex", C.c_uint32)]


class _GraphInfoU(C.Union):
    _fields_ = [("v1", _GraphInfoV1), ("v3", _GraphInfoV3)]


class _GraphInfo(C.Structure):  # QnnSystemContext_GraphInfo_t
    _fields_ = [("version", C.c_int32), ("u", _GraphInfoU)]


class _HtpOnChipDeviceInfo(C.Structure):  # QnnHtpDevice_OnChipDeviceInfoExtension_t
    _fields_ = [("vtcmSize", C.c_size_t), ("socModel", C.c_uint32), ("signedPdSupport", C.c_bool), ("dlbcSupport", C.c_bool),
                ("arch", C.c_uint32)]


class _HtpDeviceInfoExtension(C.Structure):  # QnnHtpDevice_DeviceInfoExtension_t
    _fields_ = [("devType", C.c_int32), ("onChipDevice", _HtpOnChipDeviceInfo)]


class _CoreInfoV1(C.Structure):  # QnnDevice_CoreInfoV1_t
    _fields_ = [("coreId", C.c_uint32), ("coreType", C.c_uint32), ("coreInfoExtension", C.c_void_p)]


class _CoreInfo(C.Structure):  # QnnDevice_CoreInfo_t
    _fields_ = [("version", C.c_int32), ("v1", _CoreInfoV1)]


class _HardwareDeviceInfoV1(C.Structure):  # QnnDevice_HardwareDeviceInfoV1_t
    _fields_ = [("deviceId", C.c_uint32), ("deviceType", C.c_uint32), ("numCores", C.c_uint32), ("cores", C.POINTER(_CoreInfo)),
                ("deviceInfoExtension", C.POINTER(_HtpDeviceInfoExtension))]


class _HardwareDeviceInfo(C.Structure):  # QnnDevice_HardwareDeviceInfo_t
    _fields_ = [("version", C.c_int32), ("v1", _HardwareDeviceInfoV1)]


class _PlatformInfoV1(C.Structure):  # QnnDevice_PlatformInfoV1_t
    _fields_ = [("numHwDevices", C.c_uint32), ("hwDevices", C.POINTER(_HardwareDeviceInfo))]


class _PlatformInfo(C.Structure):  # QnnDevice_PlatformInfo_t
    _fields_ = [("version", C.c_int32), ("v1", _PlatformInfoV1)]


class _HtpContextBlobInfo(C.Structure):  # QnnHtpSystemContext_ContextBlobInfo_t (V1: dspArch)
    _fields_ = [("version", C.c_int32), ("dspArch", C.c_uint32)]


_HEAD = [("backendId", C.c_uint32), ("buildId", C.c_char_p), ("coreApiVersion", _Version), ("backendApiVersion", _Version),
         ("socVersion", C.c_char_p)]
_GRAPHS = [("numContextTensors", C.c_uint32), ("contextTensors", C.POINTER(_Tensor)), ("numGraphs", C.c_uint32),
           ("graphs", C.POINTER(_GraphInfo))]


class _BinaryInfoV1(C.Structure):  # QnnSystemContext_BinaryInfoV1_t
    _fields_ = _HEAD + [("hwInfoBlobVersion", _Version), ("contextBlobVersion", _Version), ("hwInfoBlobSize", C.c_uint32),
                        ("hwInfoBlob", C.c_void_p), ("contextBlobSize", C.c_uint64)] + _GRAPHS


class _BinaryInfoV2(C.Structure):  # QnnSystemContext_BinaryInfoV2_t
    _fields_ = _BinaryInfoV1._fields_ + [("platformInfo", C.POINTER(_PlatformInfo))]


class _BinaryInfoV3(C.Structure):  # QnnSystemContext_BinaryInfoV3_t: no hwInfoBlob fields
    _fields_ = _HEAD + [("contextBlobVersion", _Version), ("contextBlobSize", C.c_uint64)] + _GRAPHS + [
        ("platformInfo", C.POINTER(_PlatformInfo)), ("contextMetadataSize", C.c_uint32), ("contextMetadata", C.c_void_p),
        ("socModel", C.c_uint32)]


class _BinaryInfoU(C.Union):
    _fields_ = [("v1", _BinaryInfoV1), ("v2", _BinaryInfoV2), ("v3", _BinaryInfoV3)]


class _BinaryInfo(C.Structure):  # QnnSystemContext_BinaryInfo_t
    _fields_ = [("version", C.c_int32), ("u", _BinaryInfoU)]


_CreateFn = C.CFUNCTYPE(C.c_uint64, C.POINTER(C.c_void_p))
_GetBinaryInfoFn = C.CFUNCTYPE(C.c_uint64, C.c_void_p, C.c_void_p, C.c_uint64, C.POINTER(C.POINTER(_BinaryInfo)),
                               C.POINTER(C.c_uint64))
_FreeFn = C.CFUNCTYPE(C.c_uint64, C.c_void_p)


class _SystemInterface(C.Structure):  # QnnSystemInterface_t: the first function pointers of every 1.x interface
    _fields_ = [("backendId", C.c_uint32), ("providerName", C.c_char_p), ("systemApiVersion", _Version),
                ("systemContextCreate", _CreateFn), ("systemContextGetBinaryInfo", _GetBinaryInfoFn),
                ("systemContextGetMetaData", C.c_void_p), ("systemContextFree", _FreeFn)]


# Qnn_DataType_t
DATA_TYPES = {
    0x0008: "INT_8", 0x0016: "INT_16", 0x0032: "INT_32", 0x0064: "INT_64",
    0x0108: "UINT_8", 0x0116: "UINT_16", 0x0132: "UINT_32", 0x0164: "UINT_64",
    0x0216: "FLOAT_16", 0x0226: "BFLOAT_16", 0x0232: "FLOAT_32", 0x0264: "FLOAT_64",
    0x0304: "SFIXED_POINT_4", 0x0308: "SFIXED_POINT_8", 0x0316: "SFIXED_POINT_16", 0x0332: "SFIXED_POINT_32",
    0x0404: "UFIXED_POINT_4", 0x0408: "UFIXED_POINT_8", 0x0416: "UFIXED_POINT_16", 0x0432: "UFIXED_POINT_32",
    0x0508: "BOOL_8", 0x0608: "STRING", 0x7FFFFFFF: "UNDEFINED",
}
# Qnn_QuantizationEncoding_t values read here
_SCALE_OFFSET, _AXIS_SCALE_OFFSET, _BW_SCALE_OFFSET, _BW_AXIS_SCALE_OFFSET = 0, 1, 2, 3
_QNN_DEFINITION_DEFINED = 1
_MALFORMED = {30010: "malformed binary", 30002: "operation failed", 30001: "invalid argument", 30000: "invalid handle"}


# ---------------------------------------------------------------- reading (in the child process)


def system_library() -> Path:
    """``libQnnSystem.so`` of the installed onnxruntime-qnn, or a :class:`QnnBinaryError` saying what to install."""
    try:
        import onnxruntime_qnn
    except ImportError as e:
        raise QnnBinaryError("reading QNN context binaries needs onnxruntime-qnn, which is not installed",
                             hint="pip install 'llmc[qnn]'") from e
    d = Path(onnxruntime_qnn.__file__).parent
    lib = next((d / n for n in ("libQnnSystem.so", "QnnSystem.dll") if (d / n).is_file()), None)
    if lib is None:
        raise QnnBinaryError(f"onnxruntime-qnn in {d} has no QNN System library (libQnnSystem.so)",
                             hint="reinstall onnxruntime-qnn: pip install --force-reinstall onnxruntime-qnn")
    return lib


@lru_cache(maxsize=1)
def _interface() -> _SystemInterface:
    lib = C.CDLL(str(system_library()))
    providers = C.POINTER(C.POINTER(_SystemInterface))()
    n = C.c_uint32()
    lib.QnnSystemInterface_getProviders.restype = C.c_uint64
    lib.QnnSystemInterface_getProviders.argtypes = [C.POINTER(C.POINTER(C.POINTER(_SystemInterface))), C.POINTER(C.c_uint32)]
    err = lib.QnnSystemInterface_getProviders(C.byref(providers), C.byref(n))
    if err or n.value == 0:
        raise QnnBinaryError(f"the QNN System library gives no interface (error {err & 0xFFFF})")
    iface = providers[0].contents
    if iface.systemApiVersion.major != 1:
        raise QnnBinaryError(f"the QNN System library's API is {iface.systemApiVersion}; llmc reads version 1.x",
                             hint="install an onnxruntime-qnn whose QNN SDK has QNN System API 1.x")
    return iface


def _str(p: bytes | None) -> str:
    return p.decode("utf-8", "replace") if p else ""


def _tensor(t: _Tensor) -> TensorInfo:
    if t.version not in (1, 2):
        raise ValueError(f"tensor version {t.version}")
    v = t.u.v1  # V2 starts with V1's fields
    dims = tuple(int(v.dimensions[i]) for i in range(v.rank)) if v.rank else ()
    q = v.quantizeParams
    quant: tuple | None = None
    if q.encodingDefinition == _QNN_DEFINITION_DEFINED:
        e = q.quantizationEncoding
        if e == _SCALE_OFFSET:
            quant = (float(q.u.scaleOffset.scale), int(q.u.scaleOffset.offset))
        elif e == _BW_SCALE_OFFSET:
            quant = (float(q.u.bwScaleOffset.scale), int(q.u.bwScaleOffset.offset))
        elif e == _AXIS_SCALE_OFFSET:
            a = q.u.axisScaleOffset
            quant = ("axis", int(a.axis), tuple((float(a.scaleOffset[i].scale), int(a.scaleOffset[i].offset)) for i in range(a.num)))
        elif e == _BW_AXIS_SCALE_OFFSET:
            a = q.u.bwAxisScaleOffset
            quant = ("axis", int(a.axis), tuple((float(a.scales[i]), int(a.offsets[i]) if a.offsets else 0) for i in range(a.num)))
        else:
            quant = ("encoding", int(e))
    return TensorInfo(_str(v.name), dims, DATA_TYPES.get(v.dataType, f"0x{v.dataType:04x}"), quant)


def _graph(g: _GraphInfo) -> GraphInfo:
    if g.version not in (1, 2, 3):
        raise ValueError(f"graph info version {g.version}")
    v = g.u.v1
    return GraphInfo(_str(v.graphName), tuple(_tensor(v.graphInputs[i]) for i in range(v.numGraphInputs)),
                     tuple(_tensor(v.graphOutputs[i]) for i in range(v.numGraphOutputs)))


def _decode(path: str, info: _BinaryInfo) -> BinaryInfo:
    if info.version not in (1, 2, 3):
        raise ValueError(f"binary info version {info.version}")
    b = {1: info.u.v1, 2: info.u.v2, 3: info.u.v3}[info.version]
    soc_model = htp_arch = vtcm = None
    if info.version == 3 and b.socModel:
        soc_model = int(b.socModel)
    platform = b.platformInfo if info.version >= 2 else None
    if platform and platform.contents.version == 1 and b.backendId == 6:  # the HTP's device info extension
        p = platform.contents.v1
        for i in range(p.numHwDevices):
            dev = p.hwDevices[i]
            if dev.version == 1 and dev.v1.deviceInfoExtension:
                ext = dev.v1.deviceInfoExtension.contents
                if ext.devType == 0:  # QNN_HTP_DEVICE_TYPE_ON_CHIP
                    soc_model = soc_model or int(ext.onChipDevice.socModel) or None
                    htp_arch = int(ext.onChipDevice.arch) or None
                    vtcm = int(ext.onChipDevice.vtcmSize) or None
                    break
    if info.version == 3 and b.contextMetadata and b.contextMetadataSize >= C.sizeof(_HtpContextBlobInfo) and b.backendId == 6:
        meta = C.cast(b.contextMetadata, C.POINTER(_HtpContextBlobInfo)).contents
        if meta.version == 1 and htp_arch is None:
            htp_arch = int(meta.dspArch) or None
    graphs = tuple(_graph(b.graphs[i]) for i in range(b.numGraphs))
    return BinaryInfo(path=path, backend_id=int(b.backendId), build_id=_str(b.buildId), core_api=str(b.coreApiVersion),
                      backend_api=str(b.backendApiVersion), info_version=int(info.version),
                      context_blob_version=str(b.contextBlobVersion), soc_version=_str(b.socVersion) or None,
                      soc_model=soc_model, htp_arch=htp_arch, vtcm_mb=vtcm,
                      context_blob_bytes=int(b.contextBlobSize), graphs=graphs)


def read_binary_info_here(path: str | Path) -> BinaryInfo:
    """Read ``path`` in this process. A corrupted binary can crash the QNN System library:
    use :func:`read_binary_info`, which runs this in a child process."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise QnnBinaryError(f"cannot read QNN context binary {path}: {e.strerror or e}") from e
    if not data:
        raise QnnBinaryError(f"{path} is empty, not a QNN context binary", hint="the file was truncated; recompile the bundle")
    iface = _interface()
    handle = C.c_void_p()
    err = iface.systemContextCreate(C.byref(handle))
    if err:
        raise QnnBinaryError(f"the QNN System library cannot create a system context (error {err & 0xFFFF})")
    try:
        buf = C.create_string_buffer(data, len(data))
        info = C.POINTER(_BinaryInfo)()
        size = C.c_uint64()
        err = iface.systemContextGetBinaryInfo(handle, C.cast(buf, C.c_void_p), len(data), C.byref(info), C.byref(size))
        if err or not info:
            code = err & 0xFFFF
            raise QnnBinaryError(f"{path} is not a readable QNN context binary: the QNN System library reports "
                                 f"{_MALFORMED.get(code, 'error')} ({code})",
                                 hint="recompile the bundle (llmc compile ... --soc S); the file is truncated, corrupted or of another kind")
        try:
            return _decode(str(path), info.contents)
        except ValueError as e:
            raise QnnBinaryError(f"{path}: unexpected QNN binary info ({e})",
                                 hint="the binary was written by a QNN SDK whose metadata llmc does not read") from e
    finally:
        iface.systemContextFree(handle)


def _child(paths: list[Path], timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-m", "llmc.runtime.qnn_binary", *map(str, paths)], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "PYTHONFAULTHANDLER": ""})
    except subprocess.TimeoutExpired as e:
        raise QnnBinaryError(f"reading QNN context binaries {', '.join(map(str, paths))} did not finish in {timeout:.0f} s",
                             hint="the files may be damaged; recompile the bundle") from e


def read_binary_infos(paths: list[str | Path], timeout: float = 300.0) -> list[BinaryInfo]:
    """:func:`read_binary_info` of several files, in one child process (one per file again only to name
    the file that crashed it)."""
    paths = [Path(p) for p in paths]
    for p in paths:
        if not p.is_file():
            raise QnnBinaryError(f"QNN context binary {p} is missing", hint="copy the whole bundle directory, or recompile it")
    if not paths:
        return []
    system_library()  # onnxruntime-qnn missing: say so here, not from the child
    proc = _child(paths, timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]  # the library may log to stdout too
    if proc.returncode != 0 or len(lines) != len(paths):
        if len(paths) > 1:
            return [info for p in paths for info in read_binary_infos([p], timeout)]
        tail = proc.stderr.strip().splitlines()[-1:] if proc.stderr.strip() else []
        how = f"exit code {proc.returncode}{': ' + tail[0][:300] if tail else ''}"
        if proc.returncode < 0:
            try:
                how = signal.Signals(-proc.returncode).name
            except ValueError:
                how = f"signal {-proc.returncode}"
        log.debug("reading %s: %s", paths[0], proc.stderr.strip()[-2000:])
        raise QnnBinaryError(f"{paths[0]} is not a readable QNN context binary: the QNN System library crashed reading it ({how})",
                             hint="the file is corrupted or of another kind; recompile the bundle")
    out = []
    for line in lines:
        result = json.loads(line)
        if "error" in result:
            raise QnnBinaryError(result["error"], hint=result.get("hint"))
        out.append(BinaryInfo.from_json(result))
    return out


def read_binary_info(path: str | Path, timeout: float = 120.0) -> BinaryInfo:
    """What the QNN context binary at ``path`` holds, read in a child process (see the module docstring)."""
    return read_binary_infos([path], timeout)[0]


# ---------------------------------------------------------------- checking against the bundle

# ONNX TensorProto data type -> the QNN data types a graph input or output of that type may have in the binary
_ONNX_TO_QNN = {
    1: {"FLOAT_32"}, 10: {"FLOAT_16"}, 16: {"BFLOAT_16"}, 2: {"UFIXED_POINT_8", "UINT_8"}, 3: {"SFIXED_POINT_8", "INT_8"},
    4: {"UFIXED_POINT_16", "UINT_16"}, 5: {"SFIXED_POINT_16", "INT_16"}, 6: {"INT_32", "SFIXED_POINT_32"},
    12: {"UINT_32", "UFIXED_POINT_32"}, 7: {"INT_64", "INT_32"}, 9: {"BOOL_8"},
}
_ONNX_NAMES = {1: "float", 10: "float16", 16: "bfloat16", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 12: "uint32",
               7: "int64", 9: "bool"}


@dataclass(frozen=True)
class _Expected:
    """What one graph instance must look like inside its binary."""

    instance: str  # "block00.r8"
    binary: str  # the bundle-relative binary file
    qnn_graph: str | None  # the graph's name in the binary (the EPContext node's name); None: not known
    io_prefix: str
    inputs: tuple[tuple[str, tuple, Any], ...] | None  # (name, dims, dtype: ONNX elem type int or QNN dtype str); None: not known
    outputs: tuple[tuple[str, tuple, Any], ...] | None


def _instances(qnn: dict[str, Any]):
    for name, per_rows in qnn["graphs"].items():
        for rows, e in per_rows.items():
            yield f"{name}.r{rows}", e


def _from_graphs(root: Path, qnn: dict[str, Any], load_onnx: Callable[..., Any]) -> list[_Expected]:
    """The instances as the QDQ graphs and the EP-context models in ``root`` say (``load_onnx``: ``onnx.load``)."""

    def io(values):
        out = []
        for v in values:
            tt = v.type.tensor_type
            out.append((v.name, tuple(d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim), int(tt.elem_type)))
        return tuple(out)

    exp = []
    for inst, e in _instances(qnn):
        if "binary" not in e:
            continue
        ins = outs = qnn_graph = None
        if e.get("qdq") and (root / e["qdq"]).is_file():  # a device package holds none
            qdq = load_onnx(root / e["qdq"], load_external_data=False).graph
            ins, outs = io(qdq.input), io(qdq.output)
        if e.get("context") and (root / e["context"]).is_file():
            ctx = load_onnx(root / e["context"], load_external_data=False).graph
            qnn_graph = next((n.name for n in ctx.node if n.op_type == "EPContext"), None)
        exp.append(_Expected(inst, e["binary"], qnn_graph, e["io_prefix"], ins, outs))
    return exp


def _from_manifest(qnn: dict[str, Any]) -> list[_Expected]:
    """The instances as the manifest's recorded binary info says (empty where none is recorded). An instance
    the binary holds but the manifest does not run (a device package's CPU-placed ones) keeps its graph name,
    so the binary is still checked for graphs no one recorded; its tensors are not checked."""
    exp = []
    where = {inst: e for inst, e in _instances(qnn)}
    for b in qnn.get("binaries", []):
        for inst, g in ((b.get("info") or {}).get("graphs") or {}).items():
            e = where.get(inst)
            if e is not None and "binary" in e:
                p = e["io_prefix"]
                exp.append(_Expected(inst, e["binary"], g["qnn_graph"], p, tuple((p + n, tuple(d), t) for n, d, t in g["inputs"]),
                                     tuple((p + n, tuple(d), t) for n, d, t in g["outputs"])))
            elif len(b["files"]) == 1:
                exp.append(_Expected(inst, b["files"][0], g["qnn_graph"], "", None, None))
    return exp


def _fail(rel: str, what: str, hint: str | None = None) -> QnnBinaryError:
    return QnnBinaryError(f"QNN context binary {rel}: {what}",
                          hint=hint or "the binary does not hold what the bundle was compiled with (tampered, or from another "
                                       "bundle); refusing it; recompile the bundle or restore the original file")


def _compare_io(rel: str, exp: _Expected, kind: str, want, have: tuple[TensorInfo, ...]) -> None:
    g = f"graph {exp.qnn_graph} ({exp.instance})"
    got = {t.name: t for t in have}
    if set(got) != {n for n, _, _ in want} or len(got) != len(have):
        raise _fail(rel, f"{g} has {kind} {sorted(got)} where the bundle expects {sorted(n for n, _, _ in want)} "
                         f"(names prefixed with {exp.io_prefix!r})")
    for name, dims, dtype in want:
        t = got[name]
        if len(dims) != len(t.dims) or any(d is not None and d != h for d, h in zip(dims, t.dims)):
            raise _fail(rel, f"{g}: {kind[:-1]} {name} has shape {list(t.dims)}, the bundle expects {list(dims)}")
        ok = t.dtype in _ONNX_TO_QNN.get(dtype, set()) if isinstance(dtype, int) else t.dtype == dtype
        if not ok:
            want_s = _ONNX_NAMES.get(dtype, dtype) if isinstance(dtype, int) else dtype
            raise _fail(rel, f"{g}: {kind[:-1]} {name} has data type {t.dtype}, the bundle expects {want_s}")


def _compare(rel: str, info: BinaryInfo, expected: list[_Expected], qnn: dict[str, Any], recorded: dict[str, Any] | None,
             holds: list[str]) -> None:
    """``holds``: the instances the manifest says ``rel``'s shard holds; graphs beyond ``expected`` are refused only
    when ``expected`` covers all of them."""
    if info.backend_id != 6:
        raise _fail(rel, f"written for QNN backend {info.backend_id}, not the HTP (6)")
    want_model = qnn.get("soc_model")
    if info.soc_model is not None and want_model is not None and info.soc_model != int(want_model):
        raise _fail(rel, f"prepared for SoC model {info.soc_model}, the bundle is for {qnn.get('soc')} (SoC model {want_model})")
    want_arch = str(qnn.get("htp_arch", "")).lstrip("v")
    if info.htp_arch is not None and want_arch and info.htp_arch != int(want_arch):
        raise _fail(rel, f"prepared for HTP v{info.htp_arch}, the bundle is for {qnn.get('soc')} (HTP v{want_arch})")
    if recorded and recorded.get("build_id") and recorded["build_id"] != info.build_id:
        raise _fail(rel, f"written by QNN {info.build_id}, the bundle's was written by QNN {recorded['build_id']}")
    names = {g.name for g in info.graphs}
    if len(names) != len(info.graphs):
        raise _fail(rel, "holds two graphs of the same name")
    mine = [e for e in expected if e.binary == rel]
    known = {e.qnn_graph for e in mine}
    complete = None not in known and set(holds) <= {e.instance for e in expected}
    extra = sorted(names - known) if complete else []
    extra_s = f"{extra[0]}{f' and {len(extra) - 1} more' if len(extra) > 1 else ''}" if extra else ""
    for e in mine:
        if e.qnn_graph is not None and e.qnn_graph not in names:
            raise _fail(rel, f"has no graph {e.qnn_graph}, which instance {e.instance} runs"
                             + (f"; it holds graph {extra_s} instead, which no instance of the bundle runs" if extra else ""))
    if extra:
        raise _fail(rel, f"holds graph {extra_s} that no instance of the bundle runs")
    for e in mine:
        if e.qnn_graph is not None and e.inputs is not None:
            g = info.graph(e.qnn_graph)
            _compare_io(rel, e, "inputs", e.inputs, g.inputs)
            _compare_io(rel, e, "outputs", e.outputs, g.outputs)


def _record(rel_files: list[str], infos: list[BinaryInfo], expected: list[_Expected]) -> dict[str, Any]:
    """The lean metadata of one shard's binaries for the manifest: versions, SoC, and each instance's graph and io."""
    head = infos[0]
    by_name = {g.name: g for i in infos for g in i.graphs}
    graphs = {}
    for e in expected:
        if e.binary in rel_files and e.qnn_graph in by_name:
            g, p = by_name[e.qnn_graph], len(e.io_prefix)
            graphs[e.instance] = {"qnn_graph": g.name, "inputs": [[t.name[p:], list(t.dims), t.dtype] for t in g.inputs],
                                  "outputs": [[t.name[p:], list(t.dims), t.dtype] for t in g.outputs]}
    return {"build_id": head.build_id, "core_api": head.core_api, "backend_api": head.backend_api,
            "context_blob_version": head.context_blob_version, "soc_model": head.soc_model,
            "htp_arch": f"v{head.htp_arch}" if head.htp_arch else None, "graphs": graphs}


def check_binaries(root: Path, qnn: dict[str, Any], load_onnx: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Read every context binary of the ``qnn`` manifest section under ``root`` and check it.

    Each binary must hold exactly the graph instances the manifest places in it, by the name its
    EP-context model gives (the EPContext node's name), with the QDQ graph's input and output names
    (carrying the instance's ``io_prefix``), shapes and data types, for the manifest's SoC model and HTP
    arch where the binary says them. Where the manifest records binary info (``binaries[i]["info"]``)
    the binary must match that too, build id included. ``load_onnx`` (``onnx.load``, which the runtime
    does not depend on): also compare with the QDQ and EP-context ONNX files.

    Returns ``{"qnn_sdk_build", "qnn_core_api", "binaries": [info per shard]}``; raises
    :class:`QnnBinaryError` naming the binary and the graph on a mismatch.
    """
    root = Path(root)
    expected = _from_graphs(root, qnn, load_onnx) if load_onnx is not None else []
    recorded_expected = _from_manifest(qnn)
    shards = qnn.get("binaries", [])
    files = [f for b in shards for f in b["files"]]
    infos = dict(zip(files, read_binary_infos([root / f for f in files])))
    out = []
    for b in shards:
        recorded = b.get("info")
        for f in b["files"]:
            if expected:
                _compare(f, infos[f], expected, qnn, recorded, b.get("graphs", []))
            if recorded_expected:
                _compare(f, infos[f], recorded_expected, qnn, recorded, b.get("graphs", []))
        out.append(recorded or _record(b["files"], [infos[f] for f in b["files"]], expected))
        for f in b["files"]:
            log.info("QNN context binary %s: %d graphs, QNN %s, SoC model %s, HTP %s: as the bundle expects", f, len(infos[f].graphs),
                     infos[f].build_id, infos[f].soc_model, infos[f].htp_arch)
    builds = sorted({i.build_id for i in infos.values()})
    cores = sorted({i.core_api for i in infos.values()})
    return {"qnn_sdk_build": builds[0] if len(builds) == 1 else builds, "qnn_core_api": cores[0] if len(cores) == 1 else cores,
            "binaries": out}


_verified: dict[tuple, bool] = {}


def verify_binary(bundle: Path, rel: str, qnn: dict[str, Any]) -> None:
    """Check the binary ``rel`` of ``bundle`` against the manifest's recorded info, once per file (its
    path, size and modification time, and the recorded info) in a process: the runtime calls this
    before it loads a context binary. A manifest that records no info for ``rel`` is not checked."""
    from llmc.runtime.manifest import resolve_inside

    path = resolve_inside(Path(bundle), rel)
    shard = next((b for b in qnn.get("binaries", []) if rel in b["files"]), None)
    if shard is None or not shard.get("info"):
        log.info("the manifest records no QNN binary info for %s; it is not checked", rel)
        return
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, json.dumps(shard["info"], sort_keys=True))
    if key in _verified:
        return
    one = {**qnn, "binaries": [{**shard, "files": [rel]}]}
    check_binaries(Path(bundle), one)
    _verified[key] = True


if __name__ == "__main__":  # for read_binary_infos: per binary its info (or the error) as one JSON line on stdout
    for _arg in sys.argv[1:]:
        try:
            _line = json.dumps(read_binary_info_here(_arg).to_json())
        except QnnBinaryError as _e:
            _line = json.dumps({"error": str(_e), "hint": _e.hint})
        except Exception as _e:  # noqa: BLE001 - any other failure is this file's, named for the parent
            _line = json.dumps({"error": f"{_arg}: cannot read its QNN binary info ({type(_e).__name__}: {_e})",
                                "hint": "the file is corrupted or of another kind; recompile the bundle"})
        sys.stdout.write(_line + "\n")
        sys.stdout.flush()
