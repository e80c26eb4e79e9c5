"""What the CLI says while a run goes: a line per finished shard (and per backfill day), a
progress bar on a terminal (:class:`Progress`), or progress lines where none can be drawn
(:class:`ProgressLog`: cron's log, JSON logs). Imports nothing heavy."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, TextIO

import click

from pipeline.cli.terminal import Terminal
from pipeline.core.statuses import FailureKind

if TYPE_CHECKING:
    from pipeline.worker.shard import ShardResult

logger = logging.getLogger("pipeline")


def log_shard(result: ShardResult) -> None:
    """Log one finished shard.

    scored: INFO ``shard_scored`` with shard, rows (scored), rows_in, rows_rejected, rows_per_s,
    duration_s, status. failed: ERROR ``shard_failed`` with kind and the message (WARNING for
    kind ``storage``: the run's own error line follows and names it). skipped: DEBUG
    ``shard_skipped``; not scored because the run stopped (kind ``interrupted`` or
    ``cancelled``): DEBUG ``shard_not_scored``. While a :class:`Progress` bar is drawn and the
    run is not verbose (-v),
    :class:`TerminalHandler` does not write the ``shard_scored`` lines: the bar already shows
    them, and the summary table lists every shard. Failures are always logged.
    """
    common = {"shard": result.rel_path, "status": result.status, "rows_in": result.rows_in}
    if result.status == "scored":
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
    elif result.kind in (FailureKind.INTERRUPTED, FailureKind.CANCELLED):
        # Left unscored because the run stopped (a signal, or another shard's fatal error):
        # the stop is logged once and the summary counts them; a line each is noise at 300.
        logger.debug(
            "not scored %s: %s",
            result.rel_path,
            result.message,
            extra={"event": "shard_not_scored", **common, "kind": result.kind},
        )
    else:
        # A storage failure stops the run, and the run's own error line names it (one line
        # under -q, not two): the shard's line is a warning.
        logger.log(
            logging.WARNING if result.kind == FailureKind.STORAGE else logging.ERROR,
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


def log_partition(entry: Mapping[str, Any]) -> None:
    """Log one finished backfill partition (``partition_done``): ERROR if it failed, WARNING
    if its input is missing (INFO where the job accepts gaps: ``allow_missing_partitions``)."""
    status = entry["status"]
    level = logging.ERROR if status in ("failed", "error") else logging.INFO
    if status == "missing" and not entry.get("missing_allowed"):
        level = logging.WARNING
    detail = f" ({entry['message']})" if status == "missing" and entry.get("message") else ""
    logger.log(
        level,
        "partition %s: %s%s",
        entry["date"],
        status,
        detail,
        extra={
            "event": "partition_done",
            "status": status,
            "partition": entry["date"],
            "run_id": entry.get("run_id"),  # that day's run (none for a missing day)
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


class RowCounter:
    """Rows and shards done so far, from reports of rows scored inside shards (``rows``) and
    finished shards (``finish``): what the bar draws and the progress lines say."""

    def __init__(self) -> None:
        self.rows_done = 0
        self.shards_done = 0
        self._partial: dict[str, int] = {}  # rows counted so far of shards still being scored
        self._finished: set[str] = set()  # shards counted by finish(): later reports are stale

    def rows(self, rel_path: str, rows: int) -> int:
        """``rows`` of shard ``rel_path`` are done so far; returns the rows newly counted."""
        step = int(rows) - self._partial.get(rel_path, 0)
        if step <= 0 or rel_path in self._finished:  # a retry reports from 0 again
            return 0
        self._partial[rel_path] = int(rows)
        self.rows_done += step
        return step

    def finish(self, result: Any) -> int:
        """Count one finished shard (any status) and its ``rows_in`` (None counts as 0), less
        what :meth:`rows` counted of it already; returns the rows newly counted."""
        rel_path = str(getattr(result, "rel_path", ""))
        self._finished.add(rel_path)
        counted = self._partial.pop(rel_path, 0)
        step = max(0, int(getattr(result, "rows_in", None) or 0) - counted)
        self.rows_done += step
        self.shards_done += 1
        return step


class Progress:
    """A progress bar over the run's rows on a :class:`Terminal`, via click.progressbar.

    Shows the bar, percent done and ETA (click's), then rows done/total, shards done/total and
    the overall rows/s. ``rows(rel_path, n)`` moves it while a shard is scored (``n`` of its rows
    are done, as the workers report them); ``update(result)`` counts the finished shard: one
    shard, and whatever of its ``result.rows_in`` the reports had not counted yet. With
    ``enabled=False`` (JSON logs, quiet, or not a terminal: see :func:`progress_enabled`) it does
    nothing at all and writes nothing.

    Give it the ``terminal`` that :func:`setup_logging` configured the log handlers with: while
    the bar is drawn (``terminal.bar``), log lines on the same stream first clear the bar's line
    and then redraw the bar below themselves, so lines never run into the bar. Without one it
    draws on its own ``stream`` (default stderr) and knows of no log lines.
    """

    def __init__(
        self,
        total_rows: int,
        total_shards: int,
        *,
        enabled: bool,
        stream: TextIO | None = None,
        label: str = "scoring",
        terminal: Terminal | None = None,
    ) -> None:
        self.enabled = enabled
        self.total_rows = max(0, int(total_rows))
        self.total_shards = max(0, int(total_shards))
        self.terminal = terminal if terminal is not None else Terminal(stream)
        self.stream: TextIO = stream if stream is not None else self.terminal.stream
        self.label = label
        self.count = RowCounter()
        self._start = time.monotonic()
        self._bar: Any = None
        self._pid = os.getpid()

    @property
    def rows_done(self) -> int:
        return self.count.rows_done

    @property
    def shards_done(self) -> int:
        return self.count.shards_done

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
        if not self.enabled:
            return self
        self._start = time.monotonic()
        self._pid = os.getpid()
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
        with self.terminal.lock:
            self._bar = bar.__enter__()
            self.terminal.bar = self
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._bar is None:
            return
        with self.terminal.lock:
            if self.terminal.bar is self:
                self.terminal.bar = None
            bar, self._bar = self._bar, None
            if exc_type is None:
                bar.render_progress()  # the final rows/s and counts
            bar.__exit__(exc_type, exc, tb)

    def rows(self, rel_path: str, rows: int) -> None:
        """``rows`` of shard ``rel_path`` are scored so far (it is still being scored)."""
        if self._bar is None:
            return
        with self.terminal.lock:
            step = self.count.rows(rel_path, rows)
            if step:
                self._bar.update(step)

    def update(self, result: Any) -> None:
        """Count one finished shard (any status) and its ``rows_in`` (None counts as 0), less
        what :meth:`rows` counted of it already."""
        if self._bar is None:
            return
        with self.terminal.lock:
            step = self.count.finish(result)
            self._bar.update(step)
            if step == 0:  # click only redraws on a change of the line; the counts changed
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


def _duration(seconds: float) -> str:
    """``45s``, ``12m 05s``, ``3h 07m``: an ETA in a log line."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"


class ProgressLog:
    """Progress as a log line every ``interval_s`` seconds, where no bar is drawn (stderr is not
    a terminal, as in cron's log, or the log is JSON).

    Text: ``progress: 120,000/200,000 rows (60%), 3/8 shards, 41,250 rows/s, ETA 1m 56s``, at
    INFO (so none with ``-q``). JSON: the same record with ``"event": "progress"`` and the fields
    ``rows``, ``rows_total``, ``percent``, ``shards_done``, ``shards_total``, ``rows_per_s`` and
    ``eta_s`` (null until a row is done). Rows move inside shards, from the workers' reports
    (``rows``), as on the bar. A thread writes the lines, so a run that stalls keeps saying so.
    """

    def __init__(self, total_rows: int, total_shards: int, interval_s: float) -> None:
        self.total_rows = max(0, int(total_rows))
        self.total_shards = max(0, int(total_shards))
        self.interval_s = interval_s
        self.count = RowCounter()
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._start = time.monotonic()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> ProgressLog:
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="progress-log", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def rows(self, rel_path: str, rows: int) -> None:
        with self._lock:
            self.count.rows(rel_path, rows)

    def update(self, result: Any) -> None:
        with self._lock:
            self.count.finish(result)

    def _loop(self) -> None:
        while not self._done.wait(self.interval_s):
            try:
                self.log_line()
            except Exception:  # a progress line must never stop the run
                logger.debug("progress line failed", exc_info=True)

    def log_line(self) -> None:
        """Log one progress line now."""
        with self._lock:
            rows, shards = self.count.rows_done, self.count.shards_done
        elapsed = time.monotonic() - self._start
        rate = rows / elapsed if elapsed > 0 else 0.0
        eta = (self.total_rows - rows) / rate if rate > 0 else None
        percent = 100.0 * rows / self.total_rows if self.total_rows else 100.0
        logger.info(
            "progress: %s/%s rows (%.0f%%), %d/%d shards, %s rows/s, ETA %s",
            f"{rows:,}",
            f"{self.total_rows:,}",
            percent,
            shards,
            self.total_shards,
            f"{rate:,.0f}",
            "unknown" if eta is None else _duration(eta),
            extra={
                "event": "progress",
                "rows": rows,
                "rows_total": self.total_rows,
                "percent": round(percent, 1),
                "shards_done": shards,
                "shards_total": self.total_shards,
                "rows_per_s": rate,
                "eta_s": eta,
            },
        )
