"""Each phase of a run on its own: a function of the frozen values before it (pipeline.driver).

Real parts: Parquet shards with several row groups, the exported demo bundle, the local disk,
the run lock; shards scored in this process (``scheduler = "sync"``) so that each test is fast.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.core.config import ErrorPolicy, JobConfig
from pipeline.core.interrupt import StopRequest
from pipeline.core.statuses import FailureKind, RunStatus, ShardStatus
from pipeline.driver import finish, lock, prepare, score
from pipeline.driver.phases import Locked, Prepared, Scored
from pipeline.io import layout
from tests.conftest import write_shards

SIZES = [300, 250]


@pytest.fixture
def config(tmp_path: Path, bundle_dir: Path) -> JobConfig:
    """Two readable shards and one that is not Parquet (failed before scoring)."""
    cat = tmp_path / "catalog"
    write_shards(cat, SIZES, row_group_rows=100)
    (cat / "part-00009.parquet").write_bytes(b"not parquet")
    return JobConfig(
        input=str(cat),
        output=str(tmp_path / "scored"),
        model=str(bundle_dir),
        passthrough=("category",),
        scheduler="sync",
        batch_size=64,
        errors=ErrorPolicy(max_failed_shards=1),
    )


@pytest.fixture
def cleanup() -> Iterator[contextlib.ExitStack]:
    with contextlib.ExitStack() as stack:
        yield stack


def _prepare(config: JobConfig, cleanup: contextlib.ExitStack) -> Prepared:
    return prepare.prepare(config, "r1", StopRequest(), cleanup)


def _locked(prepared: Prepared, cleanup: contextlib.ExitStack) -> Locked:
    held = lock.take(prepared, StopRequest(), cleanup)
    return lock.claim(prepared, held, cleanup)


def _scored(prepared: Prepared, locked: Locked, stop: StopRequest | None = None) -> Scored:
    return score.score(prepared, locked, stop or StopRequest(), {})


def test_prepare_learns_everything_and_writes_nothing(
    config: JobConfig, cleanup: contextlib.ExitStack
) -> None:
    prepared = _prepare(config, cleanup)
    assert [s.rel_path for s in prepared.shards] == [
        "part-00000.parquet",
        "part-00001.parquet",
        "part-00009.parquet",
    ]
    assert prepared.failed["part-00009.parquet"].kind == FailureKind.UNREADABLE
    assert prepared.session is None  # scheduler sync: shards are scored in this process
    assert prepared.execution.batch_size == 64
    assert prepared.sink.name == "parquet_folder"
    s = prepared.shards[0]
    assert prepared.task(s).output_uri == str(Path(config.output) / s.rel_path)
    assert prepared.task(s).num_rows == SIZES[0]
    assert not Path(config.output).exists()  # nothing is written before the lock
    with pytest.raises(dataclasses.FrozenInstanceError):
        prepared.run_id = "another"  # type: ignore[misc]


def test_lock_takes_the_output_and_lists_what_is_left(
    config: JobConfig, cleanup: contextlib.ExitStack
) -> None:
    out = Path(config.output)
    out.mkdir()
    (out / layout.OUTPUT_MARK).write_bytes(b"")
    (out / layout.SUCCESS_NAME).write_bytes(b"")  # the previous run's
    prepared = _prepare(config, cleanup)
    locked = _locked(prepared, cleanup)
    assert (out / layout.LOCK_NAME).exists()
    assert not (out / layout.SUCCESS_NAME).exists()  # withdrawn: this run changes the output
    assert [t.rel_path for t in locked.tasks] == ["part-00000.parquet", "part-00001.parquet"]
    assert set(locked.done) == {"part-00009.parquet"}  # failed in prepare: not a task
    assert locked.cleared == () and locked.previous_outputs == frozenset()


def test_the_lock_is_released_by_the_runs_clean_up(config: JobConfig, tmp_path: Path) -> None:
    with contextlib.ExitStack() as cleanup:
        prepared = _prepare(config, cleanup)
        _locked(prepared, cleanup)
        assert (Path(config.output) / layout.LOCK_NAME).exists()
    assert not (Path(config.output) / layout.LOCK_NAME).exists()


def test_score_records_every_shard_in_the_manifest_as_it_finishes(
    config: JobConfig, cleanup: contextlib.ExitStack
) -> None:
    prepared = _prepare(config, cleanup)
    locked = _locked(prepared, cleanup)
    scored = _scored(prepared, locked)
    assert scored.fatal is None
    statuses = {rel: r.status for rel, r in scored.results.items()}
    assert statuses == {
        "part-00000.parquet": ShardStatus.SCORED,
        "part-00001.parquet": ShardStatus.SCORED,
        "part-00009.parquet": ShardStatus.FAILED,
    }
    entries = json.loads(Path(locked.manifest.loc.path).read_text())
    assert set(entries["shards"]) == {"part-00000.parquet", "part-00001.parquet"}
    assert all(e["model_sha256"] == prepared.sha for e in entries["shards"].values())
    written = scored.results["part-00000.parquet"].written
    assert written is not None and written.size == Path(written.uri).stat().st_size
    assert [r.rel_path for r in scored.ordered(prepared)] == [s.rel_path for s in prepared.shards]


def test_a_rerun_skips_what_the_manifest_and_the_files_say_is_done(
    config: JobConfig, tmp_path: Path
) -> None:
    with contextlib.ExitStack() as cleanup:
        prepared = _prepare(config, cleanup)
        _scored(prepared, _locked(prepared, cleanup))
    with contextlib.ExitStack() as cleanup:
        again = _locked(_prepare(config, cleanup), cleanup)
    assert again.tasks == ()
    assert {rel: r.status for rel, r in again.done.items()} == {
        "part-00000.parquet": ShardStatus.SKIPPED,
        "part-00001.parquet": ShardStatus.SKIPPED,
        "part-00009.parquet": ShardStatus.FAILED,
    }


def test_finish_decides_once_and_commits_success_last(
    config: JobConfig, cleanup: contextlib.ExitStack
) -> None:
    prepared = _prepare(config, cleanup)
    locked = _locked(prepared, cleanup)
    scored = _scored(prepared, locked)
    stop = StopRequest()
    concluded = finish.conclude(prepared, locked, scored, stop)
    # One failed shard, within max_failed_shards = 1.
    assert concluded.report["status"] == RunStatus.SUCCEEDED_WITH_ERRORS
    assert not (Path(config.output) / layout.SUCCESS_NAME).exists()  # not before commit
    report = finish.commit(prepared, locked, concluded, stop)
    assert report.status == RunStatus.SUCCEEDED_WITH_ERRORS
    assert (Path(config.output) / layout.SUCCESS_NAME).exists()
    on_disk = json.loads((Path(prepared.control.path) / layout.REPORT_NAME).read_text())
    assert on_disk["status"] == "succeeded_with_errors"
    section = on_disk["output_format"]
    # The commit's own time (the run index's entry, for a folder), after duration_s was taken.
    assert 0 <= section.pop("commit_s") < 10
    assert section == {"format": "parquet_folder"}
    assert report.control == prepared.control.uri


def test_a_stop_before_scoring_ends_the_run_interrupted(
    config: JobConfig, cleanup: contextlib.ExitStack
) -> None:
    prepared = _prepare(config, cleanup)
    locked = _locked(prepared, cleanup)
    stop = StopRequest()
    stop.request(15)  # SIGTERM
    scored = _scored(prepared, locked, stop)
    assert {r.kind for r in scored.results.values()} >= {FailureKind.INTERRUPTED}
    concluded = finish.conclude(prepared, locked, scored, stop)
    assert concluded.report["status"] == RunStatus.INTERRUPTED
    assert concluded.report["failure_reasons"][0] == "interrupted by SIGTERM"
    finish.commit(prepared, locked, concluded, stop)
    assert not (Path(config.output) / layout.SUCCESS_NAME).exists()


def test_a_failed_commit_is_retracted_everywhere_it_was_written(
    config: JobConfig, cleanup: contextlib.ExitStack
) -> None:
    prepared = _prepare(config, cleanup)
    locked = _locked(prepared, cleanup)
    stop = StopRequest()
    concluded = finish.conclude(prepared, locked, _scored(prepared, locked), stop)
    finish.commit(prepared, locked, concluded, stop)
    retracted = finish.retract(prepared, locked, concluded, stop, OSError(28, "No space left"))
    assert retracted.written and retracted.report is not None
    failed = retracted.report
    assert failed["status"] == RunStatus.FAILED
    reason = "could not commit the run: OSError: [Errno 28] No space left"
    assert failed["failure_reasons"][0] == reason
    assert not (Path(config.output) / layout.SUCCESS_NAME).exists()
    on_disk = json.loads((Path(prepared.control.path) / layout.REPORT_NAME).read_text())
    assert on_disk["status"] == "failed"
