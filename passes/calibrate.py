"""calibrate: record statistics of every Linear's input on calibration text.

Runs the IR itself (``llmc.interpreter``, float32, the same numerics as the fp32
bundle) on calibration tokens and keeps, per Linear input value (q/k/v share
one), and per key and value input of every Attention (for ``quantize_kv_cache``): the absolute maximum, a 16-bins-per-octave histogram of ``|x|`` (for
percentiles and clipping), per-channel maxima and a coarse per-channel
histogram (for outlier counts per input channel). Bin edges sit on a grid of
float32 values, so a value's bins are one table lookup on its top 20 bits.

The default corpus is the English reference documentation that ships with the
Python interpreter (``pydoc_data.topics``), so calibration works offline;
``--calib FILE`` uses the user's text and ``--calib-tokens N`` bounds the work.
Results are cached (keyed by the weights, the text, the token count and the
graph) so recompiling with other quantization options does not recalibrate.

Produces :class:`llmc.analyses.CalibrationStats`; the IR is unchanged.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from llmc.analyses import (
    BIN_KEY_SHIFT, CH_MIN_EXP, CH_PER_OCTAVE, HIST_MAX_EXP, HIST_MIN_EXP, HIST_PER_OCTAVE, CalibrationStats, TensorStats, channel_edges,
    hist_edges,
)
from llmc.errors import CompileError
from llmc.ir import Graph
from llmc.pass_manager import Pass, PassContext, PassResult

log = logging.getLogger(__name__)

STATS_VERSION = 3  # 3: the Attention nodes' key and value inputs too
SEQ_LEN = 512  # calibration text is run in sequences of this many tokens


def default_corpus() -> tuple[str, str]:
    """(name, text) of the built-in calibration corpus."""
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    return "pydoc_data.topics (Python reference documentation)", text


def read_calib_file(path: str | Path) -> str:
    """The text of ``--calib`` ``path``; a named error if it is missing, unreadable or not UTF-8."""
    path = Path(path)
    if not path.is_file():
        raise CompileError(f"--calib {path}: no such file", hint="pass a UTF-8 text file, or leave --calib out for the default text")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CompileError(f"--calib {path} is not UTF-8 text (byte {e.start})",
                           hint="convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8), or leave --calib out for the default text") from e
    except OSError as e:
        raise CompileError(f"--calib {path}: {e.strerror or e}", hint="pass a readable UTF-8 text file") from e


def calibration_text(options) -> tuple[str, str]:
    """(name, text) of the calibration corpus: ``--calib FILE`` or the built-in one."""
    if options.calib_file:
        return str(options.calib_file), read_calib_file(options.calib_file)
    return default_corpus()


@functools.cache
def _bin_tables() -> np.ndarray:
    """Per 20-bit magnitude key: fine bin | coarse bin << 16 (see ``hist_edges``)."""
    keys = np.arange(1 << (31 - BIN_KEY_SHIFT), dtype=np.int64)
    floor = (keys << BIN_KEY_SHIFT).astype(np.int32).view(np.float32)  # smallest |x| with each key
    floor[keys > (0x7F800000 >> BIN_KEY_SHIFT)] = 0.0  # NaN keys (add() clears NaN before the lookup); +inf is the last bin
    fine = np.searchsorted(hist_edges(), floor, side="right") - 1
    coarse = np.searchsorted(channel_edges(), floor, side="right") - 1
    return (fine | coarse << 16).astype(np.int32)


class _Accumulator:
    """Statistics of one Linear input, added one ``[tokens, features]`` batch at a time."""

    def __init__(self, features: int) -> None:
        self.absmax = 0.0
        self.count = 0
        self.hist = np.zeros(len(hist_edges()), np.int64)
        self.channel_absmax = np.zeros(features, np.float32)
        self.channel_hist = np.zeros((features, len(channel_edges())), np.int64)

    def add(self, x: np.ndarray) -> None:
        # Everything comes from |x|'s float32 bits: they order like |x| (for the
        # maxima) and their top 20 bits decide both bins (one table lookup).
        mag = np.ascontiguousarray(x, np.float32).view(np.int32) & np.int32(0x7FFFFFFF)
        mag[mag > 0x7F800000] = 0  # NaN counts as zero (bin 0), as it never raises a maximum
        ch_max = mag.max(axis=0)
        self.channel_absmax = np.maximum(self.channel_absmax, ch_max.view(np.float32))
        self.absmax = max(self.absmax, float(self.channel_absmax.max()))
        self.count += mag.size
        mag >>= BIN_KEY_SHIFT
        bins = _bin_tables()[mag]
        nf, nb = self.hist.size, self.channel_hist.shape[1]
        self.hist += np.bincount((bins & 0xFFFF).ravel(), minlength=nf)
        bins >>= 16
        bins += np.arange(0, mag.shape[1] * nb, nb, dtype=np.int32)
        self.channel_hist += np.bincount(bins.ravel(), minlength=self.channel_hist.size).reshape(self.channel_hist.shape)

    def freeze(self) -> TensorStats:
        return TensorStats(self.absmax, self.count, self.hist, self.channel_absmax, self.channel_hist)


class Calibrate(Pass):
    name = "calibrate"
    summary = "run the model on calibration text; record per-tensor and per-channel stats of every Linear input and attention key/value"
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
        result = CalibrationStats(corpus, len(ids), self._collect(graph, ids, linears))
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

    def _collect(self, graph: Graph, ids: list[int], linears) -> dict[str, TensorStats]:
        from llmc.interpreter import Interpreter

        # q/k/v (and gate/up) read one value: observe it at its first reader only.
        first_reader = {}
        for n in linears:
            first_reader.setdefault(n.inputs[0].name, n.name)
        watched = {name: (0,) for name in first_reader.values()}
        watched.update({n.name: (1, 2) for n in graph.find("Attention")})  # keys (before rotary) and values
        stats: dict[str, _Accumulator] = {}

        def observe(node, inputs, outputs):
            for i in watched.get(node.name, ()):
                x = inputs[i]
                stats.setdefault(node.inputs[i].name, _Accumulator(x.shape[1])).add(x)

        interp = Interpreter(graph, cache_weights=False)  # weights stay in the checkpoint's pages, one layer at a time
        sel = graph.find("SelectRows")
        for s in range(0, len(ids), SEQ_LEN):
            part = ids[s : s + SEQ_LEN]
            # the last Linear (the LM head) needs its input only: skip its logits
            interp.run(part, observer=observe, select_rows=np.arange(len(part)) if sel else None, stop_at=linears[-1].name if linears else None)
            log.info("calibrated on %d/%d tokens", min(s + SEQ_LEN, len(ids)), len(ids))
        return {k: a.freeze() for k, a in stats.items()}

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
            # weights a pass derived (smooth_activations) carry their own names
            "weights": sorted({w.name for n in graph.nodes for w in n.weights.values()}),
            "attention": [(n.name, n.inputs[1].name, n.inputs[2].name) for n in graph.find("Attention")],
            "bins": [HIST_PER_OCTAVE, HIST_MIN_EXP, HIST_MAX_EXP, CH_PER_OCTAVE, CH_MIN_EXP, BIN_KEY_SHIFT],
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
        for name, st in result.inputs.items():
            p = f"{name}|"
            arrays[p + "scalars"] = np.array([st.absmax, st.count], np.float64)
            arrays[p + "hist"] = st.hist
            arrays[p + "channel_absmax"] = st.channel_absmax
            arrays[p + "channel_hist"] = st.channel_hist
        tmp = None
        try:  # a cache that cannot be written only costs time; a unique temporary name per compile
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f"{key}.", suffix=".tmp.npz", delete=False) as f:
                tmp = Path(f.name)
                np.savez_compressed(f, **arrays)
            tmp.replace(path)
        except OSError as e:
            log.warning("could not cache the calibration in %s: %s", path, e.strerror or e)
            if tmp is not None:
                tmp.unlink(missing_ok=True)

    def _load(self, ctx, key) -> CalibrationStats | None:
        path = self._path(ctx, key)
        if path is None or not path.is_file():
            return None

        def build(d):
            absmax, count = d["scalars"]
            return TensorStats(float(absmax), int(count), d["hist"], d["channel_absmax"], d["channel_hist"])

        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                table: dict[str, dict[str, np.ndarray]] = {}
                for k in z.files:
                    if k == "meta":
                        continue
                    name, field = k.split("|")
                    table.setdefault(name, {})[field] = z[k]
            return CalibrationStats(meta["corpus"], meta["tokens"], {k: build(v) for k, v in table.items()})
        except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as e:  # truncated, corrupt or foreign
            log.warning("ignoring the unreadable calibration cache %s (%s: %s); calibrating again", path, type(e).__name__, e)
            return None
