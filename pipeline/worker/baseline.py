"""The baseline index of an incremental night: last night's scores, found by id and fingerprint.

An incremental run (``incremental = true``, docs/incremental.md) carries a row's scores from the
baseline when the baseline holds a row with the same id and the same fingerprint
(:mod:`pipeline.worker.fingerprint`): the model saw the same input then, and its output for a
row depends on that row alone. The driver reads the baseline's rows once per night and writes
this index into a folder (:class:`IndexWriter`); every worker maps it into memory
(:func:`open_index`), so the workers of one machine share one copy in the page cache instead
of each holding its own.

The folder holds plain ``.npy`` arrays, one row per baseline row, in the order they were read
(file by file, each file's rows in order):

* ``ids.npy`` (uint64): the id's hash (:func:`~pipeline.worker.fingerprint.id_hashes`);
* ``fps.npy`` (int64): the row's fingerprint, as its output's ``model_input_hash`` column;
* ``out<i>.npy``: output column ``i`` as written (float32, int64, or ``(rows, width)`` float32
  for a list column);
* ``seen.npy`` (uint8): set by the workers of this machine for every row whose id they met in
  tonight's input, so that the driver counts the ids the night removed without reading the
  input again (2.5-3 s on W1 x 10's 20M rows before);

and, built only when a lookup needs them (:func:`ensure_table`):

* ``slots.npy``: an open-addressing hash table over the id hashes (linear probing, at most 2/3
  full), each slot the row that sits there or -1;
* ``once.npy`` (bool): the row's id hash is on no other row. A probe stops at such a row's id
  whatever its fingerprint: a changed row is answered at its own slot instead of probing on to
  an empty one (about five slots at load 2/3).

Most rows never need the table. A shard is read in the order its baseline file holds its rows
(the file that scored the same input shard: :attr:`IndexRef.starts`), so a row is first looked
for at its expected place, by one sequential read (:meth:`BaselineIndex.match`): the same id
and fingerprint there is carried, the same id with another fingerprint is changed. Only rows
whose id is not at its place (new rows, rows of re-cut or reordered shards) are looked up in
the table, and the first worker that needs it builds it, once per machine (2.5-3.5 s for W1 x
10's 20M rows here: a night whose shards kept their rows' order never pays it).

Why a hash table and not a sorted array: on 20M rows (W1 x 10) a lookup through the table
touches about three cache lines (slot, id, fingerprint) where a binary search touches about
ten; measured on this 2-core EPYC under load, 4,096 random lookups took 2.0 ms through the table
and 13.3 ms through ``np.searchsorted``, and building it took 8.2 s against 9.8 s for an
``argsort`` (notes: bench/incremental.py measures the quiet figures).
"""

from __future__ import annotations

import fcntl
import json
import logging
import mmap
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.io import storage
from pipeline.io.locking import process_gone, process_identity

logger = logging.getLogger(__name__)

#: Rows inserted into the hash table at a time: the build's temporaries stay this many rows.
_INSERT_CHUNK = 1 << 20
#: Table slots per row, at least: linear probing stays short at this load (2/3 full at most).
_LOAD = 1.5
#: Baseline rows either side of a batch a row that is not at its place is looked for among
#: (rows inserted or deleted upstream shift a shard's rows by as many).
WINDOW = 4096
_NAMES = ("ids.npy", "fps.npy")  # with the outputs: what a worker elsewhere copies


@dataclass(frozen=True)
class OutputLayout:
    """One output column as the index holds it."""

    name: str
    dtype: str  # numpy dtype: float32 or int64
    width: int = 0  # values per row of a list column; 0: one value (a plain column)

    def arrow(self, values: np.ndarray) -> pa.Array:
        """``values`` (this column's rows) as the Arrow column the output writes."""
        if self.width:
            flat = pa.array(np.ascontiguousarray(values).reshape(-1))
            return pa.FixedSizeListArray.from_arrays(flat, self.width)
        return pa.array(values)

    def numpy(self, column: pa.Array | pa.ChunkedArray) -> np.ndarray:
        """The Arrow column ``column`` (this output, as written) as the index holds it."""
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        if column.null_count:
            raise ValueError(f"output column {self.name!r} holds nulls")
        if self.width:
            values = np.asarray(column.flatten().to_numpy(zero_copy_only=False), dtype=self.dtype)
            return values.reshape(-1, self.width)
        return np.asarray(column.to_numpy(zero_copy_only=False), dtype=self.dtype)

    @classmethod
    def of(cls, name: str, typ: pa.DataType) -> OutputLayout:
        """The layout of an output column of Arrow type ``typ``."""
        if pa.types.is_fixed_size_list(typ):
            return cls(name, typ.value_type.to_pandas_dtype().__name__, typ.list_size)
        return cls(name, np.dtype(typ.to_pandas_dtype()).name)


@dataclass(frozen=True)
class IndexRef:
    """Where a run's baseline index is and what it holds: sent to every worker in the spec."""

    where: str  # the folder: a local path, or a URI on the output's storage (remote workers)
    rows: int
    slots: int  # the hash table's size, a power of two
    outputs: tuple[OutputLayout, ...]
    tag: str  # the run's id: a worker keeps the index of one run open at a time
    # Per input shard (its path relative to the input), the first index row of the baseline
    # file that scored it: where tonight's shard is expected to start.
    starts: tuple[tuple[str, int], ...] = ()
    # The smallest and largest id value of the baseline when its ids are integers whose files'
    # footers bound them (None otherwise): an integer id outside is new, with no lookup.
    id_range: tuple[int, int] | None = None

    def start_of(self, rel_path: str) -> int:
        """The index row ``rel_path``'s rows are expected from; -1: no baseline file for it."""
        return dict(self.starts).get(rel_path, -1)


class IndexWriter:
    """Writes an index folder from the baseline's rows, file by file (the driver).

    Every array is appended to its file with plain writes. Writing them through memory maps,
    flushed with msync, took 1.2 s to add and 1.9 s to flush and save 20M rows (W1 x 10) here;
    the hash table is left to the first lookup that needs it (:func:`ensure_table`)."""

    def __init__(self, folder: Path, rows: int, outputs: Sequence[OutputLayout]) -> None:
        self.folder = folder
        self.rows = rows
        self.outputs = tuple(outputs)
        folder.mkdir(parents=True, exist_ok=True)
        self.n = max(rows, 1)  # an empty .npy cannot be mapped; rows says how many are real
        self.dtypes = [
            np.dtype(np.uint64),
            np.dtype(np.int64),
            *(np.dtype(o.dtype) for o in self.outputs),
        ]
        names = ["ids.npy", "fps.npy", *(f"out{i}.npy" for i in range(len(self.outputs)))]
        widths = [0, 0, *(o.width for o in self.outputs)]
        self.files = [
            _open_npy(folder / name, dtype, (self.n, w) if w else (self.n,))
            for name, dtype, w in zip(names, self.dtypes, widths, strict=True)
        ]
        self.filled = 0
        self.starts: dict[str, int] = {}
        self.id_range: tuple[int, int] | None = None
        self.unbounded = False  # a file whose ids no footer bounds: no range at all

    def bound(self, found: tuple[int, int] | None) -> None:
        """The next rows' ids lie in ``found`` (their footer's min and max; None: unknown)."""
        if found is None:
            self.unbounded = True
        elif self.id_range is None:
            self.id_range = found
        else:
            self.id_range = (min(self.id_range[0], found[0]), max(self.id_range[1], found[1]))

    def start(self, input_rel: str) -> None:
        """The rows added next are the baseline file that scored input shard ``input_rel``."""
        self.starts.setdefault(input_rel, self.filled)

    def add(self, ids: np.ndarray, fps: np.ndarray, outs: Sequence[np.ndarray]) -> None:
        """Append rows: their id hashes, fingerprints and output values."""
        n = ids.size
        end = self.filled + n
        if end > self.rows:
            raise ValueError(f"more baseline rows than the {self.rows:,} announced")
        if not n:
            return
        for (f, _), values, dtype in zip(self.files, [ids, fps, *outs], self.dtypes, strict=True):
            f.write(np.ascontiguousarray(values, dtype=dtype).data)
        self.filled = end

    def finish(self, where: str, tag: str) -> IndexRef:
        """Write everything down and say where it is (``where``: the folder as the workers see
        it) and what it holds: the rows added (at most those announced)."""
        self.rows = self.filled  # rows left out (a null id) were announced, never added
        for f, size in self.files:
            f.truncate(size)  # the rows announced but never added: zeros
            f.close()
        seen, size = _open_npy(self.folder / "seen.npy", np.dtype(np.uint8), (self.n,))
        seen.truncate(size)  # zeros, without writing them
        seen.close()
        meta = {"rows": self.rows, "slots": table_size(self.rows)}
        (self.folder / "index.json").write_text(json.dumps(meta))
        starts = tuple(sorted(self.starts.items()))
        bounds = None if self.unbounded else self.id_range
        return IndexRef(where, self.rows, table_size(self.rows), self.outputs, tag, starts, bounds)


def _open_npy(path: Path, dtype: np.dtype[Any], shape: tuple[int, ...]) -> tuple[Any, int]:
    """A ``.npy`` file of ``shape`` opened for appending its data after the header, and the
    file's full size (``finish`` pads it to that)."""
    f = open(path, "wb")  # noqa: SIM115  (closed by IndexWriter.finish)
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(f, header)
    return f, f.tell() + int(np.prod(shape)) * dtype.itemsize


def removed_ids(folder: Path, ref: IndexRef, seen: np.ndarray) -> int:
    """Distinct ids of the index in ``folder`` none of whose rows is marked in ``seen`` (bool
    per row): the ids of the unmarked rows, less those a marked row has too (a duplicated id
    met tonight through another of its rows)."""
    ids = np.load(folder / "ids.npy", mmap_mode="r")[: ref.rows]
    seen = seen[: ref.rows]
    gone = np.unique(ids[~seen])
    if not gone.size:
        return 0
    # Arrow's hash set of the (few) candidates, probed by every row: 20M rows in about 0.3 s.
    has = pc.is_in(pa.array(ids), value_set=pa.array(gone)).to_numpy(zero_copy_only=False)
    present = np.unique(ids[has & seen])
    return int(gone.size - present.size)


def release(*arrays: np.ndarray) -> None:
    """Drop this process's mapping of the pages of memory-mapped ``arrays`` (MADV_DONTNEED):
    they stay in the page cache, and the next read maps them again (a minor fault). Clean
    pages only (flush first): a file mapped read-only, or flushed."""
    if not hasattr(mmap, "MADV_DONTNEED"):
        return
    for a in arrays:
        mm = getattr(a, "_mmap", None)
        if isinstance(mm, mmap.mmap):
            mm.madvise(mmap.MADV_DONTNEED)


def table_size(rows: int) -> int:
    """Slots of the hash table for ``rows`` rows: a power of two, at least ``_LOAD`` x rows."""
    return 1 << max(4, int(np.ceil(np.log2(rows * _LOAD + 1))))


def build_table(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(slots, rep, later): the open-addressing table over ``ids`` (uint64 hashes), each row's
    first row with the same hash (itself for the first, so distinct ids = rows where
    ``rep == arange``), and the rows that are not their hash's first, ascending.

    Vectorised, in rounds: every pending row looks at its slot; rows at an empty slot write
    themselves into it (one of several contenders wins: the last write), the others move one
    slot on. A row that meets a row of the same id (before it, or winning the slot it wanted)
    takes that row's ``rep``: rows of one id share their home slot and probe the same slots, and
    slots only ever fill, so the first of them is always met first.
    """
    n = ids.size
    size = table_size(n)
    mask = size - 1
    index_type: type[np.signedinteger[Any]] = np.int32 if n < np.iinfo(np.int32).max else np.int64
    slots: np.ndarray = np.full(size, -1, dtype=index_type)
    rep: np.ndarray = np.full(n, -1, dtype=index_type)
    later: list[np.ndarray] = []
    for start in range(0, n, _INSERT_CHUNK):
        pending = np.arange(start, min(n, start + _INSERT_CHUNK), dtype=np.int64)
        pos = (ids[pending] & np.uint64(mask)).astype(np.int64)
        while pending.size:
            # One gather of the slots, then only the slots just written read back and only
            # the losers' ids compared (slots only fill): 2.62 s against 2.69-2.74 s for 20M
            # rows here, the same table and reps.
            owner = slots[pos].astype(np.int64)
            empty = owner < 0
            slots[pos[empty]] = pending[empty]
            owner[empty] = slots[pos[empty]]
            won = owner == pending
            fresh = won & (rep[pending] < 0)
            rep[pending[fresh]] = pending[fresh]
            left = ~won
            pending, owner, pos = pending[left], owner[left], pos[left]
            first = (ids[owner] == ids[pending]) & (rep[pending] < 0)
            rep[pending[first]] = rep[owner[first]]
            later.append(pending[first])
            pos = (pos + 1) & mask
    dups = np.sort(np.concatenate(later)) if later else np.zeros(0, dtype=np.int64)
    return slots, rep, dups


def _save(path: Path, array: np.ndarray) -> None:
    """``array`` saved to ``path`` whole or not at all (a temporary file renamed)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


def ensure_table(folder: Path, rows: int) -> None:
    """Build the folder's hash table (``slots.npy``, ``once.npy``) unless it is there: the
    first process that needs it builds it, under a lock, and the others wait for it and map
    it. ``slots.npy`` is written last, so that its presence means the table is whole (a
    builder killed half-way leaves none, and the next one builds it)."""
    if (folder / "slots.npy").exists():
        return
    with open(folder / "table.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if (folder / "slots.npy").exists():
                return
            t0 = time.perf_counter()
            mapped = np.load(folder / "ids.npy", mmap_mode="r")
            slots, rep, later = build_table(np.asarray(mapped[:rows]))
            once = np.zeros(mapped.size, dtype=bool)  # as long as ids.npy: rows announced
            once[:rows] = True
            once[later] = False  # rows that are not their id's first, and those firsts
            once[rep[later]] = False
            release(mapped)
            _save(folder / "once.npy", once)
            _save(folder / "slots.npy", slots)
            logger.info(
                "incremental: rows not in their baseline file's order: the baseline's id table "
                "built in %.2fs (%s rows)",
                time.perf_counter() - t0,
                f"{rows:,}",
            )
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class BaselineIndex:
    """An index folder mapped into memory: lookups by id hash and fingerprint."""

    def __init__(self, folder: Path, ref: IndexRef) -> None:
        self.ref = ref
        self.folder = folder
        load = np.load
        self.ids = load(folder / "ids.npy", mmap_mode="r")
        self.fps = load(folder / "fps.npy", mmap_mode="r")
        self.outs = [load(folder / f"out{i}.npy", mmap_mode="r") for i in range(len(ref.outputs))]
        # The hash table, mapped when a lookup first needs it (_table).
        self.slots: np.ndarray | None = None
        self.once: np.ndarray | None = None
        self.mask = np.int64(ref.slots - 1)
        self.umask = np.uint64(ref.slots - 1)
        # The driver's own seen.npy (not a worker's copy of a remote index, which has none):
        # the rows whose ids tonight's input has, set by whoever reads the input.
        seen = folder / "seen.npy"
        self.seen = load(seen, mmap_mode="r+") if seen.exists() else None

    def _table(self) -> tuple[np.ndarray, np.ndarray]:
        """The hash table (slots, once), built first if no process has built it yet."""
        if self.slots is None or self.once is None:
            ensure_table(self.folder, self.ref.rows)
            slots = np.load(self.folder / "slots.npy", mmap_mode="r")
            if slots.size != self.ref.slots:
                raise ValueError(
                    f"baseline index {self.folder}: {slots.size} slots, expected {self.ref.slots}"
                )
            self.slots, self.once = slots, np.load(self.folder / "once.npy", mmap_mode="r")
        return self.slots, self.once

    def _probe(
        self, ids: np.ndarray, fps: np.ndarray | None, rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """For each of ``rows`` (indices into ``ids``/``fps``): the index row with the same id
        hash and fingerprint (-1: none; ``fps`` None: the first row with the same id hash), and
        the first index row with the same id hash (-1: the id is not in the baseline)."""
        m = ids.size
        found = np.full(m, -1, dtype=np.int64)
        first = np.full(m, -1, dtype=np.int64)
        if not rows.size:
            return found, first
        table, once = self._table()
        pending = rows.astype(np.int64, copy=False)
        pos = (ids[pending] & self.umask).astype(np.int64)
        while pending.size:
            owner = table[pos].astype(np.int64)
            taken = owner >= 0
            at = np.where(taken, owner, 0)
            same = taken & (self.ids[at] == ids[pending])
            new_first = same & (first[pending] < 0)
            first[pending[new_first]] = at[new_first]
            hit = same if fps is None else same & (self.fps[at] == fps[pending])
            found[pending[hit]] = at[hit]
            # An id on one row only: its slot answers, fingerprint equal or not.
            go_on = taken & ~hit & ~(same & once[at])
            pending = pending[go_on]
            pos = (pos[go_on] + 1) & self.mask
        return found, first

    def match(
        self,
        ids: np.ndarray,
        fps: np.ndarray,
        use: np.ndarray,
        hint: int = -1,
        new: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(index row to carry or -1, an index row with the same id or -1) for each row; only
        rows where ``use`` is set are looked up (the others: -1, -1).

        ``hint``: the index row the batch's first row is expected at (tonight's shard in its
        baseline file's order, :attr:`Carry.hint`); rows found near it are answered there
        (:meth:`_nearby`). ``new``: rows known not to be in the baseline (an integer id outside
        its range, :attr:`IndexRef.id_range`). Only the other rows are probed in the table,
        whose random reads cost 1.6 ms per 4,096 rows over a 20M-row index here, and which is
        built the first time a lookup needs it."""
        m = ids.size
        found = np.full(m, -1, dtype=np.int64)
        first = np.full(m, -1, dtype=np.int64)
        rows = np.flatnonzero(use if new is None else use & ~new)
        if hint >= 0 and rows.size:
            rows = self._nearby(ids, fps, rows, hint, found, first)
        far, far_first = self._probe(ids, fps, rows)
        found[rows] = far[rows]
        first[rows] = far_first[rows]
        return found, first

    def _nearby(
        self,
        ids: np.ndarray,
        fps: np.ndarray,
        rows: np.ndarray,
        hint: int,
        found: np.ndarray,
        first: np.ndarray,
    ) -> np.ndarray:
        """Answer the ``rows`` found near where the batch is expected (``hint``), into
        ``found`` and ``first``; return the others.

        A row whose id is at its expected index row is answered there by one sequential read.
        A row that is not (rows inserted or deleted before it in the shard shift the rest of
        the batch) is looked for among the baseline rows ``WINDOW`` either side of the batch,
        sorted once for the batch. Either way it is carried when the fingerprint is the same
        too, and changed when it is not: a duplicated id's other rows are not searched for its
        fingerprint (such a row is scored, and scored right)."""
        n = self.ref.rows
        at = rows + hint
        inside = at < n  # ids.npy may be longer: rows announced, never added
        at = np.where(inside, at, 0)
        same = inside & (self.ids[at] == ids[rows])
        hit = same & (self.fps[at] == fps[rows])
        found[rows[hit]] = at[hit]
        first[rows[same]] = at[same]
        rest: np.ndarray = rows[~same]
        lo, hi = max(0, hint + int(rows[0]) - WINDOW), min(n, hint + int(rows[-1]) + WINDOW + 1)
        if not rest.size or lo >= hi:
            return rest
        window = np.asarray(self.ids[lo:hi])
        order = np.argsort(window, kind="stable")  # equal ids: the first of them first
        ranked = window[order]
        pos = np.minimum(np.searchsorted(ranked, ids[rest]), ranked.size - 1)
        same = ranked[pos] == ids[rest]
        at = lo + order[pos]
        hit = same & (self.fps[at] == fps[rest])
        found[rest[hit]] = at[hit]
        first[rest[same]] = at[same]
        left: np.ndarray = rest[~same]
        return left

    def first_rows(self, ids: np.ndarray, use: np.ndarray) -> np.ndarray:
        """The first index row with each id hash (-1: not in the baseline), for ``use`` rows."""
        return self._probe(ids, None, np.flatnonzero(use))[1]

    def mark(self, rows: np.ndarray) -> bool:
        """Record that tonight's input has the ids of index rows ``rows`` (any row of each
        id); False when this index cannot record it (a copy of a remote index). Writes of the
        same byte from several workers at once are harmless: a mark is only ever set."""
        if self.seen is None:
            return False
        if rows.size > 1 and bool((np.diff(rows) == 1).all()):
            self.seen[int(rows[0]) : int(rows[-1]) + 1] = 1  # a batch in order: one slice
        else:
            self.seen[rows] = 1
        return True

    def release(self) -> None:
        """Unmap the pages read so far (:func:`release`); a worker does it after each shard, so
        that the index it holds is one shard's pages, not every page it ever read (the
        workers' memory grew by the whole index, 600 MB on W1 x 10, before)."""
        table = [a for a in (self.slots, self.once) if a is not None]
        release(self.ids, self.fps, *table, *self.outs)

    def outputs(self, rows: np.ndarray) -> list[np.ndarray]:
        """The output values of index rows ``rows``, one array per output column."""
        return [np.asarray(out[rows]) for out in self.outs]


# -- where workers find it --------------------------------------------------------------------

_OPEN: dict[str, BaselineIndex] = {}
_OPEN_LOCK = threading.Lock()


def open_index(ref: IndexRef, storage_options: Mapping[str, Any] | None = None) -> BaselineIndex:
    """The index ``ref`` names, mapped into memory once per process (a worker's threads share
    it; the index of an earlier run is dropped). A folder on remote storage is copied to this
    machine's temporary folder first, once."""
    with _OPEN_LOCK:
        found = _OPEN.get(ref.tag)
        if found is not None and found.ref == ref:
            return found
        for tag in list(_OPEN):
            old = _OPEN.pop(tag)
            if old.folder.name.startswith(_COPY_PREFIX):
                shutil.rmtree(old.folder, ignore_errors=True)
        loc = storage.locate(ref.where, storage_options)
        folder = Path(loc.path) if loc.is_local else _copy_here(loc, ref)
        index = _OPEN[ref.tag] = BaselineIndex(folder, ref)
        return index


_COPY_PREFIX = "score-catalog-baseline-copy-"


def worker_files(ref: IndexRef) -> list[str]:
    """The files of an index folder a worker on another machine copies (it builds the table
    itself if it needs it, and marks nothing: the driver reads the shards it scored)."""
    return [*_NAMES, *(f"out{i}.npy" for i in range(len(ref.outputs)))]


def _copy_here(loc: storage.Location, ref: IndexRef) -> Path:
    """The remote index folder ``loc`` copied into a local temporary folder."""
    folder = Path(tempfile.mkdtemp(prefix=f"{_COPY_PREFIX}{ref.tag}-"))
    (folder / _OWNER).write_text(json.dumps(process_identity()))
    names = worker_files(ref)
    try:
        for name in names:
            with storage.open_input(loc.child(name)) as src, open(folder / name, "wb") as dst:
                shutil.copyfileobj(src, dst, 8 << 20)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


def forget_open() -> None:
    """Drop this process's open index (tests; a worker drops it when the next run's comes)."""
    with _OPEN_LOCK:
        _OPEN.clear()


_PREFIX = "score-catalog-baseline-"
_OWNER = "owner.json"


def new_folder(run_id: str) -> Path:
    """A fresh index folder in the temporary folder, marked with this process; the folders
    that processes no longer alive left there (a SIGKILLed night's: up to 0.8 GB at 20M rows)
    are removed first."""
    remove_abandoned(Path(tempfile.gettempdir()))
    folder = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{run_id}-"))
    (folder / _OWNER).write_text(json.dumps(process_identity()))
    return folder


def remove_abandoned(root: Path) -> list[Path]:
    """Remove the index folders under ``root`` whose process has exited (a driver's, or a
    worker's copy of a remote index); folders of live processes, of other machines and
    without a readable mark are left alone. Returns those removed."""
    removed = []
    for folder in sorted(root.glob(f"{_PREFIX}*")):
        try:
            owner = json.loads((folder / _OWNER).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(owner, dict) and process_gone(owner):
            remove_folder(folder)
            logger.info("removed %s: its run is no longer running", folder)
            removed.append(folder)
    return removed


def remove_folder(folder: str | os.PathLike[str]) -> None:
    """Delete an index folder; an error is logged (a leftover temporary folder is harmless)."""
    try:
        shutil.rmtree(folder)
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.warning("could not remove the baseline index %s: %s", folder, e)
