"""SIGTERM and SIGINT as a run status: real CLI processes, real signals.

The first signal stops scheduling; shards in flight commit within ``grace_period_s``; the run
records every committed shard, writes ``_report.json`` with status ``interrupted`` and exits 143
(SIGTERM) or 130 (SIGINT), without ``_SUCCESS``. A rerun rescores only what was not committed
and ends with a clean run's output. A second signal stops at once, closing the embedded Dask
cluster so that no worker process outlives the run.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.core.interrupt import REPEAT_WINDOW_S
from tests.conftest import write_shards
from tests.integration.helpers import (
    Pause,
    cli,
    cli_argv,
    cli_env,
    data_files,
    job_args,
    manifest_path,
    pause_env,
    read_tree,
    report,
    report_path,
    temporaries,
    wait_for_text,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SHARDS = 16
ROWS = 3_000


@pytest.fixture(scope="module")
def catalog16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cat = tmp_path_factory.mktemp("interrupt") / "catalog"
    write_shards(cat, [ROWS] * SHARDS, row_group_rows=1_000)
    return cat


def _args(cat: Path, out: Path, bundle: Path, *extra: str) -> list[str]:
    # One shard per task, so that a stop finds shards not started. How long the run lasts does
    # not matter: the tests hold it where they signal it (fault-point pauses).
    return ["run", *job_args(cat, out, bundle), "--batch-size", "1000", "--task-rows", "1", *extra]


@pytest.fixture(scope="module")
def clean(
    catalog16: Path, torchscript_bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, pa.Table]:
    out = tmp_path_factory.mktemp("clean") / "out"
    args = _args(catalog16, out, torchscript_bundle_dir, "--scheduler", "sync", "-q")
    r = cli(*args, in_process=True)
    assert r.returncode == 0, r.output
    return read_tree(out)


def _start(
    args: list[str], *, own_group: bool = False, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """The CLI in the background; ``own_group``: in a process group of its own, so that a
    signal to the group reaches its worker processes too, as Ctrl-C on a terminal does."""
    return subprocess.Popen(
        cli_argv(*args),
        env=cli_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=own_group,
    )


def _staged_shards(out: Path) -> int:
    """Shards being written now: their staged (hidden) Parquet files."""
    return sum(p.name.startswith(".part-") for p in temporaries(out))


def _descendants(proc: subprocess.Popen[str]) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _assert_no_orphans(procs: list[psutil.Process]) -> None:
    """Every process the run started is gone (a zombie awaiting its reaper counts as gone)."""
    deadline = time.monotonic() + 5
    while True:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for p in alive:
        p.kill()
    assert not alive, f"processes outlived the run: {alive}"


def _send(proc: subprocess.Popen[str], sig: signal.Signals, *, group: bool) -> None:
    if group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)


@pytest.mark.parametrize(
    ("scheduler", "sig", "code", "group"),
    [
        ("sync", signal.SIGTERM, 143, False),
        ("local", signal.SIGTERM, 143, False),
        # Ctrl-C on a terminal: SIGINT to the whole process group, Dask workers included.
        ("local", signal.SIGINT, 130, True),
    ],
)
def test_a_signal_after_a_commit_interrupts_and_a_rerun_completes(
    tmp_path: Path,
    catalog16: Path,
    torchscript_bundle_dir: Path,
    clean: dict[str, pa.Table],
    scheduler: str,
    sig: signal.Signals,
    code: int,
    group: bool,
    pauses: Callable[..., Pause],
) -> None:
    out = tmp_path / "out"
    metrics = tmp_path / "metrics.prom"
    args = _args(catalog16, out, torchscript_bundle_dir, "--scheduler", scheduler, "-q")
    args += ["--workers", "2"] if scheduler == "local" else []
    args += ["--metrics-file", str(metrics)]
    # Each process that scores shards is held once it has committed its first: the signal
    # comes after a commit and before the run could have finished, on any machine.
    committed = pauses("output-committed")
    # On a cluster the workers are let go only once the driver has told every one of them to
    # start no shard (a pause released in advance only marks that the point was reached).
    stopping = pauses("stop-raised")
    stopping.release()
    proc = _start(args, own_group=group, env=pause_env(committed, stopping))
    committed.wait(proc)
    kids = _descendants(proc)
    _send(proc, sig, group=group)
    if scheduler != "sync":  # in sync, the run checks the stop itself before the next shard
        stopping.wait(proc)
    committed.release()
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stderr
    _assert_no_orphans(kids)
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr

    rep = report(out)  # checked against the report schema
    assert rep["status"] == "interrupted"
    assert rep["failure_reasons"][0] == f"interrupted by {sig.name}"
    assert not (out / "_SUCCESS").exists() and not (out / "_lock.json").exists()
    assert 'status="interrupted"} 1' in metrics.read_text()
    scored = {s["rel_path"] for s in rep["shards"] if s["status"] == "scored"}
    left = {s["rel_path"] for s in rep["shards"] if s["status"] != "scored"}
    assert scored and left, rep["shards"]
    assert {s["kind"] for s in rep["shards"] if s["status"] != "scored"} == {"interrupted"}
    # A cron timeout is not a failure of the data: the shards left are not scored, not failed.
    assert rep["shards_not_scored"] == len(left) and rep["shards_failed"] == 0
    (failed_line,) = [
        ln
        for ln in metrics.read_text().splitlines()
        if ln.startswith("score_catalog_last_run_failed_shards{")
    ]
    assert failed_line.endswith(" 0.0"), failed_line
    assert all(
        s["message"] == f"not scored: the run was interrupted by {sig.name}"
        for s in rep["shards"]
        if s["status"] != "scored"
    )
    # Every committed shard is in the manifest, and what readers see is exactly those shards.
    manifest = json.loads(manifest_path(out).read_text())
    assert set(manifest["shards"]) == scored
    assert {str(p.relative_to(out)) for p in data_files(out)} == scored

    again = cli(*_args(catalog16, out, torchscript_bundle_dir, "--scheduler", "sync", "-q"))
    assert again.returncode == 0, again.output
    assert again.report is not None
    assert again.report["shards_skipped"] == len(scored)
    assert again.report["shards_scored"] == len(left)
    assert (out / "_SUCCESS").exists() and temporaries(out) == []
    tree = read_tree(out)
    assert set(tree) == set(clean)
    for rel, table in tree.items():
        assert table.equals(clean[rel]), rel


@pytest.mark.parametrize(
    ("sig", "code", "group"), [(signal.SIGTERM, 143, False), (signal.SIGINT, 130, True)]
)
def test_a_second_signal_aborts_at_once_and_leaves_no_worker(
    tmp_path: Path,
    torchscript_bundle_dir: Path,
    sig: signal.Signals,
    code: int,
    group: bool,
    pauses: Callable[..., Pause],
) -> None:
    cat = tmp_path / "catalog"
    write_shards(cat, [4_000] * 4, row_group_rows=1_000)
    out = tmp_path / "out"
    args = ["run", *job_args(cat, out, torchscript_bundle_dir), "--batch-size", "500"]
    args += ["--scheduler", "local", "--workers", "2", "--grace-period-s", "600", "-q"]
    metrics, log = tmp_path / "metrics.prom", tmp_path / "run.log"
    args += ["--metrics-file", str(metrics), "--log-file", str(log)]
    # Both workers held mid-shard (a batch in their staged files): the first signal finds
    # shards in flight, which cannot finish before the second comes.
    writing = pauses("batch-written")
    proc = _start(args, own_group=group, env=pause_env(writing))
    writing.wait(proc, count=2)
    assert _staged_shards(out) == 2
    kids = _descendants(proc)
    assert kids, "the embedded cluster has no worker process"
    _send(proc, sig, group=group)
    # The driver took the first signal (its handler logs it, -q or not) ...
    wait_for_text(log, f"{sig.name} received: no new shards are scheduled", proc)
    # ... and the second comes more than REPEAT_WINDOW_S after it: a repeat within that window
    # is the same request (GNU timeout signals twice). Held, the run cannot end meanwhile.
    time.sleep(REPEAT_WINDOW_S + 0.5)
    assert proc.poll() is None, "the first signal should wait for the shards in flight"
    second = time.monotonic()
    _send(proc, sig, group=group)
    writing.release()  # the workers go on scoring while the driver stops at once
    _, stderr = proc.communicate(timeout=120)
    took = time.monotonic() - second
    assert proc.returncode == code, stderr
    assert took < 60, f"a second signal took {took:.0f}s to stop the run (grace is 600s)"
    _assert_no_orphans(kids)
    assert f"aborted by a second {sig.name}" in stderr
    # Only the driver reacts (workers ignore SIGINT): no worker tracebacks on Ctrl-C.
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert not report_path(out).exists() and not (out / "_SUCCESS").exists()
    assert not (out / "_lock.json").exists()
    assert 'status="interrupted"} 1' in metrics.read_text()
    # Whatever is visible is whole: a staged write never shows a partial file.
    for p in data_files(out):
        assert pq.read_metadata(p).num_rows == 4_000

    again = cli("run", *job_args(cat, out, torchscript_bundle_dir), "--scheduler", "sync", "-q")
    assert again.returncode == 0, again.output
    assert again.report is not None and again.report["rows_out"] == 16_000
    assert temporaries(out) == []


def test_shards_still_running_when_the_grace_period_ends_commit_nothing(
    tmp_path: Path, torchscript_bundle_dir: Path, pauses: Callable[..., Pause]
) -> None:
    cat = tmp_path / "catalog"
    write_shards(cat, [4_000] * 4, row_group_rows=1_000)
    out = tmp_path / "out"
    args = ["run", *job_args(cat, out, torchscript_bundle_dir), "--batch-size", "500"]
    args += ["--scheduler", "local", "--workers", "2", "--grace-period-s", "0", "-q"]
    # Both workers held mid-shard; the driver held once it has given up on them (after its
    # grace period, before its report), so that the abandoned shards try to commit while the
    # run is still there to be fooled, and only then does it end.
    writing, judged = pauses("batch-written"), pauses("judged")
    proc = _start(args, env=pause_env(writing, judged))
    writing.wait(proc, count=2)
    kids = _descendants(proc)
    proc.send_signal(signal.SIGTERM)
    judged.wait(proc)
    writing.release()
    # The abandoned shards finish and try to commit: their staged files go, one way or the
    # other (the deadline is only a safety net).
    deadline = time.monotonic() + 120
    while _staged_shards(out):
        assert time.monotonic() < deadline, "the abandoned shards never finished"
        time.sleep(0.02)
    judged.release()
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr
    _assert_no_orphans(kids)
    rep = report(out)
    assert rep["status"] == "interrupted"
    # Held before their first commit, and the run gave up on them at once: nothing scored.
    assert {s["status"] for s in rep["shards"]} == {"failed"}, rep["shards"]
    assert {s["kind"] for s in rep["shards"]} == {"interrupted"}
    # What readers see is what the report and the manifest say: the shards abandoned in flight
    # never appear, though their workers finished them.
    assert data_files(out) == []
    manifest = out / "_manifest.json"
    recorded = set(json.loads(manifest.read_text())["shards"]) if manifest.exists() else set()
    assert recorded == set()


def test_gnu_timeout_interrupts_with_a_report_not_an_abort(
    tmp_path: Path, torchscript_bundle_dir: Path, pauses: Callable[..., Pause]
) -> None:
    """Cron's usual guard: ``timeout`` sends SIGTERM to its child and then to the child's whole
    process group, so the driver gets two SIGTERMs at once and the embedded workers get one.
    That is one stop request: the run ends interrupted, with its report, not aborted; and no
    worker is killed and restarted to rescore the shards the driver is stopping.

    The timeout fires while both workers are held mid-shard: ``timeout`` acts on SIGALRM, its
    own timer's signal, exactly as when its time is up (coreutils' timeout.c), so the test
    sends it when the run is there instead of guessing how far a run gets in N seconds."""
    cat = tmp_path / "catalog"
    write_shards(cat, [4_000] * 4, row_group_rows=1_000)
    out = tmp_path / "out"
    log = tmp_path / "run.log"
    args = ["run", *job_args(cat, out, torchscript_bundle_dir), "--batch-size", "500"]
    args += ["--scheduler", "local", "--workers", "2", "--grace-period-s", "2", "-q"]
    args += ["--log-file", str(log)]
    writing, stopping = pauses("batch-written"), pauses("stop-raised")
    stopping.release()  # only a mark: the driver has told every worker to start no shard
    proc = subprocess.Popen(
        ["timeout", "--preserve-status", "-s", "TERM", "3600", *cli_argv(*args)],
        env=cli_env(pause_env(writing, stopping)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    writing.wait(proc)
    os.kill(proc.pid, signal.SIGALRM)  # timeout's time is up
    stopping.wait(proc)  # the driver took the SIGTERM and no shard starts from now on
    writing.release()
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 143, stderr
    assert "aborted" not in stderr and "Restarting worker" not in stderr, stderr
    assert "aborted" not in log.read_text()
    rep = report(out)  # checked against the report schema
    assert rep["status"] == "interrupted", rep["failure_reasons"]
    assert not (out / "_SUCCESS").exists() and not (out / "_lock.json").exists()
    scored = {s["rel_path"] for s in rep["shards"] if s["status"] == "scored"}
    assert len(scored) <= 2  # at most the two held in flight; none started after the stop
    assert {str(p.relative_to(out)) for p in data_files(out)} == scored


def _metrics_status(metrics: Path) -> str:
    """The status the metrics file says the last run ended with."""
    (status,) = [
        line.split('status="')[1].split('"')[0]
        for line in metrics.read_text().splitlines()
        if line.startswith("score_catalog_last_run_status{") and line.endswith(" 1.0")
    ]
    return status


# Issue 22, item 9: a stop that finds nothing left in flight still interrupts.


@pytest.mark.parametrize(("sig", "code"), [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_stop_after_the_last_shard_finished_still_interrupts(
    catalog: Path, bundle_dir: Path, tmp_path: Path, sig: str, code: int
) -> None:
    """One Ctrl-C (or a cron timeout's SIGTERM) while the last shard is finishing: nothing is
    left to cancel, but the run was asked to stop, so it does not commit (no _SUCCESS)."""
    out = tmp_path / "out"
    metrics = tmp_path / "m.prom"
    args = ["run", *job_args(catalog, out, bundle_dir), "--scheduler", "sync"]
    args += ["--metrics-file", str(metrics)]
    # The signal arrives right after the third (last) shard was yielded.
    env = {"_SCORE_CATALOG_KILL_AT": "between-shards:3", "_SCORE_CATALOG_KILL_SIGNAL": sig}
    stopped = cli(*args, env=env)
    assert stopped.returncode == code, stopped.output
    rep = stopped.report
    assert rep is not None and rep["status"] == "interrupted"
    assert rep["failure_reasons"][0] == f"interrupted by {sig}"
    assert rep["shards_scored"] == 3 and rep["shards_not_scored"] == 0
    assert not (out / "_SUCCESS").exists()
    assert _metrics_status(metrics) == "interrupted"
    rerun = cli(*args)
    assert rerun.returncode == 0, rerun.output
    assert rerun.report is not None and rerun.report["shards_skipped"] == 3
    assert (out / "_SUCCESS").exists()


def test_a_stop_while_the_report_is_written_interrupts(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    metrics = tmp_path / "m.prom"
    args = ["run", *job_args(catalog, out, bundle_dir), "--scheduler", "sync"]
    env = {"_SCORE_CATALOG_KILL_AT": "report-rename", "_SCORE_CATALOG_KILL_SIGNAL": "SIGINT"}
    r = cli(*args, "--metrics-file", str(metrics), env=env)
    assert r.returncode == 130, r.output
    assert json.loads(report_path(out).read_text())["status"] == "interrupted"
    assert not (out / "_SUCCESS").exists()
    assert _metrics_status(metrics) == "interrupted"


# ---------------------------------------------------------------------------------------------
# A signal while the command starts up (issue 22, item 9): before the run has taken its output.


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file below ``root`` (output, control folder, rejects): size and mtime."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize(
    ("point", "sig", "code"),
    [
        ("launch", "SIGTERM", 143),  # the command line not even imported yet (Click, config)
        ("launch", "SIGINT", 130),
        ("imported", "SIGINT", 130),  # torch and Dask imported, the job's config not read yet
        ("startup", "SIGTERM", 143),  # the job's config read, the run's handler not installed
        ("routed", "SIGTERM", 143),  # the run's handler installed, the run not started
        ("cluster-started", "SIGTERM", 143),  # the embedded cluster starting its workers
        ("model-loaded", "SIGINT", 130),  # the model loaded and dry-run checked in the driver
        ("locked", "SIGTERM", 143),  # the lock taken, the output not claimed yet
    ],
)
def test_a_signal_while_starting_ends_in_one_line_and_leaves_the_last_run_in_place(
    tmp_path: Path, catalog: Path, bundle_dir: Path, point: str, sig: str, code: int
) -> None:
    """Cron's timeout or Ctrl-C at any moment of start-up: the signal's exit code and one line
    on stderr, never the default action (killed without a word) or a traceback; and the output
    as the last run left it: its _SUCCESS and report kept, no lock, nothing of this run."""
    scored = tmp_path / "scored"
    out = scored / "out"
    first = cli("run", *job_args(catalog, out, bundle_dir), "--scheduler", "sync", in_process=True)
    assert first.returncode == 0, first.output
    before = _snapshot(scored)
    assert "out/_SUCCESS" in before

    args = ["run", *job_args(catalog, out, bundle_dir), "--scheduler", "local", "--workers", "1"]
    env = {"_SCORE_CATALOG_KILL_AT": f"{point}:1", "_SCORE_CATALOG_KILL_SIGNAL": sig}
    stopped = cli(*args, "-q", env=env)
    assert stopped.returncode == code, stopped.output
    assert stopped.stderr.splitlines() == [
        f"error: stopped by {sig} while starting; nothing was written"
    ], stopped.stderr
    assert stopped.stdout == ""
    assert _snapshot(scored) == before


@pytest.mark.parametrize(
    ("point", "sig"),
    [  # each place of the start-up (pipeline.core.faults points), in order; both signals
        ("launch", "SIGTERM"),
        ("imported", "SIGINT"),
        ("startup", "SIGTERM"),
        ("routed", "SIGINT"),
        ("cluster-started", "SIGTERM"),
        ("model-loaded", "SIGINT"),
        ("locked", "SIGTERM"),
    ],
)
def test_a_signal_inside_a_callback_while_starting_is_never_lost(
    tmp_path: Path, catalog: Path, bundle_dir: Path, point: str, sig: str
) -> None:
    """The signal lands inside a callback whose exceptions the interpreter drops (as importlib's
    module-lock callback, or torch's C++ callbacks, run Python while torch imports): a handler
    that raised there printed "Exception ignored in ..." with a traceback and lost the signal,
    and the run went on to exit 0 with _SUCCESS (breakit22 M1; in torch's C++ callbacks the
    same raise aborted the process). Recorded instead, it stops the command at the next safe
    point: one line, the signal's exit code, the last run's output untouched."""
    code = 130 if sig == "SIGINT" else 143
    scored = tmp_path / "scored"
    out = scored / "out"
    first = cli("run", *job_args(catalog, out, bundle_dir), "--scheduler", "sync", in_process=True)
    assert first.returncode == 0, first.output
    before = _snapshot(scored)
    args = ["run", *job_args(catalog, out, bundle_dir), "--scheduler", "local", "--workers", "1"]
    env = {
        "_SCORE_CATALOG_KILL_AT": f"{point}:1",
        "_SCORE_CATALOG_KILL_SIGNAL": sig,
        "_SCORE_CATALOG_KILL_FROM": "callback",
    }
    stopped = cli(*args, "-q", "--force", env=env)
    assert stopped.returncode == code, stopped.output
    assert stopped.stderr.splitlines() == [
        f"error: stopped by {sig} while starting; nothing was written"
    ], stopped.stderr
    assert _snapshot(scored) == before


def test_a_signal_inside_a_callback_while_a_backfill_imports_stops_it(
    tmp_path: Path, bundle_dir: Path
) -> None:
    """The same for ``backfill``: no day runs, no summary, one line, exit 143."""
    write_shards(tmp_path / "archive" / "dt=2025-03-01", [600, 400])
    job = tmp_path / "rescore.toml"
    job.write_text(
        f'input = "{tmp_path}/archive/dt={{date}}"\noutput = "{tmp_path}/scored/dt={{date}}"\n'
        f'model = "{bundle_dir}"\nscheduler = "sync"\n'
    )
    env = {
        "_SCORE_CATALOG_KILL_AT": "imported:1",
        "_SCORE_CATALOG_KILL_SIGNAL": "SIGTERM",
        "_SCORE_CATALOG_KILL_FROM": "callback",
    }
    r = cli("backfill", str(job), "--from", "2025-03-01", "--to", "2025-03-01", "-q", env=env)
    assert r.returncode == 143, r.output
    assert r.stderr.splitlines() == [
        "error: stopped by SIGTERM while starting; nothing was written"
    ], r.stderr
    assert not (tmp_path / "scored").exists() and not (tmp_path / "_score_catalog").exists()


def test_a_signal_before_a_backfill_day_starts_stops_it_even_if_every_day_is_done(
    tmp_path: Path, bundle_dir: Path
) -> None:
    """Every day finished earlier: a SIGTERM once the backfill routes signals used to be
    recorded and never acted on (no day ran a run to stop), exit 0. Now no day starts."""
    days = ["2025-03-01", "2025-03-02"]
    for k, day in enumerate(days):
        write_shards(tmp_path / "archive" / f"dt={day}", [600, 400], start=10_000 * k, seed=k)
    job = tmp_path / "rescore.toml"
    job.write_text(
        f'input = "{tmp_path}/archive/dt={{date}}"\noutput = "{tmp_path}/scored/dt={{date}}"\n'
        f'model = "{bundle_dir}"\nscheduler = "sync"\n'
    )
    args = ["backfill", str(job), "--from", days[0], "--to", days[1], "-q"]
    assert cli(*args).returncode == 0
    env = {"_SCORE_CATALOG_KILL_AT": "routed:1", "_SCORE_CATALOG_KILL_SIGNAL": "SIGTERM"}
    r = cli(*args, env=env)
    assert r.returncode == 143, r.output
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    backfills = tmp_path / "_score_catalog" / "scored" / "_backfills" / "rescore"
    summary = json.loads((backfills / f"{days[0]}_{days[1]}.json").read_text())
    assert summary["status"] == "interrupted" and summary["not_run"] == [days[1]]
    assert summary["partitions"][0]["status"] == "interrupted"


def _catches_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has a handler for SIGTERM (``SigCgt`` in /proc/PID/status): the
    console script's first line (pipeline.cli.launch) has run. Before it, the interpreter's own
    start takes the default action, a documented limit this test does not measure."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:  # already gone
        return True
    (mask,) = [ln.split()[1] for ln in status.splitlines() if ln.startswith("SigCgt:")]
    return bool(int(mask, 16) >> (signal.SIGTERM - 1) & 1)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/PID/status")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_at_random_moments_of_a_run_never_abort_trace_or_get_lost(
    tmp_path: Path, catalog: Path, bundle_dir: Path, sig: signal.Signals
) -> None:
    """breakit22 M1's loop, bounded: a --force run on the default scheduler, signalled at a
    random moment from its first line to 3 s in (start-up, scoring or after). Whatever the
    moment: exit 0 or the signal's code, at most one line on stderr under -q, no traceback or
    abort, and never an exit 0 from a run that had the signal before it finished. The outcome
    does not depend on when the signal lands, only which of the allowed endings it gets."""
    import random

    rng = random.Random(int(sig))
    out = tmp_path / "out"
    args = [*job_args(catalog, out, bundle_dir), "-q"]
    assert cli("run", *args, "--scheduler", "sync").returncode == 0
    code = 128 + int(sig)
    for attempt in range(12):
        proc = subprocess.Popen(
            [*cli_argv("run", *args, "--force")],
            env=cli_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        while not _catches_sigterm(proc.pid):
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 3.0))
        sent = proc.poll() is None
        if sent:
            proc.send_signal(sig)
        # Read after the send: the signal was pending before this moment, so a run that
        # finished later and exited 0 lost it (read before, a test held up between the two
        # on a busy machine blamed the run for its own delay).
        sent_at = time.time()
        _, err = proc.communicate(timeout=300)
        what = f"try {attempt}: exit {proc.returncode}, stderr {err!r}"
        assert proc.returncode in (0, code), what
        assert "Traceback" not in err and "Exception ignored" not in err, what
        assert len(err.strip().splitlines()) <= 1, what
        if proc.returncode == 0 and sent:
            rep = report(out)
            finished = dt.datetime.fromisoformat(rep["finished_at"]).timestamp()
            assert sent_at > finished - 0.05, f"{what}: the signal was lost"


def test_a_signal_after_the_run_ended_leaves_its_outcome(
    tmp_path: Path, catalog: Path, bundle_dir: Path
) -> None:
    """The report is written and says succeeded: a SIGTERM while the summary is printed is
    logged and changes neither the exit code nor the summary (it used to end "stopped while
    starting; nothing was written", exit 143, after a succeeded report)."""
    out = tmp_path / "out"
    env = {"_SCORE_CATALOG_KILL_AT": "run-ended:1", "_SCORE_CATALOG_KILL_SIGNAL": "SIGTERM"}
    done = cli("run", *job_args(catalog, out, bundle_dir), "--scheduler", "sync", env=env)
    assert done.returncode == 0, done.output
    assert done.report is not None and done.report["status"] == "succeeded"
    assert (out / "_SUCCESS").exists()
    assert "SIGTERM received after the run ended: its outcome stands (succeeded)" in done.stderr
    assert "SUCCEEDED" in done.stdout and "stopped by" not in done.output


def test_a_signal_before_a_backfill_day_takes_its_output_stops_the_backfill(
    tmp_path: Path, bundle_dir: Path
) -> None:
    """SIGTERM while the second day's run loads its model: that day is interrupted with nothing
    written, the third is not run, the summary says so, exit 143."""
    days = ["2025-03-01", "2025-03-02", "2025-03-03"]
    for k, day in enumerate(days):
        write_shards(tmp_path / "archive" / f"dt={day}", [600, 400], start=10_000 * k, seed=k)
    job = tmp_path / "rescore.toml"
    job.write_text(
        f'input = "{tmp_path}/archive/dt={{date}}"\noutput = "{tmp_path}/scored/dt={{date}}"\n'
        f'model = "{bundle_dir}"\nscheduler = "sync"\n[monitoring]\ndrift = false\n'
    )
    env = {"_SCORE_CATALOG_KILL_AT": "model-loaded:2", "_SCORE_CATALOG_KILL_SIGNAL": "SIGTERM"}
    r = cli("backfill", str(job), "--from", days[0], "--to", days[-1], env=env)
    assert r.returncode == 143, r.output
    summary = json.loads(
        (
            tmp_path
            / "_score_catalog"
            / "scored"
            / "_backfills"
            / "rescore"
            / f"{days[0]}_{days[-1]}.json"
        ).read_text()
    )
    parts = {p["date"]: p for p in summary["partitions"]}
    assert parts[days[0]]["status"] == "succeeded"
    assert parts[days[1]]["status"] == "interrupted"
    assert parts[days[1]]["message"] == "stopped by SIGTERM while starting; nothing was written"
    assert summary["not_run"] == [days[2]] and summary["status"] == "interrupted"
    assert not (tmp_path / "scored" / f"dt={days[1]}").exists()
    assert "Traceback" not in r.stderr, r.stderr
