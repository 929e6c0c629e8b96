"""Running a bundle under a memory budget: resident, streamed and row-read weights.

A bundle compiled with ``--memory-budget`` carries an ``offload`` section (the
compiler's :class:`~llmc.analyses.OffloadPlan`, see ``docs/memory-budget.md``):

* ``resident`` weights are read once into ordinary (anonymous) memory, so the
  process's RSS counts exactly what is resident; the weight file is never
  memory-mapped.
* ``streamed`` weights are graph *inputs* of their static graphs. They are read
  from ``weights.bin`` for every use with positioned reads — ``O_DIRECT`` into
  page-aligned buffers where the filesystem allows, so the page cache does not
  quietly keep the model; else ``pread`` followed by
  ``posix_fadvise(DONTNEED)`` — into a :class:`BufferPool` of at most
  ``buffer_bytes``. A background thread walks the execution order and reads the
  streamed weights of the next ``prefetch_depth`` steps that have any while the
  current one computes; the main thread waits only for a buffer not yet read.
* ``row_streamed`` tables (the embedding table, the int8 codes that shadow-outlier
  corrections read by row, and their ``*.hot_delta``) are :class:`RowTable` objects: indexing one with an array
  of row numbers reads just those rows, with up to ``ROW_READ_WORKERS`` reads in
  flight, except the plan's ``resident_rows``, read at load and served from memory.

Only numpy and the standard library are used.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import mmap
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from llmc.runtime.errors import BundleError
from llmc.runtime.manifest import resolve_inside

log = logging.getLogger(__name__)

BLOCK = 4096  # O_DIRECT alignment of offsets, lengths and buffer addresses (a page; covers 512- and 4096-byte sectors)
OFFLOAD_KEYS = {
    "budget_bytes": int, "weight_bytes": int, "resident": list, "streamed": list, "row_streamed": list, "resident_bytes": int,
    "streamed_bytes": int, "buffer_bytes": int, "prefetch_depth": int, "predicted_decode_s": (int, float),
    "predicted_decode_no_prefetch_s": (int, float),
}
OFFLOAD_OPTIONAL_KEYS = {"resident_rows": dict}  # table -> rows kept in memory (bundles before it keep none)
# Which op-step weights may be read by row: op -> weight slots.
ROW_READABLE = {"Embedding": ("table",), "QEmbedding": ("codes",), "ShadowOutliers": ("codes", "hot_delta")}


def buffer_size(nbytes: int) -> int:
    """Bytes of the pool buffer that holds a streamed weight of ``nbytes`` (room for block-aligned reads at any offset)."""
    return -(-nbytes // BLOCK) * BLOCK + BLOCK


class WeightFile:
    """Positioned reads of one weight file that bypass the page cache.

    ``O_DIRECT`` where the filesystem supports it (reads of whole aligned blocks
    into page-aligned buffers); otherwise ordinary ``pread`` followed by
    ``posix_fadvise(DONTNEED)`` on the range read. Safe to use from several threads.
    """

    def __init__(self, path: Path, direct: bool = True) -> None:
        self.path = path
        self.size = path.stat().st_size
        self.fd = os.open(path, os.O_RDONLY)
        self.dfd: int | None = None
        if direct and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError:
                fd = None
            if fd is not None:
                probe = mmap.mmap(-1, BLOCK)
                try:
                    os.preadv(fd, [probe], 0)
                    self.dfd = fd
                except OSError:
                    os.close(fd)
                finally:
                    probe.close()
        if self.dfd is None:
            log.info("%s: O_DIRECT is not available here; streaming with pread + posix_fadvise(DONTNEED)", path)

    @property
    def direct(self) -> bool:
        return self.dfd is not None

    def read_into(self, buf: Any, offset: int, nbytes: int) -> int:
        """Read ``nbytes`` at ``offset`` into ``buf`` (page-aligned, ``len >= buffer_size(nbytes)``); return where the data starts in ``buf``."""
        mv = memoryview(buf)
        if self.dfd is not None:
            start = offset - offset % BLOCK
            end = min(-(-(offset + nbytes) // BLOCK) * BLOCK, -(-self.size // BLOCK) * BLOCK)
            self._read_all(self.dfd, mv[: end - start], start, offset + nbytes - start)
            skip = offset - start
        else:
            self._read_all(self.fd, mv[:nbytes], offset, nbytes)
            os.posix_fadvise(self.fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
            skip = 0
        return skip

    def _read_all(self, fd: int, mv: memoryview, offset: int, need: int) -> None:
        got = 0
        while got < need:
            n = os.preadv(fd, [mv[got:]], offset + got)
            if n <= 0:
                raise BundleError(f"{self.path}: short read at byte {offset + got} (the file is truncated?)", hint="recompile the bundle")
            got += n

    def read_array(self, offset: int, nbytes: int) -> np.ndarray:
        """A fresh ``uint8`` array holding ``nbytes`` at ``offset`` (ordinary memory, page cache dropped)."""
        out = np.empty(nbytes, np.uint8)
        self._read_all(self.fd, memoryview(out), offset, nbytes)
        os.posix_fadvise(self.fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        return out

    def close(self) -> None:
        for fd in (self.fd, self.dfd):
            if fd is not None:
                os.close(fd)
        self.dfd = None


ROW_READ_WORKERS = 8  # positioned row reads in flight at once (see RowReader)


class RowReader:
    """Reads rows of a :class:`WeightFile` with up to ``workers`` reads in flight.

    A token's table rows are small random reads, and storage with a queue serves
    several at once faster than one after another: on this repository's test
    host, 129 µs per random 4 KiB ``O_DIRECT`` read one at a time and 55 µs each
    with eight threads reading continuously; through this class, eight rows per
    call, 131 → 117 µs per row (docs/memory-budget.md).
    The calling thread reads one share itself and worker threads the others;
    ``os.preadv`` releases the GIL.
    """

    def __init__(self, file: WeightFile, workers: int = ROW_READ_WORKERS) -> None:
        self.file = file
        self.workers = max(int(workers), 1)
        self._pool = None
        if self.workers > 1:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(self.workers - 1, thread_name_prefix="llmc-rows")
        self._local = threading.local()

    def read(self, offsets: Sequence[int], nbytes: int, out: np.ndarray) -> None:
        """``out[j] = `` the ``nbytes`` at ``offsets[j]`` (``out``: uint8 ``[len(offsets), nbytes]``)."""
        k = len(offsets)
        n = min(self.workers, k)
        if self._pool is None or n <= 1:
            self._read(offsets, nbytes, out, 0, k)
            return
        cuts = [i * k // n for i in range(n + 1)]
        futures = [self._pool.submit(self._read, offsets, nbytes, out, cuts[i], cuts[i + 1]) for i in range(1, n)]
        self._read(offsets, nbytes, out, cuts[0], cuts[1])
        for f in futures:
            f.result()

    def _read(self, offsets: Sequence[int], nbytes: int, out: np.ndarray, lo: int, hi: int) -> None:
        scratch = getattr(self._local, "scratch", None)
        if scratch is None or len(scratch) < buffer_size(nbytes):
            scratch = self._local.scratch = mmap.mmap(-1, buffer_size(nbytes))  # page-aligned, per thread
        view = np.frombuffer(scratch, np.uint8)
        for j in range(lo, hi):
            skip = self.file.read_into(scratch, int(offsets[j]), nbytes)
            out[j] = view[skip : skip + nbytes]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class RowTable:
    """A 2-D weight read by row: ``table[rows]`` reads just those rows from the file.

    Stands in for the numpy array in :func:`llmc.runtime.kernels.embedding` and
    :func:`~llmc.runtime.kernels.shadow_outliers`; ``shape`` and ``dtype`` are
    the weight's. ``keep`` rows (the offload plan's ``resident_rows``: the
    channels calibration saw with outliers most often) are read once, here, and
    served from memory; the others are read from the file when asked for,
    through ``reader`` (one at a time without one). Main thread only.
    """

    def __init__(self, file: WeightFile, name: str, offset: int, shape: Sequence[int], dtype: np.dtype, *,
                 reader: RowReader | None = None, keep: Sequence[int] = ()) -> None:
        self.file = file
        self.reader = reader if reader is not None else RowReader(file, workers=1)
        self.name = name
        self.offset = offset
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        self._keep = np.unique(np.asarray(keep, dtype=np.int64))  # sorted
        if self._keep.size and (self._keep[0] < 0 or self._keep[-1] >= self.shape[0]):
            raise BundleError(f"the offload plan keeps rows of {name} beyond its {self.shape[0]} rows", hint="the bundle is corrupt; recompile it")
        self._kept = np.empty((self._keep.size, self.row_bytes), np.uint8)
        if self._keep.size:
            self.reader.read(self.offset + self._keep * self.row_bytes, self.row_bytes, self._kept)
        self.rows_read = 0  # rows read from the file by indexing (kept rows not counted)

    @property
    def resident_bytes(self) -> int:
        return self._kept.nbytes

    def __getitem__(self, rows: Any) -> np.ndarray:
        idx = np.asarray(rows, dtype=np.int64)
        flat = idx.reshape(-1)
        if flat.size and (flat.min() < -self.shape[0] or flat.max() >= self.shape[0]):
            raise IndexError(f"row index out of range for {self.name} with {self.shape[0]} rows")
        flat = np.where(flat < 0, flat + self.shape[0], flat)
        uniq, inverse = np.unique(flat, return_inverse=True)
        got = np.empty((len(uniq), self.row_bytes), np.uint8)
        if self._keep.size:
            slots = np.minimum(np.searchsorted(self._keep, uniq), self._keep.size - 1)
            kept = self._keep[slots] == uniq
            got[kept] = self._kept[slots[kept]]
            missing = np.flatnonzero(~kept)
        else:
            missing = np.arange(len(uniq))
        if missing.size:
            fresh = np.empty((missing.size, self.row_bytes), np.uint8)
            self.reader.read(self.offset + uniq[missing] * self.row_bytes, self.row_bytes, fresh)
            got[missing] = fresh
            self.rows_read += int(missing.size)
        return got[inverse.reshape(-1)].view(self.dtype).reshape(*idx.shape, *self.shape[1:])

    def __len__(self) -> int:
        return self.shape[0]


class BufferPool:
    """Page-aligned anonymous buffers for streamed weights, never more than ``capacity`` bytes in total.

    Buffers freed by a step are kept for reuse by a later weight of the same
    :func:`buffer_size` (decode reads the same shapes every token, so the pages
    stay mapped) and dropped (unmapped) when a new size needs the room.
    ``live_bytes`` counts every buffer that exists, in use or kept; ``peak_bytes``
    is its maximum. Not thread-safe: the caller holds its lock.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free: dict[int, list[mmap.mmap]] = collections.defaultdict(list)
        self.live_bytes = 0
        self.peak_bytes = 0

    def reserve(self, sizes: Sequence[int]) -> list[mmap.mmap] | None:
        """Buffers of ``sizes`` bytes, or None if they do not fit now (wait for a release and retry)."""
        need = collections.Counter(sizes)
        reuse = {s: min(k, len(self.free.get(s, ()))) for s, k in need.items()}
        new = sum(s * (k - reuse[s]) for s, k in need.items())
        if self.live_bytes + new > self.capacity:
            spare = sum(s * (len(bs) - reuse.get(s, 0)) for s, bs in self.free.items())
            if self.live_bytes - spare + new > self.capacity:
                return None
            for s in sorted(self.free, reverse=True):  # unmap kept buffers nobody needs now, largest first
                while len(self.free[s]) > reuse.get(s, 0) and self.live_bytes + new > self.capacity:
                    self.free[s].pop()  # unmapped when the last view of it goes
                    self.live_bytes -= s
        out = []
        for s in sizes:
            if self.free.get(s):
                out.append(self.free[s].pop())
            else:
                out.append(mmap.mmap(-1, s))
                self.live_bytes += s
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return out

    def give_back(self, bufs: Iterable[mmap.mmap]) -> None:
        for b in bufs:
            self.free[len(b)].append(b)

    def close(self) -> None:
        self.free.clear()  # each buffer is unmapped when the last view of it goes
        self.live_bytes = 0


@dataclasses.dataclass
class StreamStats:
    """What streaming cost: reads, time spent waiting for them on the main thread."""

    uses: int = 0  # steps that got their streamed weights
    bytes_read: int = 0
    read_s: float = 0.0  # time inside reads (either thread)
    wait_s: float = 0.0  # main thread blocked on a read not finished
    mispredicted: int = 0  # steps run out of the announced order (their prefetches dropped)
    peak_buffer_bytes: int = 0

    @property
    def read_bandwidth(self) -> float:
        return self.bytes_read / self.read_s if self.read_s > 0 else 0.0


class _Use:
    __slots__ = ("step", "bufs", "arrays", "ready", "error")

    def __init__(self, step: int, bufs: list[mmap.mmap]) -> None:
        self.step = step
        self.bufs = bufs
        self.arrays: dict[str, np.ndarray] = {}
        self.ready = False
        self.error: BaseException | None = None


class StreamedWeights:
    """Reads the streamed weights of each program step into the pool, ahead of time when ``prefetch``.

    The session announces the order it will run steps in (:meth:`schedule`),
    then for each step with streamed weights calls :meth:`acquire` (returns
    ``name -> array``, waiting if the read is not done) and :meth:`release`.
    A step acquired out of the announced order drops the prefetched reads and is
    read on the spot, so results never depend on the prediction.
    """

    def __init__(self, file: WeightFile, table: dict[str, dict[str, Any]], by_step: dict[int, list[str]],
                 buffer_bytes: int, depth: int, prefetch: bool) -> None:
        self.file = file
        self.table = table
        self.by_step = by_step
        self.depth = depth
        self.prefetch = prefetch and depth > 0  # depth 0 (--prefetch-depth 0): the ring holds the running step only
        self.pool = BufferPool(buffer_bytes)
        self.stats = StreamStats()
        self.shapes: dict[str, tuple[int, ...]] = {}  # graph-input shapes that differ from the stored ones (scalar scales)
        self._cond = threading.Condition()
        self._queue: collections.deque[_Use] = collections.deque()
        self._future: Iterator[int] = iter(())
        self._next: int | None = None
        self._active: _Use | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        if prefetch:
            self._thread = threading.Thread(target=self._prefetch_loop, name="llmc-prefetch", daemon=True)
            self._thread.start()

    # -- the order -----------------------------------------------------------
    def schedule(self, order: Iterable[int], then_repeat: Sequence[int] | None = None) -> None:
        """The steps about to run, in order; then ``then_repeat`` over and over (decode), if given.

        Reads already made for a prefix of this order are kept; others are dropped.
        """
        if not self.prefetch:
            return
        order = list(order)

        def future() -> Iterator[int]:
            it: Iterator[int] = (i for i in order if i in self.by_step)
            rep = [i for i in (then_repeat or ()) if i in self.by_step]
            return itertools.chain(it, itertools.cycle(rep)) if rep else it

        with self._cond:
            fut = future()
            if not all(next(fut, None) == u.step for u in self._queue):
                self._drop_queue_locked()  # the order changed: start over from the new one
                fut = future()
            self._future, self._next = fut, None
            self._cond.notify_all()

    def _drop_queue_locked(self) -> None:
        while any(not u.ready for u in self._queue):
            self._cond.wait()
        for u in self._queue:
            self.pool.give_back(u.bufs)
        self._queue.clear()

    # -- the main thread -----------------------------------------------------
    def acquire(self, step: int) -> dict[str, np.ndarray]:
        """The streamed weights of program step ``step``, read (waits for a prefetch in flight)."""
        with self._cond:
            if self._active is not None:
                raise RuntimeError(f"step {step} acquired while step {self._active.step} still holds its streamed weights")
            t = time.perf_counter()
            waited = False
            while True:
                if self._queue and self._queue[0].step == step:
                    use = self._queue.popleft()
                    while not use.ready:
                        waited = True
                        self._cond.wait()
                    self._cond.notify_all()  # a queue slot is free
                    break
                if not self._queue and self.prefetch:
                    if self._next is None:
                        self._next = next(self._future, None)
                    if self._next == step:  # the prefetcher is about to take it
                        waited = True
                        self._cond.notify_all()
                        self._cond.wait()
                        continue
                # not the step announced: drop the prefetched reads, read this one now
                self.stats.mispredicted += int(self.prefetch)
                self._future, self._next = iter(()), None
                self._drop_queue_locked()
                bufs = self.pool.reserve([buffer_size(int(self.table[n]["nbytes"])) for n in self.by_step[step]])
                if bufs is None:  # only this step holds buffers now, and check_offload saw that the largest step fits
                    raise BundleError(f"the streamed weights of program step {step} do not fit in the buffer pool")
                use = _Use(step, bufs)
                self._read(use)
                waited = True
                break
            if waited:
                self.stats.wait_s += time.perf_counter() - t
            self._active = use
        if use.error is not None:
            self.release(step)
            raise use.error
        self.stats.uses += 1
        return use.arrays

    def release(self, step: int) -> None:
        with self._cond:
            use, self._active = self._active, None
            if use is None or use.step != step:
                raise RuntimeError(f"release of step {step}, which is not the acquired one")
            use.arrays = {}
            self.pool.give_back(use.bufs)
            self._cond.notify_all()

    # -- reading ---------------------------------------------------------------
    def _read(self, use: _Use) -> None:
        t = time.perf_counter()
        try:
            for name, buf in zip(self.by_step[use.step], use.bufs):
                w = self.table[name]
                nbytes = int(w["nbytes"])
                skip = self.file.read_into(buf, int(w["offset"]), nbytes)
                dtype = np.dtype(w["dtype"])
                arr = np.frombuffer(buf, dtype=dtype, count=nbytes // dtype.itemsize, offset=skip)
                use.arrays[name] = arr.reshape(self.shapes.get(name, w["shape"]))
                self.stats.bytes_read += nbytes
        except BaseException as e:  # surfaced on the main thread by acquire
            use.error = e
        self.stats.read_s += time.perf_counter() - t
        use.ready = True
        self.stats.peak_buffer_bytes = max(self.stats.peak_buffer_bytes, self.pool.peak_bytes)

    def _prefetch_loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    if len(self._queue) < self.depth:
                        if self._next is None:
                            self._next = next(self._future, None)
                        if self._next is not None:
                            bufs = self.pool.reserve([buffer_size(self.table[n]["nbytes"]) for n in self.by_step[self._next]])
                            if bufs is not None:
                                use = _Use(self._next, bufs)
                                self._queue.append(use)
                                self._next = None
                                break
                    self._cond.wait()
            self._read(use)
            with self._cond:
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        with self._cond:
            self._queue.clear()
            self._active = None
            self.pool.close()


def _tighten_malloc() -> None:
    """Make glibc's malloc give freed memory back to the system (process-wide; a no-op elsewhere).

    By default glibc raises its mmap threshold each time a large block is freed
    (up to 32 MB), after which large activations come from the heap and stay in
    the RSS once freed. A fixed threshold and trim threshold keep the RSS at
    what is live. Measured in docs/memory-budget.md.
    """
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version"):
            return
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 256 * 1024)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        return


class Residency:
    """The weights of a budgeted bundle: ``weights`` (what the session indexes by name) and ``streaming``.

    ``weights`` maps every resident weight to an ordinary numpy array and every
    row-streamed table to a :class:`RowTable`; streamed weights are not in it —
    the session feeds them per run from :attr:`streaming`.
    """

    def __init__(self, bundle: Path, manifest: dict[str, Any], *, prefetch: bool = True, direct: bool = True) -> None:
        self.plan = check_offload(bundle, manifest)
        _tighten_malloc()
        table = manifest["weights"]
        files = {table[n]["file"] for n in self.plan["resident"] + self.plan["streamed"] + self.plan["row_streamed"]}
        if len(files) > 1:
            raise BundleError(f"{bundle}: the offload plan spans several weight files ({sorted(files)}); this runtime streams from one",
                              hint="recompile the bundle with this version of llmc")
        self.file = WeightFile(resolve_inside(bundle, files.pop() if files else "weights/weights.bin"), direct=direct)
        self.rows = RowReader(self.file)
        try:
            self._load(manifest, prefetch)
        except BaseException:
            self.rows.close()
            self.file.close()
            raise

    def _load(self, manifest: dict[str, Any], prefetch: bool) -> None:
        table = manifest["weights"]
        self.weights: dict[str, Any] = {}
        for name in self.plan["resident"]:
            w = table[name]
            self.weights[name] = self.file.read_array(int(w["offset"]), int(w["nbytes"])).view(np.dtype(w["dtype"])).reshape(w["shape"])
        keep = self.plan.get("resident_rows", {})
        for name in self.plan["row_streamed"]:
            w = table[name]
            self.weights[name] = RowTable(self.file, name, int(w["offset"]), w["shape"], np.dtype(w["dtype"]), reader=self.rows, keep=keep.get(name, ()))
        # verify=True hashed the whole file through the page cache; drop it, the weights not resident stay on storage
        os.posix_fadvise(self.file.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        streamed = set(self.plan["streamed"])
        by_step = {}
        for i, s in enumerate(manifest["program"]):
            if s["kind"] == "graph":
                names = [n for n in manifest["graphs"][s["name"]]["weights"] if n in streamed]
                if names:
                    by_step[i] = names
        self.resident_bytes = sum(int(table[n]["nbytes"]) for n in self.plan["resident"])
        self.resident_bytes += sum(t.resident_bytes for t in self.weights.values() if isinstance(t, RowTable))
        self.streaming = StreamedWeights(self.file, table, by_step, int(self.plan["buffer_bytes"]), int(self.plan["prefetch_depth"]), prefetch)

    def session_options(self, ort: Any, so: Any) -> dict[str, Any]:
        """Configure an ONNX Runtime session of this bundle so that it copies no resident weight; return extra session kwargs.

        * ``session.disable_prepacking``: prepacking copies every constant
          weight into a packed layout (the resident bytes would count twice);
        * ``ConstantFolding`` off: it may fold ``DequantizeLinear`` of a
          resident int8 weight into a float32 copy (4x its bytes);
        * no per-session memory arena: each of the few hundred sessions would
          keep the high-water mark of its own runs.
        Measured on SmolLM2-135M in docs/memory-budget.md.
        """
        so.add_session_config_entry("session.disable_prepacking", "1")
        so.enable_cpu_mem_arena = False
        return {"disabled_optimizers": ["ConstantFolding"]}

    def close(self) -> None:
        self.streaming.close()
        self.rows.close()
        self.file.close()


def check_offload(bundle: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest's ``offload`` section, checked to be one this runtime can honour (else :class:`BundleError`)."""
    off = manifest["offload"]
    bad = f"{bundle}: the manifest's offload section"
    newer = "the bundle was made by a newer llmc, or edited; recompile it with this version"
    if not isinstance(off, dict):
        raise BundleError(f"{bad} is not an object", hint=newer)
    unknown = sorted(set(off) - set(OFFLOAD_KEYS) - set(OFFLOAD_OPTIONAL_KEYS))
    if unknown:
        raise BundleError(f"{bad} has keys this runtime does not know: {unknown}", hint=newer)
    for key, typ in OFFLOAD_KEYS.items():
        if key not in off or not isinstance(off[key], typ) or isinstance(off[key], bool):
            raise BundleError(f"{bad} lacks {key!r} or it has the wrong type", hint=newer)
    for key, typ in OFFLOAD_OPTIONAL_KEYS.items():
        if key in off and not isinstance(off[key], typ):
            raise BundleError(f"{bad}'s {key!r} has the wrong type", hint=newer)
    table = manifest["weights"]
    for key in ("resident", "streamed", "row_streamed"):
        missing = [n for n in off[key] if not isinstance(n, str) or n not in table]
        if missing:
            raise BundleError(f"{bad} names {key} weights that are not in the weight table: {missing[:3]}", hint="the bundle is corrupt; recompile it")
    resident, streamed, rows = set(off["resident"]), set(off["streamed"]), set(off["row_streamed"])
    for n, r in off.get("resident_rows", {}).items():  # names checked above
        if n not in rows:
            raise BundleError(f"{bad} keeps rows of {n}, which is not a table read by row", hint="the bundle is corrupt; recompile it")
        count = int(table[n]["shape"][0])
        if not isinstance(r, list) or not all(type(i) is int and 0 <= i < count for i in r) or len(set(r)) != len(r):
            raise BundleError(f"{bad} keeps rows of {n} that are not distinct row numbers below {count}", hint="the bundle is corrupt; recompile it")
    both = (resident & streamed) | (resident & rows)
    if both:
        raise BundleError(f"{bad} makes weights both resident and streamed: {sorted(both)[:3]}", hint="the bundle is corrupt; recompile it")
    if off["prefetch_depth"] < 0 or off["buffer_bytes"] < 0:
        raise BundleError(f"{bad} has a negative prefetch_depth or buffer_bytes", hint="the bundle is corrupt; recompile it")
    largest = 0
    for gname, g in manifest["graphs"].items():
        fed = [n for n in g.get("fed", []) if n not in resident]
        if fed:
            raise BundleError(f"{bad} does not keep resident the weights {fed[:3]} that graph {gname} takes as resident inputs",
                              hint="the graphs and the offload plan disagree; recompile the bundle")
        listed = g.get("streamed", [])
        want = [n for n in g["weights"] if n in streamed]
        if listed != want:
            raise BundleError(f"{bad} streams {want[:3]}... of graph {gname}, but the graph feeds {listed[:3]}... as inputs",
                              hint="the graphs and the offload plan disagree; recompile the bundle")
        for n in g["weights"]:
            if n not in resident and n not in streamed:
                raise BundleError(f"{bad} neither keeps resident nor streams weight {n} of graph {gname}", hint="recompile the bundle")
        largest = max(largest, sum(buffer_size(int(table[n]["nbytes"])) for n in want))
    for s in manifest["program"]:
        if s["kind"] != "op":
            continue
        for slot, n in s.get("weights", {}).items():
            if n in resident or (n in rows and slot in ROW_READABLE.get(s["op"], ())):
                continue
            how = "streams" if n in streamed else ("reads by row" if n in rows else "does not cover")
            raise BundleError(f"{bad} {how} weight {n}, which CPU op {s['op']} (step {s['name']}) reads whole",
                              hint="only graph weights can be streamed and only embedding/shadow tables read by row; recompile the bundle")
    if largest > off["buffer_bytes"]:
        raise BundleError(f"{bad} gives a {off['buffer_bytes']}-byte buffer, but one step streams {largest} bytes (with block alignment)",
                          hint="the buffer must hold the largest step's streamed weights, each rounded by llmc.runtime.residency.buffer_size; recompile the bundle")
    return off
