"""Which rows of a batch go through the model on an incremental night, and which are carried.

A row is carried (its output values copied from the baseline index,
:mod:`pipeline.worker.baseline`) when its id is not null, its features are valid, and the
baseline holds a row with the same id and the same fingerprint; every other valid row is sent
through the model. The batch's output rows are then the two merged back in input order, so the
file a worker writes is the one a full rescore would write, row for row.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.worker.baseline import BaselineIndex, OutputLayout
from pipeline.worker.fingerprint import fingerprints, id_hashes


@dataclass
class CarryCounts:
    """What an incremental shard did with its rows (the report's ``incremental`` counts)."""

    carried: int = 0  # output values copied from the baseline
    scored: int = 0  # sent through the model
    new: int = 0  # ... of which the baseline has no row with the id (null ids included)
    changed: int = 0  # ... of which the baseline has the id with another fingerprint

    def add(self, other: CarryCounts) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def public(self) -> dict[str, int]:
        return {f"rows_{f.name}": getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_public(cls, data: Any) -> CarryCounts | None:
        """Counts a manifest entry kept (None when it kept none)."""
        if not isinstance(data, dict):
            return None
        try:
            return cls(**{f.name: int(data[f"rows_{f.name}"]) for f in fields(cls)})
        except (KeyError, TypeError, ValueError):
            return None


@dataclass
class Split:
    """One batch's rows: their fingerprints, which are carried and from which index rows."""

    fps: np.ndarray  # (rows,) int64, every row's fingerprint
    carry: np.ndarray  # (rows,) bool: the row's outputs come from the baseline
    rows: np.ndarray  # index rows of the carried rows, in input order
    send: np.ndarray  # (rows,) bool: valid and not carried, so through the model
    counts: CarryCounts = field(default_factory=CarryCounts)


class Carry:
    """A shard's side of an incremental night: fingerprints, lookups and the merge."""

    def __init__(
        self, index: BaselineIndex | None, layouts: tuple[OutputLayout, ...], start: int = -1
    ) -> None:
        self.index = index  # None: fingerprints are written, every row is scored
        self.layouts = layouts
        self.counts = CarryCounts()
        # The index row the next batch's first row is expected at: the shard read in the
        # baseline's order (the same shard, or its rows in the same order) matches by
        # sequential reads (BaselineIndex.match). ``start``: where the baseline file that
        # scored the same input shard begins (-1: none; then from the first row found).
        self.hint = start
        # Every row's id this shard read was marked in the index's seen.npy (the driver's
        # count of removed ids need not read the shard again).
        self.marked = index is not None

    def split(self, tensors: tuple[Any, ...], ids: pa.Array, valid: np.ndarray) -> Split:
        """Fingerprint the batch (its model inputs as the model sees them, on the CPU) and look
        its valid rows up in the baseline."""
        fps = fingerprints(tensors)
        m = fps.size
        if self.index is None:
            none = np.zeros(m, dtype=bool)
            split = Split(
                fps, none, np.zeros(0, np.int64), valid, CarryCounts(scored=int(valid.sum()))
            )
            split.counts.new = split.counts.scored
            self.counts.add(split.counts)
            return split
        hashes, has_id = id_hashes(ids)
        # Every row with an id is looked up, a rejected one too: its id is still in tonight's
        # input (it marks the baseline's row as met), and it keeps its place in the order, so
        # it is found near its place like the others, not through the id table.
        found, same_id = self.index.match(hashes, fps, has_id, self.hint, self._new(ids))
        carry = (found >= 0) & valid
        known = same_id >= 0
        self.marked = self.index.mark(same_id[known]) and self.marked
        # From the batch's last row whose id the baseline has, carried or changed: a night
        # with every row changed reads in the baseline's order too (it probed every row
        # before, 11% of a W1 x 10 worker's samples at 100% changed).
        matched = np.flatnonzero(known)
        if matched.size:
            last = int(matched[-1])
            self.hint = int(same_id[last]) + (m - last)
        send = valid & ~carry
        counts = CarryCounts(
            carried=int(carry.sum()),
            scored=int(send.sum()),
            changed=int((send & known).sum()),
        )
        counts.new = counts.scored - counts.changed
        self.counts.add(counts)
        return Split(fps, carry, found[carry], send, counts)

    def _new(self, ids: pa.Array) -> np.ndarray | None:
        """Rows whose integer id lies outside the baseline's ids (new, with no lookup: the
        next item ids of a catalog that numbers its items in order); None when not known."""
        bounds = self.index.ref.id_range if self.index is not None else None
        if bounds is None or not pa.types.is_integer(ids.type):
            return None
        try:
            low, high = pa.scalar(bounds[0]), pa.scalar(bounds[1])
            outside = pc.or_(pc.less(ids, low), pc.greater(ids, high))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OverflowError):
            return None  # an unsigned id beyond int64, against signed bounds: look them up
        return np.asarray(outside.fill_null(False).to_numpy(zero_copy_only=False), dtype=bool)

    def merge(self, split: Split, scored: list[pa.Array], keep: np.ndarray) -> list[pa.Array]:
        """The output columns of the ``keep`` rows in input order: the model's values
        (``scored``: one array per output over the sent rows it scored, in order) and the
        carried rows' values from the baseline."""
        if not split.rows.size:
            return scored
        carried = self.index.outputs(split.rows) if self.index is not None else []
        from_carry = split.carry[keep]
        if from_carry.all():
            return [lay.arrow(v) for lay, v in zip(self.layouts, carried, strict=True)]
        out = []
        for lay, model_col, base in zip(self.layouts, scored, carried, strict=True):
            values = np.empty((from_carry.size, *base.shape[1:]), dtype=base.dtype)
            values[from_carry] = base
            values[~from_carry] = lay.numpy(model_col)
            out.append(lay.arrow(values))
        return out
