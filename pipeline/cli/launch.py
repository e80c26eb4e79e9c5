"""The ``score-catalog`` console script's way in: SIGTERM and SIGINT handled from its first line.

Until a program installs handlers of its own, SIGTERM kills it by the default action (no message,
no report: the shell just sees 143) and SIGINT raises ``KeyboardInterrupt`` wherever it lands (a
traceback). Importing the command line (Click, the config, logging) took 70 ms here before
``pipeline.cli.commands`` could install its handlers, and cron's ``timeout`` or a quick Ctrl-C
can land there. So this module imports nothing but :mod:`pipeline.core.signals` (which imports
only :mod:`signal`) and ``sys``, routes both signals first, and only then imports the rest.

Until a run routes signals to its stop request, a signal is recorded, and acted on at safe
points (:mod:`pipeline.core.signals` says why: raised where it landed, inside an import, it could
be lost or abort the process): :class:`~pipeline.core.signals.EarlyStop`, and the command ends
with one line (text or JSON, as asked) and exit 143 (SIGTERM) or 130 (SIGINT), having written
nothing. What stays uncovered is the interpreter's own start before this module's first line
(about 20 ms here), where the default action applies.
"""

from __future__ import annotations

import sys

from pipeline.core.signals import EarlyStop, check_early_stop, route_early_signals


def main() -> None:
    """The console script (and ``python -m pipeline``): signals first, then the command line."""
    route_early_signals()
    try:
        # Imported here, after the signals are routed (see the module doc); the same layer.
        from pipeline.core.faults import checkpoint

        checkpoint("launch")  # the crash tests' place for a signal before the CLI is imported
        from pipeline.cli.commands import entrypoint

        check_early_stop()
    except EarlyStop as e:
        from pipeline.cli.logs import stopped_while_starting

        stopped_while_starting(e, sys.argv[1:])
    entrypoint()


if __name__ == "__main__":  # pragma: no cover
    main()
