"""SIGTERM and SIGINT before a run has taken its output: recorded, then :class:`EarlyStop`.

While the command starts, a signal is only *recorded* (:func:`on_early_signal`), never raised
where it lands: Python runs a handler between any two bytecodes, and start-up is mostly imports
(torch, Dask), where that can be inside importlib's module-lock callback (an exception there is
printed as "Exception ignored in ..." and dropped: the signal was lost and the run went on) or
inside a Python function that torch's C++ calls through pybind11 (an exception there aborted the
process, SIGABRT: 2 of 80 signals sent 0.5-1.6 s into start-up did). The start-up looks at the
record at safe points (:func:`check_early_stop`: after the command line is imported, after the
run's heavy imports), and the run's own handler takes it over (:func:`take_early_signal`, called
by :func:`pipeline.core.interrupt.handle_signals` once its handler is installed, so a signal in
between is never lost): a run asked to stop before it takes its output raises :class:`EarlyStop`
(``pipeline.driver``). The command ends with one line (text or JSON, as asked) and exit 143
(SIGTERM) or 130 (SIGINT), having written nothing. Commands other than ``run`` and ``backfill``
(which have no stop handling of their own) raise :class:`EarlyStop` wherever the signal lands
once they are dispatched (:func:`raise_early_signals`).

This module imports nothing but :mod:`signal`: the console script (:mod:`pipeline.cli.launch`)
routes both signals here before it imports anything else.
"""

from __future__ import annotations

import signal
from types import FrameType

#: The signals that stop the tool; exit code 128 + signal number, as the shell reports them.
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class EarlyStop(BaseException):
    """SIGTERM or SIGINT while starting up, before the run took its output: nothing was written.

    A BaseException, like ``KeyboardInterrupt``: no ``except Exception`` takes it for an error of
    the run, and Click does not turn it into its own ``Abort`` (and a blank line).
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.signal_name = signal.Signals(signum).name
        super().__init__(f"stopped by {self.signal_name} while starting; nothing was written")

    @property
    def exit_code(self) -> int:
        """143 for SIGTERM, 130 for SIGINT."""
        return 128 + self.signum


#: Signals received while starting, in order: the first is the one that stops the command.
_received: list[int] = []


def on_early_signal(signum: int, _frame: FrameType | None) -> None:
    """The handler while starting up: record the signal, raise nothing (see the module doc)."""
    _received.append(signum)  # one bytecode-level append: nothing here can fail or be lost


def _raise_early_stop(signum: int, _frame: FrameType | None) -> None:
    """The handler of a command without stop handling of its own: stop wherever it is."""
    _received.append(signum)
    raise EarlyStop(signum)


def route_early_signals() -> None:
    """SIGTERM and SIGINT are recorded from now on (main thread only); a signal recorded
    earlier stays recorded. SIGINT first: until then Python's own handler raises
    ``KeyboardInterrupt``, so once SIGTERM is caught too (``SigCgt`` in ``/proc/PID/status``,
    which a test waits for) both are ours."""
    for s in reversed(SIGNALS):
        signal.signal(s, on_early_signal)


def check_early_stop() -> None:
    """A safe point of the start-up: raise :class:`EarlyStop` if a signal was recorded."""
    if _received:
        raise EarlyStop(_received[0])


def take_early_signal() -> int | None:
    """The signal recorded while starting (the first), handed to whoever handles signals now,
    and forgotten here; None if none was. Call it after installing the new handler: a signal
    that arrives in between is then the new handler's, and none is missed."""
    if not _received:
        return None
    signum = _received[0]
    _received.clear()
    return signum


def raise_early_signals() -> None:
    """For a command without stop handling of its own (everything but ``run`` and
    ``backfill``): a signal recorded so far stops it now, a later one wherever it lands.
    Nothing changes where signals were not routed here (Click's test runner, a library user)."""
    if signal.getsignal(signal.SIGTERM) is not on_early_signal:
        return
    check_early_stop()
    for s in SIGNALS:
        signal.signal(s, _raise_early_stop)
