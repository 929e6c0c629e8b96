"""``llmc verify --qnn``: the HTP's numerics against ONNX Runtime's CPU provider, graph by graph.

Every NPU graph instance of a bundle is prepared again as a context binary of its
own (the x86_64 HTP simulator loads those, not weight-shared ones) and run on the
inputs it sees in a real generation (recorded from a run with every graph on the
HTP). Each output is compared three ways, relative to its largest magnitude:

* ``htp``: the context on the HTP against the same fully quantized QDQ graph on the
  CPU provider: what the HTP itself computes differently;
* ``qdq``: that QDQ graph on the CPU provider against the bundle's CPU instance of the
  graph: what the 16-bit activations of the QNN graphs cost;
* and, end to end, the logits of prompts run with every graph on the HTP against the
  CPU provider's.

Errors compound from graph to graph, so the end-to-end gap is larger than any
one graph's; the per-graph table says where it comes from.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmc.errors import LlmcError

log = logging.getLogger(__name__)

DEFAULT_TOLERANCE = 0.05  # of an output's largest magnitude, HTP against the CPU provider on one graph


class NothingToVerify(LlmcError):
    """The bundle has no QNN graphs to check (a usage error)."""

    exit_code = 2


class VerificationFailed(LlmcError):
    """A numerical check found the HTP further from the CPU provider than the tolerance."""

    exit_code = 12


@dataclass(frozen=True)
class OutputCheck:
    name: str
    htp: float  # max |HTP - QDQ on CPU| / max |QDQ on CPU|
    qdq: float  # max |QDQ on CPU - CPU instance| / max |CPU instance|


@dataclass(frozen=True)
class InstanceCheck:
    graph: str
    rows: int
    outputs: tuple[OutputCheck, ...]

    @property
    def htp(self) -> float:
        return max((o.htp for o in self.outputs), default=0.0)

    @property
    def qdq(self) -> float:
        return max((o.qdq for o in self.outputs), default=0.0)


@dataclass(frozen=True)
class QnnVerification:
    bundle: str
    soc: str
    instances: tuple[InstanceCheck, ...]
    logits_gap: tuple[float, ...]  # per prompt: max |logits on the HTP - on the CPU| / max |logits on the CPU|
    tolerance: float

    @property
    def worst(self) -> InstanceCheck | None:
        return max(self.instances, key=lambda c: c.htp, default=None)

    @property
    def ok(self) -> bool:
        return all(c.htp <= self.tolerance for c in self.instances)

    def as_dict(self) -> dict:
        return {"bundle": self.bundle, "soc": self.soc, "tolerance": self.tolerance, "ok": self.ok,
                "logits_gap": list(self.logits_gap),
                "instances": [{"graph": c.graph, "rows": c.rows, "htp": c.htp, "qdq": c.qdq,
                               "outputs": [{"name": o.name, "htp": o.htp, "qdq": o.qdq} for o in c.outputs]} for c in self.instances]}


def _gap(x: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(x.astype(np.float64) - ref).max() / max(float(np.abs(ref).max()), 1e-12))


def _prompts(sess, n: int, seed: int) -> list[list[int]]:
    """``n`` prompts of a chunk and a few tokens (so chunk and one-row instances both run): slices of held-out
    English with the bundle's tokenizer, else seeded random ids."""
    length = min(sess.chunk + 3, sess.max_context - 3)
    if sess.tokenizer is not None:
        from llmc.runtime.evaluate import heldout_english

        ids = sess.encode(heldout_english())
        step = max(1, (len(ids) - length) // max(n, 1))
        return [ids[i * step : i * step + length] for i in range(n)]
    vocab = sess.manifest["model"].get("vocab_size") or 100
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(min(4, vocab - 1), vocab, size=length)] for _ in range(n)]


def verify_qnn(bundle: str | Path, prompts: int = 5, seed: int = 0, tolerance: float = DEFAULT_TOLERANCE) -> QnnVerification:
    """Check every NPU graph instance of ``bundle`` on the HTP simulator against the CPU provider (see the module)."""
    import onnxruntime as ort

    from llmc.backends.package import prepare_unshared_contexts
    from llmc.runtime import Session, load_manifest
    from llmc.runtime.manifest import map_weights
    from llmc.runtime.qnn import provider_options, qnn_session, register_qnn

    bundle = Path(bundle)
    m = load_manifest(bundle)
    q = m.get("qnn") or {}
    if not q.get("graphs") or any("qdq" not in inst for by in q["graphs"].values() for inst in by.values()):
        raise NothingToVerify(f"{bundle} has no fully quantized QDQ graphs to check "
                                 + ("(it is a device package)" if "package" in m else f"({q.get('skipped', 'compiled without --soc')})"),
                                 hint="verify the bundle compiled with --target npu --soc SOC")
    htp = Session(bundle, provider="qnn", placement="npu", verify=False)  # load_manifest checked the hashes
    cpu = Session(bundle, provider="cpu", placement="cpu", verify=False)
    htp.recorded_inputs = {}
    gaps = []
    for ids in _prompts(htp, prompts, seed):
        htp.reset(), cpu.reset()
        gaps.append(_gap(htp.prefill(ids, all_logits=True), cpu.prefill(ids, all_logits=True)))
        htp.generate(ids, 3, stop_at_eos=False)  # decode: the one-row instances
    recorded = {k: v for k, v in htp.recorded_inputs.items() if k[0] in q["graphs"] and str(k[1]) in q["graphs"][k[0]]}
    o_ort, oq, devices = register_qnn()
    weights = {n: np.ascontiguousarray(a) for n, a in map_weights(bundle, m["weights"]).items() if n.endswith(".q8")}  # the QDQ graphs' by name
    checks = []
    with tempfile.TemporaryDirectory(prefix="llmc-verify-") as tmp:
        made = prepare_unshared_contexts(bundle, m, sorted(recorded), Path(tmp), q["soc"])
        for (name, rows), inputs in sorted(recorded.items()):
            inst = q["graphs"][name][str(rows)]
            prefix = inst["io_prefix"]
            so = ort.SessionOptions()
            so.log_severity_level = 3
            so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
            so.add_provider_for_devices(devices, provider_options(oq, q["htp_arch"], q["soc_model"]))
            on_htp = qnn_session(ort, str(Path(tmp) / made[f"{name}/{rows}"]["context"]), so)
            so = ort.SessionOptions()
            so.log_severity_level = 3
            names = [n for n in m["graphs"][name]["weights"] if n in weights]
            if names:
                so.add_external_initializers(names, [ort.OrtValue.ortvalue_from_numpy(weights[n]) for n in names])
            qdq_cpu = ort.InferenceSession((bundle / inst["qdq"]).read_bytes(), so, providers=["CPUExecutionProvider"])
            feeds = {prefix + k: v for k, v in inputs.items()}
            outs = [o["name"] for o in m["graphs"][name]["outputs"]]
            a = qdq_cpu.run([prefix + o for o in outs], feeds)
            h = on_htp.run([prefix + o for o in outs], feeds)
            c = cpu.run_instance(name, rows, inputs)
            checks.append(InstanceCheck(name, rows, tuple(OutputCheck(o, _gap(y, x), _gap(x, c[o])) for o, x, y in zip(outs, a, h))))
            log.info("%s r%d: HTP vs CPU provider %.4f, 16-bit QDQ vs CPU instance %.4f", name, rows, checks[-1].htp, checks[-1].qdq)
    return QnnVerification(str(bundle), q["soc"], tuple(checks), tuple(gaps), tolerance)
