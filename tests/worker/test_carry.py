"""Tests for pipeline.worker.carry: which rows of a batch are carried, scored, new or changed."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from pipeline.worker.baseline import BaselineIndex, IndexWriter, OutputLayout
from pipeline.worker.carry import Carry
from pipeline.worker.fingerprint import fingerprints, id_hashes


def _baseline(folder: Path, ids: pa.Array, x: torch.Tensor) -> BaselineIndex:
    layouts = [OutputLayout("score", "float32")]
    w = IndexWriter(folder, len(ids), layouts)
    w.bound((int(np.min(ids)), int(np.max(ids))))
    w.add(id_hashes(ids)[0], fingerprints([x]), [np.arange(len(ids), dtype=np.float32)])
    return BaselineIndex(folder, w.finish(str(folder), "run"))


def test_integer_ids_beyond_the_baseline_s_range_are_new_without_the_id_table(
    tmp_path: Path,
) -> None:
    x = torch.arange(40, dtype=torch.float32).reshape(20, 2)
    index = _baseline(tmp_path, pa.array(np.arange(100, 120), pa.int64()), x)
    assert index.ref.id_range == (100, 119)
    carry = Carry(index, (OutputLayout("score", "float32"),), start=0)
    # Tonight: the same 20 rows (as int32 ids), then 3 new items numbered on, 1 below.
    ids = pa.array([*range(100, 120), 120, 121, 500, 7], pa.int32())
    tonight = torch.cat([x, torch.zeros(4, 2)])
    split = carry.split((tonight,), ids, np.ones(24, bool))
    assert split.counts.carried == 20 and split.counts.new == 4 and split.counts.changed == 0
    assert not (tmp_path / "slots.npy").exists()  # nothing was looked up in the table
    # An id inside the range that the baseline lacks needs the table to be known new.
    gap = Carry(index, (OutputLayout("score", "float32"),), start=0)
    gap.split((torch.zeros(1, 2),), pa.array([1000], pa.int64()), np.ones(1, bool))
    assert (tmp_path / "slots.npy").exists() is False  # 1000 > 119: still outside
    inside = Carry(index, (OutputLayout("score", "float32"),))
    counts = inside.split((torch.zeros(1, 2),), pa.array([110], pa.int64()), np.ones(1, bool))
    assert counts.counts.changed == 1 and (tmp_path / "slots.npy").exists()


def test_ids_that_are_not_integers_or_do_not_compare_are_looked_up(tmp_path: Path) -> None:
    x = torch.arange(4, dtype=torch.float32).reshape(2, 2)
    index = _baseline(tmp_path, pa.array([1, 2], pa.int64()), x)
    carry = Carry(index, (OutputLayout("score", "float32"),))
    assert carry._new(pa.array(["1", "3"])) is None
    huge = pa.array([2**64 - 1, 1], pa.uint64())
    new = carry._new(huge)
    assert new is None or new.tolist() == [True, False]
    ref = dataclasses.replace(index.ref, id_range=None)
    assert Carry(BaselineIndex(tmp_path, ref), carry.layouts)._new(pa.array([9])) is None


def test_a_rejected_row_marks_its_id_near_its_place_and_is_never_carried(tmp_path: Path) -> None:
    """A row whose features are invalid tonight is not carried, even with the baseline's
    fingerprint; its id is still marked as met, found at its place (no id table built)."""
    x = torch.arange(40, dtype=torch.float32).reshape(20, 2)
    ids = pa.array(np.arange(100, 120), pa.int64())
    index = _baseline(tmp_path, ids, x)
    carry = Carry(index, (OutputLayout("score", "float32"),), start=0)
    valid = np.ones(20, bool)
    valid[[3, 7]] = False
    split = carry.split((x,), ids, valid)
    assert split.counts.carried == 18 and split.counts.scored == 0
    assert not split.carry[3] and not split.carry[7]
    assert np.load(tmp_path / "seen.npy")[:20].all()  # every id met, the rejected ones too
    assert not (tmp_path / "slots.npy").exists()
