"""The run lock: one run at a time on an output.

``_lock.json`` at the output root names its holder (host, pid, run id, start time). A second run
refuses with that information. A lock is stale, and taken over, when its holder was on this host
and its pid is gone, or when it is older than ``stale_after_s``. On local disk the lock is created
with O_EXCL; object stores have no such primitive, so there the check-then-write leaves a small
race that two runs started in the same second could lose.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from pipeline import storage
from pipeline.errors import LockError
from pipeline.storage import Location

LOCK_NAME = "_lock.json"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class RunLock:
    loc: Location
    holder: dict[str, Any]
    took_over: dict[str, Any] | None = None

    @classmethod
    def acquire(cls, root: Location, run_id: str, *, stale_after_s: float) -> RunLock:
        """Take the lock or raise :class:`LockError` naming who holds it."""
        loc = root.child(LOCK_NAME)
        me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "run_id": run_id,
            "started_at": dt.datetime.now(dt.timezone.utc).isoformat(),
            "started_ts": time.time(),
        }
        root.fs.makedirs(root.path, exist_ok=True)
        took_over = None
        for _ in range(2):
            if cls._create(loc, me):
                return cls(loc, me, took_over)
            try:
                held = storage.read_json(loc)
            except json.JSONDecodeError:
                held = None  # a torn lock from a crash mid-write: nobody can hold it
            if held is None:
                storage.remove(loc)
                continue
            reason = cls._stale_reason(held, stale_after_s)
            if reason is None:
                raise LockError(
                    f"output {root.uri} is locked by run {held.get('run_id')} (pid "
                    f"{held.get('pid')} on {held.get('host')}, since {held.get('started_at')}). "
                    f"Wait for it to finish; if it is dead, delete {loc.uri}."
                )
            took_over = {**held, "reason": reason}
            storage.remove(loc)
        raise LockError(f"could not take the lock {loc.uri}: another run keeps taking it")

    @staticmethod
    def _create(loc: Location, me: dict[str, Any]) -> bool:
        data = json.dumps(me).encode()
        if loc.is_local:
            try:
                fd = os.open(loc.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            return True
        if storage.exists(loc):
            return False
        storage.write_bytes(loc, data)
        return True

    @staticmethod
    def _stale_reason(held: dict[str, Any], stale_after_s: float) -> str | None:
        age = time.time() - float(held.get("started_ts") or 0)
        pid = held.get("pid")
        if (
            held.get("host") == socket.gethostname()
            and isinstance(pid, int)
            and not _pid_alive(pid)
        ):
            return f"pid {pid} is no longer running on this host"
        if age > stale_after_s:
            return f"lock is {age:.0f}s old (stale after {stale_after_s:.0f}s)"
        return None

    def release(self) -> None:
        storage.remove(self.loc)
