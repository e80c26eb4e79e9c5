"""The terminal the CLI's log lines and its progress bar share (stderr)."""

from __future__ import annotations

import sys
import threading
from typing import Any, Protocol, TextIO


class Bar(Protocol):
    """A progress bar drawn on a :class:`Terminal` (``pipeline.cli.progress.Progress``): log
    lines clear its line, write themselves, then redraw it below."""

    def draws_on(self, stream: Any) -> bool: ...

    def clear_line(self) -> None: ...

    def redraw(self) -> None: ...


class Terminal:
    """The stream (stderr) that log lines and at most one progress bar share.

    The CLI creates one and hands it to :func:`setup_logging` (for the log handlers) and to
    :class:`Progress`; ``lock`` serialises log lines and bar redraws (Dask logs from its own
    threads), and ``bar`` is the bar drawn on it now, if any.
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream: TextIO = stream if stream is not None else sys.stderr
        self.lock = threading.RLock()
        self.bar: Bar | None = None
