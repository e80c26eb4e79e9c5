"""``format = "delta"``: a run's scores as one commit to a Delta Lake table (:class:`DeltaSink`).

The table is the output template's fixed part; a run's output is one partition of it (the
template's ``key={placeholder}`` folders filled in), or the whole table when the template has
no placeholder. Workers write each shard's data file exactly as for a folder (staged, atomic,
footer marks), but under a name no other run uses, directly in the partition's folder, and send
back its size, rows and Delta stats (:func:`~pipeline.sinks.delta.stats.delta_facts`). The
manifest, in the partition's control folder beside the table, records each shard's file and
whether it is committed. Nothing is visible to a reader until :meth:`DeltaSink.commit`: ONE
Delta version that adds the run's new files and removes every file of the partition it does not
keep (rescored shards' old files, shards whose input vanished, failed or was skipped), carrying
the run's token (:mod:`pipeline.sinks.delta.protocol`).

The run lock lives in the partition's control folder: inside a table nothing but data may live
(a ``VACUUM ... FULL`` deletes unlisted files, ``_``-names in partition folders included).
Maintenance (``rollback``, ``optimize``, ``vacuum``) takes the table lock in the table's control
area (:func:`table_lock_root`), which a run checks right after taking its own. docs/delta.md
describes it all.
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
from pipeline.sinks.delta import table as delta
from pipeline.sinks.delta.partition import (
    STALE_REASON,
    UNKNOWN_REASON,
    DeltaBegun,
    check_folder,
    not_in_storage,
    settle_pending,
    uncommitted_files,
)
from pipeline.sinks.delta.runcommit import (
    check_committed,
    commit_info,
    new_files,
    section_details,
)
from pipeline.sinks.delta.stats import NewFile, check_partition_values, delta_facts
from pipeline.sinks.files import (
    clear_rejects_way,
    delete_files,
    file_problems,
    forget_another_outputs,
)
from pipeline.sinks.naming import app_id_of, partition_label
from pipeline.sinks.tables import table_lock_root
from pipeline.sinks.token import IndexPlace, TokenState

if TYPE_CHECKING:
    from pipeline.core.config import JobConfig

logger = logging.getLogger(__name__)


def table_root(template: str, options: Mapping[str, Any] | None = None) -> Location:
    """The table an output template writes to: its fixed part."""
    return storage.locate(fixed_part(template)[0], options)


@dataclass(frozen=True)
class DeltaPlan:
    """What the run's commit removes, decided before it is made."""

    removes: tuple[str, ...]  # paths of files of the partition the commit removes
    removed: tuple[Removal, ...]  # of those, what readers stop seeing, and why
    uncommitted: tuple[str, ...]  # names of files of runs that never committed: deleted now
    rejects_after: tuple[tuple[Location, Location], ...]  # (rejects, output) once committed
    foreign: tuple[str, ...] = ()

    @property
    def at_commit(self) -> bool:
        return True


@dataclass(frozen=True)
class DeltaSink:
    """One run's output as a Delta table's partition (see the module doc)."""

    table: delta.TableRef
    root: Location  # the partition's folder (the table's root when unpartitioned)
    partition: Mapping[str, str]  # column -> value, in the table's partition column order
    control: Location  # the partition's control folder: manifest, report, run lock
    area: Location  # the table's control area: run index, table lock
    job: str
    run_id: str
    meta_columns: tuple[str, ...]  # id and pass-through columns (the others are outputs)
    allow_new_columns: bool = False
    log_retention_days: int = delta.DEFAULT_LOG_RETENTION_DAYS
    deleted_file_retention_days: int = delta.DEFAULT_DELETED_FILE_RETENTION_DAYS
    options: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, config: JobConfig, places: Places, run_id: str) -> DeltaSink:
        """The partition a run of ``config`` writes (``places``: its places)."""
        opts = dict(config.storage)
        root = table_root(config.output, opts)
        columns = [c for c, _ in partition_columns(config.output)]
        rest = below(root.path, places.output.path)
        segments = [s for s in rest.split("/") if s] if rest else []
        values = dict(s.partition("=")[::2] for s in segments)
        if list(values) != columns:
            raise ConfigError(
                f"output {places.output.uri} is not a partition of the Delta table {root.uri} "
                f"(partition columns {columns})"
            )
        check_partition_values(values)
        return cls(
            table=delta.TableRef.of(root.uri, opts),
            root=places.output,
            partition=values,
            control=places.control,
            area=places.index,
            job=config.name,
            run_id=run_id,
            meta_columns=(config.id_column, *config.passthrough),
            allow_new_columns=config.allow_schema_evolution,
            log_retention_days=config.delta.log_retention_days,
            deleted_file_retention_days=config.delta.deleted_file_retention_days,
            options=opts,
        )

    @property
    def name(self) -> str:
        return "delta"

    @property
    def places(self) -> SinkPlaces:
        # The run lock beside the table, in the partition's control folder; nothing is
        # written inside a table but data: its log and properties say whose it is.
        return SinkPlaces(
            output=self.root,
            dataset=self.table.location,
            lock_root=self.control,
            exclusive_with=(table_lock_root(self.area),),
            mark=None,
            table=True,
            table_names=("_delta_log",),
        )

    @property
    def app_id(self) -> str:
        return app_id_of(self.job, self.partition)

    @property
    def label(self) -> str:
        return partition_label(self.partition)

    def check(self, mode: str, schema: pa.Schema | None) -> None:
        """Refuse a table folder that is not a Delta table, a table this tool did not create,
        and a run whose output does not fit the table's schema (read only: no lock yet)."""
        check_folder(self.table, self.root)
        if not delta.table_exists(self.table):
            return
        snap = delta.snapshot(self.table, self.partition or None)
        if snap.properties.get(delta.WRITER_PROPERTY) != delta.WRITER_PROPERTY_VALUE:
            raise ConfigError(
                f"output {self.root.uri}: the Delta table {self.table.uri} was not created by "
                "score-catalog (its table property "
                f"{delta.WRITER_PROPERTY} is not set): a run replaces whole partitions, which "
                "are not its to replace in another writer's table. Nothing was written. Point "
                "the output at a new folder."
            )
        if schema is not None:
            delta.check_table(
                self.table, schema, list(self.partition), allow_new_columns=self.allow_new_columns
            )

    def state(self, manifest: Manifest) -> DeltaBegun:
        """The partition as it is now (``plan``, a backfill): read only, no lock."""
        snap = (
            delta.snapshot(self.table, self.partition or None)
            if delta.table_exists(self.table)
            else None
        )
        token = TokenState.read(manifest.format_state, self.app_id, self.name)
        return self._begun(snap, token, manifest)

    def _begun(
        self, snap: delta.Snapshot | None, token: TokenState, manifest: Manifest, **more: Any
    ) -> DeltaBegun:
        done = snap.transaction_version(self.app_id) if snap is not None else None
        return DeltaBegun(
            table=self.table,
            root=self.root,
            snapshot=snap,
            missing=not_in_storage(self.root, self.partition, snap),
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
        schema: pa.Schema | None,
    ) -> DeltaBegun:
        """Under the run lock: the table made (or its schema checked and evolved), its
        partition read, and the manifest brought up to date with it (the token settled)."""
        if schema is not None:
            delta.ensure_table(
                self.table,
                schema,
                list(self.partition),
                allow_new_columns=self.allow_new_columns,
                log_retention_days=self.log_retention_days,
                deleted_file_retention_days=self.deleted_file_retention_days,
                metadata={"run_id": self.run_id},
            )
        snap = (
            delta.snapshot(self.table, self.partition or None)
            if delta.table_exists(self.table)
            else None
        )
        forget_another_outputs(manifest, self.name)
        where = IndexPlace(
            self.area, self.options, self.job, self.run_id, self.app_id, self.table.uri
        )
        token, recovered = settle_pending(where, self.table, manifest, snap)
        begun = self._begun(snap, token, manifest, recovered=recovered, schema=schema)
        manifest.set_format_state(
            token.begun(self.run_id, table=self.table.uri, partition=self.label).public()
        )
        manifest.save()
        # Data files are plain names in the partition folder: a shard that changed shape is
        # in nobody's way there. Its rejects still are, in the rejects folder.
        clear_rejects_way(self.root, rejects, list(wanted), self.options)
        return begun

    def writer(self) -> WriterSpec:
        return WriterSpec(self.root.uri, "per_run", delta_facts)

    def visible(self, output: str) -> Visible:
        """The files of the table's partition at ``output`` (a partition folder of this
        table, or its root) in the table's latest version."""
        loc = storage.locate(output, self.options)
        try:
            rest = below(self.table.location.path, loc.path)
        except ValueError:
            raise ConfigError(f"{loc.uri} is not in the Delta table {self.table.uri}") from None
        values = dict(s.partition("=")[::2] for s in rest.split("/") if s)
        snap = delta.snapshot(self.table, values or None)
        files = tuple(self.table.location.child(f.path).uri for f in snap.files)
        return Visible(files, snap.version)

    def keeps_fingerprints(self) -> bool:
        if not delta.table_exists(self.table):
            return False
        return MODEL_INPUT_HASH_COLUMN in delta.snapshot(self.table).columns

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
            "stats": str(written.facts.get("stats", "")),
            "modification_time": delta.now_ms(),
            "committed": False,
        }

    def plan(
        self, begun: DeltaBegun, manifest: Manifest, outcome: Outcome, rejects: Location
    ) -> DeltaPlan:
        """The commit's removes: every file of the partition the run does not keep; the files
        of runs that never committed, not reused now (no reader ever sees them); rejects of
        shards that leave, to go once the commit has landed."""
        entries = manifest.shards
        kept = {str(entries[r]["file"]) for r in outcome.keep if "file" in entries.get(r, {})}
        current = [f.path for f in begun.snapshot.files] if begun.snapshot is not None else []
        removes = tuple(p for p in current if p not in kept)
        removed = []
        for path in removes:
            rel = begun.owners.get(path)
            if rel is not None and rel in outcome.keep:
                continue  # rescored: its new file replaces it, not a removal from the dataset
            reason = UNKNOWN_REASON if rel is None else outcome.reasons.get(rel, STALE_REASON)
            removed.append(Removal(rel or path, self.table.location.child(path).uri, reason))
        gone = (outcome.ours | set(outcome.reasons)) - outcome.keep
        uncommitted = uncommitted_files(self.root, self.partition, begun, kept)
        return DeltaPlan(
            removes=removes,
            removed=tuple(removed),
            uncommitted=uncommitted,
            rejects_after=tuple((rejects.child(r), self.root.child(r)) for r in sorted(gone)),
        )

    def delete_stale(self, plan: DeltaPlan) -> tuple[Removal, ...]:
        delete_files(self.root, plan.uncommitted)
        return ()  # what readers stop seeing goes with the commit

    def verify(
        self,
        begun: DeltaBegun,
        plan: DeltaPlan,
        manifest: Manifest,
        expected: Mapping[str, Expected],
    ) -> list[str]:
        """How the version this run would commit differs from the report: each shard's file
        (a new one or one the table keeps) read back from its footer, and no other file."""
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
        snap = begun.snapshot
        after = {f.path for f in snap.files} - set(plan.removes) if snap is not None else set()
        for path in sorted(after - planned):
            problems.append(
                f"{self.table.location.child(path).uri} would stay in the table's partition but "
                "is not in the report"
            )
        return problems

    def commit(
        self,
        begun: DeltaBegun,
        plan: DeltaPlan,
        manifest: Manifest,
        run_id: str,
        record: Callable[[], object] | None = None,
    ) -> Committed:
        """ONE commit of the run's new files and the removes ``plan`` names, with the run's
        token; then the manifest marks them committed and the committed version is checked
        against the report. Nothing to add or remove: no commit (the table holds the output
        already)."""
        entries = manifest.shards
        in_table = {f.path for f in begun.snapshot.files} if begun.snapshot is not None else set()
        adds = new_files(entries, self.partition, in_table)
        if not adds and not plan.removes:
            if record is not None:
                record()
            token = TokenState.read(manifest.format_state, self.app_id, self.name)
            manifest.set_format_state(token.idle().public())
            manifest.save()
            self._remove_rejects(plan)
            version = begun.recovered.table_version if begun.recovered else None
            snap_version = begun.snapshot.version if begun.snapshot is not None else None
            return Committed(visible=True, version=version or snap_version)
        version = self._commit(begun, plan, manifest, run_id, adds, record)
        try:
            self._record(begun, plan, manifest, run_id, version, {a.path for a in adds})
        except BaseException as e:  # the store died after the commit landed: say so
            mark_landed(e, version, self.table.uri)
            raise
        details = {"files_added": len(adds), "files_removed": len(plan.removes)}
        return Committed(visible=True, version=version, made=True, details=details)

    def _record(
        self,
        begun: DeltaBegun,
        plan: DeltaPlan,
        manifest: Manifest,
        run_id: str,
        version: int,
        added: set[str],
    ) -> None:
        """The commit that landed as ``version``, in the manifest (its token still pending
        until the run's report names it: :meth:`seal`), then checked against the report."""
        for entry in manifest.shards.values():
            if entry.get("file") in added:
                entry["committed"] = True
                entry.pop("gone_from_table", None)
        token = TokenState.read(manifest.format_state, self.app_id, self.name)
        manifest.set_format_state(token.made(begun.run_version, version, run_id).public())
        manifest.save()
        self._remove_rejects(plan)
        check_committed(self.table, self.partition, version, manifest.shards)

    def _commit(
        self,
        begun: DeltaBegun,
        plan: DeltaPlan,
        manifest: Manifest,
        run_id: str,
        adds: list[NewFile],
        record: Callable[[], object] | None,
    ) -> int:
        if begun.schema is None:
            raise CommitRefused(
                f"nothing to commit to {self.table.uri}: the run has no output schema",
                uri=self.table.uri,
            )
        token = TokenState.read(manifest.format_state, self.app_id, self.name)
        after = begun.snapshot.version if begun.snapshot is not None else None
        manifest.set_format_state(token.committing(begun.run_version, run_id, after).public())
        manifest.save()  # fenced: only the lock holder records a pending token
        # The run index's entry after the pending token (a kill between them: the next run
        # finds the token and makes the entry say the commit never landed), before the commit.
        if record is not None:
            record()
        checkpoint("delta-before-commit")
        version = delta.commit(
            self.table,
            adds=adds,
            removes=list(plan.removes),
            app_id=self.app_id,
            run_version=begun.run_version,
            metadata=commit_info(
                run_id, self.job, manifest.shards, begun.schema, self.meta_columns
            ),
            expected_schema=begun.schema,
        )
        checkpoint("delta-after-commit")
        return version

    def _remove_rejects(self, plan: DeltaPlan) -> None:
        for rejects, output in plan.rejects_after:
            remove_rejects(rejects, output, self.options)

    def seal(self, begun: DeltaBegun, manifest: Manifest, committed: Committed) -> None:
        """The run's report names its commit: the pending token is settled. (The commit is the
        success marker: a table has no ``_SUCCESS``.)"""
        token = TokenState.read(manifest.format_state, self.app_id, self.name)
        if token.pending is None:
            return
        manifest.set_format_state(token.sealed().public())
        manifest.save()

    def abort(self) -> None:
        return None  # a table keeps its versions: the previous one stays whole until a commit

    def section(self, begun: DeltaBegun | None, committed: Committed | None) -> Section:
        return Section(section_details(self.table.uri, self.label, self.app_id, begun, committed))
