"""What the driver and its workers tell each other during a run, besides tasks and results.

Flags the driver raises on every worker (:func:`raise_flag`, run by ``client.run``) when a signal
stops the run: a plain set read before each shard and commit, where a Dask ``Event`` would cost
a scheduler round trip each time. And rows a worker reports from inside the shard it is scoring
(:class:`RowProgress`): to a listener in this process, or as a Dask event the driver subscribes
to. Both are named per run (``pipeline.worker.spec.StopSignals``); a worker of an existing
cluster outlives its runs, so the driver has each worker forget a run's names when it ends
(:func:`forget`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator

# Flags the driver raised in this worker process.
_RAISED: set[str] = set()


def raise_flag(name: str) -> None:
    """Raise the flag ``name`` in this process (the driver runs it on every worker)."""
    _RAISED.add(name)


def flag_raised(name: str) -> bool:
    """Whether the flag ``name`` was raised here (False for no name: not on a cluster)."""
    return bool(name) and name in _RAISED


def forget(names: Iterable[str]) -> None:
    """Drop what this process keeps of a run that ended: its flags and its report times."""
    for name in names:
        _RAISED.discard(name)
        _LAST_SENT.pop(name, None)


# --------------------------------------------------------------------------------------------
# Rows, reported from inside a shard

#: A worker reports rows scored at most this often (per process and run), so that a progress
#: bar moves inside a big shard while thousands of tiny batches cost no message each.
PROGRESS_INTERVAL_S = 0.5

# Listeners of a topic in this process (the sync and threads schedulers): topic -> (pid, call).
# The pid: a worker process forked while a listener was registered must not call the driver's.
_LISTENERS: dict[str, tuple[int, Callable[[str, int], None]]] = {}
# When each topic was last reported from this process (monotonic seconds).
_LAST_SENT: dict[str, float] = {}


@contextlib.contextmanager
def listen_locally(topic: str, on_rows: Callable[[str, int], None]) -> Iterator[None]:
    """Deliver ``topic``'s reports made in this process to ``on_rows(rel_path, rows)`` while
    the block runs (shards scored in this process: ``sync`` and ``threads``)."""
    _LISTENERS[topic] = (os.getpid(), on_rows)
    try:
        yield
    finally:
        _LISTENERS.pop(topic, None)


def _send_rows(topic: str, rel_path: str, rows: int) -> None:
    """Report ``rows`` of ``rel_path`` scored so far: to a listener in this process, else as a
    Dask event on the worker (:meth:`distributed.Worker.log_event`), which the driver's client
    receives through ``subscribe_topic``. Best effort: progress never fails a shard."""
    listener = _LISTENERS.get(topic)
    if listener is not None and listener[0] == os.getpid():
        listener[1](rel_path, rows)
        return
    try:
        from distributed import get_worker

        get_worker().log_event(topic, [rel_path, rows])
    except (ImportError, ValueError):  # not in a Dask worker, or no listener: nobody asked
        pass


class RowProgress:
    """Rows of one shard scored so far, reported at most every :data:`PROGRESS_INTERVAL_S`
    (across the shards this process scores for the run: tiny shards send nothing; the
    shard's result says it is done)."""

    def __init__(self, topic: str, rel_path: str) -> None:
        self.topic = topic
        self.rel_path = rel_path
        self.rows = 0

    def add(self, rows: int) -> None:
        self.rows += rows
        if not self.topic:
            return
        now = time.monotonic()
        last = _LAST_SENT.setdefault(self.topic, now)
        if now - last >= PROGRESS_INTERVAL_S:
            _LAST_SENT[self.topic] = now
            _send_rows(self.topic, self.rel_path, self.rows)
