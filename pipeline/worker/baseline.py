"""The baseline index of an incremental night: last night's scores, found by id and fingerprint.

An incremental run (``incremental = true``, docs/incremental.md) carries a row's scores from the
baseline when the baseline holds a row with the same id and the same fingerprint
(:mod:`pipeline.worker.fingerprint`): the model saw the same input then, and its output for a
row depends on that row alone. The driver reads the baseline's rows once per night and writes
this index into a folder (:class:`IndexWriter`); every worker maps it into memory
(:func:`open_index`), so the workers of one machine share one copy in the page cache instead
of each holding its own.

The folder holds plain ``.npy`` arrays, one row per baseline row, in the order they were read:

* ``ids.npy`` (uint64): the id's hash (:func:`~pipeline.worker.fingerprint.id_hashes`);
* ``fps.npy`` (int64): the row's fingerprint, as its output's ``model_input_hash`` column;
* ``out<i>.npy``: output column ``i`` as written (float32, int64, or ``(rows, width)`` float32
  for a list column);
* ``slots.npy``: an open-addressing hash table over the id hashes (linear probing, at most 2/3
  full), each slot the row that sits there or -1;
* ``rep.npy``: per row, the first row of the table with the same id hash (the driver counts
  distinct ids with it; workers do not read it);
* ``once.npy`` (bool): the row's id hash is on no other row. A lookup stops at such a row's
  id whatever its fingerprint: a changed row is answered at its own slot instead of probing on
  to an empty one (at load 2/3, about five slots: a 100%-changed W1 x 10 night spent 1.9x a
  full rescore's wall before this).

Why a hash table and not a sorted array: on 20M rows (W1 x 10) a lookup through the table
touches about three cache lines (slot, id, fingerprint) where a binary search touches about
ten; measured on this 2-core EPYC under load, 4,096 random lookups took 2.0 ms through the table
and 13.3 ms through ``np.searchsorted``, and building it took 8.2 s against 9.8 s for an
``argsort`` (notes: bench/incremental.py measures the quiet figures).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import shutil
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.io import storage
from pipeline.io.locking import process_gone, process_identity

logger = logging.getLogger(__name__)

#: Rows inserted into the hash table at a time: the build's temporaries stay this many rows.
_INSERT_CHUNK = 1 << 20
#: Table slots per row, at least: linear probing stays short at this load (2/3 full at most).
_LOAD = 1.5
_NAMES = ("ids.npy", "fps.npy", "slots.npy", "once.npy", "rep.npy")


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


class IndexWriter:
    """Builds an index folder from the baseline's rows, added in any order (the driver)."""

    def __init__(self, folder: Path, rows: int, outputs: Sequence[OutputLayout]) -> None:
        self.folder = folder
        self.rows = rows
        self.outputs = tuple(outputs)
        folder.mkdir(parents=True, exist_ok=True)
        mk = np.lib.format.open_memmap
        n = max(rows, 1)  # an empty memmap cannot be made; rows says how many are real
        self.ids = mk(folder / "ids.npy", mode="w+", dtype=np.uint64, shape=(n,))
        self.fps = mk(folder / "fps.npy", mode="w+", dtype=np.int64, shape=(n,))
        self.outs = [
            mk(
                folder / f"out{i}.npy",
                mode="w+",
                dtype=np.dtype(o.dtype),
                shape=(n, o.width) if o.width else (n,),
            )
            for i, o in enumerate(self.outputs)
        ]
        self.filled = 0

    def add(self, ids: np.ndarray, fps: np.ndarray, outs: Sequence[np.ndarray]) -> None:
        """Append rows: their id hashes, fingerprints and output values."""
        n = ids.size
        end = self.filled + n
        if end > self.rows:
            raise ValueError(f"more baseline rows than the {self.rows:,} announced")
        self.ids[self.filled : end] = ids
        self.fps[self.filled : end] = fps
        for mm, values in zip(self.outs, outs, strict=True):
            mm[self.filled : end] = values
        self.filled = end

    def finish(self, where: str, tag: str) -> IndexRef:
        """Build the hash table over the rows added (at most those announced), write
        everything down and say where it is (``where``: the folder as the workers see it)."""
        self.rows = self.filled  # rows left out (a null id) were announced, never added
        for mm in (self.ids, self.fps, *self.outs):
            mm.flush()
        # What is written stays in the page cache, not in this process's memory (PSS): the
        # build's peak was 936 MiB on W1 x 10 before, every written page still mapped here.
        release(self.fps, *self.outs)
        ids = np.asarray(self.ids[: self.rows])
        slots, rep = build_table(ids)
        np.save(self.folder / "slots.npy", slots)
        np.save(self.folder / "rep.npy", rep)
        once = np.zeros(len(self.ids), dtype=bool)  # as long as ids.npy: rows announced
        once[: self.rows] = True
        # Rows that are not their id's first, and those firsts: a sequential compare and a few
        # random writes (0.02 s on 20M rows; a bincount over rep took 0.7 s).
        later = np.flatnonzero(rep != np.arange(rep.size, dtype=rep.dtype))
        once[later] = False
        once[rep[later]] = False
        np.save(self.folder / "once.npy", once)
        release(self.ids)
        meta = {"rows": self.rows, "slots": int(slots.size)}
        (self.folder / "index.json").write_text(json.dumps(meta))
        return IndexRef(where, self.rows, int(slots.size), self.outputs, tag)


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


def build_table(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(slots, rep): the open-addressing table over ``ids`` (uint64 hashes) and each row's
    first row with the same hash (itself for the first, so distinct ids = rows where
    ``rep == arange``).

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
            pos = (pos + 1) & mask
    return slots, rep


class BaselineIndex:
    """An index folder mapped into memory: lookups by id hash and fingerprint."""

    def __init__(self, folder: Path, ref: IndexRef) -> None:
        self.ref = ref
        self.folder = folder
        load = np.load
        self.ids = load(folder / "ids.npy", mmap_mode="r")
        self.fps = load(folder / "fps.npy", mmap_mode="r")
        self.slots = load(folder / "slots.npy", mmap_mode="r")
        self.once = load(folder / "once.npy", mmap_mode="r")
        self.outs = [load(folder / f"out{i}.npy", mmap_mode="r") for i in range(len(ref.outputs))]
        self.mask = np.int64(self.slots.size - 1)
        self.umask = np.uint64(self.slots.size - 1)
        if self.slots.size != ref.slots:
            raise ValueError(
                f"baseline index {folder}: {self.slots.size} slots, expected {ref.slots}"
            )

    def _probe(
        self, ids: np.ndarray, fps: np.ndarray | None, rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """For each of ``rows`` (indices into ``ids``/``fps``): the index row with the same id
        hash and fingerprint (-1: none; ``fps`` None: the first row with the same id hash), and
        the first index row with the same id hash (-1: the id is not in the baseline)."""
        m = ids.size
        found = np.full(m, -1, dtype=np.int64)
        first = np.full(m, -1, dtype=np.int64)
        pending = rows.astype(np.int64, copy=False)
        pos = (ids[pending] & self.umask).astype(np.int64)
        while pending.size:
            owner = self.slots[pos].astype(np.int64)
            taken = owner >= 0
            at = np.where(taken, owner, 0)
            same = taken & (self.ids[at] == ids[pending])
            new_first = same & (first[pending] < 0)
            first[pending[new_first]] = at[new_first]
            hit = same if fps is None else same & (self.fps[at] == fps[pending])
            found[pending[hit]] = at[hit]
            # An id on one row only: its slot answers, fingerprint equal or not.
            go_on = taken & ~hit & ~(same & self.once[at])
            pending = pending[go_on]
            pos = (pos[go_on] + 1) & self.mask
        return found, first

    def match(
        self, ids: np.ndarray, fps: np.ndarray, use: np.ndarray, hint: int = -1
    ) -> tuple[np.ndarray, np.ndarray]:
        """(index row to carry or -1, whether the id is in the baseline) for each row; only
        rows where ``use`` is set are looked up (the others: -1, False).

        ``hint``: the index row the batch's first row is expected at (tonight's shard in the
        baseline's order, :attr:`Carry.hint`). Rows whose id hash and fingerprint are at their
        expected row are matched by one sequential read; only the others are probed in the
        table, whose random reads cost 1.6 ms per 4,096 rows over a 20M-row index here."""
        rows = np.flatnonzero(use)
        if hint < 0 or not rows.size:
            found, first = self._probe(ids, fps, rows)
            return found, first >= 0
        at = rows + hint
        inside = at < self.ref.rows  # ids.npy may be longer: rows announced, never added
        at = np.where(inside, at, 0)
        same = inside & (self.ids[at] == ids[rows])
        hit = same & (self.fps[at] == fps[rows])
        changed = same & ~hit & self.once[at]  # its id's only row: known, not carried
        rest = rows[~(hit | changed)]
        found, first = self._probe(ids, fps, rest)
        found[rows[hit]] = at[hit]
        first[rows[hit | changed]] = at[hit | changed]
        return found, first >= 0

    def first_rows(self, ids: np.ndarray, use: np.ndarray) -> np.ndarray:
        """The first index row with each id hash (-1: not in the baseline), for ``use`` rows."""
        return self._probe(ids, None, np.flatnonzero(use))[1]

    def release(self) -> None:
        """Unmap the pages read so far (:func:`release`); a worker does it after each shard, so
        that the index it holds is one shard's pages, not every page it ever read (the
        workers' memory grew by the whole index, 600 MB on W1 x 10, before)."""
        release(self.ids, self.fps, self.slots, self.once, *self.outs)

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


def _copy_here(loc: storage.Location, ref: IndexRef) -> Path:
    """The remote index folder ``loc`` copied into a local temporary folder."""
    folder = Path(tempfile.mkdtemp(prefix=f"{_COPY_PREFIX}{ref.tag}-"))
    (folder / _OWNER).write_text(json.dumps(process_identity()))
    names = [*_NAMES[:4], *(f"out{i}.npy" for i in range(len(ref.outputs)))]
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
