"""The ``score-catalog`` console script's way in: SIGTERM and SIGINT handled from its first line.

Until a program installs handlers of its own, SIGTERM kills it by the default action (no message,
no report: the shell just sees 143) and SIGINT raises ``KeyboardInterrupt`` wherever it lands (a
traceback). Importing the command line (Click, the config, logging) took 70 ms here before
``pipeline.cli`` could install its handlers, and cron's ``timeout`` or a quick Ctrl-C can land
there. So this module imports nothing but ``signal`` and ``sys``, routes both signals first, and
only then imports the rest.

Until a run routes signals to its stop request (:func:`pipeline.interrupt.handle_signals`), a
signal raises :class:`EarlyStop`: the command ends with one line (text or JSON, as asked) and exit
143 (SIGTERM) or 130 (SIGINT), having written nothing. A run that is asked to stop before it takes
its output's lock raises it too (``pipeline.run``). What stays uncovered is the interpreter's own
start before this module's first line (about 20 ms here), where the default action applies.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType
from typing import NoReturn

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


def wants_json(argv: list[str]) -> bool:
    """Whether the command line asks for JSON logs: known before Click has parsed anything."""
    return any(
        a == "--log-format=json" or (a == "--log-format" and argv[i + 1 : i + 2] == ["json"])
        for i, a in enumerate(argv)
    )


def stopped_while_starting(e: EarlyStop, argv: list[str]) -> NoReturn:
    """One line saying so (and, for run and backfill in JSON mode, the summary line), then exit
    with the signal's code."""
    for s in SIGNALS:
        signal.signal(s, signal.SIG_DFL)  # a second signal while this line is written: gone now
    from pipeline import logs

    console = logs.Console("json" if wants_json(argv) else "text", 0, logs.Terminal())
    console.summarize_errors = bool(argv) and argv[0] in ("run", "backfill")
    console.error(str(e), e.exit_code)
    sys.exit(e.exit_code)


def main() -> None:
    """The console script (and ``python -m pipeline``): signals first, then the command line."""
    route_early_signals()
    try:
        from pipeline.faults import checkpoint

        checkpoint("launch")  # the crash tests' place for a signal before the CLI is imported
        from pipeline.cli import entrypoint
    except EarlyStop as e:
        stopped_while_starting(e, sys.argv[1:])
    entrypoint()


if __name__ == "__main__":  # pragma: no cover
    main()
