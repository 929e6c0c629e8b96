"""calibrate: record statistics of every Linear's input and output on calibration text.

Runs the IR itself (``llmc.interpreter``, float32, the same numerics as the fp32
bundle) on calibration tokens and keeps, per Linear input value and per Linear
output: the absolute maximum, a 16-bins-per-octave histogram of ``|x|`` (for
percentiles), per-channel maxima and a coarse per-channel histogram (for
outlier counts per input channel).

The default corpus is the English reference documentation that ships with the
Python interpreter (``pydoc_data.topics``), so calibration works offline;
``--calib FILE`` uses the user's text and ``--calib-tokens N`` bounds the work.
Results are cached (keyed by the weights, the text, the token count and the
graph) so recompiling with other quantization options does not recalibrate.

Produces :class:`llmc.analyses.CalibrationStats`; the IR is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np

from llmc.analyses import (
    CH_MIN_EXP, CH_PER_OCTAVE, HIST_MAX_EXP, HIST_MIN_EXP, HIST_PER_OCTAVE, CalibrationStats, TensorStats, channel_edges, hist_edges,
)
from llmc.errors import CompileError
from llmc.ir import Graph
from llmc.pass_manager import Pass, PassContext, PassResult

log = logging.getLogger(__name__)

STATS_VERSION = 1
SEQ_LEN = 512  # calibration text is run in sequences of this many tokens
_FAR = float(1 << 20)  # beyond every histogram bin in units of 1/HIST_PER_OCTAVE octave
assert HIST_PER_OCTAVE % CH_PER_OCTAVE == 0, "the per-channel bins must be unions of the fine bins"


def default_corpus() -> tuple[str, str]:
    """(name, text) of the built-in calibration corpus."""
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    return "pydoc_data.topics (Python reference documentation)", text


def calibration_text(options) -> tuple[str, str]:
    """(name, text) of the calibration corpus: ``--calib FILE`` or the built-in one."""
    if options.calib_file:
        path = Path(options.calib_file)
        if not path.is_file():
            raise CompileError(f"calibration file {path} does not exist", hint="pass a UTF-8 text file to --calib")
        return str(path), path.read_text(encoding="utf-8", errors="replace")
    return default_corpus()


class _Accumulator:
    def __init__(self, features: int) -> None:
        self.absmax = 0.0
        self.minimum = 0.0
        self.maximum = 0.0
        self.count = 0
        self.hist = np.zeros(len(hist_edges()), np.int64)
        self.channel_absmax = np.zeros(features, np.float32)
        self.channel_hist = np.zeros((features, len(channel_edges())), np.int64)

    def add(self, x: np.ndarray) -> None:
        a = np.abs(x)
        ch_max = a.max(axis=0)
        self.absmax = max(self.absmax, float(ch_max.max()))
        self.minimum = min(self.minimum, float(x.min()))
        self.maximum = max(self.maximum, float(x.max()))
        self.count += a.size
        self.channel_absmax = np.maximum(self.channel_absmax, ch_max)
        # Bin indices from one log2: f = floor(16 log2|x|) is exact (scaling by 2^k is), and
        # floor(2 log2|x|) = f // 8. log2(0) = -inf and NaN go to bin 0 and +inf to the last
        # bin, as clamping the float values would put them.
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.log2(a, out=a)
        t *= HIST_PER_OCTAVE
        np.floor(t, out=t)
        np.fmax(t, -_FAR, out=t)  # also NaN -> -_FAR
        np.fmin(t, _FAR, out=t)
        f = t.astype(np.int32)
        nf, nb = len(self.hist), self.channel_hist.shape[1]
        fine = np.clip(f - HIST_MIN_EXP * HIST_PER_OCTAVE + 1, 0, nf - 1)
        self.hist += np.bincount(fine.ravel(), minlength=nf)
        coarse = np.clip(f // (HIST_PER_OCTAVE // CH_PER_OCTAVE) - CH_MIN_EXP * CH_PER_OCTAVE + 1, 0, nb - 1)
        coarse += np.arange(a.shape[1], dtype=np.int32)[None, :] * nb
        self.channel_hist += np.bincount(coarse.ravel(), minlength=self.channel_hist.size).reshape(self.channel_hist.shape)

    def freeze(self) -> TensorStats:
        return TensorStats(self.absmax, self.count, self.hist, self.channel_absmax, self.channel_hist, self.minimum, self.maximum)


class Calibrate(Pass):
    name = "calibrate"
    summary = "run the model on calibration text; record per-tensor stats of every Linear input/output"
    produces = (CalibrationStats,)

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        opts = ctx.options
        corpus, text = calibration_text(opts)
        if ctx.inputs.encode is None:
            raise CompileError("calibration needs the model's tokenizer, and this model has none", hint="compile from a directory with tokenizer files")
        linears = [n for n in graph.nodes if n.op == "Linear"]
        key = self._key(graph, ctx, text, linears)
        cached = self._load(ctx, key)
        if cached is not None:
            ctx.put(cached)
            log.info("calibration loaded from cache (%s)", key[:12])
            return PassResult(False)
        ids = self._tokens(ctx.inputs.encode, text, opts.calib_tokens)
        if len(ids) < 16:
            raise CompileError(f"calibration text {corpus} gives only {len(ids)} tokens", hint="use a longer --calib file")
        stats = self._collect(graph, ids, linears)
        result = CalibrationStats(corpus, len(ids), *stats)
        self._save(ctx, key, result)
        ctx.put(result)
        return PassResult(False)

    @staticmethod
    def _tokens(encode, text: str, n: int) -> list[int]:
        """The first ``n`` tokens of ``text``, tokenizing only as much text as needed."""
        chars = 8 * n
        while True:
            ids = encode(text[:chars])
            if len(ids) >= n or chars >= len(text):
                return ids[:n]
            chars *= 2

    def _collect(self, graph: Graph, ids: list[int], linears):
        from llmc.interpreter import Interpreter

        watched_inputs = {n.inputs[0].name for n in linears}
        watched_nodes = {n.name for n in linears}
        ins: dict[str, _Accumulator] = {}
        outs: dict[str, _Accumulator] = {}

        def observe(node, inputs, outputs):
            if node.name not in watched_nodes:
                return
            v = node.inputs[0].name
            if v in watched_inputs and self._seen.get(v) != self._run:
                self._seen[v] = self._run
                ins.setdefault(v, _Accumulator(inputs[0].shape[1])).add(inputs[0])
            outs.setdefault(node.name, _Accumulator(outputs[0].shape[1])).add(outputs[0])

        interp = Interpreter(graph)
        self._seen: dict[str, int] = {}
        sel = graph.find("SelectRows")
        for self._run, s in enumerate(range(0, len(ids), SEQ_LEN)):
            part = ids[s : s + SEQ_LEN]
            interp.run(part, observer=observe, select_rows=np.arange(len(part)) if sel else None)
            log.info("calibrated on %d/%d tokens", min(s + SEQ_LEN, len(ids)), len(ids))
        return {k: a.freeze() for k, a in ins.items()}, {k: a.freeze() for k, a in outs.items()}

    # -- cache -----------------------------------------------------------------
    def _key(self, graph, ctx, text, linears) -> str:
        h = hashlib.sha256()
        meta = {
            "v": STATS_VERSION,
            "model": ctx.inputs.fingerprint,
            "text": hashlib.sha256(text.encode()).hexdigest(),
            "tokens": ctx.options.calib_tokens,
            "seq": SEQ_LEN,
            "linears": [(n.name, n.inputs[0].name) for n in linears],
            "bins": [HIST_PER_OCTAVE, HIST_MIN_EXP, HIST_MAX_EXP, CH_PER_OCTAVE, CH_MIN_EXP],
        }
        h.update(json.dumps(meta, sort_keys=True).encode())
        return h.hexdigest()

    def _path(self, ctx, key) -> Path | None:
        if not ctx.options.cache_dir or not ctx.inputs.fingerprint:
            return None
        return Path(ctx.options.cache_dir) / "calibration" / f"{key}.npz"

    def _save(self, ctx, key, result: CalibrationStats) -> None:
        path = self._path(ctx, key)
        if path is None:
            return
        arrays: dict[str, np.ndarray] = {"meta": np.array(json.dumps({"corpus": result.corpus, "tokens": result.tokens}))}
        for kind, table in (("in", result.inputs), ("out", result.outputs)):
            for name, st in table.items():
                p = f"{kind}|{name}|"
                arrays[p + "scalars"] = np.array([st.absmax, st.count, st.minimum, st.maximum], np.float64)
                arrays[p + "hist"] = st.hist
                arrays[p + "channel_absmax"] = st.channel_absmax
                arrays[p + "channel_hist"] = st.channel_hist
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez_compressed(tmp, **arrays)
        tmp.replace(path)

    def _load(self, ctx, key) -> CalibrationStats | None:
        path = self._path(ctx, key)
        if path is None or not path.is_file():
            return None
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                tables: dict[str, dict[str, dict[str, np.ndarray]]] = {"in": {}, "out": {}}
                for k in z.files:
                    if k == "meta":
                        continue
                    kind, name, field = k.split("|")
                    tables[kind].setdefault(name, {})[field] = z[k]
        except (OSError, ValueError, KeyError) as e:
            log.warning("ignoring unreadable calibration cache %s: %s", path, e)
            return None

        def build(d):
            absmax, count, mn, mx = d["scalars"]
            return TensorStats(float(absmax), int(count), d["hist"], d["channel_absmax"], d["channel_hist"], float(mn), float(mx))

        return CalibrationStats(meta["corpus"], meta["tokens"], {k: build(v) for k, v in tables["in"].items()}, {k: build(v) for k, v in tables["out"].items()})
