"""An Iceberg table's upkeep, with the Delta table's rules (docs/iceberg.md#optimize-and-vacuum):
``optimize`` (small files compacted by :mod:`pipeline.sinks.compaction` into ONE ``replace``
snapshot) and ``vacuum`` (snapshots older than the retention expired, and the files only they
listed deleted). pyiceberg 0.12 has neither a compaction nor a file cleanup: its
``expire_snapshots`` removes snapshots from the metadata and deletes no file.

Optimize writes each compacted file as a run writes its files (in the partition's folder, a
name :func:`~pipeline.sinks.naming.data_file_name` gives, no partition column, no field ids:
the table's name mapping), builds its ``DataFile`` as a run's commit does
(:func:`~pipeline.sinks.iceberg.commit.data_file`) and commits through the run's producer
(:class:`~pipeline.sinks.iceberg.commit.LeanOverwrite`) with the operation ``replace``: readers
see the same rows, and the snapshot says no data changed.

Vacuum is "lite", as Delta's: a file is deleted only when an expired snapshot listed it and no
kept snapshot does; a file no snapshot ever listed (a run in flight writes into the partition's
folder before its commit) and anything outside the table's folder are never touched. The
retention is the table's ``history.expire.max-snapshot-age-ms`` (Iceberg's own property, read
by Spark's and Java's expiry too), else :data:`DEFAULT_RETENTION_DAYS`; a shorter one is refused
unless ``force``. The snapshot that was current when the retention window opens is kept too: a
file a commit removed within the window stays, as Delta keeps it, and time travel to any moment
of the window still reads.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pyiceberg.exceptions import CommitFailedException, ValidationException
from pyiceberg.manifest import DataFile
from pyiceberg.table import Table
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.snapshots import Operation, Snapshot, Summary, ancestors_of
from pyiceberg.table.update.snapshot import ExpireSnapshots
from pyiceberg.typedef import EMPTY_DICT

from pipeline.core import runcontext
from pipeline.core.errors import CommitConflict, CommitRefused, ConfigError, TableError, UsageError
from pipeline.core.faults import checkpoint
from pipeline.io import storage
from pipeline.io.layout import SCORER_KEY, WRITER_KEY
from pipeline.io.storage import Location
from pipeline.sinks import compaction
from pipeline.sinks.files import folder_of
from pipeline.sinks.iceberg.commit import LeanOverwrite, NewFile, data_file
from pipeline.sinks.iceberg.schema import footer_problem
from pipeline.sinks.iceberg.view import ALL_FILES, partition_filter
from pipeline.sinks.naming import data_file_name, partition_label
from pipeline.sinks.tables import METADATA_PREFIX

logger = logging.getLogger(__name__)

#: The table property that holds the table's retention (Iceberg's: Spark's ``expire_snapshots``
#: reads it too), in milliseconds.
RETENTION_PROPERTY = "history.expire.max-snapshot-age-ms"
#: Iceberg's property for the newest snapshots of the main branch expiry always keeps.
MIN_SNAPSHOTS_PROPERTY = "history.expire.min-snapshots-to-keep"
#: The retention where the table sets none: what this tool's Delta tables keep removed files
#: (the ``[delta]`` keys' defaults), so that time travel and rollback reach back as far.
DEFAULT_RETENTION_DAYS = 30
#: Summary key (under ``score_catalog.``) of a commit of ours that is not a run's, as for Delta.
OPERATION = "operation"
#: The table property a vacuum sets in its expiry commit: when, by whom, what it removed (an
#: expiry makes no snapshot, so history cannot show it).
LAST_VACUUM_PROPERTY = METADATA_PREFIX + "last_vacuum"
#: Tries at the expiry commit while other commits land (each on the table as it is then).
EXPIRE_ATTEMPTS = 5
_HOUR_MS = 3_600_000


# --------------------------------------------------------------------------- optimize


class _Rewrite(LeanOverwrite):
    """The run's producer, its snapshot marked ``replace`` (Java's RewriteFiles: no data
    changed). pyiceberg 0.12 computes a summary's totals for append, overwrite and delete only
    (``Operation not implemented: replace``): they are computed as for an overwrite, then the
    operation is set."""

    def _summary(self, snapshot_properties: dict[str, str] = EMPTY_DICT) -> Summary:
        summary = super()._summary(snapshot_properties)
        return Summary(operation=Operation.REPLACE, **summary.additional_properties)


def optimize(
    table: Table,
    partition: Mapping[str, str] | None,
    target_size: int | None,
    metadata: Mapping[str, str],
) -> dict[str, Any]:
    """Compact the small files (of ``partition``, if given: some or all of the partition
    columns) into files of about ``target_size`` bytes (default 100 MiB, as for Delta), in ONE
    ``replace`` snapshot carrying ``metadata`` (prefixed ``score_catalog.``); each new file
    holds its sources' rows in their order. Returns ``numFilesRemoved`` and ``numFilesAdded``
    (and the snapshot's ``version``, its sequence number, and ``snapshot_id``); no snapshot when
    nothing is small enough to compact together."""
    root = storage.locate(table.metadata.location)
    columns = [f.name for f in table.spec().fields]
    unknown = sorted(set(partition or {}) - set(columns))
    if unknown:
        raise UsageError(
            f"the Iceberg table {root.uri} has no partition column {', '.join(unknown)} "
            f"(its partition columns: {columns or 'none'})"
        )
    live = _live_files(table, root, columns, partition or {})
    target = target_size or compaction.DEFAULT_TARGET_SIZE
    small = [  # by path: the same table compacts the same way (plan order is manifest order)
        compaction.Small(rel, int(f.file_size_in_bytes), partition_label(values))
        for rel, (f, values) in sorted(live.items())
    ]
    plan = compaction.bins(small, target)
    if not plan:
        return {"numFilesRemoved": 0, "numFilesAdded": 0}
    op_id = runcontext.new_run_id()
    removes: list[DataFile] = []
    adds: list[DataFile] = []
    written: list[Location] = []
    try:
        for i, group in enumerate(plan):
            old = [(s.key, live[s.key][0]) for s in group]
            name = data_file_name(f"compacted-{i}", op_id)
            new, loc = _compacted(table, root, live[group[0].key][1], columns, old, name)
            written.append(loc)
            removes += [f for _, f in old]
            adds.append(new)
        info = {
            **_prefixed(metadata),
            METADATA_PREFIX + OPERATION: "OPTIMIZE",
            METADATA_PREFIX + "compacted": f"{len(removes)} into {len(adds)}",
        }
        seq, snapshot_id = _commit(table, root, removes, adds, info)
    except _OutcomeUnknown:
        raise  # the table may list the new files: kept
    except Exception:
        for loc in written:  # the table does not list them: no reader will miss them
            storage.remove(loc)
        raise
    logger.info("compacted %d file(s) of %s into %d", len(removes), root.uri, len(adds))
    return {
        "numFilesRemoved": len(removes),
        "numFilesAdded": len(adds),
        "version": seq,
        "snapshot_id": snapshot_id,
    }


def _prefixed(metadata: Mapping[str, str]) -> dict[str, str]:
    return {
        (k if k.startswith(METADATA_PREFIX) else METADATA_PREFIX + k): str(v)
        for k, v in metadata.items()
    }


def _rel(table_location: str, root: Location, path: str) -> str | None:
    """``path`` (a ``file_path`` or manifest path) relative to the table's root; None when it
    lies outside it (never this tool's to touch)."""
    for base in (table_location, root.uri, root.path, f"file://{root.path}"):
        base = base.rstrip("/") + "/"
        if path.startswith(base):
            rel = path[len(base) :]
            return rel if rel and ".." not in rel.split("/") else None
    return None


def _live_files(
    table: Table, root: Location, columns: list[str], partition: Mapping[str, str]
) -> dict[str, tuple[DataFile, dict[str, str]]]:
    """rel path -> (DataFile, its partition values) of the live data files of the current snapshot
    in ``partition``, below the table's root and in the table's current partition spec."""
    if table.metadata.current_snapshot() is None:
        return {}
    spec_id = table.metadata.default_spec_id
    found: dict[str, tuple[DataFile, dict[str, str]]] = {}
    for task in table.scan(row_filter=partition_filter(partition), options=ALL_FILES).plan_files():
        f = task.file
        values = {c: f.partition[i] for i, c in enumerate(columns)}
        rel = _rel(table.metadata.location, root, f.file_path)
        if rel is None or f.spec_id != spec_id or None in values.values():
            continue  # outside the table, an older spec's, a null partition: not this tool's
        if all(values.get(c) == v for c, v in partition.items()):
            found[rel] = (f, {c: str(v) for c, v in values.items()})
    return found


def _compacted(
    table: Table,
    root: Location,
    values: dict[str, str],
    columns: list[str],
    old: list[tuple[str, DataFile]],
    name: str,
) -> tuple[DataFile, Location]:
    """The rows of ``old`` (one partition's files) written to one new file ``name`` in the
    partition's folder, and its ``DataFile``; the file is checked as a run's adds are."""
    rel = folder_of(values) + name
    sources = [root.child(p) for p, _ in old]
    missing = [s.uri for s in sources if not storage.exists(s)]
    if missing:
        raise TableError(
            f"optimize of {root.uri}: {len(missing)} file(s) the table lists are missing "
            f"({', '.join(missing[:5])}): deleted by hand, or by another tool's cleanup. Nothing "
            "was committed; roll the partition back to a snapshot whose files are there",
            uri=root.uri,
        )
    schema = _bin_schema(table, sources, columns)

    def align(t: pa.Table) -> pa.Table:
        cols = [
            t.column(f.name).cast(f.type) if f.name in t.column_names else pa.nulls(len(t), f.type)
            for f in schema
        ]
        return pa.table(cols, schema=schema)

    # Rows of one incremental scorer stay a baseline once compacted (docs/incremental.md).
    done = compaction.rewrite(
        sources, root.child(rel), schema, align, keep=(WRITER_KEY, SCORER_KEY)
    )
    rows = sum(int(f.record_count) for _, f in old)
    problem = footer_problem(table.schema(), done.metadata.schema.to_arrow_schema(), columns)
    if done.rows != rows:
        problem = f"{done.rows} rows written, its sources hold {rows}"
    if problem:
        storage.remove(done.location)
        raise CommitRefused(
            f"optimize of {root.uri}: the compacted file {rel} is not what its {len(old)} "
            f"source(s) hold: {problem}. Nothing was committed",
            uri=root.uri,
        )
    new = NewFile(rel, done.size, done.rows, tuple(sorted(done.nan_columns)))
    file_path = table.metadata.location.rstrip("/") + "/" + rel
    return data_file(table, file_path, new, values, done.metadata), done.location


def _bin_schema(table: Table, sources: list[Location], columns: list[str]) -> pa.Schema:
    """The Arrow schema of a compacted file: its sources' columns with the types their writers
    gave them (a column only some sources have is null in the others, as readers read it), in
    the table's column order, without the partition columns (never in a file)."""
    found: list[pa.Schema] = []
    for src in sources:
        with storage.open_input(src) as f:
            found.append(pq.read_schema(f).remove_metadata())
    unified = pa.unify_schemas(found, promote_options="permissive")
    order = {f.name: i for i, f in enumerate(table.schema().fields)}
    fields = sorted(
        (f for f in unified if f.name not in columns), key=lambda f: order.get(f.name, len(order))
    )
    return pa.schema(fields)


def _commit(
    table: Table,
    root: Location,
    removes: list[DataFile],
    adds: list[DataFile],
    info: dict[str, str],
) -> tuple[int, int]:
    """One ``replace`` snapshot: ``removes`` out, ``adds`` in; (sequence number, snapshot id).
    pyiceberg's retries rebase it over other partitions' commits; a commit that changed the
    compacted files' partition since (serializable isolation, the removed files' partitions
    scoping the check) refuses it."""
    tx = table.transaction()
    with _Rewrite(
        operation=Operation.OVERWRITE, transaction=tx, io=table.io, snapshot_properties=info
    ) as producer:
        for f in removes:
            producer.delete_data_file(f)
        for f in adds:
            producer.append_data_file(f)
    snapshot_id = producer.snapshot_id
    checkpoint("iceberg-optimize-before-commit")
    try:
        tx.commit_transaction()
    except (CommitFailedException, ValidationException) as e:  # pyiceberg's "did not land"
        raise CommitConflict(
            f"optimize of {root.uri}: another commit changed the files it compacts since it "
            f"read them ({e}). Nothing was committed; run optimize again",
            uri=root.uri,
        ) from e
    except Exception as e:  # the outcome is unknown: the table says
        snap = _snapshot_after(table, root, snapshot_id, e)
        if snap is None:
            raise
        logger.warning("optimizing %s failed (%s), but its snapshot landed", root.uri, e)
    else:
        snap = _snapshot_after(table, root, snapshot_id, None)
        if snap is None:  # pragma: no cover - pyiceberg returned without our snapshot
            raise _OutcomeUnknown(
                f"the optimize commit to {root.uri} is not in the table", uri=root.uri
            )
    return int(snap.sequence_number or 0), snapshot_id


class _OutcomeUnknown(TableError):
    """Whether the optimize snapshot landed is not known: its compacted files are kept (the
    table may list them)."""


def _snapshot_after(
    table: Table, root: Location, snapshot_id: int, failure: Exception | None
) -> Snapshot | None:
    """The snapshot ``snapshot_id`` in the table as it is now (None: not there)."""
    try:
        return table.refresh().metadata.snapshot_by_id(snapshot_id)
    except Exception as e:
        raise _OutcomeUnknown(
            f"optimize of {root.uri}: "
            + (f"the commit failed ({failure}) and " if failure is not None else "")
            + f"the table cannot be read to tell whether it landed ({e}). Its compacted files "
            "are kept; run `score-catalog history` to see whether an OPTIMIZE snapshot is there",
            uri=root.uri,
        ) from e


# --------------------------------------------------------------------------- vacuum


def vacuum(
    table: Table,
    location: Location,
    storage_options: Mapping[str, Any],
    retention_hours: int | None,
    dry_run: bool,
    force: bool,
    metadata: Mapping[str, str],
) -> list[str]:
    """Expire the snapshots older than ``retention_hours`` (default: the table's, see the
    module doc) and delete (with ``dry_run``: only list) the data files that only they listed;
    returns those files' paths, relative to the table's root ``location``. The expired
    snapshots' manifest lists and the manifests no kept snapshot lists are deleted too (not
    listed). A retention shorter than the table's is refused unless ``force``.

    Files go before the expiry commit: a vacuum stopped in between leaves snapshots older than
    the retention whose files are gone, which the next vacuum expires; committed first, the
    files of a stopped vacuum would be listed by no snapshot left, and never deleted."""
    del storage_options  # ``location`` was made with them: every file goes through it
    uri = location.uri
    if retention_hours is not None and retention_hours < 0:
        raise UsageError(f"vacuum of {uri}: a retention of {retention_hours} h is negative")
    kept_ms = _table_retention_ms(table, uri)
    retention_ms = kept_ms if retention_hours is None else retention_hours * _HOUR_MS
    if retention_ms < kept_ms and not force:
        raise UsageError(
            f"vacuum of {uri} with a retention of {retention_hours} h refused: the table keeps "
            f"snapshots {_duration(kept_ms)} ({RETENTION_PROPERTY}"
            f"{'' if RETENTION_PROPERTY in table.properties else ', not set: the default'}), the "
            "window in which a rollback, time travel or a long-running reader may still need "
            "them. Use the default, or pass --force to shorten that window (a rollback to, or a "
            "reader on, a snapshot older than the retention then fails)"
        )
    cutoff = int(time.time() * 1000) - retention_ms
    expired = _expired(table.metadata, cutoff, _min_snapshots(table, uri))
    if not expired:
        return []
    data, meta = _doomed(table, location, expired)
    if dry_run:
        return data
    for rel in data + meta:
        storage.remove(location.child(rel))
    checkpoint("iceberg-vacuum-before-expire")
    record = {
        "at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "retention_hours": f"{retention_ms / _HOUR_MS:g}",
        "snapshots_expired": str(len(expired)),
        "files_deleted": str(len(data)),
        **{k.removeprefix(METADATA_PREFIX): str(v) for k, v in metadata.items()},
    }
    _expire(table, uri, expired, json.dumps(record, sort_keys=True))
    logger.info(
        "vacuum of %s: %d snapshot(s) expired, %d data file(s) and %d metadata file(s) deleted",
        uri,
        len(expired),
        len(data),
        len(meta),
    )
    return data


def _duration(ms: int) -> str:
    hours = ms / _HOUR_MS
    return f"{hours / 24:g} days" if hours >= 24 and hours % 24 == 0 else f"{hours:g} h"


def _table_retention_ms(table: Table, uri: str) -> int:
    """The table's retention: its :data:`RETENTION_PROPERTY`, else the default."""
    found = table.properties.get(RETENTION_PROPERTY)
    if found is None:
        return DEFAULT_RETENTION_DAYS * 24 * _HOUR_MS
    try:
        value = int(found)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(
            f"the Iceberg table {uri} has {RETENTION_PROPERTY} = {found!r}, not a number of "
            "milliseconds: set it to one (or remove it: the default is "
            f"{DEFAULT_RETENTION_DAYS} days)"
        )
    return value


def _min_snapshots(table: Table, uri: str) -> int:
    found = table.properties.get(MIN_SNAPSHOTS_PROPERTY, "1")
    try:
        return max(1, int(found))
    except ValueError:
        raise ConfigError(
            f"the Iceberg table {uri} has {MIN_SNAPSHOTS_PROPERTY} = {found!r}, not a number"
        ) from None


def _expired(metadata: TableMetadata, cutoff: int, keep_last: int) -> set[int]:
    """The snapshots older than ``cutoff`` (ms) to expire: not a branch's or tag's head, not
    one of the main branch's ``keep_last`` newest, and not the one current at ``cutoff`` (what
    a reader at that moment read: Delta keeps the files removed after it, so do we)."""
    chain = list(ancestors_of(metadata.current_snapshot(), metadata))  # newest first
    keep = {ref.snapshot_id for ref in metadata.refs.values()}
    keep |= {s.snapshot_id for s in chain[:keep_last]}
    # The log is in commit order: its last entry before the cutoff was current then.
    before = [e for e in metadata.snapshot_log if e.timestamp_ms < cutoff]
    if before:
        keep.add(before[-1].snapshot_id)
    older = next((s for s in chain if s.timestamp_ms < cutoff), None)
    if older is not None:  # the log lost it (a rollback's entry expired): the newest ancestor
        keep.add(older.snapshot_id)
    return {s.snapshot_id for s in metadata.snapshots if s.timestamp_ms < cutoff} - keep


def _doomed(table: Table, location: Location, expired: set[int]) -> tuple[list[str], list[str]]:
    """(data files, metadata files) to delete, relative to the table's root: those the expired
    snapshots list (live entries of their manifests; their manifests and manifest lists) that
    no kept snapshot lists. A kept snapshot's metadata that cannot be read stops it: what it
    lists would be unknown."""
    cache: dict[str, list[str]] = {}
    gone = [s for s in table.metadata.snapshots if s.snapshot_id in expired]
    kept = [s for s in table.metadata.snapshots if s.snapshot_id not in expired]
    old_data, old_meta = _listed(table, gone, cache, missing_ok=True)
    new_data, new_meta = _listed(table, kept, cache, missing_ok=False)
    where = table.metadata.location

    def inside(paths: Iterable[str]) -> list[str]:
        out = []
        for p in paths:
            rel = _rel(where, location, p)
            if rel is None:
                logger.warning(
                    "vacuum of %s: %s lies outside the table: left alone", location.uri, p
                )
            else:
                out.append(rel)
        return sorted(out)

    return inside(old_data - new_data), inside(old_meta - new_meta)


def _listed(
    table: Table, snapshots: list[Snapshot], cache: dict[str, list[str]], *, missing_ok: bool
) -> tuple[set[str], set[str]]:
    """(the data files the ``snapshots`` list, their manifest lists and manifests). With
    ``missing_ok``, a manifest list or manifest that is gone (a vacuum stopped before its
    commit deleted it) lists nothing."""
    data: set[str] = set()
    meta: set[str] = set()
    for snap in snapshots:
        meta.add(snap.manifest_list)
        try:
            manifests = snap.manifests(table.io)
        except FileNotFoundError:
            if missing_ok:
                continue
            raise TableError(
                f"vacuum of {table.metadata.location}: snapshot {snap.snapshot_id}, which it "
                f"keeps, has no manifest list {snap.manifest_list}: nothing was deleted",
                uri=table.metadata.location,
            ) from None
        for m in manifests:
            meta.add(m.manifest_path)
            if m.manifest_path not in cache:
                try:
                    entries = m.fetch_manifest_entry(table.io, discard_deleted=True)
                except FileNotFoundError:
                    if not missing_ok:
                        raise
                    continue
                cache[m.manifest_path] = [e.data_file.file_path for e in entries]
            data.update(cache[m.manifest_path])
    return data, meta


def _expire(table: Table, uri: str, expired: set[int], record: str) -> None:
    """One metadata commit: the ``expired`` snapshots removed (those still there; pyiceberg
    keeps branch and tag heads), :data:`LAST_VACUUM_PROPERTY` set; tried again on a table
    other commits changed in between."""
    for attempt in range(1, EXPIRE_ATTEMPTS + 1):
        present = [i for i in expired if table.metadata.snapshot_by_id(i) is not None]
        tx = table.transaction()
        tx.set_properties({LAST_VACUUM_PROPERTY: record})
        if present:
            ExpireSnapshots(tx).by_ids(present).commit()
        try:
            tx.commit_transaction()
            return
        except CommitFailedException as e:
            if attempt == EXPIRE_ATTEMPTS:
                raise CommitConflict(
                    f"vacuum of {uri}: expiring {len(present)} snapshot(s) failed {attempt} "
                    f"times ({e}); their files are deleted already: run vacuum again to expire "
                    "them",
                    uri=uri,
                ) from e
            table = table.refresh()
