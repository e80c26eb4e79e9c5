"""The Parquet folder output (pipeline.sinks.folder.sink) on real Parquet files: who wrote a file,
what goes, what the check
finds."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.core.errors import ConfigError, StorageError
from pipeline.core.jobfile import build_config
from pipeline.core.statuses import FailureKind, ShardStatus
from pipeline.core.templates import default_rejects
from pipeline.driver.reconcile import wanted
from pipeline.io import storage
from pipeline.io.layout import footer_metadata, rejects_metadata
from pipeline.io.ownership import (
    check_output_owner,
    check_rejects_location,
    is_data,
    remove_foreign,
    written_by_us,
)
from pipeline.io.parquet import read_footer
from pipeline.io.storage import Location
from pipeline.sinks.base import Expected, Outcome, Removal
from pipeline.sinks.folder.sink import delete_stale, plan_removals, verify
from pipeline.worker.shard import ShardResult
from pipeline.worker.sink import output_schema, rejects_schema

SHA = "a" * 64
SETTINGS = "0123456789abcdef"


def _ours(path: Path, rows: int, sha: str = SHA, source: str = "", fp: str = "") -> None:
    """An output file as a run writes it: output schema with the footer metadata (naming its
    input shard ``source`` and its fingerprint hash ``fp`` when given)."""
    meta = pa.schema([pa.field("item_id", pa.int64())])
    footer = footer_metadata(sha, SETTINGS, source, fp)
    schema = output_schema(meta, [("score", pa.float32())], footer)
    table = pa.table(
        {
            "item_id": pa.array(range(rows), pa.int64()),
            "score": pa.array([0.5] * rows, pa.float32()),
            "model_version": pa.array(["1"] * rows),
        },
        schema=schema,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=max(1, rows // 3))


@dataclass
class _Reconciled:
    removed: list[Removal]
    foreign: list[str]


def reconcile(
    out: Location, rej: Location, *, keep: set[str], ours: set[str], reasons: dict[str, str]
) -> _Reconciled:
    """The folder sink's finish on ``out``: its plan (pure), then what it deletes."""
    plan = plan_removals(out, rej, Outcome(frozenset(keep), frozenset(ours), reasons))
    return _Reconciled(list(delete_stale(plan, None)), list(plan.foreign))


def _theirs(path: Path, rows: int = 10) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"x": list(range(rows))}), path, row_group_size=4)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_footer_marks_our_files_only(tmp_path: Path) -> None:
    _ours(tmp_path / "a.parquet", 9)
    _theirs(tmp_path / "b.parquet")
    (tmp_path / "notes.txt").write_text("hello")
    loc = storage.locate(str(tmp_path))
    assert written_by_us(loc.child("a.parquet"))
    assert not written_by_us(loc.child("b.parquet"))
    assert not written_by_us(loc.child("notes.txt"))
    assert is_data(loc.child("b.parquet")) and not is_data(loc.child("notes.txt"))
    (tmp_path / "data.bin").write_bytes((tmp_path / "b.parquet").read_bytes())
    assert is_data(loc.child("data.bin"))  # a Parquet footer under another name is data too


def test_reconcile_removes_ours_not_kept_with_rejects_and_never_foreign(tmp_path: Path) -> None:
    out, rej = tmp_path / "out", tmp_path / "_rejects" / "out"
    _ours(out / "kept.parquet", 30)
    _ours(out / "gone.parquet", 30)  # in the manifest, its input deleted
    _ours(rej / "gone.parquet", 2)
    _ours(out / "d=1" / "failed.parquet", 30)  # failed in this run
    # Not in the manifest, though this tool's mark is in its footer: copied in from another
    # output (or left by a crash before its entry was saved). Never deleted: verify decides.
    _ours(out / "copied.parquet", 12)
    _theirs(out / "theirs.parquet")
    (out / "notes.txt").write_text("x")
    before = _sha(out / "theirs.parquet")
    done = reconcile(
        storage.locate(str(out)),
        storage.locate(str(rej)),
        keep={"kept.parquet"},
        ours={"kept.parquet", "gone.parquet", "d=1/failed.parquet"},
        reasons={"d=1/failed.parquet": "its shard failed in this run (unreadable)"},
    )
    removed = {Path(r.output).relative_to(out).as_posix(): r for r in done.removed}
    assert set(removed) == {"gone.parquet", "d=1/failed.parquet"}
    assert removed["gone.parquet"].rejects == str(rej / "gone.parquet")
    assert "no longer exists" in removed["gone.parquet"].reason
    assert "unreadable" in removed["d=1/failed.parquet"].reason
    assert not (rej / "gone.parquet").exists()
    assert sorted(done.foreign) == ["copied.parquet", "notes.txt", "theirs.parquet"]
    assert _sha(out / "theirs.parquet") == before and (out / "kept.parquet").exists()
    assert (out / "copied.parquet").exists()


def test_reconcile_never_deletes_a_scored_file_its_manifest_does_not_list(tmp_path: Path) -> None:
    """A scored file of another output copied in, under a name of a shard whose input is gone
    and under a new name: this output's manifest lists neither, so both stay (and verify then
    refuses _SUCCESS), whatever the footers say."""
    other, out = tmp_path / "other", tmp_path / "out"
    _ours(other / "part-0.parquet", 7, source="part-0.parquet", fp="f0")
    _ours(out / "part-1.parquet", 5, source="part-1.parquet", fp="f1")  # this output's own
    (out / "part-0.parquet").write_bytes((other / "part-0.parquet").read_bytes())
    (out / "extra.parquet").write_bytes((other / "part-0.parquet").read_bytes())
    before = {p.name: _sha(p) for p in out.glob("*.parquet")}
    loc = storage.locate(str(out))
    done = reconcile(
        loc,
        storage.locate(str(tmp_path / "rej")),
        keep={"part-1.parquet"},
        ours={"part-1.parquet"},
        reasons={},
    )
    assert done.removed == []
    assert sorted(done.foreign) == ["extra.parquet", "part-0.parquet"]
    assert {p.name: _sha(p) for p in out.glob("*.parquet")} == before
    expected = {"part-1.parquet": Expected(5, SHA, SETTINGS)}
    problems = verify(loc, expected)
    assert len(problems) == 2 and all("not in the report" in p for p in problems), problems


def test_reconcile_withdraws_success_from_a_folder_whose_data_it_removed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _ours(out / "d=1" / "a.parquet", 4)
    _ours(out / "d=1" / "sub" / "b.parquet", 4)
    (out / "d=1" / "_SUCCESS").write_bytes(b"")
    _ours(out / "d=2" / "c.parquet", 4)
    (out / "d=2" / "_SUCCESS").write_bytes(b"")
    _ours(out / "d=3" / "e.parquet", 4)  # loses one file, keeps another
    _ours(out / "d=3" / "f.parquet", 4)
    (out / "d=3" / "_SUCCESS").write_bytes(b"")
    listed = {
        "d=1/a.parquet",
        "d=1/sub/b.parquet",
        "d=2/c.parquet",
        "d=3/e.parquet",
        "d=3/f.parquet",
    }
    done = reconcile(
        storage.locate(str(out)),
        storage.locate(str(tmp_path / "rej")),
        keep={"d=2/c.parquet", "d=3/f.parquet"},
        ours=listed,
        reasons={},
    )
    assert {r.rel_path for r in done.removed} == {
        "d=1/a.parquet",
        "d=1/sub/b.parquet",
        "d=3/e.parquet",
    }
    assert not (out / "d=1" / "_SUCCESS").exists()  # its data is gone: no _SUCCESS vouches for it
    assert (out / "d=2" / "_SUCCESS").exists() and (out / "d=3" / "_SUCCESS").exists()


def _rejects(path: Path, owner: str | None) -> None:
    """A rejects file naming ``owner`` (an output file URI) in its footer; None: unnamed, as
    versions before the name wrote them."""
    meta = rejects_metadata(owner) if owner is not None else None
    schema = rejects_schema(pa.schema([pa.field("item_id", pa.int64())]), meta)
    path.parent.mkdir(parents=True, exist_ok=True)
    cols = [pa.array([1], pa.int64()), pa.array(["nan"])]
    pq.write_table(pa.Table.from_arrays(cols, schema=schema), path)


def test_reconcile_never_deletes_rejects_of_another_output(tmp_path: Path) -> None:
    out, rej, other = tmp_path / "out", tmp_path / "rejects", tmp_path / "other"
    _ours(out / "gone.parquet", 3)
    _rejects(rej / "gone.parquet", str(other / "gone.parquet"))
    _rejects(rej / "lost.parquet", str(other / "lost.parquet"))  # its output already gone
    _rejects(rej / "mine.parquet", str(out / "mine.parquet"))
    _rejects(rej / "old.parquet", None)
    done = reconcile(
        storage.locate(str(out)),
        storage.locate(str(rej)),
        keep=set(),
        ours={"gone.parquet", "lost.parquet", "mine.parquet", "old.parquet"},
        reasons={},
    )
    assert [r.rejects for r in done.removed] == [None]  # the output went, their rejects stay
    assert not (out / "gone.parquet").exists()
    assert sorted(p.name for p in rej.iterdir()) == ["gone.parquet", "lost.parquet"]


def test_rejects_location_of_another_output_or_a_file_is_refused(tmp_path: Path) -> None:
    out, rej = storage.locate(str(tmp_path / "b")), tmp_path / "rejects"
    _rejects(rej / "part-0.parquet", str(tmp_path / "b" / "part-0.parquet"))
    _rejects(rej / "d=1" / "part-1.parquet", None)  # unnamed: an older version's, taken as ours
    check_rejects_location(storage.locate(str(rej)), out)
    _rejects(rej / "d=1" / "part-2.parquet", str(tmp_path / "a" / "d=1" / "part-2.parquet"))
    with pytest.raises(ConfigError) as e:
        check_rejects_location(storage.locate(str(rej)), out)
    text = str(e.value)
    assert str(rej / "d=1" / "part-2.parquet") in text
    assert f"another output ({tmp_path / 'a'})" in text
    # A run whose shards do not include that name never writes or deletes it: not refused.
    check_rejects_location(storage.locate(str(rej)), out, rel_paths=["part-0.parquet"])
    (tmp_path / "file").write_text("x")
    for where in ("file", "file/below/it"):
        with pytest.raises(StorageError, match=r"is a file or lies under one \(.*/file\)"):
            check_rejects_location(storage.locate(str(tmp_path / where)), out)
    check_rejects_location(storage.locate(str(tmp_path / "new" / "deeper")), out)  # absent: fine


def test_reconcile_removes_legacy_rejects_inside_the_output(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _ours(out / "a.parquet", 5)
    _ours(out / "_rejects" / "a.parquet", 1)
    _ours(out / "_rejects" / "unknown.parquet", 1)
    reconcile(
        storage.locate(str(out)),
        storage.locate(str(tmp_path / "_rejects" / "out")),
        keep={"a.parquet"},
        ours={"a.parquet"},
        reasons={},
    )
    assert not (out / "_rejects" / "a.parquet").exists()
    assert (out / "_rejects" / "unknown.parquet").exists()  # not a shard this run knows


def test_verify_names_every_difference(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _ours(out / "good.parquet", 30, source="good.parquet", fp="f1")
    _ours(out / "short.parquet", 20)
    _ours(out / "other_model.parquet", 30, sha="b" * 64)
    # part-1's output copied over part-2's: rows, model and settings all match.
    _ours(out / "part-1.parquet", 30, source="part-1.parquet", fp="f1")
    _ours(out / "part-2.parquet", 30, source="part-1.parquet", fp="f1")
    _ours(out / "old_input.parquet", 30, source="old_input.parquet", fp="before")
    _ours(out / "legacy.parquet", 30)  # written before outputs named their input
    _theirs(out / "stray.parquet")
    (out / "notes.txt").write_text("not data")

    def want(rel: str, rows: int = 30, fp: str = "f1") -> Expected:
        return Expected(rows, SHA, SETTINGS, rel, fp)

    expected = {
        rel: want(rel)
        for rel in ("good.parquet", "other_model.parquet", "part-1.parquet", "part-2.parquet")
    }
    expected |= {
        "short.parquet": want("short.parquet"),
        "missing.parquet": want("missing.parquet", 5),
        "old_input.parquet": want("old_input.parquet", fp="after"),
        "legacy.parquet": want("legacy.parquet"),
    }
    problems = verify(storage.locate(str(out)), expected)
    text = "\n".join(problems)
    assert len(problems) == 6, text
    assert "stray.parquet is in the output but not in the report" in text
    assert "missing.parquet is in the report but missing" in text
    assert "short.parquet holds 20 rows, the report says 30" in text
    assert "other_model.parquet was scored by model bbbbbbbbbbbb" in text
    assert "part-2.parquet was scored from input shard part-1.parquet, not part-2" in text
    assert "old_input.parquet was scored from another version of old_input.parquet" in text
    assert "notes.txt" not in text and "good.parquet" not in text and "legacy" not in text
    other = Expected(30, SHA, "f" * 16, "good.parquet", "f1")
    ok = verify(storage.locate(str(out)), {"good.parquet": other})
    assert any("settings" in p for p in ok)


def test_foreign_output_is_refused_with_names_and_the_flag(tmp_path: Path) -> None:
    out = tmp_path / "out"
    for i in range(12):
        _theirs(out / f"t{i:02d}.parquet")
    (out / "notes.txt").write_text("x")
    loc = storage.locate(str(out))
    with pytest.raises(ConfigError) as info:
        check_output_owner(loc, "refuse")
    msg = str(info.value)
    assert "13 entries" in msg and "the first 10 of 13" in msg
    assert "notes.txt" in msg and "t00.parquet" in msg and "t11.parquet" not in msg
    assert "--on-foreign-output replace" in msg
    assert check_output_owner(loc, "replace").kind == "foreign"


def test_a_folder_of_our_marked_files_is_ours_without_a_manifest(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _ours(out / "a.parquet", 5)
    _ours(out / "d=1" / "b.parquet", 5)
    (out / "_lock.json").write_text("{}")
    assert check_output_owner(storage.locate(str(out)), "refuse").kind == "ours"
    _theirs(out / "d=1" / "c.parquet")
    with pytest.raises(ConfigError, match="d=1"):
        check_output_owner(storage.locate(str(out)), "refuse")


def test_remove_foreign_deletes_data_and_keeps_the_rest(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _ours(out / "unlisted.parquet", 5)  # our footer, but not this output's manifest: foreign
    _ours(out / "listed.parquet", 5)
    _theirs(out / "theirs.parquet")
    _theirs(out / "sub" / "deep.parquet")
    (out / "notes.txt").write_text("x")
    found = remove_foreign(storage.locate(str(out)), {"listed.parquet"})
    assert sorted(found.removed) == [
        str(out / "sub" / "deep.parquet"),
        str(out / "theirs.parquet"),
        str(out / "unlisted.parquet"),
    ]
    assert found.kept == [str(out / "notes.txt")]
    assert sorted(p.name for p in out.rglob("*") if p.is_file()) == ["listed.parquet", "notes.txt"]


def test_wanted_sorts_results() -> None:
    def result(rel: str, status: str, kind: str | None = None, rows: int = 0) -> ShardResult:
        return ShardResult(rel, f"/in/{rel}", status, rows_out=rows, kind=kind)

    w = wanted(
        [
            result("a", ShardStatus.SCORED, rows=3),
            result("b", ShardStatus.SKIPPED, rows=4),
            result("c", ShardStatus.FAILED, FailureKind.SCHEMA),
            result("d", ShardStatus.FAILED, FailureKind.UNREADABLE),
            result("e", ShardStatus.FAILED, FailureKind.CANCELLED),
        ]
    )
    assert w.rows == {"a": 3, "b": 4}
    assert w.untouched == {"e"} and w.keep == {"a", "b", "e"}
    assert set(w.reasons) == {"c", "d"} and "unreadable" in w.reasons["d"]


def test_footer_hash_follows_values_not_just_size(tmp_path: Path) -> None:
    p = tmp_path / "s.parquet"
    values = [float(i) for i in range(100)]
    pq.write_table(pa.table({"f": values}), p, row_group_size=30, compression="none")
    first = read_footer(str(p)).footer_hash
    assert read_footer(str(p)).footer_hash == first
    size = p.stat().st_size
    values[5] = 1e6
    pq.write_table(pa.table({"f": values}), p, row_group_size=30, compression="none")
    assert p.stat().st_size == size
    assert read_footer(str(p)).footer_hash != first


@pytest.mark.parametrize(
    ("template", "output", "rejects"),
    [
        (
            "data/scored/run_date={date}",
            "data/scored/run_date=X",
            "data/_rejects/scored/run_date=X",
        ),
        ("s3://bucket/scored/{date}/", "s3://bucket/scored/x/", "s3://bucket/_rejects/scored/x"),
        ("s3://b/s/{date}/{run_id}", "s3://b/s/x/r", "s3://b/_rejects/s/x/r"),
        ("data/scored", "data/scored", "data/_rejects/scored"),
        ("s3://bucket/x", "s3://bucket/x", "s3://bucket/_rejects/x"),
        ("out", "out", "_rejects/out"),
        ("s3://bucket", "s3://bucket", None),
        ("s3://bucket/", "s3://bucket/", None),
        ("s3://bucket/{date}", "s3://bucket/x", None),  # the root is the bucket: no parent
        ("{date}/scored", "x/scored", None),
        ("/", "/", None),
    ],
)
def test_default_rejects_sit_outside_the_template_root(
    template: str, output: str, rejects: str | None
) -> None:
    assert default_rejects(template, output) == rejects


def test_an_output_without_a_parent_must_set_rejects() -> None:
    base = {"input": "in", "model": "m", "output": "s3://bucket"}
    with pytest.raises(ConfigError, match="set rejects"):
        build_config(env={}, overrides=base)
    cfg = build_config(env={}, overrides={**base, "rejects": "s3://other/rej"})
    assert cfg.rejects_uri("r") == "s3://other/rej"
