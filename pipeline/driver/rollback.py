"""``score-catalog rollback``: a table (Delta or Iceberg), or one partition of it, back to an
older version.

Pointed at a partition (a partition folder as OUTPUT, or ``--partition COLUMN=VALUE``), a
rollback restores only that partition's files to what the version held, as ONE new commit,
and leaves every other partition as it is (:meth:`pipeline.sinks.tables.TableOps.
restore_partition`). Pointed at the table (its folder, or a job file: its output template's
table), it restores the whole table as one new version (Delta's RESTORE; for an Iceberg table
one new snapshot: :meth:`~pipeline.sinks.tables.TableOps.restore`). Either way it first works
out what it changes,
partition by partition, with row counts (:func:`plan`), and hands that to ``announce`` before
it acts: a rollback that removes other days says so before it does (``--dry-run`` stops there).

It is recorded in the table (the commit info says who, why, which version, which partitions
and which runs it rolled back) and in the run index of each job whose runs it touched
(``_runs/<job>/_rollbacks/``, :func:`pipeline.io.runindex.record_rollback`) with, per partition
it changed, the score sketches of what that partition holds again: the next run of that
partition compares its drift with them (:mod:`pipeline.report.verdict`), and only the runs of
the partitions it changed count as rolled back (``history``, ``report``). The manifests of
those partitions name files no longer in the table: their next run scores those shards again.
App versions (a run's commit token) are never rolled back: a retry of an undone run is still
refused, and the next run of the partition commits a new run version.

A rollback killed after its commit landed, before its records were written, is recorded by the
next rollback of the table, from the commit (:func:`settle`); a retry of it finds nothing more
to do (:func:`_nothing_to_do`) and commits nothing.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.core.errors import PipelineError, UsageError
from pipeline.core.faults import checkpoint
from pipeline.driver.tables import Target, labels_of, maintenance, rolled_back
from pipeline.io import runindex
from pipeline.report.verdict import default_actor
from pipeline.sinks.tables import PartitionChange, VersionInfo
from pipeline.worker.sketch import sketch

logger = logging.getLogger(__name__)

_MAX_SHOWN = 50  # partitions listed one per line; the rest counted
_MAX_RUNS = 10  # undone runs named before it acts (all are in the record and the commit info)


@dataclass(frozen=True)
class Plan:
    """What rolling ``target`` (or ``partition`` of it) back to ``to_version`` changes."""

    target: Target
    partition: dict[str, str] | None  # None: the whole table (a RESTORE)
    from_version: int  # the latest version now
    to_version: int
    changes: list[PartitionChange]  # the partitions it changes, by label
    unchanged: int  # partitions it leaves as they are (in its scope)
    undone: list[VersionInfo]  # the run commits it undoes, newest first
    gained: list[str]  # columns the table gained after to_version
    infos: list[VersionInfo]  # the table's history, newest first

    @property
    def label(self) -> str | None:
        """``run_date=2026-12-01`` for a partition's rollback; None for the whole table."""
        return "/".join(f"{k}={v}" for k, v in self.partition.items()) if self.partition else None


def scope(target: Target, partition: Mapping[str, str] | None) -> dict[str, str] | None:
    """The partition a rollback is of: the folder OUTPUT names and ``--partition``, which must
    agree; None (the whole table) when neither names one."""
    given = dict(partition or {})
    where = dict(target.partition or {})
    clash = sorted(k for k in given.keys() & where.keys() if given[k] != where[k])
    if clash:
        raise UsageError(
            f"--partition {', '.join(f'{k}={given[k]}' for k in clash)} is not the partition "
            f"OUTPUT points at ({target.label}): give one of them"
        )
    return {**where, **given} or None


def _within(info: VersionInfo, partition: Mapping[str, str] | None) -> bool:
    """Whether a commit touched ``partition`` (every commit is within the whole table)."""
    if partition is None:
        return True
    for label in labels_of(info):
        values = dict(s.partition("=")[::2] for s in label.split("/") if s)
        if all(values.get(k) == v for k, v in partition.items()):
            return True
    return False


def plan(target: Target, to_version: int, partition: Mapping[str, str] | None = None) -> Plan:
    """What the rollback would change (reads the log, changes nothing); raises
    :class:`UsageError` for a version it cannot restore, or, for a partition, one whose schema
    the table can no longer read its files with."""
    part = dict(partition) if partition else None
    infos = target.table.history()
    latest, changes = target.table.restore_changes(to_version, part)
    gained, problems = target.table.restore_schema(to_version)
    if part is not None and problems:
        label = "/".join(f"{k}={v}" for k, v in part.items())
        raise UsageError(
            f"cannot roll {label} of {target.table.uri} back to version {to_version}: "
            f"{'; '.join(problems)}. Roll the whole table back to that version instead (its "
            "schema reverts with it), or a partition to a later version"
        )
    served = rolled_back(infos)  # runs an earlier rollback undid are not served now
    undone = [
        i
        for i in infos
        if to_version < i.version <= latest
        and i.run_id
        and i.version not in served
        and _within(i, part)
    ]
    changed = [c for c in changes if c.changed]
    return Plan(
        target,
        part,
        latest,
        to_version,
        changed,
        len(changes) - len(changed),
        undone,
        gained,
        infos,
    )


def rollback(
    target: Target,
    to_version: int,
    reason: str,
    *,
    by: str | None = None,
    partition: Mapping[str, str] | None = None,
    dry_run: bool = False,
    announce: Callable[[Plan], None] | None = None,
) -> dict[str, Any]:
    """Roll the table, or its partition (:func:`scope`), back to ``to_version``: :func:`plan`,
    ``announce`` it, then act under the table lock (a dry run takes no lock and stops after
    ``announce``). Returns what was done (see :func:`_record`); ``version`` is None when
    nothing was committed (a dry run, or a partition that already holds that version's
    files)."""
    part = scope(target, partition)
    if not dry_run and not reason.strip():
        raise UsageError("--reason must say why the table is rolled back (it is kept)")
    if dry_run:
        found = plan(target, to_version, part)
        if announce is not None:
            announce(found)
        return _record(found, None, reason, by or default_actor(), dry_run=True)
    who = by or default_actor()
    with maintenance(target, "rollback"):
        found = plan(target, to_version, part)
        if announce is not None:
            announce(found)
        settled = settle(found, who)  # an earlier rollback killed before it recorded itself
        if _nothing_to_do(found):  # a retry of a rollback that landed lands here too
            entry = _record(found, None, reason, who)
        else:
            entry = _act(found, reason.strip(), who)
    entry["settled"] = settled
    if entry["version"] is not None:
        logger.info(
            "rolled %s%s back to version %d as version %d (%s)",
            target.table.uri,
            f" partition {found.label}" if found.label else "",
            to_version,
            entry["version"],
            entry["by"],
        )
    return entry


def _nothing_to_do(found: Plan) -> bool:
    """Whether what ``found`` rolls back already holds what its version held: no partition
    changes, and, for the whole table, no run undone and no schema that would revert (a
    RESTORE that changes nothing would only be one more version in the history, and a retry
    of a rollback that landed would undo the one it retries)."""
    if found.changes:
        return False
    if found.partition is not None:
        return True
    return not found.undone and not (found.gained and found.target.table.schema_reverts)


def _act(found: Plan, reason: str, who: str) -> dict[str, Any]:
    """Commit the rollback ``found`` planned and record it in the run index."""
    table = found.target.table
    metadata = {
        "reason": reason,
        "by": who,
        "rolled_back_runs": ",".join(i.run_id or "" for i in found.undone),
    }
    if found.partition is not None:
        version = table.restore_partition(found.to_version, found.partition, metadata)
    else:
        changed = [c.label for c in found.changes if c.label]
        version = table.restore(found.to_version, metadata, changed)
    checkpoint("rollback-committed")  # landed, not yet in the run index: settle() records it
    entry = _record(found, version, reason, who)
    if version is None:  # the partition held that version's files after all: nothing done
        return entry
    restored = _restored(found, [c.label for c in found.changes])
    _index(found, entry, restored, _jobs(found, restored))
    return entry


def _restored(found: Plan, changed: list[str]) -> dict[str, VersionInfo | None]:
    """label -> the run whose scores that partition holds again, for each partition the
    rollback changed and each whose run it undid (:func:`_holding_run`)."""
    labels = set(changed) | {p for i in found.undone for p in labels_of(i)}
    return {label: _holding_run(found, label) for label in sorted(labels)}


def _jobs(found: Plan, restored: Mapping[str, VersionInfo | None]) -> list[str]:
    """The jobs whose runs the rollback touched: those it undid and those it serves again."""
    touched = [*found.undone, *(i for i in restored.values() if i is not None)]
    return sorted({str(i.metadata["job"]) for i in touched if i.metadata.get("job")})


def _index(
    found: Plan, entry: dict[str, Any], restored: Mapping[str, VersionInfo | None], jobs: list[str]
) -> None:
    """Complete ``entry`` with what each partition holds again, and write it in the run index
    of each of ``jobs``."""
    entry["partitions"] = [
        _partition_record(found, label, info) for label, info in restored.items()
    ]
    entry["index"] = [
        runindex.record_rollback(
            found.target.area.uri, found.target.table.storage_options, j, entry
        )
        for j in jobs
    ]


# --------------------------------------------------------------------------- settling


def settle(found: Plan, who: str) -> list[dict[str, Any]]:
    """Record in the run index each rollback the table holds and the index does not: one
    killed (or whose storage failed) after its commit landed and before :func:`_act` wrote
    its records. Returns the records written, each with ``recovered`` (who recorded it late).

    Why from the table's history, and not a record written before the commit and settled after
    (as a run's pending token is: pipeline.sinks.token): a rollback's commit already carries
    what its record is made of (``restored_to``, the partitions it changed, ``rolled_back_runs``,
    ``reason``, ``by``: the commit info or snapshot summary ``history`` reads), and every
    rollback runs under the table lock, so the next one, a retry of the same rollback
    included, can make the record the lost one would have made. A record written first would
    need a pending state of its own, which every reader of the records (drift, ``report``)
    would have to skip until a later command settled it against the table anyway.

    Idempotent: a rollback counts as recorded once the index of each job it touched has a
    record of its version, and a late record is named after the commit's time, so making it
    twice writes the same file. What the commit cannot say is left out (the rows before and
    after of each partition it changed: ``changes`` is empty). Best effort per rollback: one
    whose records cannot be made now (its version's files vacuumed, say) is logged and
    skipped, never the reason the rollback asked for fails."""
    done: list[dict[str, Any]] = []
    recorded: dict[str, set[int]] = {}
    for info in reversed(found.infos):  # oldest first: records in the order they were made
        if info.metadata.get("restored_to") is None or info.run_id is not None:
            continue
        try:
            entry = _settle_one(found, info, who, recorded)
        except (OSError, ValueError, PipelineError) as e:
            logger.warning(
                "the rollback at version %d of %s is not in the run index and could not be "
                "recorded now: %s",
                info.version,
                found.target.table.uri,
                e,
            )
            continue
        if entry is not None:
            done.append(entry)
    return done


def _settle_one(
    found: Plan, info: VersionInfo, who: str, recorded: dict[str, set[int]]
) -> dict[str, Any] | None:
    """The record of rollback ``info`` written where it is missing (:func:`settle`), or None."""
    past = _replay(found, info)
    restored = _restored(past, [p for p in (info.partition or "").split(",") if p])
    if not restored and not info.partition and _unpartitioned(found.infos):
        restored = _restored(past, [""])
    jobs = _jobs(past, restored)
    for job in jobs:
        if job not in recorded:
            records = runindex.rollbacks(
                found.target.area.uri, found.target.table.storage_options, job
            )
            recorded[job] = {r["version"] for r in records if isinstance(r.get("version"), int)}
    missing = [j for j in jobs if info.version not in recorded[j]]
    if not missing:
        return None
    meta = info.metadata
    entry = _record(past, info.version, str(meta.get("reason") or ""), str(meta.get("by") or "?"))
    entry["at"] = info.timestamp.isoformat(timespec="seconds")  # when it was made
    entry["changes"] = []
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    entry["recovered"] = {"by": who, "at": now}
    _index(past, entry, restored, missing)
    logger.info(
        "the rollback at version %d of %s (to version %s, by %s) stopped before it recorded "
        "itself in the run index: recorded now",
        info.version,
        found.target.table.uri,
        entry["to_version"],
        entry["by"],
    )
    return entry


def _replay(found: Plan, info: VersionInfo) -> Plan:
    """The plan rollback ``info`` acted on, as far as its commit says it (no partition's
    rows: ``changes`` is empty), with ``found``'s history."""
    to = int(info.metadata["restored_to"])
    runs = {r for r in str(info.metadata.get("rolled_back_runs") or "").split(",") if r}
    older = [i for i in found.infos if i.version < info.version]
    part = None
    if info.operation != "RESTORE":  # a partition's rollback: a WRITE of that partition
        label = (info.partition or "").split(",")[0]
        part = dict(s.partition("=")[::2] for s in label.split("/") if s) or None
    return Plan(
        target=found.target,
        partition=part,
        from_version=older[0].version if older else to,
        to_version=to,
        changes=[],
        unchanged=0,
        undone=[i for i in older if i.run_id in runs and i.version > to],
        gained=[],
        infos=found.infos,
    )


def _unpartitioned(infos: list[VersionInfo]) -> bool:
    """Whether the table's runs wrote no partition (its rollback commits name none either)."""
    return all(not i.partition for i in infos if i.run_id)


def _record(
    found: Plan, version: int | None, reason: str, who: str, *, dry_run: bool = False
) -> dict[str, Any]:
    """The rollback as the run index keeps it and the CLI prints it."""
    return {
        "event": "rollback",
        "scope": "partition" if found.partition is not None else "table",
        "table": found.target.table.uri,
        "partition": found.label,
        "from_version": found.from_version,
        "to_version": found.to_version,
        "version": version,
        "dry_run": dry_run,
        "by": who,
        "at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "reason": reason.strip(),
        "rolled_back": sorted({str(i.run_id) for i in found.undone}),
        "changes": [
            {
                "partition": c.label or None,
                "rows_before": c.rows_now,
                "rows_after": c.rows_then,
                "files_removed": len(c.removed),
                "files_added": len(c.re_added),
            }
            for c in found.changes
        ],
        "unchanged": found.unchanged,
        "columns_gained": found.gained,
        "partitions": [],
        "index": [],
    }


def _holding_run(found: Plan, label: str) -> VersionInfo | None:
    """The run whose scores partition ``label`` holds at ``found.to_version``: its newest run
    commit at or before that version that no rollback at or before it had undone (what that
    partition holds again); None if it held none."""
    undone = rolled_back([i for i in found.infos if i.version <= found.to_version])
    return next(
        (
            i
            for i in found.infos
            if i.version <= found.to_version
            and i.run_id
            and i.version not in undone
            and label in labels_of(i)
        ),
        None,
    )


def _partition_record(found: Plan, label: str, info: VersionInfo | None) -> dict[str, Any]:
    """What a partition holds again after the rollback, for the next run's drift: its run, its
    rows and score sketches (from that run's index entry, else read back from the table)."""
    target = found.target
    output = target.table.location.child(label).uri if label else target.table.location.uri
    record: dict[str, Any] = {"partition": label or None, "output": output}
    if info is None:
        return {**record, "run_id": None, "rows_out": 0, "outputs": {}}
    record["run_id"] = info.run_id
    job = info.metadata.get("job")
    entry = runindex.entry(target.area.uri, target.table.storage_options, job, info.run_id)
    if entry is not None and isinstance(entry.get("scorer"), dict):
        # Whose scores the partition holds again: an incremental night may carry from it
        # (issue 31 review: without it the next night scored every row, "not incremental").
        record["scorer"] = entry["scorer"]
    if entry is not None and entry.get("outputs"):
        record["rows_out"] = entry.get("rows_out")
        record["outputs"] = entry["outputs"]
        return record
    columns = [c for c in (info.metadata.get("outputs") or "").split(",") if c]
    values = dict(s.partition("=")[::2] for s in label.split("/") if s) if label else None
    table = target.table.read(found.to_version, values, columns or None)
    record["rows_out"] = table.num_rows
    record["outputs"] = _sketches(table, columns)
    return record


def _sketches(table: pa.Table, columns: list[str]) -> dict[str, Any]:
    """``{column: {count, sketch}}`` of the numeric output columns, as a run index entry has."""
    out: dict[str, Any] = {}
    for name in columns:
        col = table.column(name)
        if not (pa.types.is_floating(col.type) or pa.types.is_integer(col.type)):
            continue
        values = np.asarray(col.to_numpy(zero_copy_only=False), dtype=float)
        out[name] = {"count": int(np.isfinite(values).sum()), "sketch": sketch(values)}
    return out


# --------------------------------------------------------------------------- what it prints


def _rows(n: int | None) -> str:
    return "? rows" if n is None else f"{n:,} rows"


def _change_line(c: PartitionChange) -> str:
    before, after = c.rows_now, c.rows_then
    if not c.then:
        what = "removed: it held nothing then"
    elif not c.now:
        what = "added back"
    else:
        what = f"replaced: {len(c.removed)} file(s) out, {len(c.re_added)} back"
    return f"  {c.label or '(the table)'}: {_rows(before)} -> {_rows(after)} ({what})"


def plan_text(found: Plan, *, dry_run: bool) -> str:
    """What a rollback is about to do (or, ``dry_run``, would do), printed before it acts."""
    uri, n = found.target.table.uri, len(found.changes)
    what = (
        f"partition {found.label} of {uri}" if found.label else f"the whole table {uri} (RESTORE)"
    )
    verb = "would roll" if dry_run else "rolling"
    lines = [
        f"{verb} {what} back to version {found.to_version} (it is at {found.from_version}): "
        + (f"{n} partition(s) change" if n else "no partition changes")
    ]
    lines += [_change_line(c) for c in found.changes[:_MAX_SHOWN]]
    if n > _MAX_SHOWN:
        lines.append(f"  ... and {n - _MAX_SHOWN} more partition(s)")
    if found.partition is not None:
        lines.append("  every other partition stays as it is")
    elif found.unchanged:  # counted, not listed: a table of a thousand days stays readable
        lines.append(f"  {found.unchanged} other partition(s) unchanged")
    if found.undone:
        runs = ", ".join(f"{i.run_id} (version {i.version})" for i in found.undone[:_MAX_RUNS])
        more = len(found.undone) - _MAX_RUNS
        lines.append(f"  undoes run(s) {runs}" + (f" and {more} more" if more > 0 else ""))
    lines += _schema_lines(found)
    if found.partition is None and n > 1:
        lines.append(
            f"  to roll back one partition alone: score-catalog rollback "
            f"{uri}/{found.changes[0].label} --to-version {found.to_version} --reason ..."
        )
    if dry_run:
        lines.append(f"dry run: nothing was changed (the table stays at {found.from_version})")
    return "\n".join(lines)


def _schema_lines(found: Plan) -> list[str]:
    if not found.gained:
        return []
    cols = ", ".join(found.gained)
    if found.partition is None and found.target.table.schema_reverts:
        return [f"  the schema reverts to version {found.to_version}'s: column(s) {cols} go"]
    where = "there" if found.partition is not None else "in the rows restored"
    return [f"  column(s) {cols}, added after version {found.to_version}, read as null {where}"]


def done_text(entry: Mapping[str, Any]) -> str:
    """What a rollback did, printed after it acted (after what it found unrecorded first)."""
    settled = [_settled_text(s) for s in entry.get("settled") or []]
    return "\n".join([*settled, _own_text(entry)])


def _settled_text(entry: Mapping[str, Any]) -> str:
    where = f" of partition {entry['partition']}" if entry["partition"] else ""
    undone = ", ".join(entry["rolled_back"]) or "no run's commit"
    return (
        f"recorded the rollback{where} to version {entry['to_version']} (table version "
        f"{entry['version']}, {entry['at']}, by {entry['by']}: {entry['reason']!r}; undid "
        f"{undone}): it stopped before it recorded itself"
        + "".join(f"\n  recorded in {uri}" for uri in entry["index"])
    )


def _own_text(entry: Mapping[str, Any]) -> str:
    where = f"partition {entry['partition']} of " if entry["partition"] else ""
    if entry["version"] is None:
        return (
            f"{where}{entry['table']} already holds what version {entry['to_version']} held: "
            f"nothing to roll back, nothing committed (it stays at {entry['from_version']})"
        )
    undone = ", ".join(entry["rolled_back"]) or "no run's commit"
    changed = "; ".join(
        f"{c['partition'] or '(the table)'} {_rows(c['rows_before'])} -> {_rows(c['rows_after'])}"
        for c in entry["changes"][:_MAX_SHOWN]
    )
    more = len(entry["changes"]) - _MAX_SHOWN
    return (
        f"rolled {where}{entry['table']} back to version {entry['to_version']} as version "
        f"{entry['version']} (it was at {entry['from_version']}): {changed or 'no rows changed'}"
        + (f" and {more} more partition(s)" if more > 0 else "")
        + ("; every other partition as it was" if entry["partition"] else "")
        + f"\n  undid {undone}\n  by {entry['by']} at {entry['at']}: {entry['reason']}"
        + "".join(f"\n  recorded in {uri}" for uri in entry["index"])
    )
