"""pipeline.cli.logs: text/JSON log lines on stderr, shard lines, the progress bar, the summary."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import select
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pipeline.cli import logs
from pipeline.cli import progress as bars
from pipeline.core import runcontext
from pipeline.worker.shard import ShardResult

TIME_RE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
LIB_LOGGERS = ("distributed", "distributed.worker", "distributed.client", "bokeh", "tornado")


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """Put the root and library loggers and warnings capture back afterwards."""
    root = logging.getLogger()
    saved_root = (list(root.handlers), root.level)
    saved_libs = {
        name: (list(lg.handlers), lg.level, lg.propagate)
        for name in LIB_LOGGERS
        for lg in [logging.getLogger(name)]
    }
    yield
    logging.captureWarnings(False)
    for h in root.handlers:
        if h not in saved_root[0]:
            h.close()
    root.handlers[:] = saved_root[0]
    root.setLevel(saved_root[1])
    for name, (handlers, level, propagate) in saved_libs.items():
        lg = logging.getLogger(name)
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate = propagate


def scored(rel: str = "part-0.parquet", **kw: Any) -> ShardResult:
    fields: dict[str, Any] = dict(
        rows_in=25_000, rows_out=24_990, rows_rejected=10, duration_s=1.25, rows_per_s=19_992.0
    )
    fields.update(kw)
    return ShardResult(rel, f"/in/{rel}", "scored", **fields)


def json_lines(text: str) -> list[dict[str, Any]]:
    lines = text.splitlines()
    assert all(line.startswith("{") for line in lines), text
    return [json.loads(line) for line in lines]


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


# --------------------------------------------------------------------------------------------
# JSON lines


def test_json_shard_scored_line_has_documented_fields(capsys: pytest.CaptureFixture[str]) -> None:
    logs.setup_logging("json", 0)
    bars.log_shard(scored())
    out, err = capsys.readouterr()
    assert out == ""
    [rec] = json_lines(err)
    assert TIME_RE.match(rec["time"]), rec["time"]
    assert rec["level"] == "info"
    assert rec["event"] == "shard_scored"
    assert rec["logger"] == "pipeline"
    assert rec["message"] == (
        "scored part-0.parquet: 24,990 rows, 10 rejected, 1.25s (19,992 rows/s)"
    )
    assert rec["shard"] == "part-0.parquet"
    assert rec["rows"] == 24_990
    assert rec["rows_in"] == 25_000
    assert rec["rows_rejected"] == 10
    assert rec["rows_per_s"] == 19_992.0
    assert rec["duration_s"] == 1.25
    assert rec["status"] == "scored"


def test_json_failed_and_skipped_shards(capsys: pytest.CaptureFixture[str]) -> None:
    failed = ShardResult(
        "bad.parquet", "/in/bad.parquet", "failed", kind="schema", message="no column f3"
    )
    skipped = ShardResult("done.parquet", "/in/done.parquet", "skipped", rows_in=5, rows_out=5)
    logs.setup_logging("json", 0)
    bars.log_shard(failed)
    bars.log_shard(skipped)  # DEBUG: not at verbosity 0
    [rec] = json_lines(capsys.readouterr().err)
    assert rec["level"] == "error"
    assert rec["event"] == "shard_failed"
    assert rec["kind"] == "schema"
    assert rec["shard"] == "bad.parquet"
    assert rec["status"] == "failed"
    assert "no column f3" in rec["message"]

    logs.setup_logging("json", 1)
    bars.log_shard(skipped)
    [rec] = json_lines(capsys.readouterr().err)
    assert (rec["level"], rec["event"], rec["shard"]) == ("debug", "shard_skipped", "done.parquet")


def test_json_event_default_extras_and_non_finite_numbers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    logs.setup_logging("json", 0)
    log = logging.getLogger("pipeline.test")
    log.warning("plain %s", "message")
    log.info(
        "run done",
        extra={
            "event": "run_finished",
            "run_id": "r1",
            "output": "/out",
            "exit_code": 0,
            "rows_per_s": float("nan"),
            "not_a_field": "dropped",
        },
    )
    plain, done = json_lines(capsys.readouterr().err)
    assert (plain["event"], plain["level"], plain["message"]) == ("log", "warning", "plain message")
    assert plain["logger"] == "pipeline.test"
    assert done["event"] == "run_finished"
    assert (done["run_id"], done["output"], done["exit_code"]) == ("r1", "/out", 0)
    assert done["rows_per_s"] is None  # NaN is not JSON
    assert "not_a_field" not in done


def test_exception_is_one_json_line_with_exc(capsys: pytest.CaptureFixture[str]) -> None:
    logs.setup_logging("json", 0)
    try:
        raise ValueError("bad\nvalue \x1b[31mred\r")
    except ValueError:
        logging.getLogger("pipeline").exception("it broke:\n\x1b[1mhere")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("\n")
    assert "\x1b" not in err and "\r" not in err
    assert all(c == "\n" or 32 <= ord(c) < 127 for c in err)
    [rec] = json_lines(err)
    assert rec["level"] == "error"
    assert rec["message"] == "it broke:\n\x1b[1mhere"
    assert rec["exc"].startswith("Traceback (most recent call last):")
    assert "ValueError: bad\nvalue \x1b[31mred\r" in rec["exc"]


def test_warning_becomes_a_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    logs.setup_logging("json", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("pandas says hello", FutureWarning, stacklevel=1)
    [rec] = json_lines(capsys.readouterr().err)
    assert rec["event"] == "warning"
    assert rec["level"] == "warning"
    assert rec["logger"] == "py.warnings"
    assert "FutureWarning: pandas says hello" in rec["message"]


def test_quiet_keeps_errors_only(capsys: pytest.CaptureFixture[str]) -> None:
    for fmt in ("json", "text"):
        logs.setup_logging(fmt, -1)
        assert logging.getLogger().level == logging.ERROR
        bars.log_shard(scored())
        logging.getLogger("pipeline").warning("a warning")
        logging.getLogger("distributed.worker").info("dask chatter")  # own level: INFO
        logging.getLogger("pipeline").error("an error")
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert "an error" in err


def test_setup_is_idempotent(capsys: pytest.CaptureFixture[str]) -> None:
    logs.setup_logging("text", 0)
    logs.setup_logging("json", 0)
    logs.setup_logging("json", 0)
    assert len(logging.getLogger().handlers) == 1
    logging.getLogger("pipeline").info("once")
    assert len(json_lines(capsys.readouterr().err)) == 1
    logs.setup_logging("text", 0)
    assert len(logging.getLogger().handlers) == 1
    logging.getLogger("pipeline").info("once in text")
    err = capsys.readouterr().err
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO once in text\n", err), err


def test_dask_stderr_handlers_are_repointed_at_json(capsys: pytest.CaptureFixture[str]) -> None:
    from distributed.utils import silence_logging_cmgr

    # What `import distributed` does when the root logger has no handler yet.
    dask_logger = logging.getLogger("distributed")
    plain = logging.StreamHandler(sys.stderr)
    plain.setFormatter(logging.Formatter("%(asctime)s - %(name)s - %(levelname)s - %(message)s"))
    dask_logger.handlers[:] = [plain]
    dask_logger.propagate = False
    dask_logger.setLevel(logging.INFO)

    logs.setup_logging("json", 0)
    [handler] = dask_logger.handlers
    assert handler is not plain
    assert handler not in logging.getLogger().handlers  # silence_logs must not reach ours
    logging.getLogger("distributed.worker").info("worker started")
    # LocalCluster(silence_logs=ERROR) lowers the distributed handlers only.
    with silence_logging_cmgr(logging.ERROR):
        logging.getLogger("distributed.worker").info("silenced")
        bars.log_shard(scored())
    dask_rec, shard_rec = json_lines(capsys.readouterr().err)
    assert dask_rec["logger"] == "distributed.worker"
    assert dask_rec["message"] == "worker started"
    assert dask_rec["event"] == "log"
    assert shard_rec["event"] == "shard_scored"

    # Text mode gives Dask its own format back, still through our (bar-aware) handler.
    logs.setup_logging("text", 0)
    logging.getLogger("distributed.worker").info("in text")
    assert " - distributed.worker - INFO - in text" in capsys.readouterr().err


def test_dask_imported_after_setup_propagates_to_our_handler(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import dask
    from distributed.config import initialize_logging

    for name in LIB_LOGGERS:
        logging.getLogger(name).handlers[:] = []
    logs.setup_logging("json", 0)
    initialize_logging(dask.config.config)  # what `import distributed` runs
    assert not logging.getLogger("distributed").handlers
    logging.getLogger("distributed.scheduler").warning("late")
    [rec] = json_lines(capsys.readouterr().err)
    assert (rec["logger"], rec["message"]) == ("distributed.scheduler", "late")


def test_unknown_format_is_rejected() -> None:
    with pytest.raises(ValueError, match="log format"):
        logs.setup_logging("xml", 0)


# --------------------------------------------------------------------------------------------
# Progress


def test_progress_enabled_only_for_text_not_quiet_tty() -> None:
    tty, pipe = FakeTTY(), io.StringIO()
    assert bars.progress_enabled("text", 0, tty)
    assert bars.progress_enabled("text", 2, tty)
    assert not bars.progress_enabled("text", -1, tty)
    assert not bars.progress_enabled("json", 0, tty)
    assert not bars.progress_enabled("text", 0, pipe)
    assert not bars.progress_enabled("text", 0, object())


def test_progress_disabled_writes_nothing() -> None:
    stream = io.StringIO()
    terminal = logs.Terminal(stream)
    with bars.Progress(100, 2, enabled=False, terminal=terminal) as p:
        p.update(scored(rows_in=60))
        p.update(SimpleNamespace(rows_in=None))
        assert terminal.bar is None
    assert stream.getvalue() == ""
    assert terminal.bar is None


def test_non_tty_output_has_no_escape_codes(capsys: pytest.CaptureFixture[str]) -> None:
    for fmt in ("text", "json"):
        logs.setup_logging(fmt, 0)
        enabled = bars.progress_enabled(fmt, 0, sys.stderr)
        assert not enabled
        with bars.Progress(50_000, 2, enabled=enabled) as p:
            for r in (scored("a.parquet"), scored("b.parquet")):
                bars.log_shard(r)
                p.update(r)
        logs.emit_summary({"run_id": "r"}, fmt, "summary table")
        logs.emit_error("boom", 3, fmt)
        out, err = capsys.readouterr()
        assert err.count("scored a.parquet") == 1
        for text in (out, err):
            assert "\x1b" not in text and "\r" not in text


def test_progress_counts_rows_and_shards() -> None:
    stream = FakeTTY()
    terminal = logs.Terminal(stream)
    with bars.Progress(100_000, 4, enabled=True, terminal=terminal) as p:
        assert terminal.bar is p
        p.update(scored(rows_in=25_000))
        p.update(ShardResult("f.parquet", "/in/f.parquet", "failed", kind="unreadable"))
        assert (p.rows_done, p.shards_done) == (25_000, 2)
    assert terminal.bar is None
    text = stream.getvalue()
    assert "25,000/100,000 rows" in text
    assert "2/4 shards" in text
    assert "rows/s" in text
    assert text.endswith("\n")


def test_log_lines_go_above_the_bar_and_scored_lines_wait_for_verbose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    terminal = logs.setup_logging("text", 0)
    failed = ShardResult("bad.parquet", "/in/bad.parquet", "failed", kind="schema", message="x")
    with bars.Progress(50_000, 2, enabled=True, terminal=terminal) as p:
        bars.log_shard(scored("a.parquet"))  # the bar shows it; no line at verbosity 0
        p.update(scored("a.parquet"))
        bars.log_shard(failed)
        p.update(failed)
    text = tty.getvalue()
    assert "scored a.parquet" not in text
    # The bar's line is cleared, the log line written, and the bar drawn again below it.
    before, sep, after = text.partition("\r\x1b[K")
    assert sep and "scoring" in before
    line, _, rest = after.partition("\n")
    assert re.search(r" ERROR failed bad\.parquet: \[schema\] x$", line), line
    assert rest.startswith("\rscoring")

    terminal = logs.setup_logging("text", 1)
    tty.truncate(0)
    tty.seek(0)
    with bars.Progress(50_000, 2, enabled=True, terminal=terminal):
        bars.log_shard(scored("a.parquet"))
    assert "INFO scored a.parquet" in tty.getvalue()


PTY_SCRIPT = textwrap.dedent(
    """
    import sys, time, types

    sys.path.insert(0, sys.argv[1])
    from pipeline.cli import progress as bars

    assert "torch" not in sys.modules  # the bar imports nothing heavy
    stream = sys.stderr
    assert bars.progress_enabled("text", 0, stream), "stderr is not a TTY"
    shard = types.SimpleNamespace(rows_in=1000, status="scored")
    with bars.Progress(4000, 4, enabled=True, stream=stream) as p:
        p.update(shard)
        time.sleep(1.2)  # click estimates the ETA once a second has passed
        p.update(shard)
        p.update(shard)
    print("PTY-DONE", file=stream, flush=True)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs a Linux pty")
def test_progress_bar_draws_on_a_real_terminal(tmp_path: Path) -> None:
    import pty

    script = tmp_path / "bar.py"
    script.write_text(PTY_SCRIPT)
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(Path(__file__).resolve().parents[2])],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=slave,
            close_fds=True,
        )
        os.close(slave)
        slave = -1
        chunks: list[bytes] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 4096)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
                if b"PTY-DONE" in b"".join(chunks):
                    break
            elif proc.poll() is not None:
                break
        stdout, _ = proc.communicate(timeout=30)
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)
    text = b"".join(chunks).decode("utf-8", "replace")
    assert proc.returncode == 0, (text, stdout)
    assert "PTY-DONE" in text
    assert "\r" in text  # redrawn in place
    assert "1,000/4,000 rows" in text
    assert "3,000/4,000 rows  3/4 shards" in text
    assert "rows/s" in text
    assert re.search(r"\d\d:\d\d:\d\d", text), text  # the ETA


# --------------------------------------------------------------------------------------------
# Summary and fatal errors

REPORT = {
    "run_id": "20261129T221510Z-ab12",
    "job": "nightly",
    "status": "succeeded",
    "rows_in": 200_000,
    "rows_out": 199_990,
    "rows_rejected": 10,
    "shards_total": 8,
    "shards_scored": 7,
    "shards_skipped": 1,
    "shards_failed": 0,
    "rows_per_s": 51_234.5,
    "duration_s": 3.9,
    "output": "/out/2026-11-29",
    "failure_reasons": [],
    "warnings": ["took over a stale lock: pid 4 gone"],
    "shards": [{"rel_path": "part-0.parquet"}],
    "model": {"name": "m"},
}


def test_emit_summary_json(capsys: pytest.CaptureFixture[str]) -> None:
    logs.emit_summary({**REPORT, "exit_code": 0}, "json", "ignored table")
    out, err = capsys.readouterr()
    assert err == ""
    [rec] = json_lines(out)
    assert TIME_RE.match(rec["time"])
    assert (rec["level"], rec["event"]) == ("info", "summary")
    assert rec["exit_code"] == 0
    for key in logs.SUMMARY_FIELDS:
        if key != "exit_code":
            assert rec[key] == REPORT[key], key
    assert "shards" not in rec and "model" not in rec


def test_emit_summary_text(capsys: pytest.CaptureFixture[str]) -> None:
    logs.emit_summary(REPORT, "text", "score-catalog run x: SUCCEEDED\n  job  nightly")
    assert capsys.readouterr() == ("score-catalog run x: SUCCEEDED\n  job  nightly\n", "")


def test_emit_error(capsys: pytest.CaptureFixture[str]) -> None:
    logs.emit_error("input s3://b/x: no such bucket", 4, "text")
    assert capsys.readouterr() == ("", "error: input s3://b/x: no such bucket\n")
    logs.emit_error("bad\nconfig", 2, "json")
    out, err = capsys.readouterr()
    assert out == ""
    [rec] = json_lines(err)
    assert TIME_RE.match(rec["time"])
    assert rec == {**rec, "level": "error", "event": "error", "message": "bad\nconfig"}
    assert rec["exit_code"] == 2


# --------------------------------------------------------------------------------------------
# No module state: each terminal has its own bar; Dask's levels through logging config


def test_two_terminals_do_not_share_a_bar() -> None:
    tty_a, tty_b = FakeTTY(), FakeTTY()
    term_a, term_b = logs.Terminal(tty_a), logs.Terminal(tty_b)
    handler_b = logs.TerminalHandler(term_b)
    handler_b.setFormatter(logging.Formatter("%(message)s"))
    record = logging.LogRecord("pipeline", logging.INFO, __file__, 1, "line on b", None, None)
    with bars.Progress(10, 1, enabled=True, terminal=term_a):
        assert term_a.bar is not None and term_b.bar is None
        handler_b.emit(record)
    # b has no bar: its line is written as is, with no clearing of a's bar.
    assert tty_b.getvalue() == "line on b\n"
    assert "\x1b[K" not in tty_a.getvalue()


def test_configure_dask_logging_sets_levels_only() -> None:
    dask_logger = logging.getLogger("distributed")
    dask_logger.setLevel(logging.INFO)
    marker = logging.NullHandler()
    dask_logger.addHandler(marker)
    runcontext.configure_dask_logging(debug=False)
    assert dask_logger.level == logging.WARNING
    assert marker in dask_logger.handlers  # incremental: handlers stay
    dask_logger.setLevel(logging.INFO)
    runcontext.configure_dask_logging(debug=True)
    assert dask_logger.level == logging.INFO  # debugging: Dask's own INFO stays


def test_console_run_progress_logs_shards_and_draws_on_a_tty(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    console = logs.Console.setup("text", 0)
    failed = ShardResult("bad.parquet", "/in/bad.parquet", "failed", kind="schema", message="x")
    with console.progress() as progress:
        progress.on_start(50_000, 2)
        assert console.terminal.bar is progress.bar
        progress.on_shard(scored("a.parquet"))
        progress.on_shard(failed)
    assert console.terminal.bar is None
    text = tty.getvalue()
    assert "25,000/50,000 rows  2/2 shards" in text
    assert "scored a.parquet" not in text  # the bar counted it
    assert "ERROR failed bad.parquet: [schema] x" in text


def test_console_without_a_tty_draws_no_bar(capsys: pytest.CaptureFixture[str]) -> None:
    console = logs.Console.setup("text", 0)
    with console.progress() as progress:
        progress.on_start(50_000, 1)
        progress.on_shard(scored("a.parquet"))
    err = capsys.readouterr().err
    assert "INFO scored a.parquet" in err
    assert "\r" not in err and "\x1b" not in err


# --------------------------------------------------------------------------------------------
# Issue 13: progress by rows, run_id on every line, tracebacks in one line


def test_progress_moves_with_row_reports_and_counts_each_row_once() -> None:
    stream = FakeTTY()
    with bars.Progress(60_000, 2, enabled=True, terminal=logs.Terminal(stream)) as p:
        p.rows("part-0.parquet", 4_096)
        p.rows("part-0.parquet", 12_288)
        assert (p.rows_done, p.shards_done) == (12_288, 0)
        p.rows("part-0.parquet", 8_192)  # a retry starting over: nothing new
        assert p.rows_done == 12_288
        p.update(scored("part-0.parquet", rows_in=25_000))  # the rest of the shard
        assert (p.rows_done, p.shards_done) == (25_000, 1)
        p.rows("part-0.parquet", 20_480)  # late: the shard is counted already
        assert p.rows_done == 25_000
        p.update(scored("part-1.parquet", rows_in=35_000))
        assert (p.rows_done, p.shards_done) == (60_000, 2)
    text = stream.getvalue()
    assert "12,288/60,000 rows  0/2 shards" in text  # drawn while no shard had finished
    assert "60,000/60,000 rows  2/2 shards" in text


def test_run_progress_passes_row_reports_to_the_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    console = logs.Console.setup("text", 0)
    with console.progress() as progress:
        progress.on_rows("a.parquet", 100)  # before the run started: nothing to move
        progress.on_start(1_000, 1)
        progress.on_rows("a.parquet", 500)
        assert progress.bar is not None and progress.bar.rows_done == 500
    assert "500/1,000 rows  0/1 shards" in tty.getvalue()


def test_every_line_carries_the_bound_run_id(capsys: pytest.CaptureFixture[str]) -> None:
    logs.setup_logging("json", 0)
    runcontext.bind_run_id(None)
    try:
        logging.getLogger("pipeline").info("before the run")
        runcontext.bind_run_id("20261201T101010Z-abcdef")
        logging.getLogger("pipeline").info("during it")
        logging.getLogger("distributed.scheduler").warning("dask says")
        bars.log_shard(scored())
        logging.getLogger("pipeline").info("own id", extra={"run_id": "other"})
        logs.emit_error("boom", 1, "json")
    finally:
        runcontext.bind_run_id(None)
    recs = json_lines(capsys.readouterr().err)
    rid = "20261201T101010Z-abcdef"
    assert [r["run_id"] for r in recs] == [None, rid, rid, rid, "other", rid]


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_library_tracebacks_are_one_line_unless_very_verbose(
    fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for verbosity, folded in ((0, True), (1, True), (2, False)):
        logs.setup_logging(fmt, verbosity)
        try:
            raise OSError("Timed out trying to connect")
        except OSError:
            logging.getLogger("distributed.worker").exception("Failed to communicate")
        err = capsys.readouterr().err
        assert ("Traceback" not in err) == folded, err
        if folded:
            assert err.count("\n") == 1, err
            assert "Failed to communicate (OSError: Timed out trying to connect)" in err


# --------------------------------------------------------------------------------------------
# Issue 22: progress lines where no bar is drawn, and --log-file


def test_a_progress_line_counts_rows_inside_shards_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    logs.setup_logging("json", 0)
    lines = bars.ProgressLog(60_000, 2, interval_s=3600)  # no line from its thread in this test
    lines.rows("part-0.parquet", 12_288)
    lines.rows("part-0.parquet", 8_192)  # a retry starting over: nothing new
    lines.log_line()
    lines.update(scored("part-0.parquet", rows_in=25_000))
    lines.rows("part-0.parquet", 20_480)  # late: the shard is counted already
    lines.log_line()
    first, second = (r for r in json_lines(capsys.readouterr().err) if r["event"] == "progress")
    assert (first["rows"], first["shards_done"], first["percent"]) == (12_288, 0, 20.5)
    assert (second["rows"], second["shards_done"]) == (25_000, 1)
    for rec in (first, second):
        assert rec["rows_total"] == 60_000 and rec["shards_total"] == 2 and rec["level"] == "info"
        assert rec["rows_per_s"] > 0 and rec["eta_s"] >= 0
        assert rec["message"].startswith(f"progress: {rec['rows']:,}/60,000 rows (")


def test_no_progress_lines_on_a_terminal_or_when_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    for stream, fmt, verbosity, lines in (
        (FakeTTY(), "text", 0, False),  # the bar instead
        (FakeTTY(), "json", 0, True),
        (io.StringIO(), "text", 0, True),  # cron
        (io.StringIO(), "text", -1, False),  # -q
    ):
        monkeypatch.setattr(sys, "stderr", stream)
        console = logs.Console.setup(fmt, verbosity)
        console.progress_every = 3600.0
        with console.progress() as progress:
            progress.on_start(1_000, 1)
            assert (progress.lines is not None) is lines, (fmt, verbosity, stream)


def test_a_log_file_takes_info_lines_whatever_quiet_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "night.log"
    console = logs.Console.setup("text", -1, str(log))
    logging.getLogger("pipeline").info("scored part-0.parquet")
    logging.getLogger("pipeline").error("shard failed")
    console.summary({"exit_code": 1, "status": "failed"}, "THE SUMMARY", "run x failed: why")
    for h in logging.getLogger().handlers:
        if isinstance(h, logs.LogFile):
            h.close()  # each line was flushed as it was written; this only closes the file
    assert capsys.readouterr().err.splitlines() == [
        next(ln for ln in log.read_text().splitlines() if "ERROR shard failed" in ln),
        "error: run x failed: why",
    ]
    text = log.read_text()
    assert "INFO scored part-0.parquet" in text
    assert text.endswith("THE SUMMARY\nerror: run x failed: why\n")


# A Dask task that raised: a warning line, not a traceback (real embedded cluster)

_FAILING_TASK = textwrap.dedent(
    """
    import sys
    from pipeline.cli import logs
    from pipeline.driver.cluster import DaskSession, Plan

    logs.setup_logging(sys.argv[1], int(sys.argv[2]))
    session = DaskSession(Plan("local", 1, 1, 1, 1), None)

    def boom() -> None:
        raise OSError(5, "the disk went away")

    future = session.client().submit(boom, retries=2, pure=False)
    try:
        future.result()
    except OSError:
        pass
    session.close()
    """
)


@pytest.mark.parametrize(
    ("fmt", "verbosity", "lines"), [("text", -1, 0), ("text", 0, 3), ("json", 0, 3)]
)
@pytest.mark.slow
def test_a_dask_task_that_raised_is_one_warning_line_per_try(
    fmt: str, verbosity: int, lines: int, tmp_path: Path
) -> None:
    """distributed.worker logs each try of a failing task at ERROR as "Compute Failed" with its
    traceback inside the message (3 tracebacks for a task tried 3 times, under -q too): here one
    warning line per try naming the task and the exception, none under -q, all JSON in JSON
    mode. The worker is a real process of an embedded cluster, forked as in a run."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(
        [sys.executable, "-c", _FAILING_TASK, fmt, str(verbosity)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    err = done.stderr
    assert "Traceback" not in err and "Compute Failed" not in err, err
    tries = [ln for ln in err.splitlines() if "the disk went away" in ln]
    assert len(tries) == lines, err
    for line in tries:
        if fmt == "json":
            rec = json.loads(line)
            assert (rec["level"], rec["logger"]) == ("warning", "distributed.worker"), rec
        else:
            assert " WARNING " in line and "raised" in line, line


def test_a_dask_task_traceback_is_kept_at_debug_with_vv(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(
        [sys.executable, "-c", _FAILING_TASK, "text", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "DEBUG Compute Failed" in done.stderr and "the disk went away" in done.stderr
