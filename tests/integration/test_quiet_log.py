"""Issue 13: a quiet, parseable log from the real CLI on the embedded Dask cluster.

Under ``--log-format json`` every stderr line is a JSON object carrying the run's ``run_id``
(worker processes' lines included), and neither a successful run nor Ctrl-C (SIGINT to the
CLI's whole process group, as a terminal sends it) leaves a traceback. The embedded cluster
listens on no fixed port: a program holding 8787 (Dask's dashboard port) changes nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO, write_shards
from tests.integration.helpers import (
    Pause,
    cli_argv,
    cli_env,
    job_args,
    pause_env,
    report,
    temporaries,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@contextlib.contextmanager
def _hold_port(port: int) -> Iterator[None]:
    """Listen on 127.0.0.1:``port`` while the block runs (if another program already does,
    that is the same situation)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        with contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            s.listen()
        yield
    finally:
        s.close()


def _listening(pid: int) -> set[tuple[str, int]]:
    """Addresses the process ``pid`` and its children listen on now."""
    found: set[tuple[str, int]] = set()
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                for c in p.net_connections(kind="inet"):
                    if c.status == psutil.CONN_LISTEN:
                        found.add((c.laddr.ip, c.laddr.port))
    return found


def _json_lines(stderr: str) -> list[dict[str, Any]]:
    lines = stderr.splitlines()
    assert lines, "no log lines at all"
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pytest.fail(f"a stderr line is not JSON: {line!r}\n--- stderr:\n{stderr}")
    return out


def _start(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        cli_argv(*args),
        env=cli_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a group of its own, as a terminal's foreground job
    )


def test_a_successful_run_logs_json_lines_with_run_id_and_no_traceback(
    tmp_path: Path, bundle_dir: Path, pauses: Callable[..., Pause]
) -> None:
    cat = tmp_path / "catalog"
    write_shards(cat, [5_000] * 6, row_group_rows=1_000)
    out = tmp_path / "out"
    args = ["run", *job_args(cat, out, bundle_dir), "--scheduler", "local", "--workers", "2"]
    args += ["--batch-size", "1000", "--log-format", "json"]
    # The driver is held after its first shard, its cluster up and working: what the cluster
    # listens on is looked at then for sure, and all along the run besides.
    first = pauses("between-shards")
    listening: set[tuple[str, int]] = set()
    with _hold_port(8787):
        proc = _start(args, pause_env(first))
        while proc.poll() is None and not first.pids():
            listening |= _listening(proc.pid)
            time.sleep(0.05)
        first.wait(proc)
        held = _listening(proc.pid)
        first.release()
        while proc.poll() is None:
            listening |= _listening(proc.pid)
            time.sleep(0.2)
        stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stdout + stderr and "8787" not in stderr, stderr
    run_id = report(out)["run_id"]
    lines = _json_lines(stderr)
    assert all(rec.get("run_id") == run_id for rec in lines), [
        rec for rec in lines if rec.get("run_id") != run_id
    ]
    (summary,) = _json_lines(stdout)
    assert summary["event"] == "summary" and summary["run_id"] == run_id
    # The embedded cluster listened (its scheduler and workers), on loopback, not on 8787.
    assert held, "nothing of the run listened while its cluster was working"
    listening |= held
    assert {ip for ip, _ in listening} == {"127.0.0.1"}, listening
    assert 8787 not in {port for _, port in listening}


def test_ctrl_c_leaves_json_lines_and_no_traceback(
    tmp_path: Path, bundle_dir: Path, pauses: Callable[..., Pause]
) -> None:
    cat = tmp_path / "catalog"
    write_shards(cat, [3_000] * 16, row_group_rows=1_000)
    out = tmp_path / "out"
    args = ["run", *job_args(cat, out, bundle_dir), "--scheduler", "local", "--workers", "2"]
    args += ["--batch-size", "1000", "--task-rows", "1", "--log-format", "json"]
    # Ctrl-C while the workers are held writing their first shards; they go on once the driver
    # has told them to start no other (only a mark: released in advance).
    writing, stopping = pauses("batch-written"), pauses("stop-raised")
    stopping.release()
    proc = _start(args, pause_env(writing, stopping))
    writing.wait(proc)
    assert any(p.name.startswith(".part-") for p in temporaries(out))
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
    stopping.wait(proc)
    writing.release()
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stdout + stderr and "KeyboardInterrupt" not in stderr, stderr
    rep = report(out)
    assert rep["status"] == "interrupted"
    lines = _json_lines(stderr)
    assert all(rec.get("run_id") == rep["run_id"] for rec in lines), stderr
    assert any("SIGINT received" in rec["message"] for rec in lines)
    # Shards left unscored are counted by the summary, not logged one error line each.
    assert not any(rec["level"] == "error" for rec in lines), stderr
    (summary,) = _json_lines(stdout)
    assert summary["status"] == "interrupted" and summary["exit_code"] == 130


def _log_in_worker() -> int:
    """In a worker: one line from the pipeline, and one Dask error with a traceback."""
    import logging

    logging.getLogger("pipeline.worker.shard").warning("hello from a worker")
    try:
        raise OSError("Timed out during handshake")
    except OSError:
        logging.getLogger("distributed.worker").exception(
            "Failed to communicate with scheduler during heartbeat."
        )
    return os.getpid()


def test_worker_lines_are_json_with_the_run_id_and_tracebacks_fold(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """The embedded cluster's workers are forked from the driver: they write to its stderr
    with its handler, so their lines are JSON and carry the run id bound before the fork."""
    from pipeline.cli import logs
    from pipeline.core import runcontext
    from pipeline.driver.cluster import DaskSession, Plan

    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    logs.setup_logging("json", 0)
    runcontext.bind_run_id("20261201T000000Z-feed01")
    session = DaskSession(Plan("local", 1, 1, 1, 1), None)
    try:
        pids = session.client().run(_log_in_worker)
    finally:
        session.close()
        runcontext.bind_run_id(None)
        logging.captureWarnings(False)
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    assert os.getpid() not in pids.values()  # it did run in another process
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    lines = _json_lines(err)
    assert all(rec["run_id"] == "20261201T000000Z-feed01" for rec in lines), err
    assert [rec["logger"] for rec in lines if rec["message"] == "hello from a worker"] == [
        "pipeline.worker.shard"
    ]
    (beat,) = [rec for rec in lines if rec["logger"] == "distributed.worker"]
    assert beat["message"] == (
        "Failed to communicate with scheduler during heartbeat. "
        "(OSError: Timed out during handshake)"
    )
    assert "exc" not in beat


@pytest.mark.parametrize(("sig", "code"), [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_while_starting_is_one_json_line_and_a_summary(
    tmp_path: Path, bundle_dir: Path, sig: str, code: int
) -> None:
    """Ctrl-C or a cron timeout in the first second, before the run routes signals (the
    signal is sent from the ``startup`` crash point): one JSON error line on stderr, one
    summary line on stdout, the signal's exit code, nothing written."""
    write_shards(tmp_path / "in", [500])
    out = tmp_path / "out"
    env = {"_SCORE_CATALOG_KILL_AT": "startup:1", "_SCORE_CATALOG_KILL_SIGNAL": sig}
    done = subprocess.run(
        cli_argv("run", *job_args(tmp_path / "in", out, bundle_dir), "--log-format", "json"),
        env=cli_env(env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == code, done.stderr
    lines = _json_lines(done.stderr)
    assert lines[-1]["event"] == "error" and lines[-1]["exit_code"] == code
    assert lines[-1]["message"] == f"stopped by {sig} while starting; nothing was written"
    assert all(line.get("run_id") for line in lines)
    (summary,) = [json.loads(ln) for ln in done.stdout.splitlines()]
    assert summary["event"] == "summary" and summary["status"] == "interrupted"
    assert summary["exit_code"] == code and summary["run_id"] == lines[-1]["run_id"]
    assert not out.exists()


def test_usage_and_config_errors_are_json_with_a_summary_line(tmp_path: Path) -> None:
    for args, code in (
        (["run", "--bogus-flag", "--log-format", "json"], 2),
        (["run", "--input", str(tmp_path), "--log-format=json"], 2),  # no output, no model
    ):
        done = subprocess.run(
            cli_argv(*args), env=cli_env(), capture_output=True, text=True, timeout=120
        )
        assert done.returncode == code, done.stderr
        (err,) = _json_lines(done.stderr)
        assert err["event"] == "error" and err["exit_code"] == code
        summaries = [json.loads(ln) for ln in done.stdout.splitlines()]
        assert [s["status"] for s in summaries] == ["failed"]


# ---------------------------------------------------------------------------------------------
# The README's cron line, run as cron runs it (issue 22, item 9)


def _readme_cron_command() -> str:
    """The command of the README's crontab line (after its five time fields)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    block = text.split("## Running from cron", 1)[1].split("```cron", 1)[1].split("```", 1)[0]
    (line,) = [ln for ln in block.splitlines() if ln.strip() and not ln.startswith("#")]
    return line.split(None, 5)[5]


def test_the_readme_cron_line_mails_only_errors_and_logs_the_whole_night(
    tmp_path: Path, bundle_dir: Path
) -> None:
    """The line used to run `make score-catalog` (reinstalling dev tools and rebuilding the demo
    catalog at 02:15) with `>> log 2>&1`, so that `-q` could never decide what cron mails. As
    written now, with its paths moved under tmp_path: a clean night prints nothing (no mail)
    and logs everything; a failed night prints one error line and logs the summary too."""
    command = _readme_cron_command()
    assert "make" not in command.split() and "score-catalog run jobs/" in command, command
    # cron's own rule: an unescaped % ends the command (the rest is its stdin); \% is a %.
    assert "%" not in command.replace("\\%", ""), command
    command = command.replace("\\%", "%")
    home, logs, textfile = tmp_path / "srv", tmp_path / "log", tmp_path / "textfile"
    for old, new in (
        ("/srv/score-catalog", home),
        ("/var/log/score-catalog", logs),
        ("/var/lib/node_exporter/textfile", textfile),
    ):
        assert old in command, command
        command = command.replace(old, str(new))
    logs.mkdir()
    textfile.mkdir()
    tool = home / ".venv" / "bin" / "score-catalog"  # the installed console script, stood in for
    tool.parent.mkdir(parents=True)
    tool.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m pipeline "$@"\n')
    tool.chmod(0o755)
    write_shards(home / "data" / "catalog", [1_500, 1_000], row_group_rows=500)
    (home / "jobs").mkdir()
    (home / "jobs" / "score_catalog.toml").write_text(
        'input = "data/catalog"\noutput = "data/scored/run_date={date}"\n'
        f'model = "{bundle_dir}"\nscheduler = "sync"\n[monitoring]\ndrift = false\n'
    )

    def night() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["/bin/sh", "-c", command], env=cli_env(), capture_output=True, text=True, timeout=300
        )

    clean = night()
    assert clean.returncode == 0, clean.stderr
    assert clean.stdout == "" and clean.stderr == ""  # nothing to mail
    (log,) = logs.iterdir()
    text = log.read_text()
    assert "INFO scored part-00000.parquet: 1,500 rows" in text
    assert ": SUCCEEDED\n" in text and "  report    " in text  # the summary, as printed
    assert 'status="succeeded"} 1' in (textfile / "score_catalog.prom").read_text()

    shard = home / "data" / "catalog" / "part-00001.parquet"
    t = pq.read_table(shard)
    i = t.schema.get_field_index("f2")
    nulls = pa.array([None] * 100 + t.column("f2").to_pylist()[100:], pa.float32())
    pq.write_table(t.set_column(i, "f2", nulls), shard, row_group_size=500)  # 4% rejected
    bad = night()
    assert bad.returncode == 1, bad.stderr
    assert bad.stdout == ""
    (mailed,) = bad.stderr.splitlines()  # the mail: one line, what went wrong and where
    assert mailed.startswith("error: run ") and "rejected fraction" in mailed
    assert "(report: " in mailed
    text = log.read_text()  # appended: both nights, the failed one's summary and its line
    assert text.count(": SUCCEEDED\n") == 1 and ": FAILED\n" in text
    assert text.endswith(mailed + "\n")


def test_a_json_log_file_is_json_to_its_last_line_and_a_bad_path_is_a_usage_error(
    tmp_path: Path, bundle_dir: Path
) -> None:
    write_shards(tmp_path / "in", [800, 700], row_group_rows=300)
    args = ["run", *job_args(tmp_path / "in", tmp_path / "out", bundle_dir), "--scheduler", "sync"]
    log = tmp_path / "night.log"
    done = subprocess.run(
        cli_argv(*args, "-q", "--log-format", "json", "--log-file", str(log)),
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == ""
    records = [json.loads(line) for line in log.read_text().splitlines()]
    run_id = report(tmp_path / "out")["run_id"]
    assert [r["shard"] for r in records if r["event"] == "shard_scored"] == [
        "part-00000.parquet",
        "part-00001.parquet",
    ]
    assert records[-1]["event"] == "summary" and records[-1]["status"] == "succeeded"
    assert all(r["run_id"] == run_id for r in records)

    nowhere = tmp_path / "no-such-folder" / "night.log"
    bad = subprocess.run(
        cli_argv(*args, "--log-file", str(nowhere)),
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2, bad.stderr
    assert "--log-file" in bad.stderr and str(nowhere) in bad.stderr
    assert "No such file or directory" in bad.stderr
    assert not (tmp_path / "out2").exists()
