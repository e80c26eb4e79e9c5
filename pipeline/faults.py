"""Named crash points for the SIGKILL test suite.

``_SCORE_CATALOG_KILL_AT=point:N`` makes the process SIGKILL itself the N-th time it reaches
``point``: a real, unclean death at a precise place (mid-batch, mid-write, between commits,
while writing the manifest), which a timer-based kill cannot aim at. ``point:N:FILE`` kills only
the first process to get there, across all processes (the one that creates ``FILE``): a Dask
worker's replacement forks with a fresh count and would otherwise die at the same place again.
Unset, it costs one dict lookup per call. Never set it outside tests.

``_SCORE_CATALOG_KILL_SIGNAL=SIGINT`` (or ``SIGTERM``) sends that signal instead of SIGKILL:
a Ctrl-C or a cron timeout arriving at a precise place.
"""

from __future__ import annotations

import os
import signal

_SPEC = os.environ.get("_SCORE_CATALOG_KILL_AT", "")
_POINT, _, _REST = _SPEC.partition(":")
_N, _, _ONCE = _REST.partition(":")
_TARGET = int(_N) if _N.isdigit() else 1
_SIGNAL = signal.Signals[os.environ.get("_SCORE_CATALOG_KILL_SIGNAL", "SIGKILL")]
_hits: dict[str, int] = {}


def checkpoint(point: str) -> None:
    """Die here if the test asked for it."""
    if not _POINT or point != _POINT:
        return
    _hits[point] = _hits.get(point, 0) + 1
    if _hits[point] != _TARGET:
        return
    if _ONCE:
        try:
            os.close(os.open(_ONCE, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # another process died here already
    os.kill(os.getpid(), _SIGNAL)
