"""The words a run and a shard end with, in one place: report, metrics, run index, backfill, HTML.

They are ``str`` enums so that they serialise to, and compare equal with, the plain strings
that ``_report.json``, the metrics labels and older run-index entries already carry.
"""

from __future__ import annotations

import enum


class _StrEnum(str, enum.Enum):
    """``enum.StrEnum`` for Python 3.10: ``str(x)`` and f-strings give the value."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class RunStatus(_StrEnum):
    """How a whole run ended (``status`` in ``_report.json``)."""

    SUCCEEDED = "succeeded"
    SUCCEEDED_WITH_ERRORS = "succeeded_with_errors"  # within the error budget
    SUCCEEDED_WITH_WARNINGS = "succeeded_with_warnings"  # drift alert
    FAILED = "failed"
    INTERRUPTED = "interrupted"  # stopped by SIGTERM/SIGINT; what was committed is kept


#: Run statuses that count as a success: ``_SUCCESS`` is written, drift baselines come from them.
SUCCESS_STATUSES = frozenset(
    {RunStatus.SUCCEEDED, RunStatus.SUCCEEDED_WITH_ERRORS, RunStatus.SUCCEEDED_WITH_WARNINGS}
)


class ShardStatus(_StrEnum):
    """How one input shard ended in this run."""

    SCORED = "scored"
    SKIPPED = "skipped"  # already done by an earlier run with the same model and settings
    FAILED = "failed"


class FailureKind(_StrEnum):
    """Why a shard failed (``kind`` of a failed shard and of an entry in ``errors``)."""

    UNREADABLE = "unreadable"  # footer or data could not be read
    SCHEMA = "schema"  # columns do not fit the model
    INVALID_ROWS = "invalid_rows"  # on_invalid_rows = "fail" met a bad row (fatal)
    MODEL = "model"  # the model failed on every row it was given (fatal)
    ERROR = "error"  # the task crashed on every retry
    # The storage failed, not the data: a full or read-only disk, a permission refused, a store
    # still unreachable at the retry deadline (fatal: every shard after it would fail the same
    # way, so the run stops instead of counting them against the error budget).
    STORAGE = "storage"
    CANCELLED = "cancelled"  # not scored: the run stopped at a fatal error
    INTERRUPTED = "interrupted"  # not scored: the run was stopped by SIGTERM or SIGINT
    ACCOUNTING = "accounting"  # rows in != rows scored + rows rejected


class PartitionStatus(_StrEnum):
    """How one day of a backfill ended when no run report says so (else the run's status)."""

    MISSING = "missing"  # the day's input folder does not exist
    SKIPPED = "skipped"  # finished earlier with the same model bundle: no run started
    ERROR = "error"  # the run stopped before its report (configuration, input, any exception)


#: Backfill partition statuses that fail the backfill (exit 1, or the signal's code if interrupted).
FAILED_PARTITION_STATUSES = frozenset(
    {RunStatus.FAILED, RunStatus.INTERRUPTED, PartitionStatus.ERROR}
)

#: Failure kinds that stop the run whatever the error budget.
FATAL_KINDS = frozenset({FailureKind.INVALID_ROWS, FailureKind.MODEL, FailureKind.STORAGE})
