"""A small index of finished runs, so a run can find the previous successful run of its job.

The index lives in ``<root>/_runs/<job>/<run_id>.json``, where ``<root>`` is the control area
beside the output template's fixed part (:func:`index_root`), outside the dataset readers
query: one small JSON file per run, written atomically, so concurrent runs of the same job for
different dates never write the same object and need no lock, and a half-written entry is
never seen. All I/O goes through :mod:`pipeline.io.storage`, so
the index works wherever the output does (local disk, ``s3://``, ``memory://``).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from pipeline.core import templates
from pipeline.core.errors import PipelineError
from pipeline.core.statuses import RunStatus
from pipeline.io import storage
from pipeline.io.layout import ACCEPTED_DIR, ROLLBACKS_DIR, RUN_INDEX_DIR

logger = logging.getLogger(__name__)

INDEX_DIR = RUN_INDEX_DIR
SUCCESS_STATUSES = frozenset(
    {RunStatus.SUCCEEDED, RunStatus.SUCCEEDED_WITH_ERRORS, RunStatus.SUCCEEDED_WITH_WARNINGS}
)
REQUIRED_KEYS = ("run_id", "job", "status", "started_at", "finished_at", "output", "report")
#: Drift acceptances (``score-catalog accept-drift``), below the job's folder of the index.
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def index_root(output_template: str) -> str:
    """The folder that holds the run index of the jobs writing under ``output_template``.

    That is the control area of the template's fixed part (:func:`pipeline.io.layout.index_root`),
    outside it so that readers of the whole dataset see only scores: ``data/scored/{date}``
    and ``data/scored`` both give ``data/_score_catalog/scored``, and ``s3://b/scored/dt={date}/x``
    gives ``s3://b/_score_catalog/scored``. A fixed part without a parent (``s3://b/{date}``,
    ``{date}/x``) keeps it inside: ``s3://b``, ``.``. The index is then ``<root>/_runs/<job>/``,
    shared by every run of the job whatever its date. A placeholder in the bucket or host
    part of a URI leaves no fixed root: that is a :class:`ConfigError`.
    """
    return templates.index_root(output_template)


def safe_name(name: str) -> str:
    """``name`` with every character outside ``[A-Za-z0-9._-]`` replaced by ``_``.

    Job names are free text in job files; this keeps them one path segment on every filesystem.
    Names that would be hidden or special (``.``, ``..``, empty) get a leading ``_``.
    """
    safe = _UNSAFE.sub("_", name)
    if safe in ("", ".", ".."):
        safe = "_" + safe
    return safe


def _job_dir(root: str, options: Mapping[str, Any] | None, job: str) -> storage.Location:
    return storage.locate(root, options).child(f"{INDEX_DIR}/{safe_name(job)}")


def record(root: str, options: Mapping[str, Any] | None, job: str, entry: dict[str, Any]) -> str:
    """Write ``entry`` as ``<root>/_runs/<job>/<run_id>.json``, atomically; returns its URI.

    ``entry`` must hold at least ``run_id``, ``job``, ``status``, ``started_at``,
    ``finished_at`` (ISO-8601 with timezone), ``output`` (the run's output URI) and ``report``
    (the URI of its ``_report.json``); ``rows_out`` is expected too. Writing the same run twice
    replaces its entry.
    """
    missing = [k for k in REQUIRED_KEYS if k not in entry]
    if missing:
        raise ValueError(f"run index entry lacks {', '.join(missing)}")
    loc = _job_dir(root, options, job).child(f"{safe_name(str(entry['run_id']))}.json")
    storage.write_json(loc, entry, point="runindex-rename")
    return loc.uri


def remove(root: str, options: Mapping[str, Any] | None, job: str, run_id: str) -> None:
    """Delete the entry of run ``run_id`` (one that could not be rewritten after it failed)."""
    storage.remove(_job_dir(root, options, job).child(f"{safe_name(run_id)}.json"))


def parse_time(value: Any) -> dt.datetime:
    """An ISO-8601 time of an entry (``finished_at``, ``started_at``); a bare one is UTC."""
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not an ISO-8601 time")
    # Python 3.10's fromisoformat does not take a trailing Z.
    t = dt.datetime.fromisoformat(value[:-1] + "+00:00" if value.endswith("Z") else value)
    # A time without an offset is taken as UTC, which is what every run writes.
    return t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)


def finished_time(entry: Mapping[str, Any]) -> dt.datetime:
    """When an index entry's run finished (its ``finished_at``); the epoch when it cannot be
    read (such an entry is never the newest)."""
    try:
        return parse_time(entry.get("finished_at"))
    except (ValueError, TypeError):
        return dt.datetime.fromtimestamp(0, dt.timezone.utc)


def previous_success(
    root: str,
    options: Mapping[str, Any] | None,
    job: str,
    *,
    exclude_run_id: str | None = None,
    scored_only: bool = False,
    skip: Callable[[dict[str, Any]], bool] | None = None,
    rank: Callable[[dict[str, Any]], str] | None = None,
) -> dict[str, Any] | None:
    """The newest (by ``finished_at``) successful entry of ``job`` in the index, or None.

    ``rank`` orders entries before their ``finished_at`` does: the highest rank wins, the
    newest within it (the drift baseline ranks by partition date: pipeline.report.verdict).

    ``scored_only`` skips runs that scored no rows themselves (a resume that found every shard
    done): they have no score distribution to compare with. ``skip`` skips every entry for
    which it returns True (the drift baseline skips the current dataset: pipeline.report.verdict).

    Successful means a status in :data:`SUCCESS_STATUSES`. ``exclude_run_id`` skips one run
    (the current one, if it was already recorded). Entries that cannot be read or parsed are
    skipped with a warning naming the file: a damaged entry must never stop a run. Entries of a
    different job whose name sanitizes to the same directory are skipped too. A missing index
    gives None.
    """
    best: tuple[tuple[str, dt.datetime], dict[str, Any]] | None = None
    for uri, entry in _entries(_job_dir(root, options, job), "run index entry"):
        try:
            finished = parse_time(entry.get("finished_at"))
        except (ValueError, TypeError) as err:
            logger.warning("skipping unreadable run index entry %s: %s", uri, err)
            continue
        if entry.get("job", job) != job or entry.get("status") not in SUCCESS_STATUSES:
            continue
        if exclude_run_id is not None and entry.get("run_id") == exclude_run_id:
            continue
        if scored_only and entry.get("rows_processed", 1) == 0:
            continue
        if skip is not None and skip(entry):
            continue
        key = (rank(entry) if rank is not None else "", finished)
        if best is None or key > best[0]:
            best = (key, entry)
    return best[1] if best else None


def _entries(d: storage.Location, what: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(uri, document)`` of each ``*.json`` file directly in ``d``; none if ``d`` is missing.

    A file that cannot be read or is not a JSON object is skipped with a warning naming it
    (``what`` says what it should have been): a damaged entry must never stop a run.
    """
    try:
        found = [e for e in storage.ls(d) if e.name.endswith(".json")]
    except FileNotFoundError:
        return
    found = [e for e in found if not e.name.startswith(".")]
    # One bulk fetch: object stores serve these concurrently, instead of one round trip each.
    blobs = storage.read_many(found)
    for e in found:
        raw = blobs[e.uri]
        try:
            if isinstance(raw, BaseException):
                raise raw
            doc = json.loads(raw)
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
        except FileNotFoundError:
            # Listed, then gone: pruned by someone else meanwhile; nothing to warn about.
            continue
        except (OSError, ValueError, TypeError, PipelineError) as err:
            logger.warning("skipping unreadable %s %s: %s", what, e.uri, err)
            continue
        yield e.uri, doc


def record_acceptance(
    root: str, options: Mapping[str, Any] | None, job: str, entry: dict[str, Any]
) -> str:
    """Write a drift acceptance as ``<root>/_runs/<job>/_accepted/<at>-<dataset>.json``.

    ``entry`` holds at least ``dataset``, ``baseline`` (the run the drift was measured
    against), ``by``, ``at`` and ``reason``. One file each, never rewritten: the index keeps
    who accepted what, when and why. Returns its URI.
    """
    stamp = re.sub(r"[^0-9A-Za-z]", "", str(entry["at"]))
    name = f"{stamp}-{safe_name(str(entry['dataset']))}.json"
    loc = _job_dir(root, options, job).child(f"{ACCEPTED_DIR}/{name}")
    storage.write_json(loc, entry, point="acceptance-rename")
    return loc.uri


def acceptances(root: str, options: Mapping[str, Any] | None, job: str) -> Iterator[dict[str, Any]]:
    """Every drift acceptance of ``job`` in the index (unreadable ones skipped with a warning)."""
    for _uri, found in _entries(_job_dir(root, options, job).child(ACCEPTED_DIR), "acceptance"):
        yield found


def acceptance(
    root: str, options: Mapping[str, Any] | None, job: str, dataset: str, baseline: Any
) -> dict[str, Any] | None:
    """The newest acceptance of the drift of ``dataset`` against run ``baseline``, or None.

    Unreadable entries are skipped with a warning, like run entries.
    """
    best: dict[str, Any] | None = None
    for found in acceptances(root, options, job):
        if found.get("dataset") != dataset or found.get("baseline") != baseline:
            continue
        if best is None or str(found.get("at")) > str(best.get("at")):
            best = found
    return best


def entry(
    root: str, options: Mapping[str, Any] | None, job: str | None, run_id: str | None
) -> dict[str, Any] | None:
    """The index entry of run ``run_id`` of ``job``; None when there is none (or unreadable)."""
    if not job or not run_id:
        return None
    loc = _job_dir(root, options, job).child(f"{safe_name(run_id)}.json")
    try:
        doc = storage.read_json(loc)
    except (OSError, ValueError, PipelineError) as err:
        logger.warning("skipping unreadable run index entry %s: %s", loc.uri, err)
        return None
    return doc if isinstance(doc, dict) else None


def settle_commit(
    root: str,
    options: Mapping[str, Any] | None,
    job: str,
    run_id: str,
    *,
    landed: bool,
    by: str,
    table_version: int | None = None,
) -> bool:
    """Bring the entry of run ``run_id``, whose table commit was left pending when it stopped,
    in line with what the table holds, as run ``by`` found it: its commit ``landed`` (readers
    see its scores: a success, ``recovered`` by ``by`` at ``table_version``) or did not (a
    failure, whatever the entry said: it is written before the commit). Whether the entry
    changed; an entry that was never written stays absent."""
    found = entry(root, options, job, run_id)
    if found is None:
        return False
    was = dict(found)
    if landed:
        if found.get("status") not in SUCCESS_STATUSES:
            found["status"] = RunStatus.SUCCEEDED
        found["recovered"] = {"by": by, "table_version": table_version}
    else:
        found["status"] = RunStatus.FAILED
        found["commit"] = f"its commit did not land; run {by} found it pending"
    if found == was:
        return False
    record(root, options, job, found)
    return True


def record_rollback(
    root: str, options: Mapping[str, Any] | None, job: str, entry: dict[str, Any]
) -> str:
    """Write a Delta table's rollback as ``<root>/_runs/<job>/_rollbacks/<at>-v<version>.json``.

    ``entry`` holds at least ``at``, ``version`` (the rollback's table version), ``scope``
    (``table``: a RESTORE of the whole table; ``partition``: of ``partition`` alone),
    ``rolled_back`` (the run ids whose commits it undid: of that partition alone, for a
    partition's rollback) and ``partitions`` (per partition it changed: ``output``, the
    ``run_id`` whose data it holds again, ``rows_out`` and ``outputs`` sketches), which drift
    reads (:func:`rollbacks`); a partition it did not change is in neither list, so its runs
    and baselines stand. One file each, never rewritten. Returns its URI."""
    stamp = re.sub(r"[^0-9A-Za-z]", "", str(entry["at"]))
    loc = _job_dir(root, options, job).child(f"{ROLLBACKS_DIR}/{stamp}-v{entry['version']}.json")
    storage.write_json(loc, entry, point="rollback-rename")
    return loc.uri


def rollbacks(root: str, options: Mapping[str, Any] | None, job: str) -> list[dict[str, Any]]:
    """Every rollback recorded for ``job`` (unreadable ones skipped with a warning)."""
    found = _entries(_job_dir(root, options, job).child(ROLLBACKS_DIR), "rollback record")
    return [doc for _uri, doc in found]
