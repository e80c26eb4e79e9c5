"""Tests for pipeline.worker.baseline: the baseline index finds exactly the rows a dict would."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.worker import baseline
from pipeline.worker.baseline import BaselineIndex, IndexWriter, OutputLayout, build_table


def _index(
    folder: Path, ids: np.ndarray, fps: np.ndarray, chunks: int = 2
) -> tuple[BaselineIndex, np.ndarray]:
    """An index of rows (ids, fps), its one output the row number; and its ``rep``."""
    n = ids.size
    layouts = [OutputLayout("row", "int64"), OutputLayout("vec", "float32", 2)]
    w = IndexWriter(folder, n, layouts)
    cuts = np.linspace(0, n, chunks + 1).astype(int)
    rows = np.arange(n, dtype=np.int64)
    vec = np.stack([rows, -rows], axis=1).astype(np.float32)
    for a, b in itertools.pairwise(cuts):
        w.add(ids[a:b], fps[a:b], [rows[a:b], vec[a:b]])
    ref = w.finish(str(folder), "run-1")
    _, rep, _ = build_table(ids)  # deterministic: the table a lookup builds has these reps
    return BaselineIndex(folder, ref), rep


@settings(max_examples=60, deadline=None)
@given(
    base=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 3)), max_size=300),
    query=st.lists(st.tuples(st.integers(0, 45), st.integers(0, 3), st.booleans()), max_size=200),
    hint=st.integers(-1, 320),
    aligned=st.booleans(),
    window=st.sampled_from([3, baseline.WINDOW]),
)
def test_lookups_find_exactly_the_same_id_and_fingerprint(
    tmp_path_factory: pytest.TempPathFactory,
    base: list[tuple[int, int]],
    query: list[tuple[int, int, bool]],
    hint: int,
    aligned: bool,
    window: int,
) -> None:
    """Many duplicate ids, several fingerprints per id: a row found is always a baseline row
    with its id and fingerprint (and its output values are that row's); a row is found iff
    some baseline row has its id and fingerprint, unless its id sits at its expected row with
    another fingerprint (changed there: a duplicate's other rows are not searched); the id is
    known iff some baseline row has it; rows not asked about are neither. Whatever the
    position hint: none, anywhere (past the end included), or right (the query is the
    baseline's rows from ``hint`` on, a few changed: what a shard read in the baseline's order
    asks)."""
    if aligned and base:
        hint = min(hint, len(base) - 1) if hint >= 0 else 0
        query = [(b[0], b[1] if k % 7 else (b[1] + 1) % 4, True) for k, b in enumerate(base)]
        query = query[hint:]
    folder = tmp_path_factory.mktemp("idx")
    ids = np.array([b[0] for b in base], dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    fps = np.array([b[1] for b in base], dtype=np.int64)
    index, rep = _index(folder, ids, fps)
    q_ids = np.array([q[0] for q in query], dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    q_fps = np.array([q[1] for q in query], dtype=np.int64)
    use = np.array([q[2] for q in query], dtype=bool)
    default, baseline.WINDOW = baseline.WINDOW, window  # 3: most rows beyond it, probed
    try:
        found, same = index.match(q_ids, q_fps, use, hint)
    finally:
        baseline.WINDOW = default
    known = same >= 0
    pairs = set(zip(ids.tolist(), fps.tolist(), strict=True))
    used = np.flatnonzero(use)
    lo = max(0, hint + int(used[0]) - window) if used.size else 0
    hi = min(ids.size, hint + int(used[-1]) + window + 1) if used.size else 0
    for i in range(len(query)):
        if not use[i]:
            assert found[i] == -1 and not known[i]
            continue
        assert known[i] == (int(q_ids[i]) in set(ids.tolist()))
        if known[i]:  # a row of the baseline with the same id (the next batch's hint)
            assert ids[same[i]] == q_ids[i]
        expected = i + hint if hint >= 0 else -1
        at_place = 0 <= expected < ids.size and ids[expected] == q_ids[i]
        if found[i] >= 0:
            r = int(found[i])
            assert ids[r] == q_ids[i] and fps[r] == q_fps[i]
            row, vec = index.outputs(np.array([r]))
            assert row[0] == r and vec[0].tolist() == [r, -r]
        elif (int(q_ids[i]), int(q_fps[i])) in pairs:
            # Answered near its place, by a row of its id with another fingerprint: changed.
            assert hint >= 0 and fps[same[i]] != q_fps[i]
        if at_place:
            assert same[i] == expected
        elif hint >= 0 and known[i]:
            near = [r for r in range(lo, hi) if ids[r] == q_ids[i]]
            if near:  # the first row of its id near the batch
                assert same[i] == near[0]
    # rep: each row's first row with the same id; distinct ids = rows that are their own rep.
    assert np.array_equal(ids[rep], ids)
    assert int(np.count_nonzero(rep == np.arange(ids.size))) == len(set(ids.tolist()))


def test_rows_inserted_together_that_share_a_slot_find_one_another(tmp_path: Path) -> None:
    """Ids that collide in the table (the same home slot), of one id and of several, inserted
    in one round: every row is still found, and duplicates share one rep."""
    size = baseline.table_size(8)
    ids = np.array([5, 5 + size, 5, 5 + 2 * size, 5 + size, 6], dtype=np.uint64)
    fps = np.arange(6, dtype=np.int64)
    index, rep = _index(tmp_path, ids, fps, chunks=1)
    found, same = index.match(ids, fps, np.ones(6, dtype=bool))
    assert found.tolist() == [0, 1, 2, 3, 4, 5] and (same >= 0).all()
    assert rep[2] == rep[0] and rep[4] == rep[1] and len(set(rep.tolist())) == 4


def test_a_table_over_many_insert_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(baseline, "_INSERT_CHUNK", 7)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 50, 200).astype(np.uint64)
    slots, rep, later = build_table(ids)
    assert sorted(s for s in slots.tolist() if s >= 0) == list(range(200))
    assert np.array_equal(ids[rep], ids)
    assert int(np.count_nonzero(rep == np.arange(200))) == np.unique(ids).size
    assert np.array_equal(later, np.flatnonzero(rep != np.arange(200)))


def test_marks_count_the_distinct_ids_tonight_no_longer_has(tmp_path: Path) -> None:
    """Workers mark the rows whose ids they met (any row of a duplicated id); the driver counts
    the distinct ids left unmarked, whichever of an id's rows was marked."""
    ids = np.array([10, 11, 12, 11, 13, 12, 14], dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    index, rep = _index(tmp_path, ids, np.zeros(7, np.int64))
    assert rep[1] == rep[3] and rep[2] == rep[5] and len(set(rep.tolist())) == 5
    tonight = ids[[3, 0, 6]]  # ids 11 (its later row), 10 and 14: 12 and 13 are gone
    _, same = index.match(tonight, np.ones(3, np.int64), np.ones(3, bool))
    assert index.mark(same[same >= 0])
    seen = np.load(tmp_path / "seen.npy").astype(bool)
    assert baseline.removed_ids(tmp_path, index.ref, seen) == 2
    # A worker's copy of a remote index has no seen.npy: it cannot mark.
    (tmp_path / "seen.npy").unlink()
    assert not BaselineIndex(tmp_path, index.ref).mark(np.array([0]))


def test_an_empty_baseline_finds_nothing(tmp_path: Path) -> None:
    index, _ = _index(tmp_path, np.zeros(0, np.uint64), np.zeros(0, np.int64), chunks=1)
    found, same = index.match(np.array([1, 2], np.uint64), np.zeros(2, np.int64), np.ones(2, bool))
    assert found.tolist() == [-1, -1] and same.tolist() == [-1, -1]


def test_output_layouts_round_trip_the_arrow_columns() -> None:
    for typ, values in (
        (pa.float32(), pa.array([0.5, 1.5], pa.float32())),
        (pa.int64(), pa.array([3, 4], pa.int64())),
        (pa.list_(pa.float32(), 3), pa.array([[1, 2, 3], [4, 5, 6]], pa.list_(pa.float32(), 3))),
    ):
        lay = OutputLayout.of("x", typ)
        assert lay.arrow(lay.numpy(values)).equals(values)
    with pytest.raises(ValueError, match="nulls"):
        OutputLayout.of("x", pa.float32()).numpy(pa.array([1.0, None], pa.float32()))


def test_a_worker_maps_one_run_s_index_at_a_time(tmp_path: Path) -> None:
    ids = np.arange(10, dtype=np.uint64)
    w = IndexWriter(tmp_path / "a", 10, [OutputLayout("s", "float32")])
    w.add(ids, ids.astype(np.int64), [ids.astype(np.float32)])
    ref = w.finish(str(tmp_path / "a"), "run-a")
    baseline.forget_open()
    first = baseline.open_index(ref)
    assert baseline.open_index(ref) is first  # one mapping per process and run
    w = IndexWriter(tmp_path / "b", 10, [OutputLayout("s", "float32")])
    w.add(ids, ids.astype(np.int64), [ids.astype(np.float32)])
    other = baseline.open_index(w.finish(str(tmp_path / "b"), "run-b"))
    assert other is not first and list(baseline._OPEN) == ["run-b"]
    baseline.forget_open()


def test_an_index_writer_refuses_more_rows_than_announced(tmp_path: Path) -> None:
    w = IndexWriter(tmp_path, 2, [OutputLayout("s", "float32")])
    with pytest.raises(ValueError, match="more baseline rows"):
        w.add(np.arange(3, dtype=np.uint64), np.zeros(3, np.int64), [np.zeros(3, np.float32)])


def test_index_folders_of_exited_processes_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    """A SIGKILLed night leaves its index folder in the temporary folder (up to 0.8 GB at 20M
    rows); the next night removes it. A live process's folder, one from another machine and
    one without a mark are left alone."""
    import json
    import os
    import signal
    import subprocess
    import sys

    from pipeline.io.locking import process_identity

    def folder(name: str, owner: dict[str, object] | None) -> Path:
        d = tmp_path / f"score-catalog-baseline-{name}"
        d.mkdir()
        (d / "ids.npy").write_bytes(b"x" * 100)
        if owner is not None:
            (d / "owner.json").write_text(json.dumps(owner))
        return d

    code = "import json, sys; from pipeline.io.locking import process_identity; "
    code += "print(json.dumps(process_identity()), flush=True); sys.stdin.read()"
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    killed_owner = json.loads(child.stdout.readline())
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    killed = folder("killed-1", killed_owner)
    live = folder("live-2", process_identity())
    elsewhere = folder("elsewhere-3", {**killed_owner, "host": "another-machine"})
    unmarked = folder("unmarked-4", None)
    assert baseline.remove_abandoned(tmp_path) == [killed]
    assert not killed.exists()
    assert live.exists() and elsewhere.exists() and unmarked.exists()


def test_the_id_table_is_built_only_when_a_row_is_not_at_its_place(tmp_path: Path) -> None:
    """A shard read in its baseline file's order never needs the hash table; the first lookup
    that does builds it, once, and another process's index maps the same one."""
    ids = np.arange(1, 101, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    fps = np.arange(100, dtype=np.int64)
    index, _ = _index(tmp_path, ids, fps)
    fps_tonight = fps.copy()
    fps_tonight[::10] += 1  # changed at their place
    found, same = index.match(ids[40:], fps_tonight[40:], np.ones(60, bool), hint=40)
    assert (same == np.arange(40, 100)).all() and (found >= 0).sum() == 54
    assert not (tmp_path / "slots.npy").exists()
    new_id = np.array([999], dtype=np.uint64)
    moved = np.concatenate([new_id, ids[:1]])  # a new row first: the rest are one off
    found, same = index.match(moved, fps[[0, 0]], np.ones(2, bool), hint=0)
    assert found.tolist() == [-1, 0] and same.tolist() == [-1, 0]
    assert (tmp_path / "slots.npy").exists() and (tmp_path / "once.npy").exists()
    built = (tmp_path / "slots.npy").stat().st_mtime_ns
    other = BaselineIndex(tmp_path, index.ref)  # another worker of the machine
    assert other.match(ids[5:6], fps[5:6], np.ones(1, bool))[0].tolist() == [5]
    assert (tmp_path / "slots.npy").stat().st_mtime_ns == built  # not built again


def test_rows_shifted_by_inserts_and_deletes_are_found_near_their_place(tmp_path: Path) -> None:
    """Rows inserted and deleted upstream shift the rest of a batch: the rows are found in the
    baseline rows around the batch, carried or changed there, without the id table."""
    ids = np.arange(1, 2001, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    fps = np.arange(2000, dtype=np.int64)
    index, _ = _index(tmp_path, ids, fps)
    keep = np.ones(2000, bool)
    keep[100:110] = False  # deleted upstream
    t_ids, t_fps = ids[keep].copy(), fps[keep].copy()
    t_fps[500] += 1  # changed, after the deletion
    inserted = np.array([7777], dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    t_ids = np.concatenate([t_ids[:50], inserted, t_ids[50:]])
    t_fps = np.concatenate([t_fps[:50], [5], t_fps[50:]])
    new = np.zeros(t_ids.size, bool)
    new[50] = True  # what Carry knows of an id beyond the baseline's range
    found, same = index.match(t_ids, t_fps, np.ones(t_ids.size, bool), hint=0, new=new)
    rows = np.flatnonzero(keep)
    expect = np.concatenate([rows[:50], [-1], rows[50:]])
    assert same.tolist() == expect.tolist()
    carried = expect.copy()
    carried[501] = -1  # the changed row (one further on: the inserted row before it)
    assert found.tolist() == carried.tolist()
    assert not (tmp_path / "slots.npy").exists()
