"""The run index on real local directories and on fsspec's memory filesystem."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest

from pipeline.core.errors import ConfigError
from pipeline.io import storage
from pipeline.io.runindex import (
    acceptance,
    index_root,
    previous_success,
    record,
    record_acceptance,
    remove,
    safe_name,
)

JOB = "nightly-catalog"


def entry(
    run_id: str,
    finished_at: str,
    status: str = "succeeded",
    *,
    job: str = JOB,
    report: str | None = None,
    rows_out: int = 7_300,
) -> dict[str, Any]:
    """An index entry as pipeline.run records it."""
    date = f"{run_id[:4]}-{run_id[4:6]}-{run_id[6:8]}"
    return {
        "run_id": run_id,
        "job": job,
        "status": status,
        "started_at": f"{date}T02:00:00.000000+00:00",
        "finished_at": finished_at,
        "rows_out": rows_out,
        "output": f"/data/scored/{date}",
        "report": report or f"/data/scored/{date}/_report.json",
    }


@pytest.fixture(params=["local", "memory"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An index root on local disk or in a fresh, private corner of the memory filesystem."""
    if request.param == "local":
        yield str(tmp_path / "scored")
        return
    top = f"/runindex-test-{uuid.uuid4().hex[:8]}"
    yield f"memory://{top}"
    fs = fsspec.filesystem("memory")
    if fs.exists(top):
        fs.rm(top, recursive=True)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        # The control area beside the template's fixed part, outside the dataset readers query.
        ("data/scored/{date}", "data/_score_catalog/scored"),
        ("data/scored/{date}/", "data/_score_catalog/scored"),
        ("s3://b/scored/dt={date}/x", "s3://b/_score_catalog/scored"),
        ("s3://bucket/scored/{date}/{run_id}", "s3://bucket/_score_catalog/scored"),
        ("s3://bucket/{date}", "s3://bucket"),  # the root is a bucket: no parent, inside
        ("/abs/scored/date={date}", "/abs/_score_catalog/scored"),
        # One output (no placeholder) is its own root: the same place, its control folder.
        ("data/scored", "data/_score_catalog/scored"),
        ("data/scored/", "data/_score_catalog/scored"),
        ("out", "_score_catalog/out"),
        ("s3://b/scored/", "s3://b/_score_catalog/scored"),
        ("s3://b", "s3://b"),  # a bucket root has no parent: the index stays inside
        ("{date}/scored", "."),
        ("/{date}", "/"),
        ("data/{{literal}}/{date}", "data/_score_catalog/{literal}"),
    ],
)
def test_index_root(template: str, expected: str) -> None:
    assert index_root(template) == expected


def test_index_root_rejects_placeholder_in_bucket() -> None:
    with pytest.raises(ConfigError, match="bucket"):
        index_root("s3://{date}/scored")
    with pytest.raises(ConfigError, match="not a valid template"):
        index_root("data/{date")


def test_safe_name() -> None:
    assert safe_name("nightly-catalog_v2.1") == "nightly-catalog_v2.1"
    assert safe_name("team a/b:c*?") == "team_a_b_c__"
    assert safe_name("..") == "_.."
    assert safe_name("") == "_"


def test_record_writes_one_file_per_run(root: str) -> None:
    e = entry("20260301T020000Z-a1b2c3", "2026-03-01T02:14:31.500000+00:00")
    uri = record(root, {}, JOB, e)
    loc = storage.locate(root)
    assert uri == loc.child(f"_runs/{JOB}/20260301T020000Z-a1b2c3.json").uri
    assert storage.read_json(storage.locate(uri)) == e
    # Nothing but the entry: no staging leftovers next to it.
    listing = loc.fs.ls(loc.child(f"_runs/{JOB}").path, detail=False)
    assert [p.rsplit("/", 1)[-1] for p in listing] == ["20260301T020000Z-a1b2c3.json"]


def test_record_requires_the_documented_keys(root: str) -> None:
    e = entry("20260301T020000Z-a1b2c3", "2026-03-01T02:14:31+00:00")
    del e["report"], e["finished_at"]
    with pytest.raises(ValueError, match="finished_at, report"):
        record(root, {}, JOB, e)


def test_previous_success_picks_newest_success(root: str) -> None:
    runs = [
        entry("20260301T020000Z-aaaaaa", "2026-03-01T02:14:00+00:00"),
        entry("20260302T020000Z-bbbbbb", "2026-03-02T02:15:00+00:00", "succeeded_with_errors"),
        # Finished later than its run id suggests (a slow backfill), in another timezone.
        entry("20260301T230000Z-cccccc", "2026-03-03T09:00:00+05:00", "succeeded_with_warnings"),
        entry("20260303T020000Z-dddddd", "2026-03-03T05:00:00+00:00", "failed"),
        entry("20260303T030000Z-eeeeee", "2026-03-03T06:00:00+00:00", job="other-job"),
    ]
    for e in runs:
        record(root, {}, e["job"], e)
    best = previous_success(root, {}, JOB)
    # 09:00+05:00 is 04:00Z: later than 03-02 02:15Z; the failed run at 05:00Z does not count.
    assert best is not None and best["run_id"] == "20260301T230000Z-cccccc"
    best = previous_success(root, {}, JOB, exclude_run_id="20260301T230000Z-cccccc")
    assert best is not None and best["run_id"] == "20260302T020000Z-bbbbbb"
    other = previous_success(root, {}, "other-job")
    assert other is not None and other["run_id"] == "20260303T030000Z-eeeeee"


def test_previous_success_none_without_index_or_success(root: str) -> None:
    assert previous_success(root, {}, JOB) is None
    record(root, {}, JOB, entry("20260303T020000Z-dddddd", "2026-03-03T05:00:00Z", "failed"))
    assert previous_success(root, {}, JOB) is None
    e = entry("20260304T020000Z-ffffff", "2026-03-04T02:10:00Z")
    record(root, {}, JOB, e)
    assert previous_success(root, {}, JOB, exclude_run_id=e["run_id"]) is None


def test_unsafe_job_names_share_nothing_with_lookalikes(root: str) -> None:
    a = entry("20260301T020000Z-aaaaaa", "2026-03-01T02:14:00+00:00", job="team/a")
    b = entry("20260302T020000Z-bbbbbb", "2026-03-02T02:14:00+00:00", job="team_a")
    uri = record(root, {}, "team/a", a)
    record(root, {}, "team_a", b)
    assert "/_runs/team_a/" in uri
    found = previous_success(root, {}, "team/a")
    assert found is not None and found["run_id"] == a["run_id"]


def test_damaged_entries_are_skipped_with_a_warning(
    root: str, caplog: pytest.LogCaptureFixture
) -> None:
    good = entry("20260301T020000Z-aaaaaa", "2026-03-01T02:14:00+00:00")
    record(root, {}, JOB, good)
    d = storage.locate(root).child(f"_runs/{JOB}")
    storage.write_bytes(d.child("20260302T020000Z-trunc1.json"), b'{"run_id": "2026')
    storage.write_bytes(d.child("20260302T020000Z-list01.json"), b"[1, 2]")
    storage.write_bytes(d.child("20260302T020000Z-binary.json"), b"\xff\xfe\x00")
    bad_time = entry("20260303T020000Z-badtim", "yesterday")
    storage.write_json(d.child("20260303T020000Z-badtim.json"), bad_time)
    # Hidden staging files and non-JSON files are not entries at all.
    storage.write_bytes(d.child(".20260304T020000Z-x.json.tmp-123"), b"{")
    storage.write_bytes(d.child("README"), b"not an entry")
    with caplog.at_level(logging.WARNING, logger="pipeline.io.runindex"):
        found = previous_success(root, {}, JOB)
    assert found == good
    warned = "\n".join(r.getMessage() for r in caplog.records)
    for name in ("trunc1", "list01", "binary", "badtim"):
        assert f"-{name}.json" in warned
    assert "tmp-123" not in warned and "README" not in warned


def test_entries_are_plain_json_on_disk(tmp_path: Path) -> None:
    # Operators read and prune the index by hand: it must stay one readable file per run.
    e = entry("20260301T020000Z-aaaaaa", "2026-03-01T02:14:00+00:00")
    uri = record(str(tmp_path), {}, JOB, e)
    assert Path(uri).parent == tmp_path / "_runs" / JOB
    assert json.loads(Path(uri).read_text()) == e


def test_scored_only_skips_runs_that_scored_nothing(tmp_path: Path) -> None:
    root = str(tmp_path)
    base = {
        "job": "j",
        "status": "succeeded",
        "started_at": "2026-11-01T00:00:00+00:00",
        "output": "o",
        "report": "o/_report.json",
        "rows_out": 10,
    }
    record(
        root,
        {},
        "j",
        {**base, "run_id": "a", "rows_processed": 10, "finished_at": "2026-11-01T01:00:00+00:00"},
    )
    record(
        root,
        {},
        "j",
        {**base, "run_id": "b", "rows_processed": 0, "finished_at": "2026-11-02T01:00:00+00:00"},
    )
    assert previous_success(root, {}, "j")["run_id"] == "b"  # type: ignore[index]
    found = previous_success(root, {}, "j", scored_only=True)
    assert found is not None and found["run_id"] == "a"


def test_skip_leaves_out_the_entries_it_names(root: str) -> None:
    old = {**entry("20260301T230000Z-aaaaaa", "2026-03-01T23:10:00+00:00"), "dataset": "d1"}
    new = {**entry("20260302T230000Z-bbbbbb", "2026-03-02T23:10:00+00:00"), "dataset": "d2"}
    record(root, {}, JOB, old)
    record(root, {}, JOB, new)
    assert previous_success(root, {}, JOB) == new
    found = previous_success(root, {}, JOB, skip=lambda e: e.get("dataset") == "d2")
    assert found == old
    assert previous_success(root, {}, JOB, skip=lambda e: True) is None


def test_acceptances_are_kept_beside_the_runs_and_found_by_dataset_and_baseline(
    root: str,
) -> None:
    base = {"dataset": "d1", "baseline": "run-a", "by": "alice", "reason": "new feed"}
    record_acceptance(root, {}, JOB, {**base, "at": "2026-03-02T09:00:00+00:00"})
    later = {**base, "by": "bob", "at": "2026-03-03T09:00:00+00:00"}
    uri = record_acceptance(root, {}, JOB, later)
    assert f"/_runs/{JOB}/_accepted/" in uri
    assert acceptance(root, {}, JOB, "d1", "run-a") == later  # the newest
    assert acceptance(root, {}, JOB, "d1", "run-b") is None  # another baseline's alert
    assert acceptance(root, {}, JOB, "d2", "run-a") is None
    # Acceptances are not runs: no baseline comes from them.
    assert previous_success(root, {}, JOB) is None


def test_remove_deletes_one_runs_entry(root: str) -> None:
    e = entry("20260301T230000Z-aaaaaa", "2026-03-01T23:10:00+00:00")
    record(root, {}, JOB, e)
    remove(root, {}, JOB, e["run_id"])
    assert previous_success(root, {}, JOB) is None
    remove(root, {}, JOB, e["run_id"])  # gone already: nothing to do
