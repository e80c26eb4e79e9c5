"""A table's partition as one run's output, whatever the table's format: what the Delta and the
Iceberg sinks share (:class:`TablePartitionSink`, :class:`TableBegun`, :class:`TablePlan`,
:func:`settle_pending`).

A run on a table's partition is the same for every format given four things the format says:
the partition's files at the current version, the app's committed run version, the version a
run version landed as, and one commit of the run's files with its token. Those are the hooks a
format's sink fills in (``_land``, ``_check_landed``, ``_new_files``, ``_entry_facts``,
``_partition_files``); the rest (which files the commit removes and why, the report checked
against the files before the commit, the manifest's token through a commit, a resumed run's
pending commit settled) is here, once. No table client here: a format's package imports this.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import pyarrow as pa

from pipeline.core.errors import CommitRefused, ConfigError, mark_landed
from pipeline.core.faults import checkpoint
from pipeline.core.templates import below
from pipeline.io import storage
from pipeline.io.manifest import Manifest
from pipeline.io.ownership import ForeignFiles, remove_rejects
from pipeline.io.storage import Location
from pipeline.sinks.base import (
    Committed,
    Expected,
    Outcome,
    Removal,
    Section,
    SinkPlaces,
    Visible,
    WrittenFile,
)
from pipeline.sinks.files import (
    clear_rejects_way,
    delete_files,
    file_problems,
    folder_of,
    missing_files,
    uncommitted_names,
)
from pipeline.sinks.naming import app_id_of, partition_label
from pipeline.sinks.tables import TableFile, table_lock_root
from pipeline.sinks.token import IndexPlace, Pending, Recovered, TokenState, settle_index

# Why a file of the partition that this run does not keep goes, when no shard names it.
UNKNOWN_REASON = (
    "replaced: no shard in this output's manifest lists it (an earlier run's file whose record "
    "was replaced, one a rollback restored or OPTIMIZE compacted, or another writer's file: a "
    "run replaces its partition whole)"
)
STALE_REASON = "its input shard no longer exists"  # as the folder says it


class TableRefLike(Protocol):
    """What the shared code needs of a format's table reference."""

    @property
    def uri(self) -> str: ...

    @property
    def location(self) -> Location: ...


class SnapshotLike(Protocol):
    """A partition of the table at one version."""

    @property
    def version(self) -> int | None: ...

    @property
    def files(self) -> tuple[TableFile, ...]: ...


class NewFileLike(Protocol):
    """A run's file the commit adds."""

    @property
    def path(self) -> str: ...


@dataclass(frozen=True)
class TableBegun:
    """The partition when the run took it (or, for ``plan``, now)."""

    table: TableRefLike
    root: Location  # the partition's folder
    snapshot: SnapshotLike | None  # None: no table yet
    #: Committed files storage no longer holds (a lost object, a hand cleanup): their shards
    #: are scored again and the commit removes the dangling paths.
    missing: frozenset[str]
    run_version: int  # this run's token: the partition's committed run version plus one
    committed_run_version: int | None  # the table's, for this app
    token: TokenState  # as the manifest keeps it (settled, when begun under the lock)
    owners: Mapping[str, str]  # file -> shard, as the manifest listed them
    manifest_files: frozenset[str]  # the files the manifest's entries name
    options: Mapping[str, Any] = field(default_factory=dict, repr=False)  # storage options
    recovered: Recovered | None = None  # the previous run's commit, found landed
    schema: pa.Schema | None = None  # the run's output schema (None: nothing will be written)
    cleared: tuple[Removal, ...] = ()
    foreign: ForeignFiles = field(default_factory=ForeignFiles)

    @functools.cached_property
    def files(self) -> dict[str, int]:
        """The partition's files in the table: path -> size (read once: ``done`` asks per
        shard)."""
        return {f.path: f.size for f in self.snapshot.files} if self.snapshot is not None else {}

    @property
    def complete(self) -> bool:
        """The partition holds exactly the files the manifest's last commit left there, all
        of them in storage (a backfill runs a day whose file was lost)."""
        token = self.token
        if self.snapshot is None or token.pending is not None or token.committed is None:
            return False
        if self.committed_run_version != token.committed or self.missing:
            return False
        files = set(self.files)
        return bool(files) and files == set(self.manifest_files)

    def done(self, rel_path: str, entry: Mapping[str, Any], expected: Expected) -> list[str]:
        path = entry.get("file")
        if not isinstance(path, str):
            return ["its manifest entry names no file of the table"]
        if path in self.missing:
            return [
                f"its file {self.table.location.child(path).uri} is in the table but missing "
                "from storage (deleted by hand, or a lost object): it is scored again, and the "
                "run's commit removes the dangling file from the table"
            ]
        found = self.files
        if path in found:
            size = entry.get("size")
            if size is not None and found[path] != size:
                return [f"its file {path} in the table has another size than the manifest says"]
            return []
        if entry.get("committed") or entry.get("gone_from_table"):
            return [
                f"its file {path} is no longer in the table {self.table.uri} (rolled back, "
                "compacted by OPTIMIZE, or removed by another writer)"
            ]
        # Written by a run that did not commit: reused if its footer says it is this shard's.
        loc = self.table.location.child(path)
        problems = file_problems(loc, expected, self.options)
        if not problems and storage.size_of(loc) != entry.get("size"):
            problems = [f"{loc.uri} has another size than its worker reported"]
        return problems or self.reuse_problems(loc, entry)

    def reuse_problems(self, loc: Location, entry: Mapping[str, Any]) -> list[str]:
        """A format's own reasons not to reuse an uncommitted file whose footer checks out."""
        return []


@dataclass(frozen=True)
class TablePlan:
    """What the run's commit removes, decided before it is made."""

    removes: tuple[str, ...]  # paths of files of the partition the commit removes
    removed: tuple[Removal, ...]  # of those, what readers stop seeing, and why
    uncommitted: tuple[str, ...]  # names of files of runs that never committed: deleted now
    rejects_after: tuple[tuple[Location, Location], ...]  # (rejects, output) once committed
    foreign: tuple[str, ...] = ()

    @property
    def at_commit(self) -> bool:
        return True


def settle_pending(
    where: IndexPlace,
    fmt: str,
    manifest: Manifest,
    snapshot: SnapshotLike | None,
    done: int | None,
    landed_as: Callable[[Pending], int | None],
) -> tuple[TokenState, Recovered | None]:
    """What became of the previous run's pending commit (:meth:`TokenState.settle`), given the
    app's committed run version ``done`` and where a pending run version landed, recorded in the
    run index; the manifest's entries brought in line with the table: a recovered commit's
    files are committed; a committed file the table no longer holds (rolled back, compacted or
    removed since) is scored again (:meth:`TableBegun.done` says why)."""
    found = TokenState.read(manifest.format_state, where.app_id, fmt)
    pending = found.pending
    landed = None
    if pending is not None and done is not None and done >= pending.run_version:
        landed = landed_as(pending)
    token, recovered = found.settle(done, landed)
    if pending is not None:
        settle_index(where, pending, landed=recovered is not None, version=landed)
    files = {f.path for f in snapshot.files} if snapshot is not None else set()
    for entry in manifest.shards.values():
        if recovered is not None and entry.get("file") in files:
            entry["committed"] = True
        elif entry.get("committed") and entry.get("file") not in files:
            entry["committed"] = False
            entry["gone_from_table"] = True
    return token, recovered


class TablePartitionSink:
    """What a table format's sink shares: a mixin over a frozen dataclass with these fields
    (see :class:`pipeline.sinks.delta.sink.DeltaSink`). A format fills in the hooks below."""

    #: The names that make a folder a table of this format (``_delta_log``, ``metadata``).
    TABLE_NAMES: ClassVar[tuple[str, ...]]
    KIND: ClassVar[str]  # "Delta table": for messages

    table: TableRefLike
    root: Location
    partition: Mapping[str, str]
    control: Location
    area: Location
    job: str
    run_id: str
    options: Mapping[str, Any]

    @property
    def name(self) -> str:
        raise NotImplementedError

    # -- the format's hooks ------------------------------------------------------------------

    def _entry_facts(self, written: WrittenFile) -> dict[str, Any]:
        """The format's keys of a shard's manifest entry (its stats, ...)."""
        raise NotImplementedError

    def _new_files(self, entries: Mapping[str, Mapping[str, Any]], in_table: set[str]) -> list[Any]:
        """The files the manifest's entries name that the table does not hold yet."""
        raise NotImplementedError

    def _land(
        self, begun: Any, plan: TablePlan, manifest: Manifest, run_id: str, adds: list[Any]
    ) -> tuple[int, dict[str, Any]]:
        """ONE commit of ``adds`` and ``plan.removes`` with the run's token: (the version it
        landed as, the format's details for the report)."""
        raise NotImplementedError

    def _check_landed(self, version: int, details: Mapping[str, Any], manifest: Manifest) -> None:
        """The committed version's partition holds exactly the report's files and rows."""
        raise NotImplementedError

    def _partition_files(
        self, values: Mapping[str, str]
    ) -> tuple[tuple[TableFile, ...], int | None]:
        """A partition's files in the table's latest version, and that version."""
        raise NotImplementedError

    def _section_keys(self, begun: TableBegun | None) -> dict[str, Any]:
        """The format's own keys of the report's ``output_format`` (where a reader finds the
        table), placed after ``table``."""
        return {}

    def _summary(self, section: Mapping[str, Any]) -> str:
        """The summary's ``table`` line: the version readers see, whether this run made it."""
        raise NotImplementedError

    # -- shared ------------------------------------------------------------------------------

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
            table_names=self.TABLE_NAMES,
        )

    @property
    def app_id(self) -> str:
        return app_id_of(self.job, self.partition)

    @property
    def label(self) -> str:
        return partition_label(self.partition)

    def control_of(self, folder: str) -> Location:
        """The control folder of the table's partition folder ``folder`` (relative to the
        table's root, '' for the root): this partition's with its own folder swapped for
        ``folder`` (every partition's control folder lies at the same place under the table's
        control area)."""
        own = folder_of(self.partition).rstrip("/")
        base = self.control.uri.rstrip("/")
        if own:
            base = base.removesuffix(own).rstrip("/")
        return storage.sibling(self.control, f"{base}/{folder}" if folder else base)

    def _index_place(self) -> IndexPlace:
        return IndexPlace(
            self.area, self.options, self.job, self.run_id, self.app_id, self.table.uri
        )

    def _begun_of(
        self,
        snapshot: SnapshotLike | None,
        done: int | None,
        token: TokenState,
        manifest: Manifest,
        cls: type[TableBegun] = TableBegun,
        **more: Any,
    ) -> Any:
        """The partition as found: ``snapshot`` of it, ``done`` the app's committed run
        version."""
        paths = [f.path for f in snapshot.files] if snapshot is not None else []
        return cls(
            table=self.table,
            root=self.root,
            snapshot=snapshot,
            missing=missing_files(self.root, folder_of(self.partition), paths),
            run_version=(done or 0) + 1,
            committed_run_version=done,
            token=token,
            owners={str(e["file"]): rel for rel, e in manifest.shards.items() if "file" in e},
            manifest_files=frozenset(
                str(e["file"]) for e in manifest.shards.values() if e.get("file")
            ),
            options=self.options,
            **more,
        )

    def _take(
        self,
        manifest: Manifest,
        rejects: Location,
        wanted: tuple[str, ...],
        settled: tuple[TokenState, Recovered | None],
        begun: Callable[..., TableBegun],
        **names: Any,
    ) -> Any:
        """The end of ``begin``, under the run lock: the partition as found with the token
        ``settled``, this run recorded in the manifest (with ``names``: the table's, for readers
        of the manifest), the rejects of shards that changed shape out of the way."""
        token, recovered = settled
        found = begun(token, recovered=recovered)
        state = token.begun(self.run_id, table=self.table.uri, partition=self.label, **names)
        manifest.set_format_state(state.public())
        manifest.save()
        # Data files are plain names in the partition folder: a shard that changed shape is
        # in nobody's way there. Its rejects still are, in the rejects folder.
        clear_rejects_way(self.root, rejects, list(wanted), self.options)
        return found

    def section(self, begun: TableBegun | None, committed: Committed | None) -> Section:
        """The report's ``output_format`` of a run on the table's partition: the version
        readers see after the run, whether this run made it (and its token), what an earlier
        run's commit it recovered, and the heading and summary line the report shows."""
        made = committed is not None and committed.made
        snap = begun.snapshot if begun is not None else None
        d: dict[str, Any] = {
            "format": self.name,
            "table": self.table.uri,
            **self._section_keys(begun),
            "partition": self.label or None,
            "app_id": self.app_id,
            "run_version": begun.run_version if made and begun is not None else None,
            "version": snap.version if snap is not None else None,
            "committed": made,
            "files_added": 0,
            "files_removed": 0,
        }
        recovered = begun.recovered if begun is not None else None
        if recovered is not None:
            d["recovered"] = recovered.public()
            if not made and recovered.table_version is not None:
                d["version"] = recovered.table_version
        if committed is not None:
            d.update(committed.details)
            if made:
                d["version"] = committed.version
        d["title"] = self.KIND
        d["summary"] = self._summary(d)
        return Section(d)

    def visible(self, output: str) -> Visible:
        """The files of the table's partition at ``output`` (a partition folder of this
        table, or its root) in the table's latest version."""
        loc = storage.locate(output, self.options)
        try:
            rest = below(self.table.location.path, loc.path)
        except ValueError:
            raise ConfigError(f"{loc.uri} is not in the {self.KIND} {self.table.uri}") from None
        values = dict(s.partition("=")[::2] for s in rest.split("/") if s)
        files, version = self._partition_files(values)
        return Visible(tuple(self.table.location.child(f.path).uri for f in files), version)

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
            **self._entry_facts(written),
            "committed": False,
        }

    def plan(
        self, begun: TableBegun, manifest: Manifest, outcome: Outcome, rejects: Location
    ) -> TablePlan:
        """The commit's removes: every file of the partition the run does not keep; the files
        of runs that never committed, not reused now (no reader ever sees them); rejects of
        shards that leave, to go once the commit has landed."""
        entries = manifest.shards
        kept = {str(entries[r]["file"]) for r in outcome.keep if "file" in entries.get(r, {})}
        current = list(begun.files)
        removes = tuple(p for p in current if p not in kept)
        removed = []
        for path in removes:
            rel = begun.owners.get(path)
            if rel is not None and rel in outcome.keep:
                continue  # rescored: its new file replaces it, not a removal from the dataset
            reason = UNKNOWN_REASON if rel is None else outcome.reasons.get(rel, STALE_REASON)
            removed.append(Removal(rel or path, self.table.location.child(path).uri, reason))
        gone = (outcome.ours | set(outcome.reasons)) - outcome.keep
        uncommitted = uncommitted_names(
            self.root, folder_of(self.partition), begun.token.runs, set(current) | kept
        )
        return TablePlan(
            removes=removes,
            removed=tuple(removed),
            uncommitted=uncommitted,
            rejects_after=tuple((rejects.child(r), self.root.child(r)) for r in sorted(gone)),
        )

    def delete_stale(self, plan: TablePlan) -> tuple[Removal, ...]:
        delete_files(self.root, plan.uncommitted)
        return ()  # what readers stop seeing goes with the commit

    def verify(
        self,
        begun: TableBegun,
        plan: TablePlan,
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
        after = set(begun.files) - set(plan.removes)
        for path in sorted(after - planned):
            problems.append(
                f"{self.table.location.child(path).uri} would stay in the table's partition but "
                "is not in the report"
            )
        return problems

    def commit(
        self,
        begun: TableBegun,
        plan: TablePlan,
        manifest: Manifest,
        run_id: str,
        record: Callable[[], object] | None = None,
    ) -> Committed:
        """ONE commit of the run's new files and the removes ``plan`` names, with the run's
        token; then the manifest marks them committed and the committed version is checked
        against the report. Nothing to add or remove: no commit (the table holds the output
        already)."""
        adds = self._new_files(manifest.shards, set(begun.files))
        if not adds and not plan.removes:
            return self._nothing(begun, plan, manifest, record)
        version, details = self._commit(begun, plan, manifest, run_id, adds, record)
        try:
            self._record(begun, plan, manifest, run_id, version, {a.path for a in adds})
            self._check_landed(version, details, manifest)
        except BaseException as e:  # the store died after the commit landed: say so
            mark_landed(e, version, self.table.uri)
            raise
        details = {"files_added": len(adds), "files_removed": len(plan.removes), **details}
        return Committed(visible=True, version=version, made=True, details=details)

    def _nothing(
        self,
        begun: TableBegun,
        plan: TablePlan,
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
        begun: TableBegun,
        plan: TablePlan,
        manifest: Manifest,
        run_id: str,
        adds: list[Any],
        record: Callable[[], object] | None,
    ) -> tuple[int, dict[str, Any]]:
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
        checkpoint(f"{self.name}-before-commit")
        landed = self._land(begun, plan, manifest, run_id, adds)
        checkpoint(f"{self.name}-after-commit")
        return landed

    def _record(
        self,
        begun: TableBegun,
        plan: TablePlan,
        manifest: Manifest,
        run_id: str,
        version: int,
        added: set[str],
    ) -> None:
        """The commit that landed as ``version``, in the manifest (its token still pending
        until the run's report names it: :meth:`seal`)."""
        for entry in manifest.shards.values():
            if entry.get("file") in added:
                entry["committed"] = True
                entry.pop("gone_from_table", None)
        token = TokenState.read(manifest.format_state, self.app_id, self.name)
        manifest.set_format_state(token.made(begun.run_version, version, run_id).public())
        manifest.save()
        self._remove_rejects(plan)

    def _remove_rejects(self, plan: TablePlan) -> None:
        for rejects, output in plan.rejects_after:
            remove_rejects(rejects, output, self.options)

    def seal(self, begun: TableBegun, manifest: Manifest, committed: Committed) -> None:
        """The run's report names its commit: the pending token is settled. (The commit is the
        success marker: a table has no ``_SUCCESS``.)"""
        token = TokenState.read(manifest.format_state, self.app_id, self.name)
        if token.pending is None:
            return
        manifest.set_format_state(token.sealed().public())
        manifest.save()

    def abort(self) -> None:
        return None  # a table keeps its versions: the previous one stays whole until a commit
