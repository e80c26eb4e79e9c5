"""Read-ahead and write-behind threads: order, bounds, errors, early stop."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from pipeline.worker.overlap import WriteBehind, read_ahead


def test_read_ahead_keeps_order_and_is_bounded() -> None:
    produced: list[int] = []

    def gen() -> Iterator[int]:
        for i in range(50):
            produced.append(i)
            yield i

    out = []
    for item in read_ahead(gen(), depth=2):
        time.sleep(0.002)
        # The producer is never more than depth items (+ the one it holds) ahead.
        assert len(produced) - len(out) <= 4
        out.append(item)
    assert out == list(range(50))


def test_read_ahead_reraises_in_the_consumer_after_earlier_items() -> None:
    def gen() -> Iterator[int]:
        yield 1
        yield 2
        raise ValueError("bad page in row group 3")

    got = []
    with pytest.raises(ValueError, match="row group 3"):
        for item in read_ahead(gen(), depth=2):
            got.append(item)
    assert got == [1, 2]


def test_read_ahead_stops_its_thread_when_the_consumer_stops() -> None:
    def endless() -> Iterator[int]:
        i = 0
        while True:
            yield i
            i += 1

    before = threading.active_count()
    it = read_ahead(endless(), depth=2)
    assert [next(it) for _ in range(5)] == [0, 1, 2, 3, 4]
    it.close()  # type: ignore[attr-defined]
    # close() returns only once the producer thread has ended (read_ahead joins it).
    assert threading.active_count() == before


def test_read_ahead_depth_zero_is_inline() -> None:
    assert list(read_ahead(iter([3, 1, 2]), depth=0)) == [3, 1, 2]


def test_write_behind_writes_in_order_and_drains() -> None:
    written: list[int] = []
    wb = WriteBehind(lambda x: (time.sleep(0.001), written.append(x)), depth=2)
    for i in range(30):
        wb.submit(i)
    wb.drain()
    assert written == list(range(30))


def test_write_behind_reraises_the_first_error() -> None:
    def write(x: int) -> None:
        if x == 3:
            raise OSError("disk full")

    wb = WriteBehind(write, depth=2)
    with pytest.raises(OSError, match="disk full"):
        for i in range(10):
            wb.submit(i)
            time.sleep(0.005)
        wb.drain()
    with pytest.raises(OSError, match="disk full"):
        wb.drain()
