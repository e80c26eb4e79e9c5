"""Read-ahead and write-behind: bounded background threads around the scoring loop.

Decoding the next batches and encoding finished ones happen in pyarrow code that releases the
GIL, so a reader thread and a writer thread keep the model busy while I/O runs alongside it.
Both queues are bounded, so memory stays at a few batches whatever the shard size.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
_DONE = object()


def _put(q: queue.Queue[Any], item: Any, stop: threading.Event) -> bool:
    """Queue ``item`` unless the consumer has gone; False once it has."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _produce(items: Iterator[Any], q: queue.Queue[Any], stop: threading.Event) -> None:
    try:
        for item in items:
            if not _put(q, item, stop):
                return
        q.put(_DONE)
    except BaseException as e:  # handed to the consumer
        q.put(e)


def read_ahead(items: Iterator[T], depth: int) -> Iterator[T]:
    """Iterate ``items`` in a background thread, at most ``depth`` items ahead of the consumer.

    Exceptions raised by ``items`` are re-raised in the consumer, in order. Closing the returned
    generator early stops the thread.
    """
    if depth <= 0:
        yield from items
        return
    q: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()
    t = threading.Thread(target=_produce, args=(items, q, stop), name="read-ahead", daemon=True)
    t.start()
    try:
        while True:
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while t.is_alive():  # unblock a producer waiting on a full queue
            try:
                q.get_nowait()
            except queue.Empty:
                t.join(0.05)


class WriteBehind:
    """Run ``write(item)`` calls in one background thread, in order, at most ``depth`` queued.

    :meth:`drain` waits for every queued write and re-raises the first error; after an error,
    further :meth:`submit` calls raise it at once.
    """

    def __init__(self, write: Callable[[Any], None], depth: int) -> None:
        self._write = write
        self._q: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="write-behind", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is _DONE:
                return
            if self._error is None:
                try:
                    self._write(item)
                except BaseException as e:
                    self._error = e

    def submit(self, item: Any) -> None:
        if self._error is not None:
            raise self._error
        self._q.put(item)

    def drain(self) -> None:
        """Wait for every submitted write; re-raise the first error."""
        if self._thread.is_alive():
            self._q.put(_DONE)
            self._thread.join()
        if self._error is not None:
            raise self._error
