"""Storage failures are run failures: a full or read-only disk and a dead S3 server, for real.

A storage failure (``ENOSPC``, ``EROFS``, ``EACCES``, a store still gone at the retry deadline)
is not bad data: the run stops at once with exit 1, status ``failed`` and a failure of kind
``storage``, whatever the error budget; the shard is not retried; one line on stderr under
``-q`` names the path and the cause, and no Dask traceback reaches stderr. A dead store ends the
run about ``retry_deadline_s`` after it died, not that long per storage call.

How the failures are made (``tests/integration/diskfaults.py``): a tiny tmpfs fills up, a tmpfs
is remounted read-only (or, not as root, a folder loses its write permission) while the run is
held at a named point (``_SCORE_CATALOG_PAUSE_AT``, :class:`tests.integration.helpers.Pause`),
and the moto server is killed by its PID while the Dask workers are held in the middle of a
shard.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import write_shards
from tests.integration.diskfaults import breakable_folder, small_disk
from tests.integration.helpers import (
    Pause,
    check_report,
    cli,
    control_of,
    job_args,
    pause_env,
    report,
    start_cli,
    wait_for_text,
)
from tests.integration.netfaults import flaky_proxy
from tests.integration.servers import S3Bucket, aws_env, start_moto_server

pytestmark = pytest.mark.integration

SIZES = [2500, 1700, 3100, 2000]
POISONED = "part-00001.parquet"  # the shard with a null feature: its rejects are written


def _catalog(root: Path) -> Path:
    """Four shards; one has a null feature in one row, so the run writes rejects for it."""
    paths = write_shards(root, SIZES, row_group_rows=1000)
    path = root / POISONED
    t = pq.read_table(path)
    vals = t.column("f0").to_pylist()
    vals[5] = None
    t = t.set_column(t.schema.get_field_index("f0"), "f0", pa.array(vals, pa.float32()))
    pq.write_table(t, path, row_group_size=300)
    return paths[0].parent


def _assert_storage_failure(rep: dict[str, Any], shard: str) -> None:
    """``rep`` failed on storage at ``shard``: not as bad data, and never within the budget."""
    assert rep["status"] == "failed", rep["failure_reasons"]
    kinds = {e["shard"].rsplit("/", 1)[-1]: e["kind"] for e in rep["errors"]}
    assert kinds.get(shard) == "storage", rep["errors"]
    assert "error" not in kinds.values(), rep["errors"]  # no shard "crashed on every retry"
    assert rep["failure_reasons"][0].startswith("storage failure: "), rep["failure_reasons"]
    assert not any("max_failed_shards" in r for r in rep["failure_reasons"])


def _lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.strip()]


# --------------------------------------------------------------------------- a local disk


def _run_breaking_rejects(
    tmp_path: Path, bundle: Path, *flags: str
) -> tuple[int, str, Path, str, Path]:
    """Start a run, hold it once it has its lock (before any shard is scored), make its
    rejects folder unwritable, let it go on. (exit code, stderr, output, strerror, rejects)"""
    cat = _catalog(tmp_path / "catalog")
    out, rejects = tmp_path / "scored", tmp_path / "rejects"
    locked = Pause("locked", tmp_path / "paused")
    with breakable_folder(rejects) as break_it:
        args = job_args(cat, out, bundle, "--rejects", str(rejects), "--passthrough", "category")
        proc = start_cli("run", *args, *flags, env=pause_env(locked))
        try:
            locked.wait(proc)
            cause = break_it()
        finally:
            locked.release()
        _, stderr = proc.communicate(timeout=300)
    return proc.returncode, stderr, out, cause, rejects


@pytest.mark.parametrize("budget", ["0", "5"])
def test_a_rejects_folder_made_read_only_mid_run_fails_the_run_on_storage(
    tmp_path: Path, bundle_dir: Path, budget: str
) -> None:
    """Not a failed data shard retried three times and judged against the budget (with
    ``max_failed_shards = 5`` that night passed as ``succeeded_with_errors``): exit 1, status
    ``failed``, kind ``storage``, and one line naming the rejects file and the cause."""
    code, stderr, out, cause, rejects = _run_breaking_rejects(
        tmp_path, bundle_dir, "-q", "--max-failed-shards", budget
    )
    assert code == 1, stderr
    lines = _lines(stderr)
    assert len(lines) == 1, stderr
    assert str(rejects / POISONED) in lines[0] and cause in lines[0], lines[0]
    assert "storage" in lines[0] and "max_failed_shards" not in lines[0], lines[0]
    _assert_storage_failure(report(out), POISONED)
    assert not (out / "_SUCCESS").exists()


def test_json_logs_of_a_storage_failure_hold_no_traceback_and_no_retry(
    tmp_path: Path, bundle_dir: Path
) -> None:
    """Every stderr line is one JSON object, none carries a traceback (Dask's "Compute Failed"
    put one in each retry's message), and the shard was tried once: no task retry, no
    rescoring."""
    code, stderr, out, cause, _ = _run_breaking_rejects(
        tmp_path, bundle_dir, "--log-format", "json"
    )
    assert code == 1, stderr
    events = [json.loads(ln) for ln in _lines(stderr)]  # every line parses
    for e in events:
        text = json.dumps(e)
        assert "Traceback" not in text and 'File \\"' not in text, e
    assert not [e for e in events if e.get("logger", "").startswith("distributed")], events
    assert not [e for e in events if "again" in e["message"]], events  # not rescored
    failed = [e for e in events if e["event"] == "shard_failed"]
    assert [(e["shard"], e["kind"]) for e in failed] == [(POISONED, "storage")], failed
    assert cause in failed[0]["message"]
    _assert_storage_failure(report(out), POISONED)


@pytest.mark.parametrize("budget", ["0", "5"])
def test_a_full_disk_mid_run_fails_the_run_on_storage(
    tmp_path: Path, bundle_dir: Path, budget: str
) -> None:
    """The output fills its disk while shards are written: exit 1, kind ``storage``, one line
    naming the output file and ``No space left on device`` (the OSError alone names no path)."""
    cat = _catalog(tmp_path / "catalog")
    # The output is the small disk itself: its report, beside it, is on the big one.
    with small_disk(tmp_path / "scored", "48k") as out:
        args = job_args(cat, out, bundle_dir, "--passthrough", "category")
        r = cli(
            "run",
            *args,
            "--rejects",
            str(tmp_path / "rejects"),
            "-q",
            "--max-failed-shards",
            budget,
        )
        assert r.returncode == 1, r.stderr
        lines = _lines(r.stderr)
        assert len(lines) == 1, r.stderr
        assert os.strerror(28) in lines[0] and f"{out}/part-0000" in lines[0], lines[0]
        assert "max_failed_shards" not in lines[0], lines[0]
        rep = r.report
        assert rep is not None, f"no report beside {out}"
        full = [e for e in rep["errors"] if e["kind"] == "storage"]
        assert len(full) == 1 and os.strerror(28) in full[0]["message"], rep["errors"]
        _assert_storage_failure(rep, full[0]["shard"].rsplit("/", 1)[-1])
        assert not (out / "_SUCCESS").exists()


# --------------------------------------------------------------------------- a dead S3 server


def _kill_s3_mid_run(
    tmp_path: Path, bundle: Path, *, output: str, deadline: float | None
) -> tuple[int, str, float, Path | None]:
    """Start a run reading its input from a moto server of its own, hold the Dask workers once
    they have read a batch, kill the server by its PID, let the workers go on. (exit code, stderr,
    seconds from the kill to the run's exit, the local output or None)."""
    local = tmp_path / "catalog"
    write_shards(local, [20_000] * 8, row_group_rows=2_000)
    reading = Pause("batch-read", tmp_path / "paused")
    with start_moto_server(tmp_path / "moto.log") as server:
        name = f"dead-{uuid.uuid4().hex[:8]}"
        server.client().create_bucket(Bucket=name)
        bucket = S3Bucket(name, server.endpoint)
        bucket.fs = bucket.new_fs()
        bucket.upload_tree(local, "catalog")
        out = tmp_path / "scored" if output == "local" else None
        opts = dict(bucket.storage_options)
        if deadline is not None:
            opts["retry_deadline_s"] = deadline
        job = bucket.write_job(
            tmp_path / "job.toml",
            storage=opts,
            input=bucket.uri("catalog/"),
            output=str(out) if out is not None else bucket.uri("scored/"),
            model=str(bundle),
            passthrough=["category"],
            batch_size=512,
        )
        proc = start_cli("run", str(job), "-q", env={**aws_env(), **pause_env(reading)})
        try:
            reading.wait(proc)
            os.kill(server.pid, signal.SIGKILL)
            server.proc.wait()
            killed = time.monotonic()
        finally:
            reading.release()
        _, stderr = proc.communicate(timeout=600)
        took = time.monotonic() - killed
    return proc.returncode, stderr, took, out


def _assert_ended_on_storage(code: int, stderr: str, took: float) -> None:
    assert code == 1, stderr
    assert "Traceback" not in stderr, stderr
    lines = _lines(stderr)
    assert 1 <= len(lines) <= 5, stderr
    assert lines[-1].startswith("error:") and "storage" in lines[-1], lines[-1]
    # The bound for a dead endpoint. Before, each storage call had its own deadline and
    # the run gave up 218 s after the server died (measured), whatever the deadline was set to.
    assert took < 90, f"the run took {took:.0f}s to end after the server died\n{stderr}"


@pytest.mark.slow
@pytest.mark.parametrize("output", ["local", "s3"])
def test_a_killed_s3_server_ends_the_run_on_storage(
    tmp_path: Path, bundle_dir: Path, output: str
) -> None:
    """The S3 server dies in the middle of a shard (``retry_deadline_s = 5`` to keep it short):
    exit 1 with at most 5 lines under -q, none a traceback; a local output gets a ``failed``
    report of kind ``storage`` (on S3 there is nowhere to write one)."""
    code, stderr, took, out = _kill_s3_mid_run(tmp_path, bundle_dir, output=output, deadline=5)
    _assert_ended_on_storage(code, stderr, took)
    if out is not None:
        rep = json.loads((control_of(out) / "_report.json").read_text())
        check_report(rep)
        assert rep["status"] == "failed"
        assert "storage" in {e["kind"] for e in rep["errors"]}, rep["errors"]
        assert "error" not in {e["kind"] for e in rep["errors"]}, rep["errors"]
        assert rep["failure_reasons"][0].startswith("storage failure: "), rep["failure_reasons"]
        assert not (out / "_SUCCESS").exists()


@pytest.mark.slow
def test_a_killed_s3_server_ends_the_run_within_90s_at_the_default_deadline(
    tmp_path: Path, bundle_dir: Path
) -> None:
    """The issue's "done when": with the default ``retry_deadline_s`` (60 s), input and output
    on S3, a dead endpoint ends the run within 90 s, with at most 5 lines on stderr under -q."""
    code, stderr, took, _ = _kill_s3_mid_run(tmp_path, bundle_dir, output="s3", deadline=None)
    _assert_ended_on_storage(code, stderr, took)


@pytest.mark.slow
def test_a_short_outage_is_retried_and_the_run_succeeds(tmp_path: Path, bundle_dir: Path) -> None:
    """A blip is not a failure: S3 (through a proxy) goes away in the middle of a shard until the
    run has met the outage, and comes back well within ``retry_deadline_s``; reads are retried,
    a write cut short scores its shard again, and the run succeeds with every row."""
    local = tmp_path / "catalog"
    write_shards(local, [20_000] * 8, row_group_rows=2_000)
    reading = Pause("batch-read", tmp_path / "paused")
    with start_moto_server(tmp_path / "moto.log") as server:
        port = int(server.endpoint.rsplit(":", 1)[1])
        with flaky_proxy(port) as proxy:
            name = f"blip-{uuid.uuid4().hex[:8]}"
            server.client().create_bucket(Bucket=name)
            direct = S3Bucket(name, server.endpoint)
            direct.fs = direct.new_fs()
            direct.upload_tree(local, "catalog")
            via = S3Bucket(name, proxy.endpoint)
            job = via.write_job(
                tmp_path / "job.toml",
                storage={**via.storage_options, "retry_deadline_s": 60},
                input=via.uri("catalog/"),
                output=via.uri("scored/"),
                model=str(bundle_dir),
                passthrough=["category"],
                batch_size=512,
            )
            env = {**aws_env(), **pause_env(reading)}
            log = tmp_path / "run.log"
            proc = start_cli("run", str(job), "-q", "--log-file", str(log), env=env)
            try:
                reading.wait(proc)
                proxy.down()
            finally:
                reading.release()
            # The outage lasts until the run has met it (a request refused or cut, and retried:
            # the retry layer logs the first retry of each call), not a fixed time that a
            # slow machine could spend before its next request.
            wait_for_text(log, "; retry 1 in ", proc)
            proxy.up()
            _, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, stderr
            assert "Traceback" not in stderr, stderr
            rep = json.loads(direct.fs.cat_file(f"{name}/_score_catalog/scored/_report.json"))
            check_report(rep)
            assert rep["status"] == "succeeded", rep["failure_reasons"]
            assert rep["rows_out"] == 8 * 20_000


def test_a_lock_heartbeat_that_cannot_be_written_fails_the_run_at_its_next_commit(
    tmp_path: Path,
) -> None:
    """The heartbeat's folder turns read-only (or refuses writes): the next ``assert_held``
    (before each commit) raises a StorageError naming the heartbeat file, once; a beat missed
    for a reason a retry may fix stays a warning."""
    from pipeline.core.errors import StorageError
    from pipeline.io import storage
    from pipeline.io.locking import RunLock

    with breakable_folder(tmp_path / "scored") as break_it:
        root = storage.locate(str(tmp_path / "scored"))
        lock = RunLock.acquire(root, "run-1", stale_after_s=3600, heartbeat_s=0.05)
        lock.assert_held()
        cause = break_it()
        deadline = time.monotonic() + 30
        while True:
            try:
                lock.assert_held()
            except StorageError as e:
                failure = e
                break
            assert time.monotonic() < deadline, "the heartbeat's failure never reached the run"
            time.sleep(0.05)
        assert "_lock.heartbeat-" in str(failure) and cause in str(failure), failure
        assert failure.uri is not None and "_lock.heartbeat-" in failure.uri
        lock.assert_held()  # raised once: the failed report may still be written elsewhere
        with pytest.raises(StorageError):
            lock.release()  # deleting the lock on a read-only folder fails too, naming it
