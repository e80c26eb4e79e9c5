"""Named crash points for the SIGKILL test suite.

``_SCORE_CATALOG_KILL_AT=point:N`` makes the process SIGKILL itself the N-th time it reaches
``point``: a real, unclean death at a precise place (mid-batch, mid-write, between commits,
while writing the manifest), which a timer-based kill cannot aim at. ``point:N:FILE`` kills only
the first process to get there, across all processes (the one that creates ``FILE``): a Dask
worker's replacement forks with a fresh count and would otherwise die at the same place again.
Unset, it costs one dict lookup per call. Never set it outside tests.

``_SCORE_CATALOG_KILL_SIGNAL=SIGINT`` (or ``SIGTERM``) sends that signal instead of SIGKILL:
a Ctrl-C or a cron timeout arriving at a precise place.

``_SCORE_CATALOG_FAIL_AT=point:N`` fills the disk instead: from the N-th time the process
reaches ``point`` on, every staged write (the points named ``*-rename``, just before a file is
published) raises ``OSError(ENOSPC)`` with no file name, as a full disk does. ``point:N:once``
fails that one write only. Deleting files still works, as on a full disk.
"""

from __future__ import annotations

import errno
import os
import signal

_SPEC = os.environ.get("_SCORE_CATALOG_KILL_AT", "")
_POINT, _, _REST = _SPEC.partition(":")
_N, _, _ONCE = _REST.partition(":")
_TARGET = int(_N) if _N.isdigit() else 1
_SIGNAL = signal.Signals[os.environ.get("_SCORE_CATALOG_KILL_SIGNAL", "SIGKILL")]
_hits: dict[str, int] = {}

_FAIL_POINT, _, _FAIL_REST = os.environ.get("_SCORE_CATALOG_FAIL_AT", "").partition(":")
_FAIL_N, _, _FAIL_MODE = _FAIL_REST.partition(":")
_FAIL_TARGET = int(_FAIL_N) if _FAIL_N.isdigit() else 1
_full: list[bool] = []  # the disk is full from here on (set once the point is reached)


def _disk_full(point: str) -> None:
    """Raise ENOSPC here if the test filled the disk (see the module doc)."""
    if point == _FAIL_POINT:
        _hits[f"fail:{point}"] = n = _hits.get(f"fail:{point}", 0) + 1
        if n == _FAIL_TARGET:
            if _FAIL_MODE == "once":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            _full.append(True)
    if _full and point.endswith("rename"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def checkpoint(point: str) -> None:
    """Die here (or fail to write) if the test asked for it."""
    if _FAIL_POINT:
        _disk_full(point)
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
