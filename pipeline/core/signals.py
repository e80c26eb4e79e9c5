"""SIGTERM and SIGINT before a run has taken its output: :class:`EarlyStop`.

Until a run routes signals to its stop request (:func:`pipeline.core.interrupt.handle_signals`),
a signal raises :class:`EarlyStop`: the command ends with one line and exit 143 (SIGTERM) or 130
(SIGINT), having written nothing. A run asked to stop before it takes its output's lock raises it
too (``pipeline.driver``). This module imports nothing but :mod:`signal`: the console script
(:mod:`pipeline.cli.launch`) routes both signals here before it imports anything else.
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


def on_early_signal(signum: int, _frame: FrameType | None) -> None:
    """The handler while starting up: stop wherever the command is (it has written nothing)."""
    raise EarlyStop(signum)


def route_early_signals() -> None:
    """SIGTERM and SIGINT raise :class:`EarlyStop` from now on (main thread only)."""
    for s in SIGNALS:
        signal.signal(s, on_early_signal)
