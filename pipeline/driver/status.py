"""The run's status, decided in one function from what the run found: :func:`decide`.

The status in ``_report.json``, the metrics and the exit code always agree because the status is
a function of :class:`Findings` alone, and the report is built from its :class:`Decision`
(``pipeline.report.build.build_report``). When a finding arrives after the report was written (a
signal while committing, a commit that failed), the same function decides again from the
findings with it, and what was written is rewritten to say so (``pipeline.driver.finish``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipeline.core.statuses import RunStatus

#: Said when a stop was asked for although every shard in flight finished.
STOPPED_AFTER_SCORING = (
    "every shard in flight finished before the run stopped, but the output is not committed "
    "(no _SUCCESS); a rerun commits it without scoring them again"
)


@dataclass(frozen=True)
class Findings:
    """Everything the run's status depends on."""

    budget: RunStatus  # the error budget's: succeeded, succeeded_with_errors or failed
    budget_reasons: tuple[str, ...] = ()  # why the budget failed the run
    stopped: bool = False  # a signal asked the run to stop (SIGTERM, SIGINT)
    stop_reason: str = "interrupted by SIGTERM"  # the first reason of an interrupted run
    shards_interrupted: bool = False  # a shard was not scored (or not committed) for a signal
    mismatch: tuple[str, ...] = ()  # what readers see of the output differs from the report
    drift_alert: bool = False  # the dataset's drift verdict has an open alert
    error: str | None = None  # the run could not be finished: that failure, in one line


@dataclass(frozen=True)
class Decision:
    status: RunStatus
    reasons: tuple[str, ...] = ()

    @property
    def succeeded(self) -> bool:
        return self.status in (
            RunStatus.SUCCEEDED,
            RunStatus.SUCCEEDED_WITH_ERRORS,
            RunStatus.SUCCEEDED_WITH_WARNINGS,
        )


def decide(f: Findings) -> Decision:
    """The run's status and its reasons, from ``f``.

    In order: an error while finishing fails the run (its line first, then the reasons it would
    have had); a requested stop makes it ``interrupted``, even when every shard in flight
    finished (the run was asked to stop; a rerun commits what is left); the error budget, or an
    output that does not match the report, makes it ``failed``; an open drift alert makes a
    success ``succeeded_with_warnings`` (from ``succeeded_with_errors`` too: the status alone
    gives the exit code, 4 here, and scores that drifted need a look before anyone uses them,
    which a 0 would hide; the rejects and failed shards stay in the report).
    """
    if f.error is not None:
        before = decide(dataclasses.replace(f, error=None))
        return Decision(RunStatus.FAILED, (f.error, *before.reasons))
    if f.stopped or f.shards_interrupted:
        reasons = [f.stop_reason]
        if not f.shards_interrupted:
            reasons.append(STOPPED_AFTER_SCORING)
        return Decision(RunStatus.INTERRUPTED, (*reasons, *f.budget_reasons))
    if f.budget == RunStatus.FAILED:
        return Decision(RunStatus.FAILED, f.budget_reasons)
    if f.mismatch:
        return Decision(RunStatus.FAILED, (*f.budget_reasons, *f.mismatch))
    if f.drift_alert:
        return Decision(RunStatus.SUCCEEDED_WITH_WARNINGS, f.budget_reasons)
    return Decision(f.budget, f.budget_reasons)


def may_succeed(f: Findings) -> bool:
    """Whether the run can still succeed: worth checking the output and judging drift."""
    return decide(dataclasses.replace(f, drift_alert=False)).succeeded
