"""``format = "delta"``: a run's scores as one commit to a Delta Lake table, the seam's second
implementation (:class:`DeltaOutput`, beside :class:`~pipeline.sinks.folder.sink.ParquetFolder`).

The table is the output template's fixed part; a run's output is one partition of it (the
template's ``key={placeholder}`` folders filled in), or the whole table when the template has
no placeholder. Workers write each shard's data file exactly as for a folder (staged, atomic,
footer marks), but under a name no other run uses, directly in the partition's folder
(:meth:`DeltaOutput.target`), and send back its size, rows and Delta stats
(:func:`~pipeline.sinks.delta.stats.delta_facts`). The manifest, in the partition's control
folder beside the table, records each shard's file and whether it is committed. Nothing is
visible to a reader until :meth:`DeltaOutput.commit_run`: ONE Delta version that adds the run's
new files and removes every file of the partition it does not keep (rescored shards' old files,
shards whose input vanished, failed or was skipped), carrying ``Transaction(app_id,
run_version)``. The app id is per job and partition (``score-catalog/<job>/run_date=...``), so
runs of different partitions of one table never conflict; the run version is the partition's
committed one plus one, decided under the run lock and recorded in the manifest as *pending*
before the commit, so that a resumed run (:meth:`DeltaOutput.begin`) can tell whether the dead
run's commit landed: if it did, nothing is committed again; if not, the files that run wrote are
reused where their footers check out, or deleted (only files whose names carry the run ids the
manifest recorded), never read.

The run lock lives in the partition's control folder: inside a table nothing but data may live
(a ``VACUUM ... FULL`` deletes unlisted files, ``_``-names in partition folders included).
Maintenance (``rollback``, ``optimize``, ``vacuum``: :mod:`pipeline.driver.tables`) takes the
table lock in the table's control area (:func:`table_lock_root`), which a run checks right after
taking its own. docs/delta.md describes it all; :mod:`~pipeline.sinks.delta.table` is the
only module that calls delta-rs, and this one is imported by the driver only (a forked Dask
worker that calls delta-rs after its parent did panics).

Over the ~600-line rule on purpose (688 lines): the run's side of the commit protocol (begin,
resume, commit, recover) is one sequence read top to bottom; split it with deltatable.py.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from pipeline.core.errors import CommitRefused, ConfigError, PipelineError, ShardError
from pipeline.core.faults import checkpoint
from pipeline.core.templates import below, fixed_part, partition_columns
from pipeline.io import layout, runindex, storage
from pipeline.io.layout import Places
from pipeline.io.manifest import Manifest, fingerprint_hash
from pipeline.io.ownership import ForeignFiles, remove_rejects
from pipeline.io.parquet import open_parquet
from pipeline.io.storage import Location
from pipeline.sinks.base import (
    Committed,
    Expected,
    FileFacts,
    Reconciliation,
    Removal,
    WrittenFile,
)
from pipeline.sinks.delta import table as delta
from pipeline.sinks.delta.stats import (
    NewFile,
    check_partition_values,
    delta_facts,
    stats_problem,
)
from pipeline.sinks.delta.table import Snapshot, TableRef
from pipeline.sinks.folder.sink import file_problems

if TYPE_CHECKING:
    from pipeline.core.config import JobConfig

logger = logging.getLogger(__name__)

#: The folder, in a table's control area, of the table lock that maintenance takes.
TABLE_LOCK_DIR = "_table"
#: Where a data file name's stem may come from (an input shard's relative path, flattened).
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
# Why a file of the partition that this run does not keep goes, when no shard names it.
_UNKNOWN_REASON = (
    "replaced: no shard in this output's manifest lists it (an earlier run's file whose record "
    "was replaced, one a rollback restored, or one OPTIMIZE compacted)"
)
_STALE_REASON = (
    "its input shard no longer exists"  # as the folder says it (pipeline.sinks.folder.sink)
)


def table_root(template: str, options: Mapping[str, Any] | None = None) -> Location:
    """The table an output template writes to: its fixed part."""
    return storage.locate(fixed_part(template)[0], options)


def table_lock_root(area: Location) -> Location:
    """The table lock's folder in the table's control area ``area``."""
    return area.child(TABLE_LOCK_DIR)


def partition_label(values: Mapping[str, str]) -> str:
    """``run_date=2026-12-01`` (``/``-joined for several columns); empty: the whole table."""
    return "/".join(f"{k}={v}" for k, v in values.items())


def app_id_of(job: str, values: Mapping[str, str]) -> str:
    """The Delta app id of a job's runs on one partition: runs of other partitions (and other
    jobs) never carry it, so their commits never conflict with this one's token."""
    return f"score-catalog/{job}/{partition_label(values) or 'table'}"


def data_file_name(rel_path: str, run_id: str) -> str:
    """The name of shard ``rel_path``'s data file in run ``run_id``: readable, unique per run
    (a table keeps older versions' files), plain (no folder: every data file sits directly in
    its partition's folder), and ending in ``-<run_id>.parquet`` so that the files of a run that
    never committed can be found and deleted."""
    stem = rel_path[: -len(".parquet")] if rel_path.endswith(".parquet") else rel_path
    flat = _UNSAFE.sub("_", stem.replace("/", "--")).strip("._") or "part"
    digest = hashlib.sha256(rel_path.encode()).hexdigest()[:8]
    return f"{flat[:80]}-{digest}-{run_id}.parquet"


def _now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class DeltaOutput:
    """One run's output as a Delta table's partition (see the module doc).

    Made once per run by :func:`pipeline.sinks.output_format`; the run's state (the
    manifest, the snapshot it read under the lock, the commit it planned and made) lives on it.
    """

    table: TableRef
    root: Location  # the partition's folder (the table's root when unpartitioned)
    partition: dict[str, str]  # column -> value, in the table's partition column order
    control: Location  # the partition's control folder: manifest, report, run lock
    area: Location  # the table's control area: run index, table lock
    job: str
    meta_columns: tuple[str, ...]  # id and pass-through columns (the others are outputs)
    schema: pa.Schema | None = None  # the run's output schema (None: nothing will be written)
    allow_new_columns: bool = False
    stale_after_s: float = 6 * 3600.0
    log_retention_days: int = delta.DEFAULT_LOG_RETENTION_DAYS
    deleted_file_retention_days: int = delta.DEFAULT_DELETED_FILE_RETENTION_DAYS
    # The run's state, filled in as the driver calls the methods below.
    _manifest: Manifest | None = field(default=None, repr=False)
    _snapshot: Snapshot | None = field(default=None, repr=False)
    _run_id: str = field(default="", repr=False)
    _run_version: int = field(default=0, repr=False)
    _uncommitted_runs: tuple[str, ...] = field(default=(), repr=False)
    _removes: tuple[str, ...] = field(default=(), repr=False)
    _rejects_to_remove: tuple[tuple[Location, Location], ...] = field(default=(), repr=False)
    _committed: Committed | None = field(default=None, repr=False)
    _owners: dict[str, str] = field(default_factory=dict, repr=False)  # file -> shard, at begin
    _recovered: dict[str, Any] | None = field(default=None, repr=False)
    # Committed files of the partition that storage no longer holds (a lost object, a hand
    # cleanup), found with the snapshot by one listing: their shards are scored again and the
    # commit removes the dangling paths.
    _missing: frozenset[str] = field(default=frozenset(), repr=False)

    @classmethod
    def of(
        cls, config: JobConfig, places: Places, run_id: str, schema: pa.Schema | None = None
    ) -> DeltaOutput:
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
            table=TableRef.of(root.uri, opts),
            root=places.output,
            partition=values,
            control=places.control,
            area=places.index,
            job=config.name,
            meta_columns=(config.id_column, *config.passthrough),
            schema=schema,
            allow_new_columns=config.allow_schema_evolution,
            stale_after_s=config.stale_lock_after_s,
            log_retention_days=config.delta.log_retention_days,
            deleted_file_retention_days=config.delta.deleted_file_retention_days,
            _run_id=run_id,
        )

    # -- what the driver asks of every format ----------------------------------------------

    @property
    def name(self) -> str:
        return "delta"

    @property
    def file_facts(self) -> FileFacts | None:
        return delta_facts

    @property
    def dataset(self) -> Location:
        return self.table.location

    @property
    def lock_root(self) -> Location:
        return self.control

    @property
    def exclusive_with(self) -> tuple[Location, ...]:
        return (table_lock_root(self.area),)

    @property
    def mark(self) -> str | None:
        return None  # nothing but data inside a table: its log and properties say whose it is

    @property
    def app_id(self) -> str:
        return app_id_of(self.job, self.partition)

    @property
    def label(self) -> str:
        return partition_label(self.partition)

    def check_owner(self, mode: str) -> None:
        """Refuse a table folder that is not a Delta table, a table this tool did not create,
        and a run whose output does not fit the table's schema (read only: no lock yet)."""
        self._check_folder()
        if not delta.table_exists(self.table):
            return
        snap = self._read_snapshot()
        if snap.properties.get(delta.WRITER_PROPERTY) != delta.WRITER_PROPERTY_VALUE:
            raise ConfigError(
                f"output {self.root.uri}: the Delta table {self.table.uri} was not created by "
                "score-catalog (its table property "
                f"{delta.WRITER_PROPERTY} is not set): a run replaces whole partitions, which "
                "are not its to replace in another writer's table. Nothing was written. Point "
                "the output at a new folder."
            )
        if self.schema is not None:
            delta.check_table(
                self.table,
                self.schema,
                list(self.partition),
                allow_new_columns=self.allow_new_columns,
            )

    def _check_folder(self) -> None:
        try:
            entries = storage.ls(self.table.location)
        except FileNotFoundError:
            return
        except NotADirectoryError as e:
            raise ConfigError(
                f"output {self.table.uri} is a file, not a folder for a Delta table"
            ) from e
        names = sorted(e.name for e in entries)
        if not names or "_delta_log" in names:
            return
        ours = layout.OUTPUT_MARK in names or any(
            storage.exists(e.child(layout.OUTPUT_MARK)) for e in entries[:10]
        )
        what = (
            'a Parquet folder output of score-catalog (format = "parquet")'
            if ours
            else "files that are not a Delta table"
        )
        raise ConfigError(
            f"output {self.root.uri}: {self.table.uri} holds {what} ({', '.join(names[:10])}"
            f"{' ...' if len(names) > 10 else ''}) but no _delta_log/: a Delta table needs a "
            "folder of its own. Nothing was written. Point the output at a new folder (or "
            "move the old output away)."
        )

    def begin(self, manifest: Manifest) -> None:
        """Under the run lock: the table made (or its schema checked and evolved), its
        partition read, and the manifest brought up to date with it (see the module doc)."""
        self._manifest = manifest
        if self.schema is not None:
            meta = {"run_id": self._run_id}
            delta.ensure_table(
                self.table,
                self.schema,
                list(self.partition),
                allow_new_columns=self.allow_new_columns,
                log_retention_days=self.log_retention_days,
                deleted_file_retention_days=self.deleted_file_retention_days,
                metadata=meta,
            )
        snap = self._read_snapshot() if delta.table_exists(self.table) else None
        self._snapshot = snap
        self._missing = self._not_in_storage(snap)
        self._forget_another_outputs(manifest)
        self._owners = {str(e["file"]): rel for rel, e in manifest.shards.items() if "file" in e}
        state = dict(manifest.format_state or {})
        if state.get("app_id") not in (None, self.app_id):
            state = {}  # another job's (renamed): its token is not this app's
        done = snap.transaction_version(self.app_id) if snap is not None else None
        self._settle_pending(manifest, state, snap, done)
        self._run_version = (done or 0) + 1
        # Runs whose files may lie uncommitted in the partition folder: the ones that did not
        # commit, and this one (recorded before it writes a file, so a kill at any point
        # leaves its files findable by name).
        runs = [r for r in state.get("runs", []) if r != self._run_id]
        self._uncommitted_runs = tuple(runs)
        state.update(
            {
                "format": self.name,
                "table": self.table.uri,
                "partition": self.label,
                "app_id": self.app_id,
                "runs": [*runs, self._run_id],
            }
        )
        manifest.set_format_state(state)
        manifest.save()

    def _forget_another_outputs(self, manifest: Manifest) -> None:
        """Entries a manifest kept for another output at this place (a Parquet folder moved
        away before the table was made here, as the README says to do) describe no file of
        this table: forgotten with one line, instead of a warning per shard that its entry
        names no file of the table."""
        state = manifest.format_state or {}
        if not manifest.shards or state.get("format") == self.name:
            return
        logger.info(
            "the manifest %s described a Parquet folder output that is no longer here: its %d "
            "entries are not this table's; every shard is scored",
            manifest.loc.uri,
            len(manifest.shards),
        )
        for rel in list(manifest.shards):
            manifest.forget(rel)

    def _settle_pending(
        self, manifest: Manifest, state: dict[str, Any], snap: Snapshot | None, done: int | None
    ) -> None:
        """What became of the previous run's pending commit: landed (the manifest catches up,
        nothing is committed again) or not (its files are reused or deleted later)."""
        pending = state.pop("pending", None)
        files = {f.path for f in snap.files} if snap is not None else set()
        if isinstance(pending, Mapping) and done is not None and done >= pending["run_version"]:
            for entry in manifest.shards.values():
                if entry.get("file") in files:
                    entry["committed"] = True
            version = delta.version_of(self.table, self.app_id, int(pending["run_version"]))
            state.update(
                committed=int(pending["run_version"]),
                table_version=version,
                run_id=pending.get("run_id"),
                runs=[r for r in state.get("runs", []) if r != pending.get("run_id")],
            )
            self._recovered = {"run_id": pending.get("run_id"), "table_version": version}
            self._settle_index(pending, landed=True, version=version)
            logger.warning(
                "the commit of run %s (run version %s of %s) landed as version %s of %s before "
                "it stopped: the manifest is brought up to date, nothing is committed again",
                pending.get("run_id"),
                pending["run_version"],
                self.app_id,
                version,
                self.table.uri,
            )
        elif isinstance(pending, Mapping):
            logger.warning(
                "the commit of run %s (run version %s of %s) did not land: its files are reused "
                "where their footers check out, and deleted otherwise",
                pending.get("run_id"),
                pending["run_version"],
                self.app_id,
            )
            self._settle_index(pending, landed=False)
        for entry in manifest.shards.values():
            if entry.get("committed") and entry.get("file") not in files:
                # Rolled back, compacted or removed since: scored again (is_done says why).
                entry["committed"] = False
                entry["gone_from_table"] = True

    def _settle_index(
        self, pending: Mapping[str, Any], *, landed: bool, version: int | None = None
    ) -> None:
        """The pending run's entry in the run index says what became of its commit: it is
        written before the commit, and a run whose storage died after (or during) the commit
        could not rewrite it. Best effort: the index is a record on top of the table."""
        run_id = pending.get("run_id")
        if not isinstance(run_id, str):
            return
        opts = dict(self.table.storage_options)
        try:
            changed = runindex.settle_commit(
                self.area.uri,
                opts,
                self.job,
                run_id,
                landed=landed,
                by=self._run_id,
                table_version=version,
            )
        except (OSError, PipelineError) as e:
            logger.warning("could not record the outcome of run %s in the run index: %s", run_id, e)
            return
        if changed:
            logger.info(
                "run index: run %s recorded as %s", run_id, "committed" if landed else "failed"
            )

    def withdraw(self) -> None:
        return None  # a table keeps its versions: the previous one stays whole until a commit

    def replace_foreign(self, ours: set[str]) -> ForeignFiles:
        return ForeignFiles()  # a table this tool did not create is refused before the lock

    def clear(self, rejects: Location, wanted: Iterable[str], ours: set[str]) -> list[Removal]:
        # Data files are plain names in the partition folder: a shard that changed shape is
        # in nobody's way there. Its rejects still are, in the rejects folder.
        from pipeline.sinks.folder.sink import _clear_rejects_way

        _clear_rejects_way(self.root, rejects, list(wanted), dict(self.table.storage_options))
        return []

    def target(self, rel_path: str, run_id: str) -> str:
        return self.table.location.child(self._path(data_file_name(rel_path, run_id))).uri

    def _path(self, name: str) -> str:
        """A data file's path relative to the table's root."""
        return "/".join([*(f"{k}={v}" for k, v in self.partition.items()), name])

    def is_done(self, rel_path: str, entry: Mapping[str, Any], expected: Expected) -> list[str]:
        path = entry.get("file")
        if not isinstance(path, str):
            return ["its manifest entry names no file of the table"]
        snap = self._current()
        found = {f.path: f for f in snap.files} if snap is not None else {}
        if path in self._missing:
            return [
                f"its file {self.table.location.child(path).uri} is in the table but missing "
                "from storage (deleted by hand, or a lost object): it is scored again, and the "
                "run's commit removes the dangling file from the table"
            ]
        if path in found:
            size = entry.get("size")
            if size is not None and found[path].size != size:
                return [f"its file {path} in the table has another size than the manifest says"]
            return []
        if entry.get("committed") or entry.get("gone_from_table"):
            return [
                f"its file {path} is no longer in the table {self.table.uri} (rolled back, "
                "compacted by OPTIMIZE, or removed by another writer)"
            ]
        # Written by a run that did not commit: reused if its footer says it is this shard's.
        loc = self.table.location.child(path)
        options = dict(self.table.storage_options)
        problems = file_problems(loc, expected, options)
        if not problems and storage.size_of(loc) != entry.get("size"):
            problems = [f"{loc.uri} has another size than its worker reported"]
        return problems or _stale_stats(loc, entry, options)

    def commit_shard(self, written: WrittenFile | None) -> dict[str, Any]:
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
            "modification_time": _now_ms(),
            "committed": False,
        }

    def settle(
        self,
        rejects: Location,
        keep: set[str],
        ours: set[str],
        reasons: Mapping[str, str],
    ) -> Reconciliation:
        """Plan the commit's removes: every file of the partition the run does not keep. The
        files of runs that never committed, not reused now, are deleted (no reader ever sees
        them); rejects of shards that leave go once the commit has landed."""
        manifest = self._need_manifest()
        entries = manifest.shards
        kept = {str(entries[r]["file"]) for r in keep if "file" in entries.get(r, {})}
        snap = self._current()
        current = [f.path for f in snap.files] if snap is not None else []
        self._removes = tuple(p for p in current if p not in kept)
        owners = self._owners
        result = Reconciliation(pending=True)
        for path in self._removes:
            rel = owners.get(path)
            if rel is not None and rel in keep:
                continue  # rescored: its new file replaces it, not a removal from the dataset
            reason = _UNKNOWN_REASON if rel is None else reasons.get(rel, _STALE_REASON)
            result.removed.append(Removal(rel or path, self.table.location.child(path).uri, reason))
        gone = (ours | set(reasons)) - keep
        self._rejects_to_remove = tuple(
            (rejects.child(rel), self.root.child(rel)) for rel in sorted(gone)
        )
        self._delete_uncommitted(kept)
        return result

    def _delete_uncommitted(self, kept: set[str]) -> None:
        """Delete the files of runs that never committed (their names end in ``-<run>.parquet``)
        which this run does not take over; no version of the table ever listed them."""
        if not self._uncommitted_runs:
            return
        in_table = {f.path for f in self._snapshot.files} if self._snapshot is not None else set()
        suffixes = tuple(f"-{r}.parquet" for r in self._uncommitted_runs)
        for name in storage.list_files(self.root):
            path = self._path(name)
            if "/" in name or not name.endswith(suffixes) or path in kept or path in in_table:
                continue
            storage.remove(self.root.child(name))
            logger.info("deleted %s: written by a run that never committed", path)
        state = dict(self._need_manifest().format_state or {})
        state["runs"] = [self._run_id]
        self._need_manifest().set_format_state(state)

    def verify(self, expected: Mapping[str, Expected]) -> list[str]:
        """How the version this run would commit differs from the report: each shard's file
        (a new one or one the table keeps) read back from its footer, and no other file."""
        entries = self._need_manifest().shards
        problems: list[str] = []
        planned: set[str] = set()
        opts = dict(self.table.storage_options)
        for rel, want in sorted(expected.items()):
            path = entries.get(rel, {}).get("file")
            if not isinstance(path, str):
                problems.append(f"{self.root.child(rel).uri} is in the report but has no data file")
                continue
            planned.add(path)
            problems += file_problems(self.table.location.child(path), want, opts)
        snap = self._current()
        after = {f.path for f in snap.files} - set(self._removes) if snap is not None else set()
        for path in sorted(after - planned):
            problems.append(
                f"{self.table.location.child(path).uri} would stay in the table's partition but "
                "is not in the report"
            )
        return problems

    def commit_run(self, run_id: str, entries: Mapping[str, Mapping[str, Any]]) -> Committed:
        """ONE commit of the run's new files and the removes :meth:`settle` planned, with the
        run's token; then the manifest marks them committed and the committed version is
        checked against the report. Nothing to add or remove: no commit (the table holds the
        output already)."""
        manifest = self._need_manifest()
        snap = self._current()
        in_table = {f.path for f in snap.files} if snap is not None else set()
        adds = [_new_file(e, self.partition) for e in entries.values() if _is_new(e, in_table)]
        if not adds and not self._removes:
            # Every shard skipped, none gone: the table holds this output already.
            state = dict(manifest.format_state or {})
            state["runs"] = []
            manifest.set_format_state(state)
            manifest.save()
            self._committed = Committed(self._details(committed=False), visible=True)
            self._remove_rejects()
            return self._committed
        version = self._commit(manifest, run_id, entries, adds)
        for entry in manifest.shards.values():
            if entry.get("file") in {a.path for a in adds}:
                entry["committed"] = True
                entry.pop("gone_from_table", None)
        state = dict(manifest.format_state or {})
        # The token stays pending until the run's report names the commit (seal): a run that
        # stops in between (its store died after the commit landed) leaves it for the next
        # run, which records the commit as landed (recovered) and its run-index entry with it.
        state.update(committed=self._run_version, table_version=version, run_id=run_id, runs=[])
        manifest.set_format_state(state)
        manifest.save()
        self._remove_rejects()
        self._check_committed(version, entries)
        assert self._committed is not None
        return self._committed

    def _commit(
        self,
        manifest: Manifest,
        run_id: str,
        entries: Mapping[str, Mapping[str, Any]],
        adds: list[NewFile],
    ) -> int:
        if self.schema is None:
            raise CommitRefused(
                f"nothing to commit to {self.table.uri}: the run has no output schema",
                uri=self.table.uri,
            )
        state = dict(manifest.format_state or {})
        state["pending"] = {"run_version": self._run_version, "run_id": run_id}
        manifest.set_format_state(state)
        manifest.save()  # fenced: only the lock holder records a pending token
        checkpoint("delta-before-commit")
        version = delta.commit(
            self.table,
            adds=adds,
            removes=list(self._removes),
            app_id=self.app_id,
            run_version=self._run_version,
            metadata=self._metadata(run_id, entries),
            expected_schema=self.schema,
        )
        self._committed = Committed(
            self._details(
                committed=True,
                version=version,
                files_added=len(adds),
                files_removed=len(self._removes),
            ),
            visible=True,
        )
        checkpoint("delta-after-commit")
        return version

    def _metadata(self, run_id: str, entries: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
        first = next(iter(entries.values()), {})
        fingerprints = {rel: e.get("fingerprint") for rel, e in sorted(entries.items())}
        outputs = [n for n in (self.schema.names if self.schema else []) if n not in self._meta]
        return {
            delta.RUN_ID: run_id,
            delta.MODEL_SHA256: str(first.get("model_sha256", "")),
            delta.SETTINGS_HASH: str(first.get("settings_hash", "")),
            delta.INPUT_FINGERPRINT: fingerprint_hash(fingerprints),
            delta.ROWS: str(sum(int(e.get("rows_scored") or 0) for e in entries.values())),
            delta.JOB: self.job,
            delta.OUTPUTS: ",".join(outputs),
        }

    @property
    def _meta(self) -> set[str]:
        return {*self.meta_columns, "model_version"}

    def _check_committed(self, version: int, entries: Mapping[str, Mapping[str, Any]]) -> None:
        """The committed version's partition must hold exactly the report's files and rows."""
        snap = delta.snapshot(self.table, self.partition or None, version=version)
        have = {f.path: f.rows for f in snap.files}
        want = {str(e["file"]): int(e.get("rows_scored") or 0) for e in entries.values()}
        problems = [f"{p} is missing" for p in sorted(set(want) - set(have))]
        problems += [f"{p} is not in the report" for p in sorted(set(have) - set(want))]
        problems += [
            f"{p} holds {have[p]} rows, the report says {n}"
            for p, n in sorted(want.items())
            if p in have and have[p] is not None and have[p] != n
        ]
        if problems:
            raise CommitRefused(
                f"version {version} of {self.table.uri} was committed, but its partition "
                f"{self.label or '(the table)'} differs from the report: "
                + "; ".join(problems[:10]),
                uri=self.table.uri,
            )

    def _remove_rejects(self) -> None:
        opts = dict(self.table.storage_options)
        for rejects, output in self._rejects_to_remove:
            remove_rejects(rejects, output, opts)

    def seal(self) -> None:
        """The run's report names its commit: the pending token is settled. (The commit is the
        success marker: a table has no ``_SUCCESS``.)"""
        manifest = self._manifest
        state = dict(manifest.format_state or {}) if manifest is not None else {}
        if manifest is None or state.get("pending") is None:
            return
        state["pending"] = None
        manifest.set_format_state(state)
        manifest.save()

    def describe(self, committed: Committed | None) -> dict[str, Any]:
        found = committed or self._committed
        if found is not None:
            return dict(found.details)
        return self._details(committed=False)

    def _details(self, *, committed: bool, **more: Any) -> dict[str, Any]:
        snap = self._snapshot
        d: dict[str, Any] = {
            "format": self.name,
            "table": self.table.uri,
            "partition": self.label or None,
            "app_id": self.app_id,
            "run_version": self._run_version if committed else None,
            "version": snap.version if snap is not None else None,
            "committed": committed,
            "files_added": 0,
            "files_removed": 0,
        }
        if self._recovered is not None:
            d["recovered"] = dict(self._recovered)
            if not committed and self._recovered.get("table_version") is not None:
                d["version"] = self._recovered["table_version"]
        d.update(more)
        return d

    def sealed(self) -> bool:
        """The partition holds exactly the files the manifest's last commit left there."""
        found = Manifest.load(self.control)
        state = found.format_state or {}
        if not delta.table_exists(self.table) or state.get("app_id") != self.app_id:
            return False
        if state.get("pending") or state.get("committed") is None:
            return False
        snap = self._read_snapshot()
        if snap.transaction_version(self.app_id) != state["committed"]:
            return False
        files = {f.path for f in snap.files}
        if self._not_in_storage(snap):
            return False  # a committed file is gone: the day is work to do (rescored)
        return bool(files) and files == {e.get("file") for e in found.shards.values()}

    # -- helpers ---------------------------------------------------------------------------

    def _read_snapshot(self) -> Snapshot:
        return delta.snapshot(self.table, self.partition or None)

    def _current(self) -> Snapshot | None:
        """The snapshot read under the lock, or (``plan``, no lock) one read now."""
        if self._snapshot is None and self._manifest is None:
            self._snapshot = self._read_snapshot() if delta.table_exists(self.table) else None
            self._missing = self._not_in_storage(self._snapshot)
        return self._snapshot

    def _not_in_storage(self, snap: Snapshot | None) -> frozenset[str]:
        """The files ``snap`` lists in this partition that storage does not hold: one listing
        of the partition's folder (every data file of a partition lies directly in it: ours,
        OPTIMIZE's and a rollback's), not a request per file."""
        if snap is None or not snap.files:
            return frozenset()
        try:
            names = {e.name for e in storage.ls(self.root)}
        except FileNotFoundError:
            names = set()
        prefix = "".join(f"{k}={v}/" for k, v in self.partition.items())
        return frozenset(
            f.path
            for f in snap.files
            if not (f.path.startswith(prefix) and f.path[len(prefix) :] in names)
        )

    def _need_manifest(self) -> Manifest:
        if self._manifest is None:
            raise RuntimeError("DeltaOutput.begin was not called")
        return self._manifest


def _stale_stats(loc: Location, entry: Mapping[str, Any], options: Mapping[str, Any]) -> list[str]:
    """A file a run wrote but never committed is reused only if the stats its worker recorded
    are what its footer gives today: stats recorded under other rules (an older version of this
    tool, before a resume) would make every commit refuse it, so the shard is scored again."""
    try:
        with open_parquet(loc.uri, options) as pf:
            problem = stats_problem(str(entry.get("stats") or ""), pf.metadata)
    except ShardError as e:
        return [f"{loc.uri} cannot be read back: {e}"]
    return [f"{loc.uri}: {problem} (recorded by another version?)"] if problem else []


def _is_new(entry: Mapping[str, Any], in_table: set[str]) -> bool:
    return isinstance(entry.get("file"), str) and entry["file"] not in in_table


def _new_file(entry: Mapping[str, Any], partition: Mapping[str, str]) -> NewFile:
    return NewFile(
        path=str(entry["file"]),
        size=int(entry["size"]),
        partition_values=dict(partition),
        modification_time=int(entry.get("modification_time") or _now_ms()),
        stats=str(entry.get("stats") or ""),
        rows=int(entry.get("rows") or 0),
    )
