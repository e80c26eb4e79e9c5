"""The run lock: one run at a time on an output, and a fence so that only its holder commits.

``_lock.json`` at the output root names its holder: host (hostname, boot id, pid namespace),
pid and the pid's start time, run id, and a random token. It is taken with an exclusive create
(:func:`pipeline.io.storage.exclusive_create`: a hard link on local disk, ``If-None-Match: *`` on
S3), so of two runs started together exactly one gets it.

A lock is never taken over while its holder is alive:

* same machine (same hostname, boot id and pid namespace): the holder is alive while its pid
  runs with the start time the lock recorded (``/proc/<pid>/stat``; a reused pid has another).
  A lock naming this very process but no lock it holds was left by an earlier run of it (a
  restarted container keeps its hostname and pid 1), so it is stale;
* elsewhere: the holder refreshes a heartbeat (``_lock.heartbeat-<token>.json``) from a daemon
  thread every ``stale_after_s / 4`` (at most every minute); the lock is stale once the last
  heartbeat is older than ``stale_after_s``. This compares the holder's clock with ours: hosts
  are assumed to keep time (NTP), a skew must stay well below ``stale_after_s``. A heartbeat
  stamped more than ``stale_after_s`` in the future is that assumption broken (the holder's
  clock is ahead): its age would keep a dead holder's lock for as long as the skew, for ever
  with a clock years off. Such a lock is judged by when the storage last saw its heartbeat (or
  lock) file written instead, by the storage's clock: stale once that is older than
  ``stale_after_s``; otherwise refused with a message that names both clocks.

Taking over a stale lock is race-free: contenders first exclusive-create a claim named after the
stale lock's token (``_lock.takeover-<token>-<n>.json``); only the one that gets it deletes the
stale lock, after reading it again, and then competes for ``_lock.json`` with an exclusive
create like anyone else. A holder that was wrongly judged stale (paused longer than
``stale_after_s``) finds out at its next commit: :meth:`RunLock.assert_held` and
:func:`assert_holder` raise :class:`LockLostError`, and :meth:`RunLock.release` removes the
lock only while it still holds the lock's token.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline.core import retries
from pipeline.core.errors import LockError, PipelineError, StorageError
from pipeline.io import storage
from pipeline.io.layout import HEARTBEAT_PREFIX, LOCK_NAME, TAKEOVER_PREFIX
from pipeline.io.storage import Location

logger = logging.getLogger(__name__)

# A takeover claim older than this belongs to a contender that died mid-takeover (which takes
# milliseconds); the next contender then claims the next generation instead.
TAKEOVER_GRACE_S = 30.0
_MAX_CLAIM_GENERATIONS = 16
_MAX_ROUNDS = 20  # attempts to get the lock while it keeps changing hands
_MAX_HEARTBEAT_S = 60.0

# Tokens of the locks this process holds now: a lock naming this pid is alive only if listed.
_HELD: set[str] = set()
_HELD_GUARD = threading.Lock()


class LockLostError(LockError):
    """This run no longer holds its lock: another run took it over, or it was deleted."""


#: ``kind`` of the result of a shard whose commit found the lock lost (never in a report: the
#: run stops at it without writing one, since the output belongs to another run now).
LOCK_LOST_KIND = "lock_lost"


# --------------------------------------------------------------------------- who is alive


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _stat_fields(pid: int) -> list[str] | None:
    """Fields 3.. of ``/proc/<pid>/stat`` (after the command name), or None if unavailable."""
    raw = _read_text(f"/proc/{pid}/stat")
    if raw is None or ")" not in raw:
        return None
    return raw.rsplit(")", 1)[1].split()


def process_start(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot (Linux), or None where unknown."""
    fields = _stat_fields(pid)
    # Field 22 (starttime) is the 20th after the command name.
    return fields[19] if fields and len(fields) > 19 else None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _identity() -> dict[str, Any]:
    """What names this process: host, boot, pid namespace, pid and the pid's start time."""
    return {
        "host": socket.gethostname(),
        "boot_id": _read_text("/proc/sys/kernel/random/boot_id"),
        "pid_ns": _pid_namespace(),
        "pid": os.getpid(),
        "pid_start": process_start(os.getpid()),
    }


def process_identity() -> dict[str, Any]:
    """This process, as :func:`process_gone` recognises it later (host, boot, pid namespace,
    pid and its start time)."""
    return _identity()


def process_gone(recorded: Mapping[str, Any]) -> bool:
    """True only when the process ``recorded`` (:func:`process_identity`) ran on this machine
    and boot and has exited (or its pid was reused); anything uncertain is not gone."""
    pid = recorded.get("pid")
    if not isinstance(pid, int) or not _same_machine(recorded, _identity()):
        return False
    return _local_holder_state(pid, recorded.get("pid_start")) in ("gone", "reused")


def _same_machine(held: Mapping[str, Any], me: Mapping[str, Any]) -> bool:
    """True when ``held`` was written in our pid namespace on this very machine and boot.

    Older locks carry only the hostname; for them the hostname decides, as it always did.
    """
    if held.get("host") != me["host"]:
        return False
    return all(held.get(k) in (None, me[k]) or me[k] is None for k in ("boot_id", "pid_ns"))


def _local_holder_state(pid: int, start: Any) -> str:
    """ "alive", "gone" or "reused" for a pid on this machine recorded with start time ``start``."""
    fields = _stat_fields(pid)
    if fields is None:
        if os.path.isdir("/proc/self"):
            return "gone"  # Linux: no /proc/<pid> means no such process
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "gone"
        except PermissionError:
            return "alive"
        return "alive"
    if fields[0] in ("Z", "X"):
        return "gone"  # a zombie has exited; only its parent has not collected it yet
    if start is not None and len(fields) > 19 and str(start) != fields[19]:
        return "reused"
    return "alive"


def _token_of(held: Mapping[str, Any]) -> str:
    """The lock's token; locks written before tokens existed get one from their content."""
    token = held.get("token")
    if isinstance(token, str) and token:
        return token
    return "legacy-" + hashlib.sha256(json.dumps(held, sort_keys=True).encode()).hexdigest()[:16]


def _stale_reason(
    held: Mapping[str, Any],
    last_beat: float,
    stale_after_s: float,
    now: float,
    written: float | None = None,
) -> str | None:
    """Why ``held`` is stale, or None while its holder may be alive. ``written``: when the
    storage last saw the holder's heartbeat (or lock) file written, by the storage's clock,
    for a heartbeat stamped in the future (see :func:`_skewed_reason`)."""
    me = _identity()
    pid = held.get("pid")
    if isinstance(pid, int) and _same_machine(held, me):
        if pid == me["pid"]:
            with _HELD_GUARD:
                mine = _token_of(held) in _HELD
            if mine and held.get("pid_start") in (None, me["pid_start"]):
                return None
            return (
                f"the lock names this process (pid {pid}) but no lock it holds: it was left by "
                "an earlier run in this process or container"
            )
        state = _local_holder_state(pid, held.get("pid_start"))
        if state == "gone":
            return f"pid {pid} is no longer running on this host"
        if state == "reused":
            return f"pid {pid} is no longer running on this host (another process has its pid)"
        return None
    if last_beat - now > stale_after_s:
        return _skewed_reason(held, last_beat, stale_after_s, now, written)
    age = now - last_beat
    if age > stale_after_s:
        return (
            f"no heartbeat from host {held.get('host')} for {age:.0f}s "
            f"(stale after {stale_after_s:g}s)"
        )
    return None


def _clock(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat(timespec="seconds")


def _skew_text(held: Mapping[str, Any], last_beat: float, now: float) -> str:
    """The two clocks of a heartbeat stamped in the future, for messages."""
    return (
        f"its last heartbeat is stamped {_clock(last_beat)} by host {held.get('host')}'s clock, "
        f"{last_beat - now:,.0f}s ahead of this host's ({socket.gethostname()}: {_clock(now)})"
    )


def _skewed_reason(
    held: Mapping[str, Any],
    last_beat: float,
    stale_after_s: float,
    now: float,
    written: float | None,
) -> str | None:
    """A heartbeat stamped more than ``stale_after_s`` in the future: the holder's clock is
    ahead of ours by more than the lock tolerates, so its stamps say nothing about whether it
    is alive. Stale when the storage last saw the heartbeat written more than ``stale_after_s``
    ago; None (alive, or unknown) otherwise."""
    if written is None or now - written <= stale_after_s:
        return None
    return (
        f"no heartbeat from host {held.get('host')} for {now - written:.0f}s by the storage's "
        f"clock (stale after {stale_after_s:g}s); {_skew_text(held, last_beat, now)}: the two "
        "clocks disagree, so the storage's time was used"
    )


def _last_written(root: Location, held: Mapping[str, Any]) -> float | None:
    """When the storage last saw the holder of ``held`` write its heartbeat or its lock file
    (epoch seconds, the storage's clock); None when it does not say."""
    files = [root.child(LOCK_NAME)]
    if held.get("token"):
        files.append(_heartbeat_loc(root, _token_of(held)))
    times = [t for f in files if (t := storage.modified_time(f)) is not None]
    return max(times) if times else None


# --------------------------------------------------------------------------- lock files


def _read_lock(loc: Location) -> dict[str, Any] | None:
    """The lock document, None when there is no lock, {} when it cannot be parsed."""
    for attempt in range(3):
        try:
            raw = storage.read_bytes(loc)
        except FileNotFoundError:
            return None
        try:
            doc = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            # Only a filesystem without hard links shows a lock before its content lands.
            if attempt < 2:
                time.sleep(0.05)
                continue
            return {}
        return doc if isinstance(doc, dict) else {}
    return {}


def _heartbeat_loc(root: Location, token: str) -> Location:
    return root.child(f"{HEARTBEAT_PREFIX}{token}.json")


def _last_beat(root: Location, held: Mapping[str, Any]) -> float:
    """When the holder of ``held`` last showed a sign of life (epoch seconds, its clock)."""
    beat = float(held.get("heartbeat_ts") or held.get("started_ts") or 0.0)
    if held.get("token"):
        try:
            doc = storage.read_json(_heartbeat_loc(root, _token_of(held)))
        except (ValueError, UnicodeDecodeError):
            doc = None
        if isinstance(doc, dict):
            beat = max(beat, float(doc.get("heartbeat_ts") or 0.0))
    return beat


def _claim_takeover(root: Location, token: str, me: Mapping[str, Any]) -> Location | None:
    """Exclusive-create the takeover claim for the stale lock ``token``; None if another has it."""
    data = json.dumps({**me, "claimed_ts": time.time()}).encode()
    for gen in range(_MAX_CLAIM_GENERATIONS):
        claim = root.child(f"{TAKEOVER_PREFIX}{token}-{gen}.json")
        if storage.exclusive_create(claim, data):
            return claim
        try:
            doc = storage.read_json(claim)
        except (ValueError, UnicodeDecodeError):
            doc = None
        claimed = float(doc.get("claimed_ts") or 0.0) if isinstance(doc, dict) else 0.0
        if doc is None or time.time() - claimed <= TAKEOVER_GRACE_S:
            return None  # a live contender is taking it over (or just finished)
    return None


def _take_over(
    root: Location, loc: Location, held: Mapping[str, Any], me: Mapping[str, Any]
) -> bool:
    """Delete the stale lock ``held`` if this process wins the claim on it; True if it did."""
    token = _token_of(held)
    claim = _claim_takeover(root, token, me)
    if claim is None:
        return False
    try:
        current = _read_lock(loc)
        if current is None:
            return True
        if _token_of(current) != token:
            return False  # someone took it meanwhile; judge the new lock afresh
        storage.remove(loc)
        storage.remove(_heartbeat_loc(root, token))
        return True
    finally:
        # Safe to drop now: the stale lock is gone (or was not the one claimed), so whoever
        # claims this token next finds no lock with it and backs off.
        storage.remove(claim)


def holder_text(held: Mapping[str, Any]) -> str:
    """Who holds a lock, for messages: ``run R (pid P on H, since T)``."""
    return (
        f"run {held.get('run_id')} (pid {held.get('pid')} on {held.get('host')}, since "
        f"{held.get('started_at')})"
    )


def _locked_error(
    what: str,
    loc: Location,
    held: Mapping[str, Any],
    stale_after_s: float,
    skew: str | None = None,
) -> LockError:
    why = f" {skew}." if skew else ""
    # A dead holder is no reason to delete the lock by hand: the next run takes it over (and a
    # hand deletion while the holder lives lets two runs write at once; the fence stops one).
    return LockError(
        f"{what} is locked by {holder_text(held)}.{why} Wait for it to finish, then run again: "
        "a holder that is gone is taken over by the next run (on its host once its process is "
        f"dead; from another host once its heartbeat is older than stale_lock_after_s = "
        f"{stale_after_s:g} s). Delete {loc.uri} only if that run is gone and cannot be "
        "judged (its host unreachable)."
    )


def _skew_note(
    held: Mapping[str, Any],
    last_beat: float,
    now: float,
    stale_after_s: float,
    written: float | None,
) -> str:
    """Why a lock whose heartbeat is stamped in the future is not taken over, both clocks named."""
    seen = (
        f"the storage saw its heartbeat written {now - written:,.0f}s ago, so its holder looks "
        "alive"
        if written is not None
        else "the storage does not say when its heartbeat was written, so whether its holder "
        "is alive cannot be told"
    )
    return (
        f"Its holder's clock is ahead: {_skew_text(held, last_beat, now)}, more than "
        f"stale_lock_after_s ({stale_after_s:g}s); {seen}. Fix the clock on "
        f"{held.get('host')} (NTP)"
    )


# --------------------------------------------------------------------------- the lock


@dataclass
class RunLock:
    """The lock on one output root, held by this process until :meth:`release`."""

    loc: Location
    holder: dict[str, Any]
    took_over: dict[str, Any] | None = None
    heartbeat_s: float = _MAX_HEARTBEAT_S
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)
    _released: bool = field(default=False, repr=False)
    # Set when the heartbeat cannot be written for a reason no retry fixes (a full or
    # read-only disk, a permission refused): the next assert_held raises it.
    _failure: StorageError | None = field(default=None, repr=False)

    @property
    def run_id(self) -> str:
        return str(self.holder["run_id"])

    @property
    def token(self) -> str:
        """The random token that identifies this holding (pass it to :func:`assert_holder`)."""
        return str(self.holder["token"])

    @property
    def root(self) -> Location:
        return Location(
            self.loc.fs,
            self.loc.path.rsplit("/", 1)[0],
            self.loc.uri.rsplit("/", 1)[0],
            self.loc.retry_deadline_s,
        )

    @classmethod
    def acquire(
        cls,
        root: Location,
        run_id: str,
        *,
        stale_after_s: float,
        heartbeat_s: float | None = None,
        what: str | None = None,
    ) -> RunLock:
        """Take the lock or raise :class:`LockError` naming who holds it.

        ``heartbeat_s`` (default ``stale_after_s / 4``, at most a minute) is how often the
        holder shows it is alive to runs on other hosts. ``what`` names the locked thing in
        that message (default ``output <root>``: a lock kept beside what it locks says so).
        """
        loc = root.child(LOCK_NAME)
        now = time.time()
        me = {
            **_identity(),
            "run_id": run_id,
            "token": uuid.uuid4().hex,
            "started_at": dt.datetime.now(dt.timezone.utc).isoformat(),
            "started_ts": now,
            "heartbeat_ts": now,
        }
        storage.makedirs(root)
        took_over = None
        for _ in range(_MAX_ROUNDS):
            if storage.exclusive_create(loc, json.dumps(me).encode()):
                break
            held = _read_lock(loc)
            if held is None:
                continue  # released between our create and our read: try again
            if held.get("token") == me["token"]:
                break  # our create landed although its answer was lost (then retried)
            reason = _judge(root, held, stale_after_s, what or f"output {root.uri}")
            if _take_over(root, loc, held, me):
                took_over = {k: v for k, v in held.items() if k != "token"} | {"reason": reason}
                logger.warning("taking over the stale lock %s: %s", loc.uri, reason)
            else:
                time.sleep(0.05)  # another contender is on it; look again shortly
        else:
            raise LockError(f"could not take the lock {loc.uri}: other runs keep taking it")
        interval = heartbeat_s if heartbeat_s is not None else stale_after_s / 4
        lock = cls(loc, me, took_over, heartbeat_s=min(max(interval, 0.01), _MAX_HEARTBEAT_S))
        with _HELD_GUARD:
            _HELD.add(lock.token)
        lock._sweep_claims()
        lock._start_heartbeat()
        return lock

    def _sweep_claims(self) -> None:
        """Drop takeover claims left by contenders that died mid-takeover (best effort)."""
        with contextlib.suppress(Exception):
            for claim in storage.glob_names(self.root, TAKEOVER_PREFIX):
                if not claim.name.startswith(f"{TAKEOVER_PREFIX}{self.token}-"):
                    storage.remove(claim)

    def _start_heartbeat(self) -> None:
        self._thread = threading.Thread(
            target=self._beat, name=f"lock-heartbeat-{self.run_id}", daemon=True
        )
        self._thread.start()

    def _beat(self) -> None:
        hb = _heartbeat_loc(self.root, self.token)
        while not self._stop.wait(self.heartbeat_s):
            try:
                other = self._other_holder()
                if other is not None:
                    logger.error("stopped heartbeating %s: %s", self.loc.uri, other)
                    return
                storage.write_json(
                    hb, {"run_id": self.run_id, "token": self.token, "heartbeat_ts": time.time()}
                )
            except Exception as e:
                if retries.is_permanent_storage_failure(e):
                    # Its storage is full, read-only or refused: the run cannot go on there.
                    self._failure = StorageError(
                        f"cannot refresh the lock heartbeat {hb.uri}: {retries.cause_of(e)}",
                        uri=hb.uri,
                    )
                    logger.warning("%s", self._failure)
                    return
                # A missed beat is not fatal: the lock is stale only after stale_after_s.
                logger.warning("could not refresh the lock heartbeat %s: %s", hb.uri, e)

    def _other_holder(self) -> str | None:
        """None while we hold the lock, else who holds it instead (for messages)."""
        return _loss(self.loc, self.run_id, self.token)

    def assert_held(self) -> None:
        """Raise :class:`LockLostError` unless this process still holds the lock.

        Call before each commit (shard rename, manifest save, report, ``_SUCCESS``). Once the
        heartbeat's storage failed, the next call raises that
        :class:`~pipeline.core.errors.StorageError` (once: the failed report may still be written).
        """
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure
        other = self._other_holder()
        if other is not None:
            raise LockLostError(f"run {self.run_id} lost the lock {self.loc.uri}: {other}")

    def release(self) -> None:
        """Stop the heartbeat and delete the lock, if it is still ours (idempotent)."""
        if self._released:
            return
        self._released = True
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        with _HELD_GUARD:
            _HELD.discard(self.token)
        try:
            other = self._other_holder()
            if other is None:
                storage.remove(self.loc)
            else:
                logger.warning("not deleting %s, no longer ours: %s", self.loc.uri, other)
        finally:
            storage.remove(_heartbeat_loc(self.root, self.token))

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _loss(loc: Location, run_id: str, token: str) -> str | None:
    held = _read_lock(loc)
    if held is None:
        return "the lock file is gone (deleted by hand or by a run that took it over)"
    if held.get("token") != token:
        return (
            f"it is now held by run {held.get('run_id')} (pid {held.get('pid')} on "
            f"{held.get('host')})"
        )
    return None


def live_holder(root: Location, stale_after_s: float) -> dict[str, Any] | None:
    """The holder of the lock at ``root`` while it may be alive, read only (a stale lock is
    judged as :meth:`RunLock.acquire` judges it, and left where it is); None when there is no
    lock or its holder is gone. A lock that cannot be parsed counts as held."""
    held = _read_lock(root.child(LOCK_NAME))
    if held is None:
        return None
    if not held:
        return {"run_id": f"unknown ({root.child(LOCK_NAME).uri} cannot be read)"}
    beat, now = _last_beat(root, held), time.time()
    written = _last_written(root, held) if beat - now > stale_after_s else None
    return None if _stale_reason(held, beat, stale_after_s, now, written) else held


def _judge(root: Location, held: Mapping[str, Any], stale_after_s: float, what: str) -> str:
    """Why the lock ``held`` at ``root`` is stale (it may be taken over); raises the
    :class:`LockError` naming its holder while it is not."""
    beat, now = _last_beat(root, held), time.time()
    # A heartbeat stamped in the future: judged by when the storage saw it written.
    written = _last_written(root, held) if beat - now > stale_after_s else None
    reason = _stale_reason(held, beat, stale_after_s, now, written)
    if reason is None:
        skewed = beat - now > stale_after_s and not _same_machine(held, _identity())
        note = _skew_note(held, beat, now, stale_after_s, written) if skewed else None
        raise _locked_error(what, root.child(LOCK_NAME), held, stale_after_s, note)
    return reason


def refuse_if_held(root: Location, stale_after_s: float, what: str) -> None:
    """Raise the :class:`LockError` :meth:`RunLock.acquire` would, read only, while a live run
    holds the lock at ``root``: a run refused at once instead of after its start-up (a Dask
    cluster, the model, every footer: about 7 s on the demo job here). Taking the lock later
    decides; this only spares the wait, so a lock that cannot be read here (an output under a
    file, no credentials yet) is left to the checks that say what is wrong with it."""
    try:
        held = _read_lock(root.child(LOCK_NAME))
    except (OSError, PipelineError):
        return
    if held:
        _judge(root, held, stale_after_s, what)


def assert_holder(
    root_uri: str, run_id: str, token: str, storage_options: Mapping[str, Any] | None = None
) -> None:
    """Raise :class:`LockLostError` unless run ``run_id`` with ``token`` holds the lock of the
    output at ``root_uri``. For Dask worker tasks, before each commit; one small read."""
    loc = storage.locate(root_uri, storage_options).child(LOCK_NAME)
    other = _loss(loc, run_id, token)
    if other is not None:
        raise LockLostError(f"run {run_id} lost the lock {loc.uri}: {other}")
