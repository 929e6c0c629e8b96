"""QNN backend: fully quantized NPU subgraphs and QNN HTP context binaries.

For ``--target npu --soc S`` every static (NPU) subgraph instance is written a
second time as a *fully quantized* QDQ ONNX graph, ``qnn/<name>.r<rows>.onnx``,
in the form the QNN HTP backend runs without CPU fallback:

* every activation tensor carries a uint16 Quantize/Dequantize pair with the
  range ``calibrate_ranges`` observed (norms, residual adds, activations,
  Linear outputs);
* a ``QLinear`` keeps the bundle's W8A8 numerics: its input is quantized to the
  plan's uint8 grid, then re-expressed exactly in uint16 (scale / 256, zero point
  128 * 256) so the HTP MatMul group (uint16 in and out, symmetric int8
  weights, zero point 0 — the same bytes as the CPU graphs) sees exactly
  the 8-bit input values; weight bytes are shared with ``weights/weights.bin``;
* small constants (norm scales, biases, scalar multipliers) are quantized inline.

Those graphs are then compiled by ONNX Runtime's QNN execution provider
(``onnxruntime-qnn``) for the SoC's HTP architecture into EP-context models
(``qnn/ctx/<shard>/<name>.r<rows>_ctx.onnx``) whose graphs share one context
binary per shard (``ep.share_ep_contexts``): prefill and decode instances of a
subgraph hold one copy of its weights. Shards split the model by layers so no
context exceeds ``shard_bytes`` of weights or ``shard_graphs`` graph instances,
and each shard is prepared in its own process (the EP's preparation memory
grows faster than linearly with the graphs in one context and is not returned
between shards).

Deployment loads the context binaries on the device. The x86_64 HTP simulator
cannot load weight-shared contexts, so on x86_64 the runtime runs the very same
fully quantized graphs through the QNN EP, which prepares them for the HTP in
the session (see the manifest's ``qnn.x86_64_route``).
"""

from __future__ import annotations

import logging
import platform
from pathlib import Path
from typing import Any

import numpy as np

from llmc.analyses import ChunkPlan, Subgraph, ValueRanges
from llmc.errors import LlmcError
from llmc.ir import Graph, Node
from llmc.runtime.manifest import map_weights
from llmc.runtime.qnn import provider_options, qnn_available, qnn_session, register_qnn

log = logging.getLogger(__name__)



def _socs() -> dict[str, tuple[str, str]]:
    from llmc.device_profile import qnn_socs

    return {name: (p.qnn["htp_arch"].lstrip("v"), str(p.qnn["soc_model"])) for name, p in qnn_socs().items()}


# SoC name -> (HTP architecture without "v", QNN soc_model id), read from the shipped device
# profiles that carry "qnn" SoC facts (compiler/profiles/*.json; each with its source).
SOCS = _socs()
DEFAULT_SHARD_BYTES = 2 << 30  # well under the ~4 GB the HTP can address
# Graph instances per context: preparing SmolLM2's 276 in one context took 4.7 GB of host memory
# and 173 s, in contexts of at most 69 1.6 GB and 80 s (docs/qnn.md).
DEFAULT_SHARD_GRAPHS = 64
MARGIN = 4.0  # head-room on observed ranges before uint16 saturates (costs 2 of 16 bits)


class QnnBackendError(LlmcError):
    exit_code = 9


def versions() -> dict[str, str]:
    import onnxruntime as ort
    from importlib.metadata import version

    return {"onnxruntime": ort.__version__, "onnxruntime_qnn": version("onnxruntime-qnn")}


def _u16(lo: float, hi: float) -> tuple[np.float32, np.uint16]:
    lo, hi = min(lo * MARGIN, 0.0), max(hi * MARGIN, 0.0)
    if hi - lo < 1e-8:
        hi = lo + 1e-3
    scale = np.float32((hi - lo) / 65535.0)
    zp = np.uint16(int(np.clip(np.rint(-lo / scale), 0, 65535)))
    return scale, zp


class _Builder:
    def __init__(self, graph: Graph, sub: Subgraph, rows: int, weights: dict[str, dict[str, Any]], ranges: ValueRanges) -> None:
        from onnx import helper

        self.h = helper
        self.graph, self.sub, self.rows, self.weights, self.ranges = graph, sub, rows, weights, ranges.ranges
        self.nodes: list = []
        self.inits: list = []
        self.external: list[str] = []
        self.read_name: dict[str, str] = {}  # IR value -> ONNX name consumers read (dequantized)
        self.values = {v.name: v for n in (graph.node(x) for x in sub.nodes) for v in list(n.inputs) + list(n.outputs)}
        # Graphs that share a QNN context share tensors by name: only weights may
        # collide, so every other name is prefixed with the instance.
        self.prefix = f"{sub.name}.r{rows}/"

    def p(self, name: str) -> str:
        return name if name in self.external else self.prefix + name

    def const(self, name: str, arr) -> str:
        from onnx import numpy_helper

        self.inits.append(numpy_helper.from_array(np.asarray(arr), self.p(name)))
        return name

    def add(self, op: str, ins: list[str], outs: list[str], name: str, **attrs) -> None:
        self.nodes.append(self.h.make_node(op, [self.p(i) for i in ins], [self.p(o) for o in outs], name=self.p(name), **attrs))

    def qdq(self, src: str, dst: str, value: str, lo: float | None = None, hi: float | None = None) -> None:
        """src (float) -> uint16 Q -> DQ -> dst, with the range of IR value ``value``."""
        if lo is None:
            if value not in self.ranges:
                raise QnnBackendError(f"no calibrated range for {value} in subgraph {self.sub.name}", hint="run calibrate_ranges before chunk_static_graphs")
            lo, hi = self.ranges[value]
        s, z = _u16(lo, hi)
        sn, zn = self.const(f"{dst}.s", s), self.const(f"{dst}.z", z)
        self.add("QuantizeLinear", [src, sn, zn], [f"{dst}.q"], f"{dst}.quant")
        self.add("DequantizeLinear", [f"{dst}.q", sn, zn], [dst], f"{dst}.dequant")

    def qconst(self, name: str, arr: np.ndarray) -> str:
        """A float constant as a uint16-quantized initializer + DequantizeLinear."""
        arr = np.asarray(arr, np.float32)
        s, z = _u16(float(arr.min()) / MARGIN, float(arr.max()) / MARGIN)
        q = np.clip(np.rint(arr / s) + int(z), 0, 65535).astype(np.uint16)
        self.add("DequantizeLinear", [self.const(f"{name}.q", q), self.const(f"{name}.s", s), self.const(f"{name}.z", z)], [name], f"{name}.dequant")
        return name

    def ext_weight(self, wname: str) -> str:
        from onnx import TensorProto

        if wname not in self.external:
            self.external.append(wname)
            w = self.weights[wname]
            t = TensorProto()
            t.name = wname
            t.data_type = {"int8": TensorProto.INT8, "uint8": TensorProto.UINT8, "float32": TensorProto.FLOAT}[w["dtype"]]
            t.dims.extend(w["shape"])
            t.data_location = TensorProto.EXTERNAL
            for k, v in (("location", w["file"]), ("offset", str(w["offset"])), ("length", str(w["nbytes"]))):
                e = t.external_data.add()
                e.key, e.value = k, v
            self.inits.append(t)
        return wname

    def load(self, wname: str) -> np.ndarray:
        return np.asarray(self.graph.weights.load(wname), np.float32)

    def lower(self, n: Node) -> None:
        x = [self.read_name[v.name] for v in n.inputs]
        out = n.outputs[0].name
        raw = f"{out}.raw"
        a = n.attrs
        if n.op == "QLinear":
            s8, z8 = np.float32(a["x_scale"]), np.uint8(a["x_zero_point"])
            s8n, z8n = self.const(f"{out}.xs8", s8), self.const(f"{out}.xz8", z8)
            self.add("QuantizeLinear", [x[0], s8n, z8n], [f"{out}.x8"], f"{out}.xq8")
            self.add("DequantizeLinear", [f"{out}.x8", s8n, z8n], [f"{out}.x8d"], f"{out}.xdq8")
            # the same 8-bit grid, exactly, in uint16: q16 = 256 * q8
            s16n = self.const(f"{out}.xs16", np.float32(s8 / 256.0))
            z16n = self.const(f"{out}.xz16", np.uint16(int(z8) * 256))
            self.add("QuantizeLinear", [f"{out}.x8d", s16n, z16n], [f"{out}.x16"], f"{out}.xq16")
            self.add("DequantizeLinear", [f"{out}.x16", s16n, z16n], [f"{out}.x16d"], f"{out}.xdq16")
            qw, ws = n.weights["qweight"], n.weights["wscale"]
            out_f = qw.shape[1]
            per_channel = ws.shape != (1,)
            wsc = self.load(ws.name)
            wz = self.const(f"{out}.wz", np.full(out_f if per_channel else (), a["w_zero_point"], qw.dtype))
            wsn = self.const(f"{out}.ws", wsc if per_channel else np.float32(wsc[0]))
            self.add("DequantizeLinear", [self.ext_weight(qw.name), wsn, wz], [f"{out}.w"], f"{out}.wdq", **({"axis": 1} if per_channel else {}))
            lo, hi = self.ranges[out]
            if "bias" in n.weights:
                b = self.load(n.weights["bias"].name)
                mm = f"{out}.mm"
                self.add("MatMul", [f"{out}.x16d", f"{out}.w"], [f"{mm}.raw"], f"{out}.matmul")
                bmax = float(np.abs(b).max())
                self.qdq(f"{mm}.raw", mm, out, lo - bmax, hi + bmax)
                self.add("Add", [mm, self.qconst(f"{out}.bias", b)], [raw], f"{out}.bias_add")
            else:
                self.add("MatMul", [f"{out}.x16d", f"{out}.w"], [raw], f"{out}.matmul")
        elif n.op == "RMSNorm":
            w = self.load(n.weights["weight"].name) + np.float32(a["offset"])
            self.add("RMSNormalization", [x[0], self.qconst(f"{out}.scale", w)], [raw], n.name, axis=-1, epsilon=float(a["eps"]))
        elif n.op == "LayerNorm":
            ins = [x[0], self.qconst(f"{out}.w", self.load(n.weights["weight"].name))]
            if "bias" in n.weights:
                ins.append(self.qconst(f"{out}.b", self.load(n.weights["bias"].name)))
            self.add("LayerNormalization", ins, [raw], n.name, axis=-1, epsilon=float(a["eps"]))
        elif n.op == "Act":
            if a["kind"] == "silu":
                sig = f"{out}.sigmoid"
                self.add("Sigmoid", x, [f"{sig}.raw"], f"{sig}.op")
                self.qdq(f"{sig}.raw", sig, out, 0.0, 1.0 / MARGIN)
                self.add("Mul", [x[0], sig], [raw], n.name)
            else:
                self.add("Gelu", x, [raw], n.name, approximate="tanh" if a["kind"] == "gelu_tanh" else "none")
        elif n.op in ("Add", "Mul"):
            self.add(n.op, x, [raw], n.name)
        elif n.op == "Scale":
            self.add("Mul", [x[0], self.qconst(f"{out}.value", np.array(a["value"], np.float32))], [raw], n.name)
        elif n.op == "Slice":
            ins = [x[0], self.const(f"{out}.st", np.array([a["start"]], np.int64)), self.const(f"{out}.en", np.array([a["end"]], np.int64)),
                   self.const(f"{out}.ax", np.array([1], np.int64))]
            self.add("Slice", ins, [raw], n.name)
        else:
            raise QnnBackendError(f"subgraph {self.sub.name}: node {n.name} ({n.op}) has no HTP lowering",
                                  hint="move it to the CPU side of the cut, or file an issue")
        self.qdq(raw, out, out)
        self.read_name[out] = out

    def build(self):
        for i in self.sub.inputs:
            self.qdq(i, f"{i}.in", i)
            self.read_name[i] = f"{i}.in"
        for name in self.sub.nodes:
            self.lower(self.graph.node(name))
        vi = lambda n: self.h.make_tensor_value_info(self.p(n), 1, [self.rows, self.values[n].shape[1]])  # noqa: E731
        g = self.h.make_graph(self.nodes, f"{self.sub.name}_r{self.rows}", [vi(i) for i in self.sub.inputs], [vi(o) for o in self.sub.outputs], self.inits)
        model = self.h.make_model(g, opset_imports=[self.h.make_opsetid("", 23)], producer_name="llmc")
        model.ir_version = 10
        return model


def _probe_model() -> bytes:
    """A tiny fully quantized graph in the backend's form: uint16 QDQ activations into an HTP MatMul
    with symmetric int8 weights (zero point 0)."""
    from onnx import helper, numpy_helper

    k, n = 64, 32
    w = (np.arange(k * n, dtype=np.int64).reshape(k, n) % 255 - 127).astype(np.int8)
    inits = [numpy_helper.from_array(np.float32(1e-3), "x.s"), numpy_helper.from_array(np.uint16(32768), "x.z"),
             numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.float32(1e-2), "w.s"), numpy_helper.from_array(np.int8(0), "w.z"),
             numpy_helper.from_array(np.float32(1e-2), "y.s"), numpy_helper.from_array(np.uint16(32768), "y.z")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "x.s", "x.z"], ["x.q"]), helper.make_node("DequantizeLinear", ["x.q", "x.s", "x.z"], ["x.d"]),
             helper.make_node("DequantizeLinear", ["w", "w.s", "w.z"], ["w.d"]), helper.make_node("MatMul", ["x.d", "w.d"], ["y"]),
             helper.make_node("QuantizeLinear", ["y", "y.s", "y.z"], ["y.q"]), helper.make_node("DequantizeLinear", ["y.q", "y.s", "y.z"], ["out"])]
    g = helper.make_graph(nodes, "llmc_soc_probe", [helper.make_tensor_value_info("x", 1, [4, k])], [helper.make_tensor_value_info("out", 1, [4, n])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], producer_name="llmc")
    model.ir_version = 10
    return model.SerializeToString()


def probe_soc(soc: str, workdir: Path) -> dict[str, Any]:
    """Prepare a tiny uint16 QDQ MatMul for ``soc`` with the QNN EP (``ep.context_enable``) into ``workdir``.

    Returns the context model and binary paths and what the HTP prepare configuration recorded in the
    binary says (``soc_type``, ``arch``; None where this QNN build does not record them). Raises
    QnnBackendError, naming the QNN build and what the SoC needs, if the EP cannot prepare for it.
    """
    import re

    from llmc.device_profile import load

    if soc not in SOCS:
        raise QnnBackendError(f"unknown SoC {soc!r}", hint="choose one of: " + ", ".join(SOCS))
    facts = load(soc).qnn
    ort, oq, devices = register_qnn()
    workdir.mkdir(parents=True, exist_ok=True)
    ctx = workdir / f"probe_{soc}_ctx.onnx"
    so = _session_options(ort, oq, devices, soc, {}, [], {"ep.context_enable": "1", "ep.context_file_path": str(ctx), "ep.context_embed_mode": "0"})
    build = f"onnxruntime-qnn {versions()['onnxruntime_qnn']} (QNN {getattr(oq, 'qnn_version', None) or _qnn_version()})"
    try:
        qnn_session(ort, _probe_model(), so)
        bins = sorted(workdir.glob(f"probe_{soc}_ctx*.bin"))
        if not ctx.is_file() or not bins:
            raise RuntimeError("no context binary was written")
    except Exception as e:
        need = facts.get("requires") or f"a QNN build whose SoC table has soc_model {facts['soc_model']} ({facts['part']}, HTP {facts['htp_arch']})"
        raise QnnBackendError(f"{build} cannot prepare QNN HTP graphs for --soc {soc} ({facts['part']}, HTP {facts['htp_arch']}, "
                              f"soc_model {facts['soc_model']}): {str(e).strip().splitlines()[-1][:300]}",
                              hint=f"this SoC needs {need}; install an onnxruntime-qnn built with it, or pick another --soc") from None
    blob = bins[0].read_bytes().decode("latin-1")
    field = lambda k: (m.group(1) if (m := re.search(rf";{k}=([^;]*);", blob)) else None)  # noqa: E731
    arch = field("arch")
    return {"context": ctx, "binary": bins[0], "soc_type": field("soc_type"), "htp_arch": f"v{arch}" if arch else None, "build": build}


def _qnn_version() -> str:
    try:
        from onnxruntime_qnn.build_and_package_info import qnn_version

        return str(qnn_version)
    except ImportError:
        return "unknown"


def check_soc(soc: str) -> None:
    """Fail now, before the slow stages, if this QNN build cannot prepare for ``soc`` or prepares it as another SoC."""
    import tempfile

    from llmc.device_profile import load

    facts = load(soc).qnn
    with tempfile.TemporaryDirectory(prefix="llmc-soc-") as d:
        got = probe_soc(soc, Path(d))
    if (got["soc_type"] and got["soc_type"] != facts["part"]) or (got["htp_arch"] and got["htp_arch"] != facts["htp_arch"]):
        raise QnnBackendError(f"{got['build']} prepares soc_model {facts['soc_model']} as {got['soc_type']} (HTP {got['htp_arch']}), "
                              f"but --soc {soc} is {facts['part']} (HTP {facts['htp_arch']})",
                              hint=f"the soc_model id of {soc} does not match this QNN build's SoC table; check compiler/profiles/{soc}.json")


def _session_options(ort, oq, devices, soc: str, weights: dict[str, np.ndarray], names: list[str], extra: dict[str, str]):
    htp_arch, soc_model = SOCS[soc]
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    for k, v in extra.items():
        so.add_session_config_entry(k, v)
    if names:
        so.add_external_initializers(names, [ort.OrtValue.ortvalue_from_numpy(weights[n]) for n in names])
    so.add_provider_for_devices(devices, provider_options(oq, htp_arch, soc_model))
    return so


def _prepare_shard(root: str, weights: dict[str, dict[str, Any]], soc: str,
                   items: list[tuple[str, int, str, str, list[str]]], share: bool = True) -> tuple[str, str] | None:
    """In a child process: compile one shard's QDQ graphs into EP-context models sharing one binary
    (``share=False``: a binary of its own each, which the x86_64 HTP simulator can load).

    ``items`` are (subgraph, rows, QDQ model path, context model path, external
    weight names), relative to ``root``. Returns (message, hint) if the HTP
    rejects a graph, else None.
    """
    ort, oq, devices = register_qnn()
    arrays = map_weights(root, weights)
    base = Path(root)
    for k, (name, rows, qdq_rel, ctx_rel, names) in enumerate(items):
        extra = {"ep.context_enable": "1", "ep.context_file_path": str(base / ctx_rel), "ep.context_embed_mode": "0"}
        if share:
            extra["ep.share_ep_contexts"] = "1"
        if share and k == len(items) - 1:
            extra["ep.stop_share_ep_contexts"] = "1"
        so = _session_options(ort, oq, devices, soc, arrays, names, extra)
        try:
            ort.InferenceSession((base / qdq_rel).read_bytes(), so)
        except Exception as e:
            return (f"QNN HTP cannot take subgraph {name} (rows {rows}) for {soc}: {str(e).strip().splitlines()[-1][:600]}",
                    f"inspect it with: {qdq_rel} in the failed bundle's temp dir; ops the HTP rejects must move to the CPU side")
    return None


def _run_shard_process(root: Path, weights: dict[str, dict[str, Any]], soc: str, si: int, items: list, share: bool = True,
                       job_dir: Path | None = None) -> None:
    """Run :func:`_prepare_shard` for shard ``si`` in a new Python process (``python -m llmc.backends.qnn_backend``)."""
    import json
    import subprocess
    import sys

    job = (job_dir or root / "qnn") / f".shard{si:02d}.json"
    job.write_text(json.dumps({"root": str(root), "weights": weights, "soc": soc, "items": items, "share": share}))
    try:
        proc = subprocess.run([sys.executable, "-m", "llmc.backends.qnn_backend", str(job)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        result = json.loads(job.read_text()) if proc.returncode == 0 else None
    finally:
        job.unlink(missing_ok=True)
    if result is None:
        tail = proc.stderr.strip().splitlines()[-1][:300] if proc.stderr.strip() else "no message"
        raise QnnBackendError(f"the process preparing QNN context shard {si} ({len(items)} graphs) failed with exit code {proc.returncode}: {tail}",
                              hint="if it ran out of memory, rerun with a smaller --qnn-shard-mb or --qnn-shard-graphs (docs/qnn.md)")
    if result.get("error"):
        raise QnnBackendError(result["error"], hint=result["hint"])


def emit_qnn(graph: Graph, plan: ChunkPlan, weights: dict[str, dict[str, Any]], ranges: ValueRanges, root: Path, soc: str,
             shard_bytes: int = DEFAULT_SHARD_BYTES, shard_graphs: int = DEFAULT_SHARD_GRAPHS) -> dict[str, Any]:
    """Write the fully quantized graphs and the context binaries; return the manifest's ``qnn`` section."""
    import onnx

    if soc not in SOCS:
        raise QnnBackendError(f"unknown SoC {soc!r}", hint="choose one of: " + ", ".join(SOCS))
    reason = qnn_available()
    if reason:
        raise QnnBackendError(reason)
    register_qnn()  # fail here, in this process, if the EP cannot be registered
    (root / "qnn").mkdir(parents=True, exist_ok=True)
    graphs: dict[str, dict[str, Any]] = {}
    models: list[tuple[str, int, list[str], int]] = []
    for sub in plan.subgraphs:
        graphs[sub.name] = {}
        for rows in sub.row_counts:
            b = _Builder(graph, sub, rows, weights, ranges)
            rel = f"qnn/{sub.name}.r{rows}.onnx"
            (root / rel).write_bytes(b.build().SerializeToString(deterministic=True))
            graphs[sub.name][str(rows)] = {"qdq": rel, "io_prefix": b.prefix}
            models.append((sub.name, rows, list(b.external), sum(weights[w]["nbytes"] for w in b.external)))
    # shards: consecutive subgraphs (layer order) until shard_bytes of weights or shard_graphs instances;
    # the instances of one subgraph stay together (they share its weights)
    instances = {sub.name: len(sub.row_counts) for sub in plan.subgraphs}
    largest = {sub.name: max(sub.row_counts) for sub in plan.subgraphs}
    shards: list[list[tuple]] = [[]]
    used = 0
    for m in models:
        first_instance = m[1] == largest[m[0]]
        if shards[-1] and first_instance and (used + m[3] > shard_bytes or len(shards[-1]) + instances[m[0]] > shard_graphs):
            shards.append([])
            used = 0
        shards[-1].append(m)
        if first_instance:
            used += m[3]
    binaries = []
    # Each shard is prepared in a fresh process: the QNN EP keeps memory from every graph it has
    # prepared (SmolLM2 in 10 shards: 1.0 -> 1.9 GB over the shards in one process), so without
    # this the host memory of the step grows with the model instead of with the shard.
    for si, shard in enumerate(shards):
        ctx_dir = root / "qnn" / "ctx" / f"shard{si:02d}"
        ctx_dir.mkdir(parents=True, exist_ok=True)
        items = [(name, rows, graphs[name][str(rows)]["qdq"], f"qnn/ctx/shard{si:02d}/{name}.r{rows}_ctx.onnx", names)
                 for name, rows, names, _ in shard]
        _run_shard_process(root, weights, soc, si, items)
        for name, rows, _, ctx_rel, _ in items:
            graphs[name][str(rows)]["context"] = ctx_rel
            graphs[name][str(rows)]["shard"] = si
        bins = sorted(p.relative_to(root).as_posix() for p in ctx_dir.glob("*.bin"))
        binaries.append({"shard": si, "files": bins, "bytes": sum((root / b).stat().st_size for b in bins),
                         "graphs": [f"{n}.r{r}" for (n, r, *_rest) in shard]})
    for si, shard in enumerate(shards):  # which binary each context model points at
        for name, rows, *_ in shard:
            ctx_model = onnx.load(root / graphs[name][str(rows)]["context"], load_external_data=False)
            for node in ctx_model.graph.node:
                for attr in node.attribute:
                    if attr.name == "ep_cache_context":
                        graphs[name][str(rows)]["binary"] = f"qnn/ctx/shard{si:02d}/{attr.s.decode()}"
    htp_arch, soc_model = SOCS[soc]
    qnn = {
        "soc": soc,
        "htp_arch": f"v{htp_arch}",
        "soc_model": int(soc_model),
        "versions": versions(),
        "activations": "uint16 QDQ on every tensor; Linear inputs on the plan's uint8 grid, carried exactly in uint16",
        "weights": "symmetric int8 (zero point 0), per channel or per tensor, shared bytes with weights/weights.bin",
        "graphs": graphs,
        "binaries": binaries,
        "x86_64_route": "qdq-onnx: the x86_64 HTP simulator cannot load weight-shared context binaries, so on x86_64 the runtime "
                        "runs qnn/<graph>.onnx through the QNN EP (prepared for the HTP in-session); on the device it loads the contexts",
        "built_on": platform.machine(),
    }
    return _check_binaries(root, qnn)


def _check_binaries(root: Path, qnn: dict[str, Any]) -> dict[str, Any]:
    """Read back every context binary written (``llmc.runtime.qnn_binary``), check it holds each graph
    instance as its QDQ graph says, and record what it holds in ``qnn``."""
    import onnx

    from llmc.runtime.qnn_binary import QnnBinaryError, check_binaries

    try:
        checked = check_binaries(root, qnn, load_onnx=onnx.load)
    except QnnBinaryError as e:
        raise QnnBackendError(f"the QNN EP wrote a context binary that does not match its graphs: {e}",
                              hint="a bug in llmc or in onnxruntime-qnn; report it with the versions: "
                                   + ", ".join(f"{k} {v}" for k, v in qnn["versions"].items())) from e
    for b, info in zip(qnn["binaries"], checked["binaries"]):
        b["info"] = info
    qnn["qnn_sdk_build"], qnn["qnn_core_api"] = checked["qnn_sdk_build"], checked["qnn_core_api"]
    return qnn


if __name__ == "__main__":  # one shard, for _run_shard_process: the job file in, the result written back into it
    import json
    import sys

    _job = Path(sys.argv[1])
    _spec = json.loads(_job.read_text())
    _failure = _prepare_shard(_spec["root"], _spec["weights"], _spec["soc"], [tuple(i) for i in _spec["items"]], _spec.get("share", True))
    _job.write_text(json.dumps({"error": _failure[0], "hint": _failure[1]} if _failure else {}))
