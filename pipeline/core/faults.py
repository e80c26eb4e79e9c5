"""Named crash points for the SIGKILL test suite.

``_SCORE_CATALOG_KILL_AT=point:N`` makes the process SIGKILL itself the N-th time it reaches
``point``: a real, unclean death at a precise place (mid-batch, mid-write, between commits,
while writing the manifest), which a timer-based kill cannot aim at. ``point:N:FILE`` kills only
the first process to get there, across all processes (the one that creates ``FILE``): a Dask
worker's replacement forks with a fresh count and would otherwise die at the same place again.
Never set it outside tests.

``_SCORE_CATALOG_KILL_SIGNAL=SIGINT`` (or ``SIGTERM``) sends that signal instead of SIGKILL:
a Ctrl-C or a cron timeout arriving at a precise place.

``_SCORE_CATALOG_KILL_FROM=callback`` sends it from inside a weakref callback, where the
interpreter prints whatever is raised ("Exception ignored in ...") and drops it: the place where
importlib's module-lock callback and torch's C++ callbacks (pybind11, which aborts instead) run
Python during an import, and where a signal handler that raises loses the signal.

``_SCORE_CATALOG_FAIL_AT=point:N`` fills the disk instead: from the N-th time the process
reaches ``point`` on, every staged write (the points named ``*-rename``, just before a file is
published) raises ``OSError(ENOSPC)`` with no file name, as a full disk does. ``point:N:once``
fails that one write only. Deleting files still works, as on a full disk.

``_SCORE_CATALOG_PAUSE_AT=point:N:FILE`` holds the process there instead, so that a test acts
while the run is at a known step and cannot have moved on (a timer cannot promise that: a fast
machine finishes first, a slow one has not got there). The N-th time a process reaches
``point`` it appends its pid and a newline to ``FILE`` (the marker the test waits for), then
waits until ``FILE.release`` exists (the test creates it to let the run go on). Every process
that reaches the point pauses there (a Dask worker too): a test that holds both workers waits
for two lines. Several pauses are separated by commas (``batch-read:2:A,batch-read:9:B``).
Only the thread that reached the point waits: a Dask worker keeps answering its scheduler, the
driver's signal handlers still run. A pause never released ends the process after
``_SCORE_CATALOG_PAUSE_TIMEOUT_S`` seconds (default 300) with exit code 124 and a line on
stderr, so that a broken test cannot hang CI: a loud failure, never a run that goes on as if
it had been released.

The environment is read when a point is first reached, not when this module is imported (a
process that sets the variables after importing the package is still heard), and read again
whenever the variables change. Unset, a point costs three environment lookups (``KILL_AT``,
``FAIL_AT``, ``PAUSE_AT``; the signal's is read only when a kill is asked for), as many as it
did before pauses existed.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
import weakref
from dataclasses import dataclass, field

KILL_AT = "_SCORE_CATALOG_KILL_AT"
KILL_SIGNAL = "_SCORE_CATALOG_KILL_SIGNAL"
KILL_FROM = "_SCORE_CATALOG_KILL_FROM"
FAIL_AT = "_SCORE_CATALOG_FAIL_AT"
PAUSE_AT = "_SCORE_CATALOG_PAUSE_AT"
PAUSE_TIMEOUT = "_SCORE_CATALOG_PAUSE_TIMEOUT_S"

PAUSE_TIMEOUT_S = 300.0  # a test acts on a paused run within seconds; this only ends a hang
PAUSE_TIMEOUT_EXIT = 124  # what GNU timeout exits with: nobody released the pause in time
RELEASE_SUFFIX = ".release"  # FILE.release lets the processes paused at FILE go on
_POLL_S = 0.005  # how often a paused process looks for its release file


def _point(spec: str) -> tuple[str, int, str]:
    """``point:N:rest`` -> (point, N, rest); N is 1 when absent or not a number."""
    point, _, rest = spec.partition(":")
    n, _, tail = rest.partition(":")
    return point, int(n) if n.isdigit() else 1, tail


@dataclass
class _Faults:
    """What the environment asked for, and how often each point was reached."""

    env: tuple[str, str, str, str]
    kill_point: str = ""
    kill_target: int = 1
    kill_once_file: str = ""
    kill_signal: signal.Signals = signal.SIGKILL
    fail_point: str = ""
    fail_target: int = 1
    fail_mode: str = ""
    # point -> [(N, FILE)]: where to pause, the N-th time, writing to FILE
    pauses: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    hits: dict[str, int] = field(default_factory=dict)
    full: bool = False  # the disk is full from here on (set once the fail point is reached)

    @classmethod
    def read(cls, env: tuple[str, str, str, str]) -> _Faults:
        kill, sig, fail, pause = env
        k_point, k_n, k_once = _point(kill)
        f_point, f_n, f_mode = _point(fail)
        pauses: dict[str, list[tuple[int, str]]] = {}
        for spec in filter(None, pause.split(",")):
            p_point, p_n, p_file = _point(spec)
            if not p_file:
                raise ValueError(f"{PAUSE_AT}={pause!r}: each pause is point:N:FILE")
            pauses.setdefault(p_point, []).append((p_n, p_file))
        return cls(env, k_point, k_n, k_once, signal.Signals[sig], f_point, f_n, f_mode, pauses)


_STATE: list[_Faults] = []  # the faults of this process, read at the first checkpoint


def _faults() -> _Faults:
    kill = os.environ.get(KILL_AT, "")
    # The signal matters only with a kill point: unset, a checkpoint reads three variables.
    sig = os.environ.get(KILL_SIGNAL, "SIGKILL") if kill else "SIGKILL"
    env = (kill, sig, os.environ.get(FAIL_AT, ""), os.environ.get(PAUSE_AT, ""))
    if not _STATE or _STATE[0].env != env:
        _STATE[:] = [_Faults.read(env)]
    return _STATE[0]


def _pause(f: _Faults, point: str) -> None:
    """Hold this thread at ``point`` if the test asked for it (see the module doc)."""
    f.hits[f"pause:{point}"] = n = f.hits.get(f"pause:{point}", 0) + 1
    for target, marker in f.pauses[point]:
        if n != target:
            continue
        fd = os.open(marker, os.O_CREAT | os.O_APPEND | os.O_WRONLY, 0o644)
        try:
            os.write(fd, f"{os.getpid()}\n".encode())  # one write: the lines never interleave
        finally:
            os.close(fd)
        timeout = float(os.environ.get(PAUSE_TIMEOUT, PAUSE_TIMEOUT_S))
        deadline = time.monotonic() + timeout
        while not os.path.exists(marker + RELEASE_SUFFIX):
            if time.monotonic() > deadline:
                print(
                    f"{PAUSE_AT}: paused at {point}:{target} for {timeout:g} s and never "
                    f"released ({marker}{RELEASE_SUFFIX} was not created): exiting",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(PAUSE_TIMEOUT_EXIT)
            time.sleep(_POLL_S)


def _disk_full(f: _Faults, point: str) -> None:
    """Raise ENOSPC here if the test filled the disk (see the module doc)."""
    if point == f.fail_point:
        f.hits[f"fail:{point}"] = n = f.hits.get(f"fail:{point}", 0) + 1
        if n == f.fail_target:
            if f.fail_mode == "once":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            f.full = True
    if f.full and point.endswith("rename"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def checkpoint(point: str) -> None:
    """Die here, pause here (or fail to write) if the test asked for it."""
    f = _faults()
    if f.fail_point:
        _disk_full(f, point)
    if point in f.pauses:
        _pause(f, point)
    if not f.kill_point or point != f.kill_point:
        return
    f.hits[point] = f.hits.get(point, 0) + 1
    if f.hits[point] != f.kill_target:
        return
    if f.kill_once_file:
        try:
            os.close(os.open(f.kill_once_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # another process died here already
    if os.environ.get(KILL_FROM, "") == "callback":
        _from_callback(f.kill_signal)
    else:
        os.kill(os.getpid(), f.kill_signal)


def _from_callback(sig: signal.Signals) -> None:
    """Send ``sig`` to this process from inside a weakref callback (see the module doc)."""

    class _Box:
        pass

    def callback(_ref: object) -> None:
        os.kill(os.getpid(), sig)
        _next()  # a call: Python runs the pending handler here, inside the callback

    box = _Box()
    ref = weakref.ref(box, callback)
    del box  # the callback runs now
    del ref


def _next() -> None:
    """Nothing: a Python function call, where the interpreter runs pending signal handlers."""
