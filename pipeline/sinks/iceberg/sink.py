"""``format = "iceberg"``: a run's scores as one snapshot of an Apache Iceberg table
(:class:`IcebergSink`), through pyiceberg.

The table is the output template's fixed part (its metadata in ``metadata/`` there); a run's
output is one partition of it (the template's ``key={placeholder}`` folders, identity partition
columns typed string), or the whole table when the template has no placeholder. Its catalog is
the job's ``catalog`` (by default an embedded SQLite ``SqlCatalog`` in the table's control area:
:mod:`.catalog`); its identifier the job's ``table`` (by default ``score_catalog.<the table
folder's name>``). Workers write each shard's data file exactly as
for a Delta table (a name no other run uses, directly in the partition's folder, no partition
column inside). Nothing is visible to a reader until :meth:`IcebergSink.commit`: ONE snapshot
that adds the run's new files and deletes every file of the partition it does not keep, with
the run's token (:mod:`.commit`). The token's states in the manifest are the Delta table's
(:mod:`pipeline.sinks.token`). docs/iceberg.md describes it, and what is not done yet.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from pipeline.core.errors import CommitRefused, ConfigError, mark_landed
from pipeline.core.faults import checkpoint
from pipeline.core.templates import below, fixed_part, partition_columns
from pipeline.io import storage
from pipeline.io.layout import MODEL_INPUT_HASH_COLUMN, Places
from pipeline.io.manifest import Manifest
from pipeline.io.ownership import remove_rejects
from pipeline.io.storage import Location
from pipeline.sinks.base import (
    Committed,
    Expected,
    Outcome,
    Removal,
    Section,
    SinkPlaces,
    Visible,
    WriterSpec,
    WrittenFile,
)
from pipeline.sinks.files import (
    clear_rejects_way,
    delete_files,
    file_problems,
    folder_of,
    forget_another_outputs,
    missing_files,
    uncommitted_names,
)
from pipeline.sinks.iceberg import catalog, schema
from pipeline.sinks.iceberg.catalog import IcebergRef
from pipeline.sinks.iceberg.commit import NewFile, RunCommit, commit
from pipeline.sinks.iceberg.facts import iceberg_facts
from pipeline.sinks.iceberg.partition import IcebergBegun, check_folder, settle_pending
from pipeline.sinks.iceberg.runcommit import check_committed, commit_summary, section_details
from pipeline.sinks.iceberg.view import PartitionView, committed_run_version, view
from pipeline.sinks.naming import app_id_of, partition_label
from pipeline.sinks.tables import table_lock_root
from pipeline.sinks.token import IndexPlace, TokenState

if TYPE_CHECKING:
    from pyiceberg.table import Table

    from pipeline.core.config import JobConfig

logger = logging.getLogger(__name__)

# Why a file of the partition that this run does not keep goes, when no shard names it.
UNKNOWN_REASON = (
    "replaced: no shard in this output's manifest lists it (an earlier run's file whose record "
    "was replaced)"
)
STALE_REASON = "its input shard no longer exists"


@dataclass(frozen=True)
class IcebergPlan:
    """What the run's commit removes, decided before it is made."""

    removes: tuple[str, ...]  # paths of files of the partition the commit deletes
    removed: tuple[Removal, ...]  # of those, what readers stop seeing, and why
    uncommitted: tuple[str, ...]  # names of files of runs that never committed: deleted now
    rejects_after: tuple[tuple[Location, Location], ...]
    foreign: tuple[str, ...] = ()

    @property
    def at_commit(self) -> bool:
        return True


@dataclass(frozen=True)
class IcebergSink:
    """One run's output as an Iceberg table's partition (see the module doc)."""

    table: IcebergRef
    root: Location  # the partition's folder (the table's root when unpartitioned)
    partition: Mapping[str, str]  # column -> value, in the template's order
    control: Location  # the partition's control folder: manifest, report, run lock
    area: Location  # the table's control area: run index, table lock, catalog
    job: str
    run_id: str
    meta_columns: tuple[str, ...]  # id and pass-through columns (the others are outputs)
    allow_new_columns: bool = False
    options: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, config: JobConfig, places: Places, run_id: str) -> IcebergSink:
        """The partition a run of ``config`` writes (``places``: its places)."""
        opts = dict(config.storage)
        root = storage.locate(fixed_part(config.output)[0], opts)
        columns = [c for c, _ in partition_columns(config.output, fmt="iceberg")]
        rest = below(root.path, places.output.path)
        values = dict(s.partition("=")[::2] for s in rest.split("/") if s) if rest else {}
        if list(values) != columns:
            raise ConfigError(
                f"output {places.output.uri} is not a partition of the Iceberg table {root.uri} "
                f"(partition columns {columns})"
            )
        return cls(
            table=IcebergRef.of(root, places.index, config.catalog, config.table, opts),
            root=places.output,
            partition=values,
            control=places.control,
            area=places.index,
            job=config.name,
            run_id=run_id,
            meta_columns=(config.id_column, *config.passthrough),
            allow_new_columns=config.allow_schema_evolution,
            options=opts,
        )

    @property
    def name(self) -> str:
        return "iceberg"

    @property
    def places(self) -> SinkPlaces:
        return SinkPlaces(
            output=self.root,
            dataset=self.table.location,
            lock_root=self.control,
            exclusive_with=(table_lock_root(self.area),),
            mark=None,
            table=True,
            table_names=("metadata",),
        )

    @property
    def app_id(self) -> str:
        return app_id_of(self.job, self.partition)

    @property
    def label(self) -> str:
        return partition_label(self.partition)

    def check(self, mode: str, schema_: pa.Schema | None) -> None:
        """Refuse a table folder that is not this tool's Iceberg table, a table another writer
        made, and a run whose output does not fit the table's schema (read only)."""
        table = catalog.load(self.table)
        check_folder(self.table, self.root, table)
        if table is None:
            return
        catalog.check_location(self.table, table)
        if table.properties.get(catalog.WRITER_PROPERTY) != catalog.WRITER_PROPERTY_VALUE:
            raise ConfigError(
                f"output {self.root.uri}: the Iceberg table {self.table.identifier} was not "
                f"made by score-catalog (its table property {catalog.WRITER_PROPERTY} is not "
                "set): a run replaces whole partitions, which are not its to replace in another "
                "writer's table. Nothing was written. Point the output at a new folder."
            )
        if schema_ is not None:
            wanted = schema.iceberg_schema(self.table.uri, schema_, list(self.partition))
            schema.fit(
                self.table.uri,
                table,
                wanted,
                list(self.partition),
                allow_new=self.allow_new_columns,
            )

    def _view(self, table: Table | None) -> PartitionView | None:
        return view(self.table, table, self.partition) if table is not None else None

    def state(self, manifest: Manifest) -> IcebergBegun:
        """The partition as it is now (``plan``, a backfill): read only, no lock."""
        table = catalog.load(self.table)
        token = TokenState.read(manifest.format_state, self.app_id, self.name)
        return self._begun(table, token, manifest)

    def _begun(
        self, table: Table | None, token: TokenState, manifest: Manifest, **more: Any
    ) -> IcebergBegun:
        snap = self._view(table)
        done = committed_run_version(table.metadata, self.app_id) if table is not None else None
        paths = [f.path for f in snap.files] if snap is not None else []
        return IcebergBegun(
            table=self.table,
            root=self.root,
            snapshot=snap,
            missing=missing_files(self.root, folder_of(self.partition), paths),
            run_version=(done or 0) + 1,
            committed_run_version=done,
            token=token,
            owners={str(e["file"]): rel for rel, e in manifest.shards.items() if "file" in e},
            manifest_files=frozenset(
                str(e["file"]) for e in manifest.shards.values() if e.get("file")
            ),
            **more,
        )

    def begin(
        self,
        manifest: Manifest,
        rejects: Location,
        wanted: tuple[str, ...],
        mode: str,
        schema_: pa.Schema | None,
    ) -> IcebergBegun:
        """Under the run lock: the table made (or its schema checked and evolved), its
        partition read, and the manifest brought up to date with it (the token settled)."""
        table = catalog.load(self.table)
        if schema_ is not None:
            table = self._ensure(table, schema_)
        forget_another_outputs(manifest, self.name)
        where = IndexPlace(
            self.area, self.options, self.job, self.run_id, self.app_id, self.table.uri
        )
        token, recovered = settle_pending(where, table, manifest, self._view(table))
        begun = self._begun(table, token, manifest, recovered=recovered, schema=schema_)
        manifest.set_format_state(
            token.begun(
                self.run_id,
                table=self.table.uri,
                partition=self.label,
                catalog=self.table.catalog.public(),
                identifier=self.table.identifier,
            ).public()
        )
        manifest.save()
        clear_rejects_way(self.root, rejects, list(wanted), self.options)
        return begun

    def _ensure(self, table: Table | None, output: pa.Schema) -> Table:
        """The table, made from the run's output schema, or checked against it (new columns
        added where the job allows)."""
        partition_by = list(self.partition)
        wanted = schema.iceberg_schema(self.table.uri, output, partition_by)
        if table is None:
            table = catalog.ensure_table(self.table, wanted, partition_by, {})
        catalog.check_location(self.table, table)
        added = schema.fit(
            self.table.uri, table, wanted, partition_by, allow_new=self.allow_new_columns
        )
        if added:
            table = schema.evolve(self.table.uri, table, output, partition_by)
        return table

    def writer(self) -> WriterSpec:
        return WriterSpec(self.root.uri, "per_run", iceberg_facts)

    def visible(self, output: str) -> Visible:
        """The files of the table's partition at ``output`` in the table's current snapshot."""
        loc = storage.locate(output, self.options)
        try:
            rest = below(self.table.location.path, loc.path)
        except ValueError:
            raise ConfigError(f"{loc.uri} is not in the Iceberg table {self.table.uri}") from None
        values = dict(s.partition("=")[::2] for s in rest.split("/") if s)
        table = catalog.load(self.table)
        if table is None:
            raise ConfigError(f"no Iceberg table at {self.table.uri} ({self.table.catalog.text()})")
        snap = view(self.table, table, values)
        files = tuple(self.table.location.child(f.path).uri for f in snap.files)
        return Visible(files, snap.version)

    def keeps_fingerprints(self) -> bool:
        table = catalog.load(self.table)
        return table is not None and MODEL_INPUT_HASH_COLUMN in table.schema()._name_to_id

    def entry_of(self, written: WrittenFile | None) -> dict[str, Any]:
        if written is None:
            return {}
        base = self.table.location.uri.rstrip("/") + "/"
        if not written.uri.startswith(base):
            raise ValueError(f"{written.uri} is not in the table {self.table.uri}")
        return {
            "file": written.uri[len(base) :],
            "size": written.size,
            "rows": int(written.facts.get("rows", 0)),
            "nan_columns": list(written.facts.get("nan_columns") or ()),
            "committed": False,
        }

    def plan(
        self, begun: IcebergBegun, manifest: Manifest, outcome: Outcome, rejects: Location
    ) -> IcebergPlan:
        """The commit's removes: every file of the partition the run does not keep; the files
        of runs that never committed, not reused now; rejects of shards that leave."""
        entries = manifest.shards
        kept = {str(entries[r]["file"]) for r in outcome.keep if "file" in entries.get(r, {})}
        current = list(begun.files)
        removes = tuple(p for p in current if p not in kept)
        removed = []
        for path in removes:
            rel = begun.owners.get(path)
            if rel is not None and rel in outcome.keep:
                continue  # rescored: its new file replaces it
            reason = UNKNOWN_REASON if rel is None else outcome.reasons.get(rel, STALE_REASON)
            removed.append(Removal(rel or path, self.table.location.child(path).uri, reason))
        gone = (outcome.ours | set(outcome.reasons)) - outcome.keep
        uncommitted = uncommitted_names(
            self.root, folder_of(self.partition), begun.token.runs, set(current) | kept
        )
        return IcebergPlan(
            removes=removes,
            removed=tuple(removed),
            uncommitted=uncommitted,
            rejects_after=tuple((rejects.child(r), self.root.child(r)) for r in sorted(gone)),
        )

    def delete_stale(self, plan: IcebergPlan) -> tuple[Removal, ...]:
        delete_files(self.root, plan.uncommitted)
        return ()  # what readers stop seeing goes with the commit

    def verify(
        self,
        begun: IcebergBegun,
        plan: IcebergPlan,
        manifest: Manifest,
        expected: Mapping[str, Expected],
    ) -> list[str]:
        """How the snapshot this run would commit differs from the report: each shard's file
        read back from its footer, and no other file."""
        entries = manifest.shards
        problems: list[str] = []
        planned: set[str] = set()
        for rel, want in sorted(expected.items()):
            path = entries.get(rel, {}).get("file")
            if not isinstance(path, str):
                problems.append(f"{self.root.child(rel).uri} is in the report but has no data file")
                continue
            planned.add(path)
            problems += file_problems(self.table.location.child(path), want, self.options)
        after = set(begun.files) - set(plan.removes)
        for path in sorted(after - planned):
            problems.append(
                f"{self.table.location.child(path).uri} would stay in the table's partition but "
                "is not in the report"
            )
        return problems

    def commit(
        self,
        begun: IcebergBegun,
        plan: IcebergPlan,
        manifest: Manifest,
        run_id: str,
        record: Callable[[], object] | None = None,
    ) -> Committed:
        """ONE snapshot of the run's new files and the removes ``plan`` names, with the run's
        token; then the manifest marks them committed and the snapshot is checked against the
        report. Nothing to add or remove: no snapshot."""
        entries = manifest.shards
        in_table = set(begun.files)
        adds = [
            NewFile(
                str(e["file"]),
                int(e["size"]),
                int(e.get("rows") or 0),
                tuple(e.get("nan_columns") or ()),
            )
            for e in entries.values()
            if isinstance(e.get("file"), str) and e["file"] not in in_table
        ]
        if not adds and not plan.removes:
            return self._nothing(begun, plan, manifest, record)
        version, snapshot_id = self._commit(begun, plan, manifest, run_id, adds, record)
        try:
            self._record(begun, plan, manifest, run_id, version, snapshot_id, adds)
        except BaseException as e:  # the store died after the commit landed: say so
            mark_landed(e, version, self.table.uri)
            raise
        details = {
            "files_added": len(adds),
            "files_removed": len(plan.removes),
            "snapshot_id": snapshot_id,
        }
        return Committed(visible=True, version=version, made=True, details=details)

    def _nothing(
        self,
        begun: IcebergBegun,
        plan: IcebergPlan,
        manifest: Manifest,
        record: Callable[[], object] | None,
    ) -> Committed:
        if record is not None:
            record()
        token = TokenState.read(manifest.format_state, self.app_id, self.name)
        manifest.set_format_state(token.idle().public())
        manifest.save()
        self._remove_rejects(plan)
        version = begun.recovered.table_version if begun.recovered else None
        snap_version = begun.snapshot.version if begun.snapshot is not None else None
        return Committed(visible=True, version=version or snap_version)

    def _commit(
        self,
        begun: IcebergBegun,
        plan: IcebergPlan,
        manifest: Manifest,
        run_id: str,
        adds: list[NewFile],
        record: Callable[[], object] | None,
    ) -> tuple[int, int]:
        if begun.schema is None:
            raise CommitRefused(
                f"nothing to commit to {self.table.uri}: the run has no output schema",
                uri=self.table.uri,
            )
        token = TokenState.read(manifest.format_state, self.app_id, self.name)
        after = begun.snapshot.version if begun.snapshot is not None else None
        manifest.set_format_state(token.committing(begun.run_version, run_id, after).public())
        manifest.save()  # fenced: only the lock holder records a pending token
        if record is not None:
            record()  # the run index's entry: after the pending token, before the commit
        expected = schema.iceberg_schema(self.table.uri, begun.schema, list(self.partition))
        run = RunCommit(
            partition=self.partition,
            adds=adds,
            removes=plan.removes,
            app_id=self.app_id,
            run_version=begun.run_version,
            summary=commit_summary(
                run_id, self.job, self.label, manifest.shards, begun.schema, self.meta_columns
            ),
        )
        found = commit(self.table, run, expected)
        checkpoint("iceberg-after-commit")
        return found

    def _record(
        self,
        begun: IcebergBegun,
        plan: IcebergPlan,
        manifest: Manifest,
        run_id: str,
        version: int,
        snapshot_id: int,
        adds: list[NewFile],
    ) -> None:
        added = {a.path for a in adds}
        for entry in manifest.shards.values():
            if entry.get("file") in added:
                entry["committed"] = True
                entry.pop("gone_from_table", None)
        token = TokenState.read(manifest.format_state, self.app_id, self.name)
        manifest.set_format_state(token.made(begun.run_version, version, run_id).public())
        manifest.save()
        self._remove_rejects(plan)
        check_committed(self.table, self.partition, snapshot_id, manifest.shards)

    def _remove_rejects(self, plan: IcebergPlan) -> None:
        for rejects, output in plan.rejects_after:
            remove_rejects(rejects, output, self.options)

    def seal(self, begun: IcebergBegun, manifest: Manifest, committed: Committed) -> None:
        """The run's report names its commit: the pending token is settled."""
        token = TokenState.read(manifest.format_state, self.app_id, self.name)
        if token.pending is None:
            return
        manifest.set_format_state(token.sealed().public())
        manifest.save()

    def abort(self) -> None:
        return None  # a table keeps its snapshots: the current one stays whole

    def section(self, begun: IcebergBegun | None, committed: Committed | None) -> Section:
        return Section(section_details(self.table, self.label, self.app_id, begun, committed))
