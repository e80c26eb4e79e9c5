"""CLI output: text or JSON log lines on stderr, shard lines, a progress bar, the summary.

The "text" format keeps the human ``TIME LEVEL message`` lines; "json" writes exactly one JSON
object per line on stderr, for log shippers::

    {"time": "2026-11-29T22:15:10.123Z", "level": "info", "event": "shard_scored",
     "message": "scored part-0.parquet: ...", "logger": "pipeline", "shard": "part-0.parquet",
     "rows": 25000, ...}

(one line in reality). In JSON mode Python warnings and Dask's own loggers go through the same
JSON handler, so every line on stderr parses. The run summary goes to stdout: the human table in
text mode, one ``"event": "summary"`` JSON line in JSON mode.

On an interactive terminal (text format, not quiet, stderr a TTY) :class:`Progress` draws a
progress bar on stderr; see its docstring for how log lines share the terminal with it.

This module imports nothing heavy (no torch, no pipeline modules at import time), so it is cheap
to load before anything else.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from types import TracebackType
from typing import TYPE_CHECKING, Any, TextIO

import click

if TYPE_CHECKING:
    from pipeline.scoring import ShardResult

__all__ = [
    "EXTRA_FIELDS",
    "SUMMARY_FIELDS",
    "JsonFormatter",
    "Progress",
    "adopt_library_loggers",
    "emit_error",
    "emit_summary",
    "json_line",
    "log_shard",
    "progress_enabled",
    "setup_logging",
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
# from dask's ``logging`` config) and do not propagate to the root logger.
LIBRARY_LOGGERS = ("distributed", "bokeh", "tornado")

logger = logging.getLogger("pipeline")

# Serialises log output and bar redraws on the shared terminal (Dask logs from its own threads).
_TERMINAL_LOCK = threading.RLock()
_ACTIVE: Progress | None = None  # the progress bar currently drawn, if any
_STATE: dict[str, Any] = {}  # fmt and level from the last setup_logging()


# --------------------------------------------------------------------------------------------
# Formatting


def _iso_utc(created: float) -> str:
    """``2026-11-29T22:15:10.123Z`` for a ``time.time()`` value."""
    ms = min(999, int((created - math.floor(created)) * 1000))
    stamp = datetime.fromtimestamp(math.floor(created), tz=timezone.utc)
    return f"{stamp:%Y-%m-%dT%H:%M:%S}.{ms:03d}Z"


def _jsonable(value: Any) -> Any:
    """Plain JSON values: NaN/inf become null (``NaN`` is not JSON), unknown objects str()."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, int, bool)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    try:  # numpy scalars and the like
        item = value.item()
    except (AttributeError, TypeError, ValueError):
        return str(value)
    return _jsonable(item) if isinstance(item, (str, int, float, bool)) else str(value)


def json_line(obj: Mapping[str, Any]) -> str:
    """One line of ASCII JSON: control characters and non-ASCII escaped, never a raw newline."""
    return json.dumps(_jsonable(obj), ensure_ascii=True, allow_nan=False, separators=(",", ":"))


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
# Handlers and setup


class _TerminalHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A stderr handler that writes log lines above an active progress bar, not through it."""

    # What a library handler we replaced had, so that setting up again restores it.
    library_formatter: logging.Formatter | None = None
    library_level: int = logging.NOTSET

    def emit(self, record: logging.LogRecord) -> None:
        with _TERMINAL_LOCK:
            bar = _ACTIVE
            if bar is None or not bar.draws_on(self.stream):
                super().emit(record)
                return
            bar.clear_line()
            super().emit(record)
            bar.redraw()


def _handler(fmt: str, level: int, stream: TextIO) -> _TerminalHandler:
    h = _TerminalHandler(stream)
    h.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    h.setLevel(level)
    return h


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


def adopt_library_loggers() -> None:
    """Route the stderr handlers Dask (and tornado, bokeh) installed through this module's.

    ``import distributed`` configures its loggers from dask's ``logging`` config: if the root
    logger has no handler yet, it gives them plain-text StreamHandlers on stderr and stops them
    propagating; if the root logger has one (``setup_logging`` ran first, the CLI's order), it
    only sets their levels and they propagate to our handler. For the first case each such
    handler is replaced by a separate handler of ours on the current stderr: JSON formatted in
    JSON mode; in text mode with the library's own formatter, so its lines look the same but do
    not garble the progress bar. A separate handler per logger keeps
    ``LocalCluster(silence_logs=...)``, which sets the level of the StreamHandlers on the
    ``distributed`` logger, from silencing the application's own log lines. Does nothing before
    :func:`setup_logging`.
    """
    if not _STATE:
        return
    fmt: str = _STATE["fmt"]
    level: int = _STATE["level"]
    manager = logging.Logger.manager
    for name in sorted(manager.loggerDict):
        if not any(name == p or name.startswith(p + ".") for p in LIBRARY_LOGGERS):
            continue
        lib_logger = manager.loggerDict[name]
        if not isinstance(lib_logger, logging.Logger):
            continue
        for old in list(lib_logger.handlers):
            if isinstance(old, _TerminalHandler):
                formatter, old_level = old.library_formatter, old.library_level
            elif type(old) is logging.StreamHandler and _is_stderr(old.stream):
                formatter, old_level = old.formatter, old.level
            else:
                continue
            new = _handler(fmt, max(level, old_level), sys.stderr)
            new.library_formatter, new.library_level = formatter, old_level
            if fmt == "text" and formatter is not None:
                new.setFormatter(formatter)
            lib_logger.removeHandler(old)
            lib_logger.addHandler(new)


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


def setup_logging(fmt: str, verbosity: int) -> None:
    """Configure logging to stderr: ``fmt`` "text" or "json"; ``verbosity`` -1 quiet (errors
    only), 0 info, 1 or more debug.

    Replaces the root logger's handlers, so calling it again reconfigures instead of adding a
    second handler. Dask's own loggers go through the same handler (:func:`adopt_library_loggers`;
    JSON in JSON mode, their own text format in text mode). In JSON mode Python warnings are
    logged too (``logging.captureWarnings``, ``"event": "warning"``); in text mode they print as
    Python prints them.
    """
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    level = _level(verbosity)
    root = logging.getLogger()
    with _TERMINAL_LOCK:
        for h in list(root.handlers):
            root.removeHandler(h)
            if isinstance(h, _TerminalHandler):
                h.close()
        # The handler's level too: records propagating from loggers with their own level
        # (distributed's are INFO) skip the root logger's level.
        root.addHandler(_handler(fmt, level, sys.stderr))
        root.setLevel(level)
        _STATE.update(fmt=fmt, level=level)
    logging.captureWarnings(fmt == "json")
    adopt_library_loggers()
    # Object-store clients log signed request headers at DEBUG, access key id included; storage
    # options are never logged, so these loggers stay at INFO even with -vv.
    for name in QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(max(level, logging.INFO))


# --------------------------------------------------------------------------------------------
# Per-shard lines


def _verbose() -> bool:
    return logger.isEnabledFor(logging.DEBUG)


def log_shard(result: ShardResult) -> None:
    """Log one finished shard.

    scored: INFO ``shard_scored`` with shard, rows (scored), rows_in, rows_rejected, rows_per_s,
    duration_s, status. failed: ERROR ``shard_failed`` with kind and the message. skipped: DEBUG
    ``shard_skipped``. While a :class:`Progress` bar is drawn and the run is not verbose (-v),
    ``shard_scored`` lines are not logged: the bar already shows them, and the summary table lists
    every shard. Failures are always logged.
    """
    common = {"shard": result.rel_path, "status": result.status, "rows_in": result.rows_in}
    if result.status == "scored":
        if _ACTIVE is not None and not _verbose():
            return
        logger.info(
            "scored %s: %s rows, %s rejected, %.2fs (%s rows/s)",
            result.rel_path,
            f"{result.rows_out:,}",
            f"{result.rows_rejected:,}",
            result.duration_s,
            f"{result.rows_per_s:,.0f}",
            extra={
                "event": "shard_scored",
                **common,
                "rows": result.rows_out,
                "rows_rejected": result.rows_rejected,
                "rows_per_s": result.rows_per_s,
                "duration_s": result.duration_s,
            },
        )
    elif result.status == "skipped":
        logger.debug(
            "skipped %s: already scored",
            result.rel_path,
            extra={"event": "shard_skipped", **common, "rows": result.rows_out},
        )
    else:
        logger.error(
            "%s %s: [%s] %s",
            result.status,
            result.rel_path,
            result.kind or "error",
            result.message,
            extra={
                "event": "shard_failed",
                **common,
                "kind": result.kind,
                "duration_s": result.duration_s,
            },
        )


# --------------------------------------------------------------------------------------------
# Progress bar


def progress_enabled(fmt: str, verbosity: int, stream: Any) -> bool:
    """Whether to draw a progress bar: text format, not quiet, and ``stream`` a terminal."""
    if fmt != "text" or verbosity < 0:
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Progress:
    """A progress bar over the run's rows on ``stream`` (default stderr), via click.progressbar.

    Shows the bar, percent done and ETA (click's), then rows done/total, shards done/total and
    the overall rows/s. ``update(result)`` advances it by ``result.rows_in`` and one shard. With
    ``enabled=False`` (JSON logs, quiet, or not a terminal: see :func:`progress_enabled`) it does
    nothing at all and writes nothing.

    While the bar is drawn, log lines written by this module's handlers (:func:`setup_logging`)
    on the same stream first clear the bar's line and then redraw the bar below themselves, so
    lines never run into the bar; and :func:`log_shard` drops the per-shard ``shard_scored``
    INFO lines unless the run is verbose (-v), since the bar already counts them (failures are
    always logged). Entering the bar adopts Dask's own stderr loggers in the same way.
    """

    def __init__(
        self,
        total_rows: int,
        total_shards: int,
        *,
        enabled: bool,
        stream: TextIO | None = None,
        label: str = "scoring",
    ) -> None:
        self.enabled = enabled
        self.total_rows = max(0, int(total_rows))
        self.total_shards = max(0, int(total_shards))
        self.stream: TextIO = stream if stream is not None else sys.stderr
        self.label = label
        self.rows_done = 0
        self.shards_done = 0
        self._start = time.monotonic()
        self._bar: Any = None
        self._pid = os.getpid()

    # -- the bar's text --------------------------------------------------------------------

    def _info(self, _item: Any = None) -> str:
        elapsed = time.monotonic() - self._start
        rate = self.rows_done / elapsed if elapsed > 0 else 0.0
        return (
            f"{self.rows_done:,}/{self.total_rows:,} rows  "
            f"{self.shards_done}/{self.total_shards} shards  {rate:,.0f} rows/s"
        )

    # -- context manager -------------------------------------------------------------------

    def __enter__(self) -> Progress:
        global _ACTIVE
        if not self.enabled:
            return self
        self._start = time.monotonic()
        self._pid = os.getpid()
        adopt_library_loggers()
        bar: Any = click.progressbar(
            length=self.total_rows,
            label=self.label,
            file=self.stream,
            show_eta=True,
            show_percent=True,
            show_pos=False,
            item_show_func=self._info,
            bar_template="%(label)s  [%(bar)s]  %(info)s",
            width=30,
        )
        with _TERMINAL_LOCK:
            self._bar = bar.__enter__()
            _ACTIVE = self
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        global _ACTIVE
        if self._bar is None:
            return
        with _TERMINAL_LOCK:
            if _ACTIVE is self:
                _ACTIVE = None
            bar, self._bar = self._bar, None
            if exc_type is None:
                bar.render_progress()  # the final rows/s and counts
            bar.__exit__(exc_type, exc, tb)

    def update(self, result: Any) -> None:
        """Count one finished shard (any status) and its ``rows_in`` (None counts as 0)."""
        if self._bar is None:
            return
        rows = int(getattr(result, "rows_in", None) or 0)
        with _TERMINAL_LOCK:
            self.rows_done += rows
            self.shards_done += 1
            self._bar.update(rows)
            if rows == 0:  # click only redraws on a change of the line; the counts changed
                self._bar.render_progress()

    # -- for the log handler ---------------------------------------------------------------

    def draws_on(self, stream: Any) -> bool:
        """Whether this bar is drawn on ``stream`` by this process (not a forked worker)."""
        if self._bar is None or os.getpid() != self._pid:
            return False
        if stream is self.stream:
            return True
        try:
            return bool(os.path.sameopenfile(stream.fileno(), self.stream.fileno()))
        except (AttributeError, OSError, ValueError):
            return False

    def clear_line(self) -> None:
        self.stream.write("\r\x1b[K")

    def redraw(self) -> None:
        if self._bar is None:
            return
        self.stream.write("\r" + self._bar.format_progress_line())
        self.stream.flush()


# --------------------------------------------------------------------------------------------
# Summary and fatal errors


def emit_summary(report_data: Mapping[str, Any], fmt: str, text: str) -> None:
    """The run summary on stdout: ``text`` (the human table) in text mode; in JSON mode one line
    ``{"time", "level": "info", "event": "summary", ...}`` with the :data:`SUMMARY_FIELDS` that
    ``report_data`` has (pass ``{**report.data, "exit_code": report.exit_code}`` for the exit
    code)."""
    if fmt != "json":
        click.echo(text)
        return
    obj: dict[str, Any] = {"time": _iso_utc(time.time()), "level": "info", "event": "summary"}
    obj.update((k, report_data[k]) for k in SUMMARY_FIELDS if k in report_data)
    click.echo(json_line(obj))


def emit_error(message: str, exit_code: int, fmt: str) -> None:
    """A fatal error on stderr: ``error: MESSAGE`` in text mode, one JSON line in JSON mode."""
    with _TERMINAL_LOCK:
        bar = _ACTIVE
        if bar is not None and bar.draws_on(sys.stderr):
            bar.clear_line()
        if fmt != "json":
            click.echo(f"error: {message}", err=True)
            return
        obj = {
            "time": _iso_utc(time.time()),
            "level": "error",
            "event": "error",
            "message": str(message),
            "exit_code": exit_code,
        }
        click.echo(json_line(obj), err=True)
