"""pipeline.driver.status: the run's status is a function of its findings alone."""

from __future__ import annotations

import dataclasses

import pytest

from pipeline.core.statuses import RunStatus
from pipeline.driver.status import STOPPED_AFTER_SCORING, Findings, decide, may_succeed

BUDGET = "3 failed shards > errors.max_failed_shards = 0"


@pytest.mark.parametrize(
    ("findings", "status", "reasons"),
    [
        (Findings(RunStatus.SUCCEEDED), RunStatus.SUCCEEDED, ()),
        (Findings(RunStatus.SUCCEEDED_WITH_ERRORS), RunStatus.SUCCEEDED_WITH_ERRORS, ()),
        (Findings(RunStatus.FAILED, (BUDGET,)), RunStatus.FAILED, (BUDGET,)),
        # What readers see differs from the report: no _SUCCESS, whatever the budget said.
        (
            Findings(RunStatus.SUCCEEDED, mismatch=("x.parquet is missing",)),
            RunStatus.FAILED,
            ("x.parquet is missing",),
        ),
        # An open drift alert: exit 4 from succeeded_with_errors too.
        (
            Findings(RunStatus.SUCCEEDED_WITH_ERRORS, drift_alert=True),
            RunStatus.SUCCEEDED_WITH_WARNINGS,
            (),
        ),
        # A stop request wins over the budget, and its reason comes first.
        (
            Findings(
                RunStatus.FAILED,
                (BUDGET,),
                stopped=True,
                stop_reason="interrupted by SIGINT",
                shards_interrupted=True,
            ),
            RunStatus.INTERRUPTED,
            ("interrupted by SIGINT", BUDGET),
        ),
        # Asked to stop after every shard in flight finished: still interrupted, and said so.
        (
            Findings(RunStatus.SUCCEEDED, stopped=True, stop_reason="interrupted by SIGTERM"),
            RunStatus.INTERRUPTED,
            ("interrupted by SIGTERM", STOPPED_AFTER_SCORING),
        ),
    ],
)
def test_decide(findings: Findings, status: RunStatus, reasons: tuple[str, ...]) -> None:
    decision = decide(findings)
    assert (decision.status, decision.reasons) == (status, reasons)


def test_an_error_while_finishing_fails_the_run_and_comes_first() -> None:
    before = Findings(RunStatus.SUCCEEDED, stopped=True, stop_reason="interrupted by SIGTERM")
    decision = decide(dataclasses.replace(before, error="could not commit the run: disk full"))
    assert decision.status == RunStatus.FAILED
    assert decision.reasons == ("could not commit the run: disk full", *decide(before).reasons)


@pytest.mark.parametrize(
    ("findings", "expected"),
    [
        (Findings(RunStatus.SUCCEEDED, drift_alert=True), True),  # drift is judged, not a fail
        (Findings(RunStatus.SUCCEEDED_WITH_ERRORS), True),
        (Findings(RunStatus.FAILED, (BUDGET,)), False),
        (Findings(RunStatus.SUCCEEDED, stopped=True), False),
        (Findings(RunStatus.SUCCEEDED, mismatch=("x",)), False),
    ],
)
def test_may_succeed_says_whether_the_output_is_worth_checking(
    findings: Findings, expected: bool
) -> None:
    assert may_succeed(findings) is expected
