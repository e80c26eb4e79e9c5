"""A table's history and maintenance: ``history``, ``optimize``, ``vacuum`` (and the lock and
versions ``rollback`` shares: :mod:`pipeline.driver.rollback`), through the table's
:class:`~pipeline.sinks.tables.TableOps`, whatever its format.

What a command is pointed at (``OUTPUT``) is a table's root, one of its partitions' folders,
or a job file (its output template's table): :func:`pipeline.sinks.locate_table`. Rollback,
optimize and vacuum change the table's log for every partition at once, so each takes the
*table lock* in the table's control area (:func:`pipeline.sinks.tables.table_lock_root`) and
refuses, naming the
holder, while any partition's run lock is held by a live run (:func:`maintenance`). Runs check
the table lock right after taking their own: the two never overlap, while runs on different
partitions of one table still run at once.

``history`` marks each run commit a rollback undid (:func:`rolled_back`): every later version
for a RESTORE of the whole table, only the commits of its own partitions for a partition's
rollback. ``report``'s ROLLED BACK line is decided the same way (:func:`run_rolled_back`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

from pipeline.core import config as cfg
from pipeline.core import runcontext
from pipeline.core.errors import LockError
from pipeline.io import layout, runindex, storage
from pipeline.io.layout import LOCK_NAME
from pipeline.io.locking import RunLock, holder_text, live_holder
from pipeline.report.verdict import default_actor
from pipeline.sinks import TableTarget, locate_table
from pipeline.sinks.naming import partition_label
from pipeline.sinks.tables import TABLE_LOCK_DIR, VersionInfo, table_lock_root

logger = logging.getLogger(__name__)

#: How long a partition's run lock counts as held without a heartbeat (the job key's default:
#: these commands have no job to read ``stale_lock_after_s`` from).
STALE_AFTER_S = float(cfg.setting("stale_lock_after_s").default)

#: The table a command works on (``pipeline.sinks.locate_table``).
Target = TableTarget
locate = locate_table


# --------------------------------------------------------------------------- the table lock


def running(target: Target) -> list[tuple[str, dict[str, Any]]]:
    """(partition control folder, holder) of each partition run lock held by a live run."""
    found = []
    for rel in storage.list_files(target.area):
        parts = rel.split("/")
        if parts[-1] != LOCK_NAME or parts[0] in (TABLE_LOCK_DIR, layout.RUN_INDEX_DIR):
            continue
        folder = target.area.child("/".join(parts[:-1])) if len(parts) > 1 else target.area
        held = live_holder(folder, STALE_AFTER_S)
        if held is not None:
            found.append((folder.uri, held))
    return found


@contextlib.contextmanager
def maintenance(target: Target, command: str) -> Iterator[RunLock]:
    """Hold the table lock for ``command``; refuse (:class:`LockError`, exit 1) while another
    maintenance holds it or a run on any partition is live (taken first, then checked: a run
    checks the other way round, so the two never both go on)."""
    lock = RunLock.acquire(
        table_lock_root(target.area),
        f"{command}-{runcontext.new_run_id()}",
        stale_after_s=STALE_AFTER_S,
        what=f"the {target.table.kind} {target.table.uri}",
    )
    try:
        busy = running(target)
        if busy:
            shown = "; ".join(f"{holder_text(h)} ({uri})" for uri, h in busy[:5])
            raise LockError(
                f"{command} of {target.table.uri} refused: {len(busy)} run(s) on its partitions "
                f"are in progress: {shown}. Nothing was changed; run it again once they are done"
            )
        yield lock
    finally:
        lock.release()


# --------------------------------------------------------------------------- history


def labels_of(info: VersionInfo) -> list[str]:
    """The partitions a commit touched (``run_date=2026-12-01`` each; ``""`` for an
    unpartitioned table's)."""
    return [p for p in (info.partition or "").split(",") if p] or [""]


def rolled_back(infos: list[VersionInfo]) -> dict[int, VersionInfo]:
    """version -> the rollback that undid it, as of the newest of ``infos`` (newest first).

    A RESTORE of the whole table undoes every version after the one it restores; a partition's
    rollback (a commit with ``restored_to`` that is no RESTORE) only the commits of the
    partitions it changed. Each rollback also serves again what it restores: a version undone
    by a later rollback that this one undoes counts as served again."""
    by_version = {i.version: i for i in infos}
    out: dict[int, VersionInfo] = {}
    for info in reversed(infos):
        to = info.metadata.get("restored_to")
        if to is None:
            continue
        whole, mine = info.operation == "RESTORE", set(labels_of(info))

        def in_scope(v: VersionInfo, whole: bool = whole, mine: set[str] = mine) -> bool:
            return whole or bool(v.partition and mine & set(labels_of(v)))

        for version, by in list(out.items()):
            if version <= int(to) < by.version and in_scope(by_version[version]):
                del out[version]  # undone by a rollback this one undoes: served again
        for later in infos:
            if int(to) < later.version < info.version and in_scope(later):
                out.setdefault(later.version, info)
    return out


def undoing(infos: list[VersionInfo], run_id: str) -> VersionInfo | None:
    """The rollback that undoes the commit of run ``run_id`` as of the newest of ``infos``
    (:func:`rolled_back`, as ``history`` marks it), or None: the table serves its rows."""
    undone = rolled_back(infos)
    return next(
        (undone[i.version] for i in infos if i.run_id == run_id and i.version in undone), None
    )


def run_rolled_back(
    report: Mapping[str, Any], options: Mapping[str, Any] | None = None
) -> dict[str, Any] | None:
    """The rollback that undoes the run whose ``_report.json`` is ``report``, as ``score-catalog
    report``'s ROLLED BACK line names it (:func:`pipeline.report.text.rolled_back_line`): read
    from the table's history now, so the line says what ``history`` says (a rollback undone
    since no longer counts; one killed before it recorded itself in the run index does). None
    for a run the table serves, or one that wrote no table; raises when the table cannot be
    read."""
    fmt = report.get("output_format")
    run_id = report.get("run_id")
    if not isinstance(fmt, Mapping) or not fmt.get("table") or not run_id:
        return None
    target = locate(str(fmt["table"]), options)
    by = undoing(target.table.history(), str(run_id))
    if by is None:
        return None
    return {
        "table": target.table.uri,
        # A partition's rollback is a WRITE of its partition; a RESTORE is of the whole table
        # (its `partition` lists the partitions it changed).
        "partition": None if by.operation == "RESTORE" else by.partition,
        "to_version": by.metadata.get("restored_to"),
        "version": by.version,
        "at": by.timestamp.isoformat(timespec="seconds"),
        "by": by.metadata.get("by"),
        "reason": by.metadata.get("reason"),
    }


def _touches(info: VersionInfo, label: str) -> bool:
    return info.partition is None or label in (info.partition or "").split(",")


def history(target: Target, limit: int | None = None) -> list[dict[str, Any]]:
    """The table's versions, newest first (of the partition pointed at, and every version
    that is not a run's commit: restores, compactions, vacuums), each as ``score-catalog
    history`` shows it."""
    infos = target.table.history()
    undone = rolled_back(infos)
    rows = []
    for info in infos:
        if target.label and not _touches(info, target.label):
            continue
        restored_to = info.metadata.get("restored_to")
        status = "restore" if restored_to is not None else info.operation.lower()
        if info.run_id is not None and info.operation == "WRITE":
            status = "committed"
        by = undone.get(info.version)
        if by is not None:
            status = f"rolled back (version {by.version})"
        rows.append(
            {
                "version": info.version,
                "time": info.timestamp.isoformat(timespec="seconds"),
                "operation": info.operation,
                "status": status,
                "run_id": info.run_id,
                "model_sha256": info.model_sha256,
                "rows": info.rows,
                "partition": info.partition,
                "detail": info.detail,
                "reason": info.metadata.get("reason"),
                "job": info.metadata.get("job"),
                # A rollback: the version it restored (of `partition` alone, for a commit that
                # is no RESTORE); a version a rollback undid: that rollback's version.
                "restored_to": int(restored_to) if restored_to is not None else None,
                "rolled_back_by": by.version if by is not None else None,
            }
        )
    rows = rows[:limit] if limit else rows
    _mark_drift(target, rows)
    return rows


def _mark_drift(target: Target, rows: list[dict[str, Any]]) -> None:
    """A committed run whose drift alert is open, or was accepted, says so in its status (from
    its run index entry beside the table): a drifted night must not read as a clean one."""
    accepted: dict[str, set[Any]] = {}
    opts = target.table.storage_options
    for r in rows:
        if r["status"] != "committed" or not r.get("job"):
            continue
        found = runindex.entry(target.area.uri, opts, str(r["job"]), r["run_id"])
        if not found or not found.get("drift_alert"):
            continue
        job = str(r["job"])
        if job not in accepted:
            accepted[job] = {
                a.get("dataset") for a in runindex.acceptances(target.area.uri, opts, job)
            }
        verdict = found.get("verdict")
        ok = (isinstance(verdict, dict) and verdict.get("accepted")) or (
            found.get("dataset") in accepted[job]
        )
        r["status"] = "committed, drift accepted" if ok else "committed, DRIFT"


def history_table(target: Target, rows: list[dict[str, Any]]) -> str:
    """``history``'s rows for the terminal."""
    where = f" partition {target.label}" if target.label else ""
    lines = [
        f"{target.table.kind} {target.table.uri}{where}: {len(rows)} version(s), newest first",
        f"  {'version':>7}  {'time (UTC)':<25} {'status':<26} {'run':<24} {'model':<12} "
        f"{'rows':>10}  partition / detail",
    ]
    for r in rows:
        rows_text = "-" if r["rows"] is None else f"{r['rows']:,}"
        note = r["partition"] or r["detail"] or ""
        if (r["operation"] != "WRITE" or r["restored_to"] is not None) and r["detail"]:
            note = r["detail"]
            if r["operation"] == "RESTORE" and r["partition"]:
                note += f", changing {r['partition'].replace(',', ', ')}"
            note += f" ({r['reason']})" if r.get("reason") else ""
        lines.append(
            f"  {r['version']:>7}  {r['time']:<25} {r['status']:<26} {r['run_id'] or '-':<24} "
            f"{(r['model_sha256'] or '-')[:12]:<12} {rows_text:>10}  {note}"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- optimize, vacuum


def optimize(
    target: Target, partition: Mapping[str, str] | None = None, target_size: int | None = None
) -> dict[str, Any]:
    """Compact the small files of the table (of ``partition``, or the one pointed at) under
    the table lock: one OPTIMIZE version, the same rows for readers."""
    part = dict(partition) if partition else target.partition
    with maintenance(target, "optimize"):
        metrics = target.table.optimize(part, target_size, {"by": default_actor()})
    return {
        "table": target.table.uri,
        "partition": partition_label(part) if part else None,
        **metrics,
    }


def vacuum(
    target: Target, retention_hours: int | None, *, dry_run: bool, force: bool = False
) -> dict[str, Any]:
    """Delete the files removed from the table longer ago than the retention (default: the
    table's ``delta.deletedFileRetentionDuration``; a shorter one is refused unless ``force``),
    under the table lock. Files no version lists (a run's uncommitted output) are never
    touched."""
    with maintenance(target, "vacuum"):
        files = target.table.vacuum(retention_hours, dry_run, force, {"by": default_actor()})
    return {"table": target.table.uri, "dry_run": dry_run, "files": files}
