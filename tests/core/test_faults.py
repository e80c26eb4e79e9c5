"""The pause fault point (``_SCORE_CATALOG_PAUSE_AT``): held at the N-th hit, released by a file.

The kill and full-disk points are exercised through the real CLI (tests/integration/test_crash.py,
test_one_truth.py); the pause is checked here on its own, in a thread of this process (a pause
holds only the thread that reached the point) and, for its timeout, which ends the process, in
a child process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pipeline.core import faults
from pipeline.core.faults import PAUSE_AT, PAUSE_TIMEOUT, PAUSE_TIMEOUT_EXIT, checkpoint
from tests.integration.helpers import Pause

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_faults(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (faults.KILL_AT, faults.FAIL_AT, PAUSE_AT):
        monkeypatch.delenv(var, raising=False)


def _in_thread(points: list[str], done: list[str]) -> threading.Thread:
    """A thread that reaches ``points`` in order, noting each one it got past."""

    def body() -> None:
        for p in points:
            checkpoint(p)
            done.append(p)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t


def test_a_pause_holds_the_nth_hit_until_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pause = Pause("step", tmp_path / "held", n=2)
    monkeypatch.setenv(PAUSE_AT, pause.spec)
    done: list[str] = []
    t = _in_thread(["step", "other", "step", "after"], done)
    assert pause.wait() == [os.getpid()]  # the marker names the process held
    # Held at the second "step": the first and "other" went by, nothing after it ran.
    assert done == ["step", "other"] and t.is_alive()
    pause.release()
    t.join(60)
    assert not t.is_alive() and done == ["step", "other", "step", "after"]
    checkpoint("step")  # a third hit: the pause was for the second only
    assert pause.pids() == [os.getpid()]


def test_several_pauses_hold_one_after_the_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = Pause("a", tmp_path / "first"), Pause("b", tmp_path / "second", n=2)
    monkeypatch.setenv(PAUSE_AT, f"{first.spec},{second.spec}")
    done: list[str] = []
    t = _in_thread(["a", "b", "b", "c"], done)
    first.wait()
    assert done == [] and second.pids() == []
    first.release()
    second.wait()
    assert done == ["a", "b"]
    second.release()
    t.join(60)
    assert done == ["a", "b", "b", "c"]


def test_a_released_pause_only_marks_that_the_point_was_reached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pause = Pause("step", tmp_path / "seen")
    pause.release()
    monkeypatch.setenv(PAUSE_AT, pause.spec)
    checkpoint("step")  # does not wait
    assert pause.pids() == [os.getpid()]


def test_a_pause_needs_a_marker_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PAUSE_AT, "step:1")
    with pytest.raises(ValueError, match="point:N:FILE"):
        checkpoint("step")


def test_a_pause_never_released_ends_the_process_loudly(tmp_path: Path) -> None:
    """A broken test cannot hang CI: past the timeout the held process exits 124, saying why."""
    marker = tmp_path / "held"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        PAUSE_AT: f"step:1:{marker}",
        PAUSE_TIMEOUT: "0.2",
    }
    code = "from pipeline.core.faults import checkpoint; checkpoint('step'); print('went on')"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == PAUSE_TIMEOUT_EXIT, done.stderr
    assert done.stdout == ""  # it never went on as if released
    assert "paused at step:1 for 0.2 s and never released" in done.stderr
    assert len(marker.read_text().split()) == 1  # it did reach the point and say so
