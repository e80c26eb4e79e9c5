"""SIGTERM and SIGINT as a run status: stop scheduling, let shards in flight finish, then report.

Cron's ``timeout``, systemd and Kubernetes send SIGTERM; a person at a terminal sends SIGINT. The
first signal asks the run to stop: nothing new is scheduled, shards in flight get
``grace_period_s`` to commit, and the run then records what was committed, writes its report with
status ``interrupted`` and exits 143 (SIGTERM) or 130 (SIGINT). A second signal stops at once
(:class:`Aborted`): staged writes leave no visible partial file, and the cluster is closed on the
way out so no worker process outlives the run.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

from pipeline.core.errors import EXIT_SIGINT, EXIT_SIGTERM
from pipeline.core.signals import take_early_signal

logger = logging.getLogger(__name__)

#: Exit codes of an interrupted run: the shell's 128 + signal number.
EXIT_CODES = {signal.SIGTERM: EXIT_SIGTERM, signal.SIGINT: EXIT_SIGINT}


#: A repeat of the stop signal within this many seconds is the same request, not a second one.
REPEAT_WINDOW_S = 1.0


class Aborted(BaseException):
    """A second signal: stop now. A BaseException so that no ``except Exception`` swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"aborted by a second {signal.Signals(signum).name}")
        self.signum = signum


class StopRequest:
    """Whether, when and by which signal the run was asked to stop."""

    def __init__(self, grace_period_s: float = 30.0) -> None:
        self.grace_period_s = grace_period_s
        self._event = threading.Event()
        self.signum: int | None = None
        self.requested_at: float | None = None

    def request(self, signum: int) -> None:
        """Ask the run to stop (what the first signal does; tests may call it directly)."""
        if self.signum is None:
            self.signum = signum
            self.requested_at = time.monotonic()
        self._event.set()

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds, waking as soon as a stop is requested."""
        return self._event.wait(timeout)

    def seconds_since_request(self) -> float:
        """Seconds since the first stop request (infinite before any)."""
        if self.requested_at is None:
            return float("inf")
        return time.monotonic() - self.requested_at

    def grace_left(self) -> float:
        """Seconds left for shards in flight to commit (infinite before any request)."""
        if self.requested_at is None:
            return float("inf")
        return max(0.0, self.grace_period_s - (time.monotonic() - self.requested_at))

    @property
    def exit_code(self) -> int:
        """The shell's 128 + signal for the signal received (0 while none was)."""
        return EXIT_CODES.get(signal.Signals(self.signum), 143) if self.signum else 0

    @property
    def signal_name(self) -> str:
        """``SIGTERM`` or ``SIGINT`` (empty while no signal was received)."""
        return signal.Signals(self.signum).name if self.signum else ""

    @property
    def reason(self) -> str:
        """The run's failure reason and the unfinished shards' message once stopped."""
        return interrupted_reason(self.signal_name or "SIGTERM")


def interrupted_reason(signal_name: str) -> str:
    """``interrupted by SIGTERM``: the first of ``failure_reasons`` of an interrupted run."""
    return f"{INTERRUPTED_PREFIX}{signal_name}"


INTERRUPTED_PREFIX = "interrupted by "


def exit_code_of(failure_reasons: list[str]) -> int:
    """The exit code of an interrupted run from its report's ``failure_reasons`` (143 or 130).

    The report names the signal in its first reason (:func:`interrupted_reason`), so a report
    read back from storage gives the same code as the run that wrote it.
    """
    by_name = {signum.name: code for signum, code in EXIT_CODES.items()}
    for text in failure_reasons:
        if text.startswith(INTERRUPTED_PREFIX):
            words = text[len(INTERRUPTED_PREFIX) :].split()
            if words and words[0] in by_name:
                return by_name[words[0]]
    return EXIT_CODES[signal.SIGTERM]


@contextlib.contextmanager
def handle_signals(stop: StopRequest) -> Iterator[StopRequest]:
    """Route SIGTERM and SIGINT to ``stop`` while the block runs (main thread only).

    Outside the main thread (a library user running jobs in threads) signals cannot be caught
    there, so the block runs with the process's handlers unchanged.
    """
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    aborted = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if aborted.is_set():
            # Already stopping at once: let the clean-up (closing the cluster) finish.
            logger.warning("%s received again: still closing down", signal.Signals(signum).name)
            return
        if stop.requested:
            if stop.seconds_since_request() < REPEAT_WINDOW_S:
                # One stop sent twice: GNU timeout signals its child and then the child's whole
                # process group, so a single cron timeout arrives as two SIGTERMs at once.
                return
            aborted.set()
            raise Aborted(signum)
        stop.request(signum)
        logger.warning(
            "%s received: no new shards are scheduled; shards in flight have %.0f s to commit "
            "(send it again to stop at once)",
            signal.Signals(signum).name,
            stop.grace_period_s,
        )

    previous = {s: signal.signal(s, on_signal) for s in EXIT_CODES}
    # Installed first, then taken over: a signal the command recorded while starting
    # (pipeline.core.signals) becomes this run's stop request, and one arriving in between is
    # on_signal's; either way none is lost.
    early = take_early_signal()
    if early is not None:
        stop.request(early)
        logger.warning(
            "%s received while starting: stopping before the run takes its output",
            signal.Signals(early).name,
        )
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def settled(outcome: str) -> Iterator[None]:
    """While the CLI prints the outcome of a run that has ended (its report, metrics and exit
    code written and in agreement): a signal is logged and changes none of them.

    Without it a signal there would meet the start-up handler (:mod:`pipeline.cli.launch`) and end
    the process with "stopped while starting; nothing was written", exit 143, after a report
    that says ``succeeded``. Main thread only, as :func:`handle_signals`.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        logger.warning(
            "%s received after the run ended: its outcome stands (%s)",
            signal.Signals(signum).name,
            outcome,
        )

    previous = {s: signal.signal(s, on_signal) for s in EXIT_CODES}
    early = take_early_signal()  # recorded between the run's handler and this one
    if early is not None:
        on_signal(early, None)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
