"""A Delta table's history and maintenance: ``history``, ``rollback``, ``optimize``, ``vacuum``.

What a command is pointed at (``OUTPUT``) is a table's root, one of its partitions' folders,
or a job file (its output template's table): :func:`locate`. Rollback, optimize and vacuum
change the table for every partition at once, so each takes the *table lock* in the table's
control area (:func:`pipeline.io.outputs.delta.table_lock_root`) and refuses, naming the
holder, while any partition's run lock is held by a live run (:func:`maintenance`). Runs check
the table lock right after taking their own: the two never overlap, while runs on different
partitions of one table still run at once.

A rollback is Delta's RESTORE: a new version with the old one's files. It is recorded in the
table (the commit info says who, why and which runs it rolled back) and in the run index of
each job whose runs it touched (``_runs/<job>/_rollbacks/``, :func:`pipeline.io.runindex.
record_rollback`), with the score sketches of what each partition holds again, so that the
next run's drift compares with what the table holds (:mod:`pipeline.report.verdict`). The
manifests of the partitions it changed name files that are no longer in the table: their next
run reconciles with the table and scores those shards again.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.core import config as cfg
from pipeline.core import jobfile, runcontext
from pipeline.core.errors import LockError, NotATableError, UsageError
from pipeline.core.templates import below, control_area, fixed_part
from pipeline.io import layout, runindex, storage
from pipeline.io.layout import LOCK_NAME
from pipeline.io.locking import RunLock, holder_text, live_holder
from pipeline.io.outputs import deltatable as delta
from pipeline.io.outputs.delta import TABLE_LOCK_DIR, partition_label, table_lock_root
from pipeline.io.outputs.deltatable import TableRef, VersionInfo
from pipeline.io.storage import Location
from pipeline.report.verdict import default_actor
from pipeline.worker.sketch import sketch

logger = logging.getLogger(__name__)

#: How long a partition's run lock counts as held without a heartbeat (the job key's default:
#: these commands have no job to read ``stale_lock_after_s`` from).
STALE_AFTER_S = float(cfg.setting("stale_lock_after_s").default)
_MAX_UP = 64  # folders walked up from OUTPUT looking for the table's _delta_log/


@dataclass(frozen=True)
class Target:
    """The table a command works on, and the partition it was pointed at (None: all)."""

    ref: TableRef
    partition: dict[str, str] | None
    area: Location  # the table's control area: run index, table lock, partitions' locks

    @property
    def label(self) -> str | None:
        return partition_label(self.partition) if self.partition else None


def locate(output: str, options: Mapping[str, Any] | None = None) -> Target:
    """The table ``output`` names: a job file (``*.toml``: its output template's table, its
    ``[storage]`` options), or a path or URI of the table's root or of a partition folder."""
    opts = dict(options or {})
    if output.endswith(".toml") and Path(output).is_file():
        job = jobfile.build_config(output)
        opts = {**dict(job.storage), **opts}
        loc = storage.locate(fixed_part(job.output)[0], opts)
    else:
        loc = storage.locate(output, opts)
    root = _table_above(loc)
    rest = below(root.path, loc.path)
    partition = dict(s.partition("=")[::2] for s in rest.split("/") if s) if rest else None
    ref = TableRef.of(root.uri, opts)
    area_uri = control_area(root.uri)
    return Target(ref, partition, storage.sibling(root, area_uri))


def _table_above(loc: Location) -> Location:
    """``loc`` or the nearest folder above it holding a ``_delta_log/``."""
    for folder in [loc, *layout.ancestors(loc)][:_MAX_UP]:
        if storage.exists(folder.child("_delta_log")):
            return folder
    raise NotATableError(
        f"no Delta table at {loc.uri} or above it (no _delta_log/): give the table's folder, a "
        'partition folder in it, or the job file of a job with format = "delta"',
        uri=loc.uri,
    )


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
        what=f"the Delta table {target.ref.uri}",
    )
    try:
        busy = running(target)
        if busy:
            shown = "; ".join(f"{holder_text(h)} ({uri})" for uri, h in busy[:5])
            raise LockError(
                f"{command} of {target.ref.uri} refused: {len(busy)} run(s) on its partitions "
                f"are in progress: {shown}. Nothing was changed; run it again once they are done"
            )
        yield lock
    finally:
        lock.release()


# --------------------------------------------------------------------------- history


def _rolled_back(infos: list[VersionInfo]) -> dict[int, int]:
    """version -> the RESTORE version that rolled it back (newest first ``infos``)."""
    out: dict[int, int] = {}
    for info in infos:
        if info.operation == "RESTORE":
            to = info.metadata.get("restored_to")
            if to is None:
                continue
            for later in infos:
                if int(to) < later.version < info.version:
                    out.setdefault(later.version, info.version)
    return out


def _touches(info: VersionInfo, label: str) -> bool:
    return info.partition is None or label in (info.partition or "").split(",")


def history(target: Target, limit: int | None = None) -> list[dict[str, Any]]:
    """The table's versions, newest first (of the partition pointed at, and every version
    that is not a run's commit: restores, compactions, vacuums), each as ``score-catalog
    history`` shows it."""
    infos = delta.history(target.ref)
    undone = _rolled_back(infos)
    rows = []
    for info in infos:
        if target.label and not _touches(info, target.label):
            continue
        status = info.operation.lower()
        if info.run_id is not None and info.operation == "WRITE":
            status = "committed"
        if info.version in undone:
            status = f"rolled back (version {undone[info.version]})"
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
            }
        )
    rows = rows[:limit] if limit else rows
    _mark_drift(target, rows)
    return rows


def _mark_drift(target: Target, rows: list[dict[str, Any]]) -> None:
    """A committed run whose drift alert is open, or was accepted, says so in its status (from
    its run index entry beside the table): a drifted night must not read as a clean one."""
    accepted: dict[str, set[Any]] = {}
    opts = target.ref.storage_options
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
        f"Delta table {target.ref.uri}{where}: {len(rows)} version(s), newest first",
        f"  {'version':>7}  {'time (UTC)':<25} {'status':<26} {'run':<24} {'model':<12} "
        f"{'rows':>10}  partition / detail",
    ]
    for r in rows:
        rows_text = "-" if r["rows"] is None else f"{r['rows']:,}"
        note = r["partition"] or r["detail"] or ""
        if r["operation"] not in ("WRITE",) and r["detail"]:
            note = r["detail"] + (f" ({r['reason']})" if r.get("reason") else "")
        lines.append(
            f"  {r['version']:>7}  {r['time']:<25} {r['status']:<26} {r['run_id'] or '-':<24} "
            f"{(r['model_sha256'] or '-')[:12]:<12} {rows_text:>10}  {note}"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- rollback


def rollback(
    target: Target, to_version: int, reason: str, *, by: str | None = None
) -> dict[str, Any]:
    """Restore version ``to_version`` of the table as a new version, under the table lock;
    recorded in the commit info and in the run index (see the module doc). Returns what
    was done: ``{table, from_version, to_version, version, rolled_back, partitions, index}``."""
    if not reason.strip():
        raise UsageError("--reason must say why the table is rolled back (it is kept)")
    who = by or default_actor()
    with maintenance(target, "rollback"):
        infos = delta.history(target.ref)
        latest = infos[0].version if infos else 0
        if not 0 <= to_version < latest:
            raise UsageError(
                f"cannot roll {target.ref.uri} back to version {to_version}: its versions run "
                f"from 0 to {latest} (the latest)"
            )
        undone = [i for i in infos if i.version > to_version and i.run_id]
        restored = _restored_runs(infos, to_version, {p for i in undone for p in _labels(i)})
        version = delta.restore(
            target.ref,
            to_version,
            metadata={
                "reason": reason.strip(),
                "by": who,
                "rolled_back_runs": ",".join(i.run_id or "" for i in undone),
            },
        )
        at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        entry = {
            "event": "rollback",
            "table": target.ref.uri,
            "from_version": latest,
            "to_version": to_version,
            "version": version,
            "by": who,
            "at": at,
            "reason": reason.strip(),
            "rolled_back": sorted({str(i.run_id) for i in undone}),
            "partitions": [
                _partition_record(target, label, info, to_version)
                for label, info in sorted(restored.items())
            ],
        }
        touched = [*undone, *(i for i in restored.values() if i is not None)]
        jobs = sorted({str(i.metadata["job"]) for i in touched if i.metadata.get("job")})
        entry["index"] = [
            runindex.record_rollback(target.area.uri, target.ref.storage_options, str(j), entry)
            for j in jobs
        ]
    logger.info(
        "rolled %s back to version %d as version %d (%s)", target.ref.uri, to_version, version, who
    )
    return entry


def _labels(info: VersionInfo) -> list[str]:
    return [p for p in (info.partition or "").split(",") if p] or [""]


def _restored_runs(
    infos: list[VersionInfo], to_version: int, labels: set[str]
) -> dict[str, VersionInfo | None]:
    """For each partition ``labels`` names: the newest run commit at or before ``to_version``
    that touched it (what that partition holds again), or None (it held nothing then)."""
    found: dict[str, VersionInfo | None] = {}
    for label in labels:
        found[label] = next(
            (i for i in infos if i.version <= to_version and i.run_id and label in _labels(i)),
            None,
        )
    return found


def _partition_record(
    target: Target, label: str, info: VersionInfo | None, version: int
) -> dict[str, Any]:
    """What a partition holds again after the rollback, for the next run's drift: its run, its
    rows and score sketches (from that run's index entry, else read back from the table)."""
    output = target.ref.location.child(label).uri if label else target.ref.location.uri
    record: dict[str, Any] = {"partition": label or None, "output": output}
    if info is None:
        return {**record, "run_id": None, "rows_out": 0, "outputs": {}}
    record["run_id"] = info.run_id
    job = info.metadata.get("job")
    found = runindex.entry(target.area.uri, target.ref.storage_options, job, info.run_id)
    if found is not None and found.get("outputs"):
        record["rows_out"] = found.get("rows_out")
        record["outputs"] = found["outputs"]
        return record
    columns = [c for c in (info.metadata.get("outputs") or "").split(",") if c]
    values = dict(s.partition("=")[::2] for s in label.split("/") if s) if label else None
    table = delta.read(target.ref, version=version, partition=values, columns=columns or None)
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


# --------------------------------------------------------------------------- optimize, vacuum


def optimize(
    target: Target, partition: Mapping[str, str] | None = None, target_size: int | None = None
) -> dict[str, Any]:
    """Compact the small files of the table (of ``partition``, or the one pointed at) under
    the table lock: one OPTIMIZE version, the same rows for readers."""
    part = dict(partition) if partition else target.partition
    with maintenance(target, "optimize"):
        metrics = delta.optimize(target.ref, part, target_size, metadata={"by": default_actor()})
    return {
        "table": target.ref.uri,
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
        files = delta.vacuum(
            target.ref,
            retention_hours,
            dry_run,
            force=force,
            metadata={"by": default_actor()},
        )
    return {"table": target.ref.uri, "dry_run": dry_run, "files": files}
