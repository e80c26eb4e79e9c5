"""A table run's exactly-once protocol, as values: the token state a partition's manifest keeps
(its ``output_format`` key), what a run makes of it, and the run index told what became of a
pending commit. Format-neutral: a Delta table carries the token as ``Transaction(app_id,
run_version)``, an Iceberg table in its snapshot summary and a table property; both keep this
state the same way.

Each commit carries the token ``(app_id, run_version)``: the app id per job and partition
(:func:`pipeline.sinks.naming.app_id_of`), the run version the partition's committed one plus
one, decided under the run lock. Before the commit the run records it in the manifest as
*pending* (with the version the run read, below which it cannot have landed); it stays pending
until the run's report names the commit (the seal). A run that finds a pending token asks the
table: if the table's ``transaction_version`` reached it, the commit landed (the dead run's
answer was lost, or it died before recording it): it is *recovered* (recorded, not committed
again); if not, it never landed, and the files that run wrote are reused where their footers
check out, or deleted (only files whose names carry the run ids the state lists).

No library keeps this: delta-rs accepts a repeated or lower app version (delta-rs#2580, #3821),
pyiceberg has no token at all, and a resumed run must know, before it scores anything, what
became of the commit of the run it resumes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pipeline.core.errors import PipelineError
from pipeline.io import runindex
from pipeline.io.storage import Location

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pending:
    """A commit a run recorded before making it."""

    run_version: int
    run_id: str | None
    after: int | None = None  # the table version the run read: the commit lands above it


@dataclass(frozen=True)
class Recovered:
    """A pending commit found landed by a later run."""

    run_id: str | None
    table_version: int | None

    def public(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "table_version": self.table_version}


#: The keys :meth:`TokenState.public` writes itself; any other key is the sink's (``extra``).
_OWN_KEYS = frozenset(
    {"format", "app_id", "committed", "table_version", "run_id", "pending", "runs"}
)


@dataclass(frozen=True)
class TokenState:
    """What a partition's manifest keeps of the token (its ``output_format`` key)."""

    app_id: str
    format: str  # the sink's name ("delta", "iceberg"): the manifest says whose state it is
    committed: int | None = None  # the run version of the last commit recorded
    table_version: int | None = None  # the table version it landed as
    run_id: str | None = None  # the run that made it
    pending: Pending | None = None
    runs: tuple[str, ...] = ()  # runs whose files may lie uncommitted in the partition
    #: Where the table is, for readers of the manifest (table, partition; an Iceberg table's
    #: catalog and identifier): kept as the sink wrote them.
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, state: Mapping[str, Any] | None, app_id: str, fmt: str) -> TokenState:
        """The state a manifest keeps, for ``app_id`` of format ``fmt`` (another app's, after a
        job was renamed, is no state of this one's)."""
        found = dict(state or {})
        if found.get("app_id") not in (None, app_id):
            return cls(app_id, fmt)
        raw = found.get("pending")
        pending = None
        if isinstance(raw, Mapping) and raw.get("run_version") is not None:
            after = raw.get("after")
            pending = Pending(
                int(raw["run_version"]), raw.get("run_id"), None if after is None else int(after)
            )
        committed, version = found.get("committed"), found.get("table_version")
        return cls(
            app_id=app_id,
            format=fmt,
            committed=None if committed is None else int(committed),
            table_version=None if version is None else int(version),
            run_id=found.get("run_id"),
            pending=pending,
            runs=tuple(str(r) for r in found.get("runs") or ()),
            extra={k: v for k, v in found.items() if k not in _OWN_KEYS},
        )

    def public(self) -> dict[str, Any]:
        """The manifest's ``output_format`` key."""
        pending = self.pending
        return {
            "format": self.format,
            **self.extra,
            "app_id": self.app_id,
            "committed": self.committed,
            "table_version": self.table_version,
            "run_id": self.run_id,
            "pending": None
            if pending is None
            else {
                "run_version": pending.run_version,
                "run_id": pending.run_id,
                "after": pending.after,
            },
            "runs": list(self.runs),
        }

    def settle(
        self, done: int | None, landed_as: int | None
    ) -> tuple[TokenState, Recovered | None]:
        """What became of a pending commit, given the table's committed run version ``done``
        for this app and (when it landed) the version it landed as: (the state, and what was
        recovered). Not landed: the pending token is dropped, its run's files stay in
        :attr:`runs` (reused or deleted later)."""
        pending = self.pending
        if pending is None:
            return self, None
        if done is not None and done >= pending.run_version:
            state = replace(
                self,
                committed=pending.run_version,
                table_version=landed_as,
                run_id=pending.run_id,
                pending=None,
                runs=tuple(r for r in self.runs if r != pending.run_id),
            )
            return state, Recovered(pending.run_id, landed_as)
        return replace(self, pending=None), None

    def begun(self, run_id: str, **extra: Any) -> TokenState:
        """This run recorded (before it writes a file: a kill at any point leaves its files
        findable by name), with the table and partition named for readers of the manifest."""
        runs = tuple(r for r in self.runs if r != run_id)
        return replace(self, runs=(*runs, run_id), extra={**self.extra, **extra})

    def committing(self, run_version: int, run_id: str, after: int | None) -> TokenState:
        """The commit recorded as pending, before it is made."""
        return replace(self, pending=Pending(run_version, run_id, after))

    def made(self, run_version: int, table_version: int, run_id: str) -> TokenState:
        """The commit made: recorded, still pending until the run's report names it."""
        return replace(
            self, committed=run_version, table_version=table_version, run_id=run_id, runs=()
        )

    def idle(self) -> TokenState:
        """A run that found nothing to commit: no file of its may lie uncommitted."""
        return replace(self, runs=())

    def sealed(self) -> TokenState:
        """The run's report names its commit: nothing pending."""
        return replace(self, pending=None)


@dataclass(frozen=True)
class IndexPlace:
    """Where a partition's runs are indexed, and who is asking (the run that settles)."""

    area: Location  # the table's control area (the run index's root)
    options: Mapping[str, Any]
    job: str
    run_id: str
    app_id: str
    table: str


def settle_index(
    where: IndexPlace, pending: Pending, *, landed: bool, version: int | None = None
) -> None:
    """Log what became of a pending commit, and make the pending run's entry in the run index
    say it: it is written before the commit, and a run whose storage died after (or during)
    the commit could not rewrite it. Best effort: the index is a record on top of the table."""
    if landed:
        logger.warning(
            "the commit of run %s (run version %s of %s) landed as version %s of %s before it "
            "stopped: the manifest is brought up to date, nothing is committed again",
            pending.run_id,
            pending.run_version,
            where.app_id,
            version,
            where.table,
        )
    else:
        logger.warning(
            "the commit of run %s (run version %s of %s) did not land: its files are reused "
            "where their footers check out, and deleted otherwise",
            pending.run_id,
            pending.run_version,
            where.app_id,
        )
    if pending.run_id is None:
        return
    try:
        changed = runindex.settle_commit(
            where.area.uri,
            where.options,
            where.job,
            pending.run_id,
            landed=landed,
            by=where.run_id,
            table_version=version,
        )
    except (OSError, PipelineError) as e:
        logger.warning(
            "could not record the outcome of run %s in the run index: %s", pending.run_id, e
        )
        return
    if changed:
        state = "committed" if landed else "failed"
        logger.info("run index: run %s recorded as %s", pending.run_id, state)
