"""The run lock as a fence, and errors after planning that are not ours.

A run whose lock was taken over commits nothing more: its workers check the lock's token right
before each shard's rejects and output commit, the driver before each manifest save, the report
and ``_SUCCESS``. Two runs started together on one output: exactly one writes.

Any other error after planning (an output path under a file, an output folder that cannot be
written, a manifest that cannot be read) ends the run with one line naming it, exit 1,
``_report.json`` with status ``failed`` where the output is writable, and the metrics file; an
error while releasing the lock never hides it.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline import JobConfig, run
from pipeline.io import storage
from pipeline.io.layout import LOCK_NAME
from pipeline.io.locking import LockLostError, RunLock
from pipeline.worker.shard import ShardResult
from tests.conftest import write_shards
from tests.integration import servers
from tests.integration.helpers import (
    Pause,
    cli,
    cli_argv,
    cli_env,
    data_files,
    job_args,
    manifest_path,
    pause_env,
    report_path,
)
from tests.integration.servers import DaskCluster, S3Bucket, aws_env, start_moto_server

pytestmark = pytest.mark.integration


def _visible(out: Path) -> dict[str, int]:
    """Every file under ``out`` except the lock's own, with its modification time (ns)."""
    return {
        str(p.relative_to(out)): p.stat().st_mtime_ns
        for p in out.rglob("*")
        if p.is_file() and not p.name.startswith("_lock")
    }


def _take_over(out: Path, run_id: str = "successor") -> dict[str, Any]:
    """What a run that took the lock over leaves: ``_lock.json`` naming it, with its token."""
    lock = out / LOCK_NAME
    doc = dict(json.loads(lock.read_text()))
    doc.update(run_id=run_id, token=f"{run_id}-token", pid=1, host="another-host")
    tmp = out / "_lock.json.new"
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, lock)  # the successor's lock appears whole, as an exclusive create makes it
    return doc


def _config(cat: Path, out: Path, bundle: Path, **kw: Any) -> JobConfig:
    return JobConfig(
        input=str(cat),
        output=str(out),
        model=str(bundle),
        passthrough=("category",),
        batch_size=200,
        **kw,
    )


@pytest.mark.parametrize("scheduler", ["sync", "local"])
def test_a_superseded_run_commits_nothing_more(
    tmp_path: Path, torchscript_bundle_dir: Path, scheduler: str
) -> None:
    cat = tmp_path / "catalog"
    write_shards(cat, [900] * 6, row_group_rows=300)
    out = tmp_path / "out"
    at_takeover: dict[str, int] = {}
    successor: dict[str, Any] = {}

    def on_shard(result: ShardResult) -> None:
        if not successor:  # after the first shard: another run takes the output over
            successor.update(_take_over(out))
            at_takeover.update(_visible(out))

    # One worker with one thread: at most one shard is in flight when the lock changes hands.
    config = _config(cat, out, torchscript_bundle_dir, scheduler=scheduler, workers=1, task_rows=1)
    with pytest.raises(LockLostError, match="successor"):
        run(config, on_shard=on_shard)
    after = _visible(out)
    in_flight = 0 if scheduler == "sync" else 1
    changed = {k for k, v in after.items() if at_takeover.get(k) != v}
    # Nothing but the shard that had passed its check before the takeover (none in sync)...
    assert len(changed) <= in_flight, changed
    assert all(k.endswith(".parquet") for k in changed), changed
    # ... no manifest save, no report, no _SUCCESS, and the successor's lock left in place.
    assert not report_path(out).exists() and not (out / "_SUCCESS").exists()
    assert json.loads((out / LOCK_NAME).read_text())["token"] == successor["token"]
    if scheduler == "sync":  # on a cluster, more may have committed before the takeover
        assert len(data_files(out)) == 1


def test_a_superseded_run_commits_no_rejects(tmp_path: Path, torchscript_bundle_dir: Path) -> None:
    """The fence stands before the rejects too (they are committed before the output)."""
    cat = tmp_path / "catalog"
    paths = write_shards(cat, [600, 600], row_group_rows=300)
    t = pq.read_table(paths[1])
    vals = t.column("f3").to_pylist()
    vals[5] = None
    t = t.set_column(t.schema.get_field_index("f3"), "f3", pa.array(vals, pa.float32()))
    pq.write_table(t, paths[1], row_group_size=300)
    out, rej = tmp_path / "out", tmp_path / "rejects"
    seen: list[str] = []

    def on_shard(result: ShardResult) -> None:
        seen.append(result.rel_path)
        _take_over(out)

    config = _config(cat, out, torchscript_bundle_dir, scheduler="sync", rejects=str(rej))
    with pytest.raises(LockLostError):
        run(config, on_shard=on_shard)
    assert seen == ["part-00000.parquet"]
    assert not rej.exists() or data_files(rej) == []


@pytest.mark.slow
def test_two_runs_started_together_one_writes(
    tmp_path: Path, torchscript_bundle_dir: Path, pauses: Callable[..., Pause]
) -> None:
    cat = tmp_path / "catalog"
    write_shards(cat, [2_000] * 6, row_group_rows=500)
    out = tmp_path / "out"
    args = ["run", *job_args(cat, out, torchscript_bundle_dir), "--scheduler", "sync"]
    args += ["--batch-size", "500", "-q"]
    # Whichever run takes the lock is held right after it, until the other has ended: the
    # other cannot find the output free however much later it gets there (it used to rely on
    # the first run lasting longer than the second one's start, which a fast machine broke).
    locked = pauses("locked")
    procs = [
        subprocess.Popen(
            cli_argv(*args),
            env=cli_env(pause_env(locked)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    (winner_pid,) = locked.wait(procs)
    (loser,) = [p for p in procs if p.pid != winner_pid]
    loser_out = loser.communicate(timeout=300)
    locked.release()
    winner = procs[0] if loser is procs[1] else procs[1]
    winner_out = winner.communicate(timeout=300)
    assert (winner.returncode, loser.returncode) == (0, 1), (winner_out, loser_out)
    assert locked.pids() == [winner_pid]  # the loser never held the lock
    report = json.loads(report_path(out).read_text())
    assert f"is locked by run {report['run_id']}" in loser_out[1], loser_out
    assert "Traceback" not in loser_out[1]
    # Every committed shard is the winner's, recorded once, and the output is complete.
    manifest = json.loads(manifest_path(out).read_text())
    assert {e["run_id"] for e in manifest["shards"].values()} == {report["run_id"]}
    assert report["status"] == "succeeded" and report["rows_out"] == 12_000
    assert (out / "_SUCCESS").exists() and not (out / LOCK_NAME).exists()


# ---------------------------------------------------------------- errors that are not ours


# The output-folder check (on_foreign_output = "fail") looks at what a folder holds; "replace"
# goes on to take the lock, which is where a path that cannot be a folder fails.
_PAST_THE_FOLDER_CHECK = ("--scheduler", "sync", "--on-foreign-output", "replace")


def _metrics(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_an_output_path_that_is_a_file_is_one_line_and_exit_1(
    tmp_path: Path, catalog: Path, torchscript_bundle_dir: Path
) -> None:
    target = tmp_path / "scores.parquet"
    target.write_bytes(b"not a folder")
    metrics = tmp_path / "metrics.prom"
    r = cli(
        "run",
        *job_args(catalog, target, torchscript_bundle_dir),
        *_PAST_THE_FOLDER_CHECK,
        "--metrics-file",
        str(metrics),
        in_process=True,
    )
    assert r.returncode == 1, r.output
    assert "Traceback" not in r.output
    assert str(target) in r.stderr, r.stderr
    assert target.read_bytes() == b"not a folder"
    assert 'status="failed"} 1' in _metrics(metrics)


def test_an_output_under_a_file_is_one_line_and_exit_1(
    tmp_path: Path, catalog: Path, torchscript_bundle_dir: Path
) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a folder should be")
    out = blocker / "out"
    metrics = tmp_path / "metrics.prom"
    r = cli(
        "run",
        *job_args(catalog, out, torchscript_bundle_dir),
        *_PAST_THE_FOLDER_CHECK,
        "--metrics-file",
        str(metrics),
    )
    assert r.returncode == 1, r.output
    assert "Traceback" not in r.output, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if str(blocker) in ln]
    assert lines, r.stderr
    assert 'status="failed"} 1' in _metrics(metrics)


@pytest.mark.skipif(
    hasattr(os, "geteuid") and os.geteuid() == 0,
    reason="root writes into a 0o555 folder anyway (the output-under-a-file test covers it)",
)
def test_a_read_only_output_is_one_line_and_exit_1(
    tmp_path: Path, catalog: Path, torchscript_bundle_dir: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o555)
    try:
        r = cli("run", *job_args(catalog, out, torchscript_bundle_dir), "--scheduler", "sync")
    finally:
        out.chmod(0o755)
    assert r.returncode == 1, r.output
    assert "Traceback" not in r.output and str(out) in r.stderr


def _broken_manifest(out: Path) -> None:
    """A ``_manifest.json`` that cannot be read (a folder): an error after the lock is taken."""
    manifest_path(out).mkdir(parents=True)


def test_an_error_after_the_lock_writes_a_failed_report(
    tmp_path: Path, catalog: Path, torchscript_bundle_dir: Path
) -> None:
    out = tmp_path / "out"
    _broken_manifest(out)
    metrics = tmp_path / "metrics.prom"
    r = cli(
        "run",
        *job_args(catalog, out, torchscript_bundle_dir),
        "--scheduler",
        "sync",
        "--metrics-file",
        str(metrics),
    )
    assert r.returncode == 1, r.output
    assert "Traceback" not in r.output, r.stderr
    assert "_manifest.json" in r.stderr
    assert r.report is not None  # validated against the schema by cli()
    assert r.report["status"] == "failed"
    assert "_manifest.json" in r.report["failure_reasons"][0]
    # The shards were never attempted: not scored, not failures of the data.
    assert r.report["shards_not_scored"] == r.report["shards_total"] == 3
    assert r.report["shards_failed"] == 0
    assert not (out / "_SUCCESS").exists() and not (out / LOCK_NAME).exists()
    assert 'status="failed"} 1' in _metrics(metrics)


def test_an_error_while_releasing_the_lock_does_not_hide_the_first(
    tmp_path: Path,
    catalog: Path,
    torchscript_bundle_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    out = tmp_path / "out"
    _broken_manifest(out)
    released: list[bool] = []
    real_release = RunLock.release

    def failing_release(self: RunLock) -> None:
        real_release(self)
        released.append(True)
        raise ConnectionError("the storage server went away while releasing the lock")

    monkeypatch.setattr(RunLock, "release", failing_release)
    config = _config(catalog, out, torchscript_bundle_dir, scheduler="sync")
    with caplog.at_level(logging.WARNING), pytest.raises(Exception) as info:
        run(config)
    assert released == [True]
    assert not isinstance(info.value, ConnectionError)
    assert "_manifest.json" in str(info.value)
    assert "went away while releasing the lock" in caplog.text
    assert json.loads(report_path(out).read_text())["status"] == "failed"


@pytest.mark.slow
def test_an_object_store_killed_mid_run_fails_within_the_retry_deadline(
    tmp_path: Path, torchscript_bundle_dir: Path, pauses: Callable[..., Pause]
) -> None:
    """The issue's case: the S3 server dies mid-run. The run gives up within its retry deadline
    with one line naming the error, exit 1; releasing the lock on the dead server fails too, and
    that is logged without hiding the first error."""
    cat = tmp_path / "catalog"
    write_shards(cat, [3_000] * 4, row_group_rows=1_000)
    # Held once its first shard is committed: the server dies while shards are left to write.
    committed = pauses("output-committed")
    with start_moto_server(tmp_path / "moto.log") as server:
        server.client().create_bucket(Bucket="killed")
        bucket = S3Bucket("killed", server.endpoint)
        job = bucket.write_job(
            tmp_path / "job.toml",
            storage={**bucket.storage_options, "retry_deadline_s": 3},
            input=str(cat),
            output=bucket.uri("scored"),
            model=str(torchscript_bundle_dir),
            scheduler="sync",
            batch_size=500,
        )
        proc = subprocess.Popen(
            cli_argv("run", str(job)),
            env=cli_env({**aws_env(), **pause_env(committed)}),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        committed.wait(proc)
        listing = server.client().list_objects_v2(Bucket="killed", Prefix="scored/part-")
        assert len(listing.get("Contents", [])) == 1  # the first shard, and no other yet
        server.proc.kill()
        server.proc.wait()
        killed = time.monotonic()
        committed.release()
        _, stderr = proc.communicate(timeout=300)
    took = time.monotonic() - killed
    assert proc.returncode == 1, stderr
    assert "Traceback" not in stderr, stderr
    errors = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    # It names the URI: the output, or its control folder beside it (the manifest's).
    named = ("s3://killed/scored", "s3://killed/_score_catalog/scored")
    assert len(errors) == 1 and any(uri in errors[0] for uri in named), stderr
    assert "releasing the lock" in stderr, stderr
    # Each storage call gives up after 3 s; a handful of them (the shard, the report, the
    # manifest, the lock) stay far below botocore's and s3fs's unbounded retries.
    assert took < 120, f"the run took {took:.0f}s to give up after the server died"


@pytest.mark.slow
def test_tasks_of_a_killed_driver_on_a_cluster_cannot_commit_after_a_takeover(
    tmp_path: Path,
    torchscript_bundle_dir: Path,
    dask_cluster: DaskCluster,
    pauses: Callable[..., Pause],
) -> None:
    """The issue's case: a SIGKILLed driver's tasks keep running on an external cluster. Once
    another run has taken the (now stale) lock over, none of them commits.

    Both workers are held mid-shard (a batch written to their staged files) while the driver
    is killed and the lock taken over, then let go: the orphaned tasks reach their commits
    only after the takeover, however fast or slow the machine."""
    cat = tmp_path / "catalog"
    write_shards(cat, [2_000] * 2, row_group_rows=500)
    out = tmp_path / "out"
    args = ["run", *job_args(cat, out, torchscript_bundle_dir), "--batch-size", "250"]
    args += ["--scheduler", dask_cluster.address, "--task-rows", "1", "-q"]
    held = pauses("batch-written")
    # The workers are the cluster's, not the CLI's children: they get the pause in their
    # environment (the fault points read it again when it changes), and lose it afterwards.
    with dask_cluster.client() as c:
        c.run(servers.set_env, pause_env(held))
    try:
        proc = subprocess.Popen(
            cli_argv(*args),
            env=cli_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        workers = held.wait(proc, count=2)
        assert sum(p.name.startswith(".part-") for p in out.glob(".*")) == 2
        proc.kill()  # SIGKILL: no clean-up, the lock stays, the tasks run on
        proc.communicate()
        root = storage.locate(str(out))
        successor = RunLock.acquire(root, "successor", stale_after_s=3600)  # its pid is gone
        try:
            assert successor.took_over is not None
            at_takeover = set(data_files(out))
            held.release()
            # Wait until the orphaned tasks are done (their staged files are gone one way or
            # the other), then look: nothing they wrote became visible.
            deadline = time.monotonic() + 120
            while any(p.name.startswith(".part-") for p in out.glob(".*")):
                assert time.monotonic() < deadline, "the orphaned tasks never finished"
                time.sleep(0.05)
            assert set(data_files(out)) == at_takeover
        finally:
            successor.release()
    finally:
        held.release()
        with dask_cluster.client() as c:
            c.run(servers.set_env, dict.fromkeys(pause_env(held)))
    assert len(set(workers)) == 2  # both workers were held, each with its own shard
