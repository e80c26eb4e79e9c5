"""Launch one measured subprocess: wall time, whole-tree peak RSS, and leftover-process checks.

Every comparator runs in a fresh process so that torch thread settings, model caches, Dask
clusters and allocator state never leak from one measurement into the next.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

SAMPLE_INTERVAL_S = 0.05


def tree_pids(root: int) -> list[int]:
    """``root`` and all its descendants that exist right now.

    psutil finds children by their parent pid, so a child forked from a non-main thread (Dask's
    nanny starts workers from its event-loop thread) is found too.
    """
    try:
        proc = psutil.Process(root)
        return [root, *(c.pid for c in proc.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def rss_bytes(pid: int) -> int:
    """Resident set size of one process (0 if it is gone)."""
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return 0


def tree_rss_bytes(root: int) -> int:
    """Sum of RSS over ``root`` and its descendants (shared pages are counted once per process,
    as the brief asks: an upper bound of what the tree holds)."""
    return sum(rss_bytes(p) for p in tree_pids(root))


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:  # gone, or not ours to ask about
        return None


def session_members(sid: int) -> list[int]:
    """Processes whose session id is ``sid`` (the leader included, if alive)."""
    return [pid for pid in psutil.pids() if _sid(pid) == sid]


@dataclass
class ProcRun:
    """What one measured subprocess did."""

    argv: list[str]
    returncode: int
    wall_s: float
    peak_rss_bytes: int
    stdout: str
    log_path: Path
    leaked_pids: list[int] = field(default_factory=list)
    timed_out: bool = False
    started_epoch: float = 0.0  # wall clock just before the process was started

    def log_tail(self, lines: int = 25) -> str:
        """The last lines of its stderr, for error messages."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def _sample_peak(
    proc: subprocess.Popen[str],
    peak: list[int],
    stop: threading.Event,
    memory: Callable[[int], int] = tree_rss_bytes,
) -> None:
    while not stop.is_set() and proc.poll() is None:
        peak[0] = max(peak[0], memory(proc.pid))
        stop.wait(SAMPLE_INTERVAL_S)


def _reap_leftovers(sid: int, grace_s: float = 5.0) -> list[int]:
    """Wait for processes left in the child's session to exit; kill (by pid) any that do not.

    Only processes in the session this harness created are touched.
    """
    deadline = time.monotonic() + grace_s
    left = session_members(sid)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = session_members(sid)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


def run_measured(
    argv: Sequence[str],
    *,
    log_path: Path,
    cwd: Path,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 300.0,
    memory: Callable[[int], int] = tree_rss_bytes,
) -> ProcRun:
    """Run ``argv`` to completion, timing it and sampling its process tree's RSS (or what
    ``memory`` measures of it) every ~50 ms.

    The child gets its own session so that anything it leaves running (a Dask worker that
    outlived its cluster) can be found afterwards and reported.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    out_path = log_path.with_suffix(".stdout")
    peak = [0]
    stop = threading.Event()
    # stdout goes to a file, not a pipe: a process left behind would hold a pipe open, and
    # reading it to the end would wait for that process instead of reporting it.
    with open(log_path, "w") as log, open(out_path, "w") as out:
        started = time.time()
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            list(argv),
            cwd=cwd,
            env=dict(env) if env is not None else None,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=log,
            text=True,
            start_new_session=True,
        )
        sampler = threading.Thread(
            target=_sample_peak, args=(proc, peak, stop, memory), daemon=True
        )
        sampler.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            # A hung run (a Dask worker that stopped heartbeating, say) must not stall the
            # whole bench: kill its process group and report it as a failure.
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        wall = time.perf_counter() - t0
        stop.set()
        sampler.join()
    stdout = out_path.read_text(errors="replace")
    leaked = _reap_leftovers(proc.pid)
    return ProcRun(
        list(argv), proc.returncode, wall, peak[0], stdout, log_path, leaked, timed_out, started
    )


def report_file(output: Path) -> Path:
    """The ``_report.json`` of a run into ``output``: in its control folder, beside it
    (``pipeline.io.layout``)."""
    return output.parent / "_score_catalog" / output.name / "_report.json"
