"""CLI output: text or JSON log lines on stderr, the summary on stdout, errors in one line.

The "text" format keeps the human ``TIME LEVEL message`` lines; "json" writes exactly one JSON
object per line on stderr, for log shippers::

    {"time": "2026-11-29T22:15:10.123Z", "level": "info", "event": "shard_scored",
     "message": "scored part-0.parquet: ...", "logger": "pipeline", "shard": "part-0.parquet",
     "rows": 25000, ...}

(one line in reality). In JSON mode Python warnings and Dask's own loggers go through the same
JSON handler, so every line on stderr parses. The run summary goes to stdout: the human table in
text mode, one ``"event": "summary"`` JSON line in JSON mode.

Logging is configured with :func:`logging.config.dictConfig` (:func:`logging_config` builds the
dictionary). Log lines and the progress bar (:mod:`pipeline.cli.progress`) share the terminal
through a :class:`~pipeline.cli.terminal.Terminal` object that the CLI creates (inside
:class:`Console`) and hands to both the log handler and the bar. Every line carries the run id
(:class:`~pipeline.core.runcontext.RunContextFilter`): bound by the run when it starts, and
inherited by the embedded cluster's worker processes, which are forked from the driver.

No line is a traceback unless -vv: :class:`OneLineFilter` folds a record's exception into its
message (``... (OSError: Timed out)``), so Dask's shutdown noise or a heartbeat that failed
once is one line, JSON included.

This module imports nothing heavy (no torch, nothing of the pipeline but core and the console's
own modules), so it is cheap to load before anything else.
"""

from __future__ import annotations

import logging
import logging.config
import math
import signal
import sys
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn

import click

from pipeline.cli.progress import Progress, ProgressLog, log_shard, progress_enabled
from pipeline.cli.terminal import Terminal
from pipeline.core.jsontext import to_json
from pipeline.core.runcontext import RunContextFilter, current_run_id
from pipeline.core.signals import SIGNALS, EarlyStop

if TYPE_CHECKING:
    from pipeline.worker.shard import ShardResult

__all__ = [
    "EXTRA_FIELDS",
    "FORMATS",
    "SUMMARY_FIELDS",
    "Console",
    "DaskTaskFilter",
    "JsonFormatter",
    "LogFile",
    "OneLineFilter",
    "RunProgress",
    "Terminal",
    "TerminalHandler",
    "emit_error",
    "emit_summary",
    "json_line",
    "logging_config",
    "setup_logging",
    "stopped_while_starting",
    "summary_text",
    "to_log_file",
    "wants_json",
]

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(message)s"

# Structured fields a record may carry (``extra={...}``); copied into its JSON object.
EXTRA_FIELDS = (
    "shard",
    "partition",
    "rows",
    "rows_in",
    "rows_rejected",
    "rows_per_s",
    "duration_s",
    "status",
    "kind",
    "run_id",
    "output",
    "exit_code",
    # progress lines (ProgressLog)
    "rows_total",
    "percent",
    "shards_done",
    "shards_total",
    "eta_s",
)

# Keys of the JSON summary line, taken from the report data where present.
SUMMARY_FIELDS = (
    "run_id",
    "job",
    "status",
    "exit_code",
    "rows_in",
    "rows_out",
    "rows_rejected",
    "shards_total",
    "shards_scored",
    "shards_skipped",
    "shards_failed",
    "rows_per_s",
    "duration_s",
    "output",
    "failure_reasons",
    "warnings",
)

# Third-party loggers that install their own stderr StreamHandlers (``import distributed`` does,
# from dask's ``logging`` config, when the root logger has no handler yet) and do not propagate.
LIBRARY_LOGGERS = ("distributed", "bokeh", "tornado")

# Object-store clients log signed request headers at DEBUG, access key id included; storage
# options are never logged, so these loggers stay at INFO even with -vv.
QUIET_LIBRARIES = (
    "botocore",
    "boto3",
    "aiobotocore",
    "s3fs",
    "urllib3",
    "aiohttp",
    "gcsfs",
    "adlfs",
)

logger = logging.getLogger("pipeline")


# --------------------------------------------------------------------------------------------
# Formatting


def _iso_utc(created: float) -> str:
    """``2026-11-29T22:15:10.123Z`` for a ``time.time()`` value."""
    ms = min(999, int((created - math.floor(created)) * 1000))
    stamp = datetime.fromtimestamp(math.floor(created), tz=timezone.utc)
    return f"{stamp:%Y-%m-%dT%H:%M:%S}.{ms:03d}Z"


def json_line(obj: Mapping[str, Any]) -> str:
    """One line of ASCII JSON: control characters and non-ASCII escaped, never a raw newline;
    strict JSON like every document the tool writes (NaN/inf become null: ``NaN`` is not JSON)."""
    return to_json(obj, compact=True)


class JsonFormatter(logging.Formatter):
    """A record as one JSON object: time, level, event, message, logger, extras, exc."""

    def format(self, record: logging.LogRecord) -> str:
        event = getattr(record, "event", None)
        if event is None:
            event = "warning" if record.name == "py.warnings" else "log"
        message = record.getMessage()
        if record.name == "py.warnings":
            message = message.strip()  # warnings.formatwarning ends with a newline
        obj: dict[str, Any] = {
            "time": _iso_utc(record.created),
            "level": record.levelname.lower(),
            "event": str(event),
            "message": message,
            "logger": record.name,
        }
        for key in EXTRA_FIELDS:
            if key in record.__dict__:
                obj[key] = record.__dict__[key]
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            obj["exc"] = record.exc_text
        if record.stack_info:
            obj["stack"] = self.formatStack(record.stack_info)
        return json_line(obj)


# --------------------------------------------------------------------------------------------
# The run id on every line, and tracebacks folded into one line


class OneLineFilter(logging.Filter):
    """Fold a library record's exception into its message, as ``message (Type: text)``, so
    that no log line is a multi-line traceback. Dask logs its connection and shutdown errors
    with tracebacks (a heartbeat that failed as the scheduler closed, a worker that lost its
    scheduler); they are one line here, and the full traceback only with -vv (``keep``). The
    pipeline's own records keep theirs: it logs one only where it means to (-vv, or JSON's
    ``exc`` field)."""

    def __init__(self, keep: bool = False) -> None:
        super().__init__()
        self.keep = keep

    def filter(self, record: logging.LogRecord) -> bool:
        if self.keep or not record.exc_info or record.exc_info[1] is None:
            return True
        if record.name == "pipeline" or record.name.startswith("pipeline."):
            return True
        e = record.exc_info[1]
        text = str(e).strip().splitlines()
        record.msg = f"{record.getMessage()} ({type(e).__name__}{': ' + text[0] if text else ''})"
        record.args = None
        record.exc_info = None
        record.exc_text = None
        return True


class DaskTaskFilter(logging.Filter):
    """Dask's failed tasks as one WARNING line, not a traceback per try.

    A Dask worker logs every try of a task that raised at ERROR ("Compute Failed" from
    ``distributed.worker``, with the task and its whole traceback in the message, so
    :class:`OneLineFilter` cannot fold it): a shard retried three times printed three tracebacks
    (20-39 lines) even with -q. The driver reports how each shard ended; a try that raised is a
    one-line warning naming the task and the exception, dropped below the handler's ``level``
    (-q). With -vv (``keep``) the record stays whole, traceback included, at DEBUG.
    """

    def __init__(self, level: int = logging.INFO, keep: bool = False) -> None:
        super().__init__()
        self.level = level
        self.keep = keep

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("distributed"):
            return True
        msg = record.msg if isinstance(record.msg, str) else ""
        if not msg.startswith(("Compute Failed", "Exception during execution of task")):
            return True
        if self.keep:
            level = logging.DEBUG
        else:
            level = logging.WARNING
            args = record.args if isinstance(record.args, tuple) else ()
            if msg.startswith("Compute Failed") and len(args) >= 4:
                record.msg = (
                    "Dask task %s raised %s (tried again up to errors.task_retries times; the "
                    "run reports the shard if every try fails)"
                )
                record.args = (args[0], args[3])
        record.levelno, record.levelname = level, logging.getLevelName(level)
        return level >= self.level


# --------------------------------------------------------------------------------------------
# The terminal, its handler, and the logging configuration


class TerminalHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler on a :class:`Terminal` that writes log lines above its bar, not through it.

    While a bar is drawn and the handler is not at DEBUG (no -v), ``shard_scored`` records are
    dropped: the bar already counts them and the summary lists every shard. Failures and every
    other record are always written.
    """

    def __init__(self, terminal: Terminal) -> None:
        super().__init__(terminal.stream)
        self.terminal = terminal

    def emit(self, record: logging.LogRecord) -> None:
        with self.terminal.lock:
            bar = self.terminal.bar
            if bar is None or not bar.draws_on(self.stream):
                super().emit(record)
                return
            if getattr(record, "event", None) == "shard_scored" and self.level > logging.DEBUG:
                return
            bar.clear_line()
            super().emit(record)
            bar.redraw()


class LogFile(logging.FileHandler):
    """``--log-file``: every log line at INFO (DEBUG with -v) whatever ``-q`` says, appended,
    and the command's summary and final error exactly as it prints them (:func:`to_log_file`).

    Cron mails what a job prints; with ``-q`` that is only errors, and this file keeps the
    night's whole story. Dask's worker processes are forked from the driver and inherit it:
    the file is opened for appending, so each record is one ``write`` at the end of the file.
    """

    def __init__(self, filename: str) -> None:
        super().__init__(filename, mode="a", encoding="utf-8")

    def write_text(self, text: str) -> None:
        """Append ``text`` and a newline as they are (a summary table, a JSON line)."""
        self.acquire()
        try:
            if self.stream is None:
                self.stream = self._open()
            self.stream.write(text + "\n")
            self.flush()
        finally:
            self.release()


def to_log_file(text: str) -> None:
    """Append ``text`` to the ``--log-file``, if one is configured (else nothing)."""
    for h in logging.getLogger().handlers:
        if isinstance(h, LogFile):
            h.write_text(text)


def _level(verbosity: int) -> int:
    if verbosity < 0:
        return logging.ERROR
    return logging.INFO if verbosity == 0 else logging.DEBUG


def _is_stderr(stream: Any) -> bool:
    if stream is sys.stderr or stream is sys.__stderr__:
        return True
    try:
        return bool(stream.fileno() == 2)
    except (AttributeError, OSError, ValueError):
        return False


def _writes_own_lines(name: str) -> bool:
    """Whether library logger ``name`` has its own stderr handler (Dask's, or ours from before)."""
    return any(
        isinstance(h, TerminalHandler)
        or (type(h) is logging.StreamHandler and _is_stderr(h.stream))
        for h in logging.getLogger(name).handlers
    )


def logging_config(
    fmt: str, verbosity: int, terminal: Terminal, log_file: str | None = None
) -> dict[str, Any]:
    """The :func:`logging.config.dictConfig` dictionary for the CLI's output on ``terminal``.

    The root logger gets one :class:`TerminalHandler` (text or JSON lines, at the verbosity's
    level: -1 errors only, 0 info, 1 or more debug). Dask's loggers propagate to it when Dask is
    imported after this is applied (the CLI's order: ``import distributed`` then only sets their
    levels). If Dask was imported first, it gave its loggers plain stderr handlers and stopped them
    propagating: those loggers get a handler of their own on ``terminal`` instead (JSON in JSON
    mode, Dask's ``distributed.admin.log-format`` in text mode). Their own handler, not the
    root's, so that ``LocalCluster(silence_logs=...)``, which sets the level of the handlers of
    the ``distributed`` logger, cannot silence the application's own lines.

    ``log_file``: a :class:`LogFile` handler too, in the same format, at INFO (DEBUG with -v)
    whatever the terminal's level; the root logger's level is the lower of the two.
    """
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    level = _level(verbosity)
    file_level = min(_level(max(verbosity, 0)), level)
    lowest = file_level if log_file is not None else level
    line = "json" if fmt == "json" else "text"
    # The handler's level too: records propagating from loggers with their own level
    # (distributed's are INFO) skip the root logger's level.
    handler = {
        "()": TerminalHandler,
        "terminal": terminal,
        "formatter": line,
        "level": level,
        "filters": ["run", "dask_tasks", "one_line"],
    }
    config: dict[str, Any] = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"text": {"format": TEXT_FORMAT}, "json": {"()": JsonFormatter}},
        "filters": {
            "run": {"()": RunContextFilter},
            "one_line": {"()": OneLineFilter, "keep": verbosity >= 2},
            "dask_tasks": {"()": DaskTaskFilter, "level": level, "keep": verbosity >= 2},
        },
        "handlers": {"terminal": handler},
        "root": {"handlers": ["terminal"], "level": lowest},
        "loggers": {name: {"level": max(lowest, logging.INFO)} for name in QUIET_LIBRARIES},
    }
    file_handlers = []
    if log_file is not None:
        config["handlers"]["file"] = {
            **handler,
            "()": LogFile,
            "filename": log_file,
            "level": file_level,
        }
        del config["handlers"]["file"]["terminal"]
        config["root"]["handlers"].append("file")
        file_handlers.append("file")
    own = [name for name in LIBRARY_LOGGERS if _writes_own_lines(name)]
    if own and fmt == "text":
        import dask  # imported already: it configured those loggers

        config["formatters"]["library"] = {
            "format": dask.config.get("distributed.admin.log-format")
        }
    for name in own:
        config["handlers"][name] = {**handler, "formatter": "library" if line == "text" else line}
        config["loggers"][name] = {"handlers": [name, *file_handlers], "propagate": False}
    return config


def setup_logging(
    fmt: str, verbosity: int, terminal: Terminal | None = None, log_file: str | None = None
) -> Terminal:
    """Configure logging to ``terminal`` (a new one on the current stderr if None); return it.

    ``fmt`` is "text" or "json"; ``verbosity`` -1 quiet (errors only), 0 info, 1 or more debug.
    Applies :func:`logging_config`, which replaces the root logger's handlers, so calling it
    again reconfigures instead of adding a second handler. In JSON mode Python warnings are
    logged too (``logging.captureWarnings``, ``"event": "warning"``); in text mode they print as
    Python prints them.
    """
    terminal = terminal if terminal is not None else Terminal()
    config = logging_config(fmt, verbosity, terminal, log_file)
    with terminal.lock:
        logging.config.dictConfig(config)
    logging.captureWarnings(fmt == "json")
    return terminal


class RunProgress:
    """The ``on_start``/``on_shard`` callbacks of a run for the CLI: every finished shard is
    logged (:func:`log_shard`) and, where :func:`progress_enabled` allows, counted on a
    :class:`Progress` bar opened by ``on_start``. Use it as a context manager: the bar is closed
    on the way out, before any error message is printed.
    """

    def __init__(self, console: Console) -> None:
        self.console = console
        self.bar: Progress | None = None
        self.lines: ProgressLog | None = None

    def on_start(self, rows: int, shards: int) -> None:
        """The run knows its size: open the bar (once), or where none can be drawn start the
        progress lines (:class:`ProgressLog`), unless no handler takes INFO lines (``-q``)."""
        if self.bar is not None or self.lines is not None:
            return
        c = self.console
        enabled = progress_enabled(c.fmt, c.verbosity, c.terminal.stream)
        if not enabled and rows > 0 and c.progress_every > 0 and logger.isEnabledFor(logging.INFO):
            self.lines = ProgressLog(rows, shards, c.progress_every).__enter__()
            return
        self.bar = Progress(rows, shards, enabled=enabled, terminal=c.terminal).__enter__()

    def on_shard(self, result: ShardResult) -> None:
        """One shard finished (scored, skipped or failed)."""
        log_shard(result)
        for shown in (self.bar, self.lines):
            if shown is not None:
                shown.update(result)

    def on_rows(self, rel_path: str, rows: int) -> None:
        """A shard still being scored has ``rows`` rows done: the bar and ETA move."""
        for shown in (self.bar, self.lines):
            if shown is not None:
                shown.rows(rel_path, rows)

    def __enter__(self) -> RunProgress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        bar, self.bar = self.bar, None
        if bar is not None:
            bar.__exit__(exc_type, exc, tb)
        lines, self.lines = self.lines, None
        if lines is not None:
            lines.__exit__(exc_type, exc, tb)


# --------------------------------------------------------------------------------------------
# Summary, fatal errors, and the console that ties them together


def emit_summary(report_data: Mapping[str, Any], fmt: str, text: str) -> None:
    """The run summary on stdout: ``text`` (the human table) in text mode; in JSON mode one line
    ``{"time", "level": "info", "event": "summary", ...}`` with the :data:`SUMMARY_FIELDS` that
    ``report_data`` has (pass ``{**report.data, "exit_code": report.exit_code}`` for the exit
    code)."""
    shown = summary_text(report_data, fmt, text)
    click.echo(shown)
    to_log_file(shown)


def summary_text(report_data: Mapping[str, Any], fmt: str, text: str) -> str:
    """What :func:`emit_summary` prints: ``text``, or in JSON mode the summary's JSON line."""
    if fmt != "json":
        return text
    obj: dict[str, Any] = {"time": _iso_utc(time.time()), "level": "info", "event": "summary"}
    obj.update((k, report_data[k]) for k in SUMMARY_FIELDS if k in report_data)
    obj.setdefault("run_id", None)  # a backfill's summary: its days' ids are in its partitions
    return json_line(obj)


def emit_error(message: str, exit_code: int, fmt: str, terminal: Terminal | None = None) -> None:
    """A fatal error on stderr: ``error: MESSAGE`` in text mode, one JSON line in JSON mode.

    With ``terminal``, a bar still drawn on it is cleared first.
    """
    terminal = terminal if terminal is not None else Terminal()
    with terminal.lock:
        bar = terminal.bar
        if bar is not None and bar.draws_on(sys.stderr):
            bar.clear_line()
        if fmt != "json":
            shown = f"error: {message}"
        else:
            obj = {
                "time": _iso_utc(time.time()),
                "level": "error",
                "event": "error",
                "message": str(message),
                "exit_code": exit_code,
                "run_id": current_run_id(),
            }
            shown = json_line(obj)
        click.echo(shown, err=True)
        to_log_file(shown)


class Console:
    """What one CLI command writes: its log format, verbosity, and the terminal they share.

    :meth:`setup` configures logging (:func:`setup_logging`) and returns the console; the
    command then hands out :meth:`progress` callbacks and ends with :meth:`summary` or
    :meth:`error`.
    """

    def __init__(self, fmt: str, verbosity: int, terminal: Terminal) -> None:
        self.fmt = fmt
        self.verbosity = verbosity
        self.terminal = terminal
        # Commands whose JSON contract is "one summary line on stdout" (run, backfill) set this:
        # a fatal error then also ends stdout with a summary line, status failed (or
        # interrupted) and the exit code, so a reader of stdout always gets one.
        self.summarize_errors = False
        # Seconds between progress lines where no bar is drawn (ProgressLog); 0: none.
        self.progress_every = 0.0

    @classmethod
    def setup(cls, fmt: str, verbosity: int, log_file: str | None = None) -> Console:
        """Configure logging on a new :class:`Terminal` on stderr (and ``log_file``, if
        given: :class:`LogFile`); the console for it."""
        return cls(fmt, verbosity, setup_logging(fmt, verbosity, log_file=log_file))

    def progress(self) -> RunProgress:
        """Callbacks for one run: shard lines, and the bar on a terminal."""
        return RunProgress(self)

    def summary(self, report_data: Mapping[str, Any], text: str, problem: str = "") -> None:
        """See :func:`emit_summary`. Quiet (-q: errors only) prints no summary: a run that did
        not exit 0 gets one error line instead, ``problem`` (what went wrong, in a line)."""
        if self.verbosity < 0:
            to_log_file(summary_text(report_data, self.fmt, text))  # the log keeps it
            code = int(report_data.get("exit_code") or 0)
            if code:
                self.error(problem or str(report_data.get("status", "failed")), code)
            return
        emit_summary(report_data, self.fmt, text)

    def error(self, message: str, exit_code: int) -> None:
        """See :func:`emit_error`; and, for a command that :attr:`summarize_errors` in JSON
        mode (not quiet), the failure's summary line on stdout."""
        emit_error(message, exit_code, self.fmt, self.terminal)
        if self.fmt == "json" and self.summarize_errors and self.verbosity >= 0:
            obj = {
                "time": _iso_utc(time.time()),
                "level": "error",
                "event": "summary",
                "run_id": current_run_id(),
                "status": "interrupted" if exit_code in (130, 143) else "failed",
                "exit_code": exit_code,
                "error": str(message),
            }
            click.echo(json_line(obj))
            to_log_file(json_line(obj))


def wants_json(argv: list[str]) -> bool:
    """Whether the command line asks for JSON logs: known before Click has parsed anything."""
    return any(
        a == "--log-format=json" or (a == "--log-format" and argv[i + 1 : i + 2] == ["json"])
        for i, a in enumerate(argv)
    )


def stopped_while_starting(e: EarlyStop, argv: list[str]) -> NoReturn:
    """One line saying so (and, for run and backfill in JSON mode, the summary line), then exit
    with the signal's code."""
    for s in SIGNALS:
        signal.signal(s, signal.SIG_DFL)  # a second signal while this line is written: gone now
    console = Console("json" if wants_json(argv) else "text", 0, Terminal())
    console.summarize_errors = bool(argv) and argv[0] in ("run", "backfill")
    console.error(str(e), e.exit_code)
    sys.exit(e.exit_code)
