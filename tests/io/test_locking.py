"""The run lock with real processes contending for it: exclusive create, liveness, fencing.

Every contender is a separate Python process (:class:`Contender`) that imports only
``pipeline.io.locking`` and its storage seam, waits for a "go" line, takes the lock, and later
checks whether it still holds it and releases it. The S3 variants of these tests are in
``tests/integration/test_s3_lock.py`` and reuse the helpers here.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from pipeline.core.errors import LockError
from pipeline.io import storage
from pipeline.io.layout import LOCK_NAME
from pipeline.io.locking import LockLostError, RunLock, assert_holder, process_start

REPO = Path(__file__).resolve().parents[2]
# stale_after_s for the heartbeat tests: 20 missed beats of 0.1 s, so a busy machine that delays
# a beat does not make a live holder look stale.
STALE_S = 2.0

# The contender process. It loads pipeline/ as a bare package so that it imports only the lock
# and its storage seam, not torch (pipeline/__init__ imports the whole library: 2.5 s a process).
CHILD = r"""
import json, os, socket, sys, types
args = json.loads(sys.argv[1])
if args.get("host"):
    socket.gethostname = lambda: args["host"]  # pretend to run on another machine
if args.get("clock_ahead_s"):
    import time
    _real_time = time.time
    time.time = lambda: _real_time() + args["clock_ahead_s"]  # that machine's clock is ahead
pkg = types.ModuleType("pipeline")
pkg.__path__ = [os.path.join(os.getcwd(), "pipeline")]
sys.modules["pipeline"] = pkg
from pipeline.io import storage
from pipeline.core.errors import LockError
from pipeline.io.locking import LockLostError, RunLock

def say(**kw):
    print(json.dumps(kw), flush=True)

root = storage.locate(args["root"], args.get("options"))
say(ready=True, pid=os.getpid())
sys.stdin.readline()  # "go"
try:
    lock = RunLock.acquire(root, args["run_id"], stale_after_s=args["stale"],
                           heartbeat_s=args.get("heartbeat"))
except LockError as e:
    say(got=False, error=str(e))
    sys.exit(0)
say(got=True, token=lock.token, took_over=lock.took_over)
sys.stdin.readline()  # "check"
try:
    lock.assert_held()
    say(held=True, error="")
except LockLostError as e:
    say(held=False, error=str(e))
lock.release()
say(released=True)
"""


class Contender:
    """One process that will try to take the lock on ``root``."""

    def __init__(
        self,
        root: str,
        run_id: str,
        *,
        stale: float = 3600.0,
        host: str | None = None,
        heartbeat: float | None = None,
        options: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        clock_ahead_s: float = 0.0,
    ) -> None:
        args = {
            "root": root,
            "run_id": run_id,
            "stale": stale,
            "host": host,
            "heartbeat": heartbeat,
            "options": dict(options or {}),
            "clock_ahead_s": clock_ahead_s,
        }
        self.run_id = run_id
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps(args)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(env) if env is not None else None,
        )
        self.ready = self._line()
        self.result: dict[str, Any] = {}

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"contender {self.run_id} exited early:\n{err}")
        return dict(json.loads(line))

    def send(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def acquired(self) -> dict[str, Any]:
        self.result = self._line()
        return self.result

    def check_and_release(self) -> dict[str, Any]:
        self.send()
        held = self._line()
        assert self._line() == {"released": True}
        self.proc.wait(timeout=30)
        return held

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def close(self) -> None:
        self.kill()
        self.proc.wait(timeout=30)
        for s in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if s is not None:
                s.close()


@pytest.fixture
def contenders() -> Iterator[Callable[..., Contender]]:
    made: list[Contender] = []

    def make(*args: Any, **kwargs: Any) -> Contender:
        c = Contender(*args, **kwargs)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def race(procs: list[Contender]) -> list[dict[str, Any]]:
    """Start every contender's acquire at once (all are ready), return what each got."""
    for p in procs:
        p.send()
    return [p.acquired() for p in procs]


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def read_lock(root: Path) -> dict[str, Any]:
    return dict(json.loads((root / LOCK_NAME).read_text()))


# --------------------------------------------------------------------------- in one process


def test_acquire_writes_the_holder_and_release_removes_it(tmp_path: Path) -> None:
    root = storage.locate(str(tmp_path / "out"))
    lock = RunLock.acquire(root, "run-a", stale_after_s=60)
    try:
        held = read_lock(tmp_path / "out")
        assert held["run_id"] == "run-a" and held["token"] == lock.token
        assert held["pid"] == os.getpid() and held["host"] == socket.gethostname()
        assert held["pid_start"] == process_start(os.getpid())
        assert lock.took_over is None
        lock.assert_held()
        assert_holder(str(tmp_path / "out"), "run-a", lock.token)
    finally:
        lock.release()
    assert not (tmp_path / "out" / LOCK_NAME).exists()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []
    lock.release()  # idempotent


def test_a_second_lock_in_the_same_process_is_refused(tmp_path: Path) -> None:
    root = storage.locate(str(tmp_path))
    with (
        RunLock.acquire(root, "first", stale_after_s=60),
        pytest.raises(LockError, match="locked by run first"),
    ):
        RunLock.acquire(root, "second", stale_after_s=60)
    with RunLock.acquire(root, "third", stale_after_s=60) as lock:
        assert lock.took_over is None


def test_a_lock_naming_this_process_but_not_held_is_stale(tmp_path: Path) -> None:
    # A restarted container: same hostname, same pid (1), the old incarnation's lock.
    stale = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "run_id": "before-restart",
        "token": "t-old",
        "started_ts": time.time(),
    }
    (tmp_path / LOCK_NAME).write_text(json.dumps(stale))
    with RunLock.acquire(storage.locate(str(tmp_path)), "after", stale_after_s=3600) as lock:
        assert lock.took_over is not None
        assert lock.took_over["run_id"] == "before-restart"
        assert "names this process" in lock.took_over["reason"]
        assert read_lock(tmp_path)["run_id"] == "after"


def test_release_leaves_a_lock_that_is_no_longer_ours(tmp_path: Path) -> None:
    root = storage.locate(str(tmp_path))
    lock = RunLock.acquire(root, "mine", stale_after_s=60)
    other = {**read_lock(tmp_path), "run_id": "theirs", "token": "their-token"}
    (tmp_path / LOCK_NAME).write_text(json.dumps(other))
    with pytest.raises(LockLostError, match="theirs") as e:
        lock.assert_held()
    assert str(tmp_path / LOCK_NAME) in str(e.value)
    with pytest.raises(LockLostError, match="theirs"):
        assert_holder(str(tmp_path), "mine", lock.token)
    lock.release()
    assert read_lock(tmp_path)["run_id"] == "theirs"


def test_a_deleted_lock_fails_the_fence(tmp_path: Path) -> None:
    lock = RunLock.acquire(storage.locate(str(tmp_path)), "mine", stale_after_s=60)
    (tmp_path / LOCK_NAME).unlink()
    with pytest.raises(LockLostError, match="gone"):
        lock.assert_held()
    lock.release()


def test_heartbeat_file_is_refreshed_and_removed(tmp_path: Path) -> None:
    lock = RunLock.acquire(storage.locate(str(tmp_path)), "beats", stale_after_s=0.2)
    hb = tmp_path / f"_lock.heartbeat-{lock.token}.json"
    wait_for(hb.exists, "the first heartbeat")
    first = json.loads(hb.read_text())["heartbeat_ts"]
    wait_for(lambda: json.loads(hb.read_text())["heartbeat_ts"] != first, "a second heartbeat")
    lock.release()
    assert not hb.exists() and not (tmp_path / LOCK_NAME).exists()


# --------------------------------------------------------------------------- real processes


def test_of_processes_started_together_exactly_one_gets_the_lock(
    tmp_path: Path, contenders: Callable[..., Contender]
) -> None:
    for round_ in range(3):
        root = tmp_path / f"out{round_}"
        procs = [contenders(str(root), f"run-{round_}-{i}") for i in range(4)]
        results = race(procs)
        winners = [p for p, r in zip(procs, results, strict=True) if r["got"]]
        assert len(winners) == 1, results
        for r in results:
            if not r["got"]:
                assert f"locked by run {winners[0].run_id}" in r["error"]
        assert read_lock(root)["run_id"] == winners[0].run_id
        assert winners[0].check_and_release() == {"held": True, "error": ""}
        assert not (root / LOCK_NAME).exists()


def test_a_live_holder_is_never_taken_over_however_old(
    tmp_path: Path, contenders: Callable[..., Contender]
) -> None:
    holder = contenders(str(tmp_path), "holder", stale=0.1)
    assert race([holder])[0]["got"]
    lock = read_lock(tmp_path)
    # Older than stale_after_s by far, but its pid runs with the recorded start time.
    (tmp_path / LOCK_NAME).write_text(json.dumps({**lock, "started_ts": 0, "heartbeat_ts": 0}))
    with pytest.raises(LockError, match="locked by run holder") as e:
        RunLock.acquire(storage.locate(str(tmp_path)), "second", stale_after_s=0.1)
    assert f"pid {holder.pid}" in str(e.value)
    assert holder.check_and_release()["held"] is True


def test_a_sigkilled_holder_is_stale_by_pid(
    tmp_path: Path, contenders: Callable[..., Contender]
) -> None:
    holder = contenders(str(tmp_path), "killed", stale=3600)
    assert race([holder])[0]["got"]
    holder.kill()
    holder.proc.wait(timeout=30)
    with RunLock.acquire(storage.locate(str(tmp_path)), "next", stale_after_s=3600) as lock:
        assert lock.took_over is not None and lock.took_over["run_id"] == "killed"
        assert f"pid {holder.pid} is no longer running" in lock.took_over["reason"]
        assert "token" not in lock.took_over


def test_a_reused_pid_does_not_keep_a_dead_holders_lock(tmp_path: Path) -> None:
    # The lock's pid now belongs to another process (this one, started at another time).
    sleeper = subprocess.Popen(
        # Alive until the test kills it, however long the run takes (it slept 60 s before).
        [sys.executable, "-c", "import signal; signal.pause()"]
    )
    try:
        lock = {
            "host": socket.gethostname(),
            "pid": sleeper.pid,
            "pid_start": "1",  # not the sleeper's start time
            "run_id": "long-gone",
            "token": "t",
            "started_ts": time.time(),
        }
        (tmp_path / LOCK_NAME).write_text(json.dumps(lock))
        with RunLock.acquire(storage.locate(str(tmp_path)), "new", stale_after_s=3600) as got:
            assert got.took_over is not None
            assert "another process has its pid" in got.took_over["reason"]
    finally:
        sleeper.kill()
        sleeper.wait()


def test_many_contenders_take_over_a_dead_lock_and_only_one_wins(
    tmp_path: Path, contenders: Callable[..., Contender]
) -> None:
    for round_ in range(2):
        root = tmp_path / f"out{round_}"
        dead = contenders(str(root), f"dead-{round_}")
        assert race([dead])[0]["got"]
        dead.kill()
        dead.proc.wait(timeout=30)
        procs = [contenders(str(root), f"taker-{round_}-{i}") for i in range(4)]
        results = race(procs)
        winners = [p for p, r in zip(procs, results, strict=True) if r["got"]]
        assert len(winners) == 1, results
        assert read_lock(root)["run_id"] == winners[0].run_id
        assert winners[0].check_and_release()["held"] is True
        # No lock, takeover claim or heartbeat of anyone is left behind.
        assert not [p.name for p in root.iterdir() if p.name.startswith("_lock")]


def superseded_holder(
    root: str,
    contenders: Callable[..., Contender],
    take: Callable[[], RunLock],
    **kwargs: Any,
) -> tuple[Contender, RunLock]:
    """A holder on "another host" that stops heartbeating (SIGSTOP), and the run that then
    takes its lock over; the holder is resumed before returning."""
    holder = contenders(root, "paused", host="elsewhere.example", **kwargs)
    assert race([holder])[0]["got"]
    # While it beats, the lock is not stale however long we wait past stale_after_s.
    time.sleep(2 * float(kwargs["stale"]))
    with pytest.raises(LockError, match="locked by run paused"):
        take()
    holder.kill(signal.SIGSTOP)
    try:
        taken: list[RunLock] = []

        def try_take() -> bool:
            try:
                taken.append(take())
            except LockError:
                return False
            return True

        wait_for(try_take, "the paused holder's lock to become stale")
    finally:
        holder.kill(signal.SIGCONT)
    return holder, taken[0]


@pytest.mark.slow
def test_a_silent_remote_holder_is_superseded_and_fenced(
    tmp_path: Path, contenders: Callable[..., Contender]
) -> None:
    root = storage.locate(str(tmp_path))
    holder, lock = superseded_holder(
        str(tmp_path),
        contenders,
        lambda: RunLock.acquire(root, "successor", stale_after_s=STALE_S),
        stale=STALE_S,
        heartbeat=0.1,
    )
    try:
        assert lock.took_over is not None and lock.took_over["run_id"] == "paused"
        assert "no heartbeat from host elsewhere.example" in lock.took_over["reason"]
        # The old holder wakes up: its fence fails, naming the lock and the new holder, and its
        # release leaves the successor's lock alone.
        held = holder.check_and_release()
        assert held["held"] is False
        assert str(tmp_path / LOCK_NAME) in held["error"] and "successor" in held["error"]
        lock.assert_held()
        assert read_lock(tmp_path)["token"] == lock.token
    finally:
        lock.release()


@pytest.mark.slow
def test_a_remote_holder_whose_clock_is_ahead_is_judged_by_the_storage_clock(
    tmp_path: Path, contenders: Callable[..., Contender]
) -> None:
    """Issue 22, 9a: a heartbeat stamped days in the future (the holder's clock ahead) kept a
    dead holder's lock for as long as the skew, and the refusal did not say why."""
    root = storage.locate(str(tmp_path))
    ahead = 10 * 86_400.0
    holder, lock = superseded_holder(
        str(tmp_path),
        contenders,
        lambda: RunLock.acquire(root, "successor", stale_after_s=STALE_S),
        stale=STALE_S,
        heartbeat=0.1,
        clock_ahead_s=ahead,
    )
    try:
        reason = str((lock.took_over or {}).get("reason"))
        assert "no heartbeat from host elsewhere.example" in reason
        assert "by the storage's clock" in reason
        assert "by host elsewhere.example's clock" in reason
        assert f"ahead of this host's ({socket.gethostname()}: " in reason
        held = holder.check_and_release()  # fenced: it finds out at its next commit
        assert held["held"] is False and "successor" in held["error"]
    finally:
        lock.release()


def test_a_live_holder_whose_clock_is_ahead_is_refused_naming_both_clocks(
    tmp_path: Path, contenders: Callable[..., Contender]
) -> None:
    root = storage.locate(str(tmp_path))
    holder = contenders(
        str(tmp_path), "ahead", host="elsewhere.example", stale=STALE_S, heartbeat=0.1,
        clock_ahead_s=10 * 86_400.0,
    )  # fmt: skip
    assert race([holder])[0]["got"]
    time.sleep(2 * STALE_S)  # beating all along: the storage sees fresh heartbeats
    with pytest.raises(LockError) as e:
        RunLock.acquire(root, "second", stale_after_s=STALE_S)
    msg = " ".join(str(e.value).split())
    assert "locked by run ahead" in msg
    assert "Its holder's clock is ahead: its last heartbeat is stamped" in msg
    assert "by host elsewhere.example's clock" in msg
    assert f"ahead of this host's ({socket.gethostname()}: " in msg
    assert "more than stale_lock_after_s (2s)" in msg and "looks alive" in msg
    assert "Fix the clock on elsewhere.example (NTP)" in msg
    assert holder.check_and_release()["held"] is True
