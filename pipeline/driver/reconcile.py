"""What the output should hold after a run, from its shards' results (:func:`wanted`): the
shards whose output stays (scored or skipped), those the run did not get to (left alone), and
those whose previous output must go, with why. The output format does the taking away
(``pipeline.sinks``, ``settle``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from pipeline.core.errors import PipelineError
from pipeline.core.statuses import FailureKind, ShardStatus
from pipeline.io import storage


class Outcome(Protocol):
    """What :func:`wanted` reads of a shard's result (``pipeline.worker.shard.ShardResult``)."""

    rel_path: str
    status: str
    kind: str | None
    rows_out: int


#: Failure kinds of shards this run did not get to (a fatal error or a signal stopped it): their
#: previous output is left as it was, with its manifest entry, for the next run to judge.
NOT_ATTEMPTED = frozenset({FailureKind.CANCELLED, FailureKind.INTERRUPTED})


@dataclass(frozen=True)
class Wanted:
    """What the output should hold after a run, from its shards' results."""

    rows: dict[str, int]  # shards in the output (scored or skipped): their row counts
    untouched: set[str]  # shards not attempted: their outputs are left alone
    reasons: dict[str, str]  # shards whose previous output must go, and why

    @property
    def keep(self) -> set[str]:
        """Relative paths :func:`reconcile` leaves in place."""
        return set(self.rows) | self.untouched


def wanted(results: Iterable[Outcome]) -> Wanted:
    """Sort a run's shard results into outputs to keep, to leave alone and to remove."""
    rows: dict[str, int] = {}
    untouched: set[str] = set()
    reasons: dict[str, str] = {}
    for r in results:
        if r.status in (ShardStatus.SCORED, ShardStatus.SKIPPED):
            rows[r.rel_path] = r.rows_out
        elif r.kind in NOT_ATTEMPTED:
            untouched.add(r.rel_path)
        elif r.kind == FailureKind.SCHEMA:
            reasons[r.rel_path] = (
                "its shard does not fit the model and was skipped (errors.on_schema_error)"
            )
        else:
            reasons[r.rel_path] = f"its shard failed in this run ({r.kind})"
    return Wanted(rows, untouched, reasons)


def gone_reasons(
    entries: Mapping[str, Mapping[str, Any]],
    rels: Iterable[str],
    input_uri: str,
    options: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """Why the outputs at ``rels`` go when their shard is not in this run's input although
    the input file their manifest entry names still exists (the job's input changed: another
    folder, glob or ``{date}``). Reconciling says ``its input shard no longer exists`` only of
    the others, whose input really is gone. One ``exists`` per such output: only shards that
    left the input are asked about."""
    reasons = {}
    for rel in rels:
        source = (entries.get(rel) or {}).get("input")
        if not isinstance(source, str):
            continue
        try:
            there = storage.exists(storage.locate(source, options))
        except (OSError, PipelineError):
            continue  # cannot tell: the usual reason stands
        if there:
            reasons[rel] = (
                f"its input shard {source} still exists but is no longer in this job's input "
                f"({input_uri})"
            )
    return reasons
