"""Backfills: rescore a date-partitioned archive (``dt=YYYY-MM-DD/``), partition by partition.

Each partition is an ordinary run of the job with ``date`` set: its own output, manifest,
``_report.json`` and ``_SUCCESS``, so an interrupted partition resumes shard by shard. A partition
whose output already has ``_SUCCESS`` from the current model bundle is skipped without starting a
run. One summary, ``<area>/_backfills/<job>/<from>_<to>.json`` (``<area>``: the control area
beside the output template's fixed part, ``pipeline.io.layout``), lists every partition.

A day that fails, for whatever reason (a bad input, an output path that is a file, a bug), is
recorded with its message and the backfill goes on to the next day: one bad day must not cost
the others, nor the summary that says which day went wrong.

A day with no input folder is ``missing``: a WARNING each, and it fails the backfill (exit 1)
unless ``allow_missing_partitions`` accepts gaps in the archive. A range in which no day has
input is a wrong input template (``data/my_archiv/dt={date}``), not a gap: it fails before any
day runs (exit 3), naming the template and the first path it looked for.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.core.config import JobConfig
from pipeline.core.errors import (
    EXIT_DRIFT,
    EXIT_OK,
    EXIT_RUN_FAILED,
    ConfigError,
    InputError,
    PipelineError,
    StorageError,
    describe,
)
from pipeline.core.interrupt import StopRequest
from pipeline.core.signals import EarlyStop
from pipeline.core.statuses import FAILED_PARTITION_STATUSES, PartitionStatus, RunStatus
from pipeline.driver.run import run
from pipeline.io import layout, listing, runindex, storage
from pipeline.io.layout import REPORT_NAME
from pipeline.io.manifest import Manifest
from pipeline.io.parquet import read_footer
from pipeline.model import registry
from pipeline.model.bundle import read_bundle
from pipeline.report import metrics, verdict
from pipeline.report.build import RunReport
from pipeline.sinks import sink_for
from pipeline.worker.shard import ShardResult

logger = logging.getLogger(__name__)

MAX_DAYS = 3660  # ten years of daily partitions; a typo in --from should not plan a century


@dataclass
class BackfillReport:
    """The outcome of :func:`backfill`: ``data`` is what the summary JSON holds."""

    data: dict[str, Any]

    @property
    def exit_code(self) -> int:
        """The worst of the days': interrupted (the run's 130/143), failed or missing without
        ``allow_missing_partitions`` (1), drift (4), 0."""
        parts = self.data["partitions"]
        for p in parts:
            if p["status"] == RunStatus.INTERRUPTED:
                # The shell's 128 + signal from the run; an interrupted day is never a success.
                return int(p.get("exit_code") or EXIT_RUN_FAILED)
        if any(_fails(p, self.data) for p in parts):
            return EXIT_RUN_FAILED
        if any(p.get("drift_alert") for p in parts):
            return EXIT_DRIFT
        return EXIT_OK


def _fails(part: dict[str, Any], summary: dict[str, Any]) -> bool:
    """Whether a day's outcome fails the backfill: a failed, interrupted or errored day, and a
    missing one unless the job accepts gaps (``allow_missing_partitions``)."""
    if part["status"] == PartitionStatus.MISSING:
        return not summary.get("allow_missing_partitions")
    return part["status"] in FAILED_PARTITION_STATUSES


def dates(start: dt.date, end: dt.date) -> list[str]:
    """Every day from ``start`` to ``end``, both included, as YYYY-MM-DD."""
    if end < start:
        raise ConfigError(f"--to {end} is before --from {start}")
    days = (end - start).days + 1
    if days > MAX_DAYS:
        raise ConfigError(f"{days} days from {start} to {end} is more than {MAX_DAYS}; split it")
    return [(start + dt.timedelta(days=i)).isoformat() for i in range(days)]


def _check_templates(config: JobConfig) -> None:
    """Refuse, before any day runs, templates that would make the days share a location."""
    problems = [
        f"{key} = {getattr(config, key)!r} has no {{date}}: every partition would "
        + ("read the same input" if key == "input" else "write to the same output")
        for key in ("input", "output")
        if "{date}" not in getattr(config, key)
    ]
    if problems:
        problems.append("a backfill needs both templated, e.g. dt={date}")
    # Unset, rejects go to <root's parent>/_rejects/<root's name>/<output below the root>, which
    # is per day since output has {date}. Set
    # without {date}, every day writes its rejects under the same names (part-00000.parquet...):
    # day 2 would silently replace day 1's rejected rows.
    if config.rejects is not None and "{date}" not in config.rejects:
        problems.append(
            f"rejects = {config.rejects!r} has no {{date}}: every partition would write its "
            "rejected rows to the same files, each day replacing the one before; template it "
            "like output (e.g. .../rejects/dt={date}) or leave rejects unset "
            "(<root's parent>/_rejects/<root's name>/..., one per day)"
        )
    if problems:
        raise ConfigError(problems)


def _check_some_input(config: JobConfig, days: list[str]) -> None:
    """Refuse (exit 3, before any day runs) a range in which no day's input exists: a typo in
    the input template, not a gap in the archive. Stops at the first day that has input, so a
    normal backfill pays one existence check here."""
    for day in days:
        if listing.input_exists(storage.locate(config.input.format(date=day), config.storage)):
            return
    first = storage.locate(config.input.format(date=days[0]), config.storage)
    others = f", nor does the input of the other {len(days) - 1} days" if len(days) > 1 else ""
    raise InputError(
        f"no day from {days[0]} to {days[-1]} has input: input = {config.input!r} gives "
        f"{first.uri} for {days[0]}, which does not exist{others}; nothing was scored or "
        f"written. Check the input template{listing.missing_hint(first, literal=days[0])}"
    )


def _finished(config: JobConfig, sha: str) -> dict[str, Any] | None:
    """The partition's report if its output is complete (the folder's ``_SUCCESS``, a table's
    last commit) and came from this model bundle (and,
    for a model from a registry, this registered version: ``config.model`` is pinned)."""
    where = layout.for_run(config, "backfill")
    manifest = Manifest.load(where.control, where.old_controls)
    if not sink_for(config, where, "backfill").state(manifest).complete:
        return None
    try:
        found = layout.find_in(where, REPORT_NAME)  # its control folder, or an older one
        report = storage.read_json(found) if found is not None else None
    except (StorageError, ValueError):  # unreadable: score the partition again
        return None
    if not isinstance(report, dict) or (report.get("model") or {}).get("sha256") != sha:
        return None
    version = (report.get("settings") or {}).get("model_version")
    if version != (config.model if registry.is_registry_uri(config.model) else None):
        return None  # another registered version, or a bundle where one is asked for now
    if not _input_unchanged(config, where):
        return None  # a shard added, deleted or rewritten upstream: run the day (it resumes)
    return report


def _input_unchanged(config: JobConfig, where: layout.Places) -> bool:
    """Whether the day's input still holds exactly the shards its manifest recorded, each with
    the fingerprint a run would check: size and mtime/ETag from the listing, then row count and
    footer statistics (:func:`pipeline.io.parquet.footer_hash`) from each footer. The listing
    comes first, so a day that changed in an obvious way costs no footer read; a shard
    rewritten in place with its size and mtime kept (``cp -p``, ``rsync -a``) is caught by its
    footer, as ``run`` catches it."""
    try:
        shards = listing.list_shards(config.input_uri(), config.storage)
        done = Manifest.load(where.control, where.old_controls).shards
    except PipelineError:
        return False
    if {s.rel_path for s in shards} != set(done):
        return False
    for s in shards:
        recorded = done[s.rel_path].get("fingerprint") or {}
        if any(recorded.get(k) != v for k, v in s.fingerprint().items()):
            return False
    for s in shards:
        recorded = done[s.rel_path].get("fingerprint") or {}
        try:
            info = read_footer(s.uri, config.storage)
        except PipelineError:
            return False
        if (recorded.get("num_rows"), recorded.get("footer_hash")) != (
            info.num_rows,
            info.footer_hash,
        ):
            return False  # an entry from before footers were recorded is run again too
    return True


def backfill(
    config: JobConfig,
    start: dt.date,
    end: dt.date,
    *,
    force: bool = False,
    on_partition: Callable[[dict[str, Any]], None] | None = None,
    on_shard: Callable[[ShardResult], None] | None = None,
    stop: StopRequest | None = None,
) -> BackfillReport:
    """Run ``config`` once per date partition from ``start`` to ``end`` and write a summary.

    Partitions whose input folder does not exist are listed as ``missing``; finished ones (with
    ``_SUCCESS`` from the same model bundle) as ``skipped`` unless ``force``. A partition that
    fails, whatever the exception, is listed with its message and does not stop the others; an
    interrupted one (SIGTERM/SIGINT) stops the backfill, and the days left are listed in the
    summary's ``not_run`` (``stop`` is the signal state the CLI installs). The summary is
    written either way; the exit code is the worst outcome, and a missing day fails the
    backfill unless ``config.allow_missing_partitions``. Templates that would make days share
    a location raise :class:`ConfigError`, and a range in which no day has input
    :class:`InputError`, before any day runs.

    The metrics file and the Pushgateway (when configured) get one outcome, the backfill's
    (:func:`metrics_data`), whatever ends it: the days' own runs publish nothing, and an error
    that stops the backfill early (a template, the range, the model) publishes ``failed``.
    """
    metrics.check_metrics_file(config)
    started_at = dt.datetime.now(dt.timezone.utc)
    t0 = time.perf_counter()
    try:
        clock = (started_at, t0)
        report = _backfill(config, start, end, clock, force, on_partition, on_shard, stop)
    except BaseException as e:  # Aborted or EarlyStop too: the metrics say how it ended
        status = RunStatus.FAILED if isinstance(e, Exception) else RunStatus.INTERRUPTED
        duration = time.perf_counter() - t0
        _publish(
            config, metrics.failure_summary(config.name, started_at, duration, describe(e), status)
        )
        raise
    _publish(config, metrics_data(report.data))
    return report


def _publish(config: JobConfig, data: dict[str, Any]) -> None:
    """The backfill's outcome to the metrics; the last success kept from before the backfill
    unless it succeeded as a whole (the days it ran are in the run index, but a backfill that
    failed is no success, whichever of its days succeeded)."""
    started = dt.datetime.fromisoformat(str(data["started_at"]))
    if config.metrics_file is None and config.pushgateway is None:
        return
    metrics.publish(
        config.metrics_file,
        config.pushgateway,
        data,
        lambda: metrics.last_success_from_index(config, before=started),
    )


def _backfill(
    config: JobConfig,
    start: dt.date,
    end: dt.date,
    clock: tuple[dt.datetime, float],
    force: bool,
    on_partition: Callable[[dict[str, Any]], None] | None,
    on_shard: Callable[[ShardResult], None] | None,
    stop: StopRequest | None,
) -> BackfillReport:
    """:func:`backfill` without its metrics; ``clock``: when it started (time, perf_counter)."""
    started_at, t0 = clock
    _check_templates(config)
    days = dates(start, end)
    _check_some_input(config, days)
    source = registry.resolve_model(config.model)
    if source.registry is not None:
        # Every day scores the version the alias names now, even if it moves meanwhile.
        config = dataclasses.replace(config, model=source.registry.pinned)
    _, _, sha = read_bundle(source.bundle, config.storage)
    # The days publish no metrics of their own: the backfill publishes its outcome, once.
    quiet = dataclasses.replace(config, metrics_file=None, pushgateway=None)
    parts: list[dict[str, Any]] = []
    for i, day in enumerate(days):
        entry: dict[str, Any] = {"date": day, "input": config.input.format(date=day)}
        if config.allow_missing_partitions:
            entry["missing_allowed"] = True  # for the log line: accepted, not a warning
        try:
            if stop is not None and stop.requested and stop.signum is not None:
                # Asked to stop between days (or while starting): this day does not start,
                # even if it would only have been skipped, so the backfill ends interrupted.
                raise EarlyStop(stop.signum)
            cfg = dataclasses.replace(quiet, date=day, force=force or config.force)
            entry.update(_partition(cfg, sha, force, on_shard, stop))
        except EarlyStop as e:  # a signal before the day's run took its output: nothing written
            entry.update(status=RunStatus.INTERRUPTED, exit_code=e.exit_code, message=str(e))
        except PipelineError as e:
            entry.update(status=PartitionStatus.ERROR, exit_code=e.exit_code, message=str(e))
        except Exception as e:  # one day's unexpected error must not cost the other days
            message = f"{type(e).__name__}: {e}"
            logger.error("partition %s failed: %s", day, message, extra={"partition": day})
            logger.debug("partition %s traceback", day, exc_info=True)
            entry.update(status=PartitionStatus.ERROR, exit_code=EXIT_RUN_FAILED, message=message)
        parts.append(entry)
        if on_partition is not None:
            on_partition(entry)
        if entry["status"] == RunStatus.INTERRUPTED:
            not_run = days[i + 1 :]
            break
    else:
        not_run = []
    data = _summary(config, start, end, started_at, time.perf_counter() - t0, parts, not_run)
    root = runindex.index_root(config.output)
    job = runindex.safe_name(config.name)
    target = storage.locate(f"{root}/_backfills/{job}/{start}_{end}.json", config.storage)
    storage.write_json(target, data, point="backfill-report-rename")
    data["summary_uri"] = target.uri
    return BackfillReport(data)


def _partition(
    cfg: JobConfig,
    sha: str,
    force: bool,
    on_shard: Callable[[ShardResult], None] | None,
    stop: StopRequest | None = None,
) -> dict[str, Any]:
    """One day: missing, skipped (done earlier with this bundle), or run; its summary entry."""
    inp = storage.locate(cfg.input_uri(), cfg.storage)
    if not listing.input_exists(inp):
        return {"status": PartitionStatus.MISSING, "message": f"input {inp.uri} does not exist"}
    done = None if force else _finished(cfg, sha)
    if done is not None:
        return {
            "status": PartitionStatus.SKIPPED,
            "output": done.get("output"),
            "run_id": done.get("run_id"),
            "rows_out": done.get("rows_out"),
            "note": "finished earlier with this model bundle",
            # Its verdict stands: a day that drifted still says so until it is accepted.
            "drift_alert": verdict.open_alert(cfg, done),
            **_drift_facts(done),
        }
    report: RunReport = run(cfg, on_shard=on_shard, stop=stop)
    d = report.data
    return {
        "status": d["status"],
        "exit_code": report.exit_code,
        "run_id": d["run_id"],
        "output": d["output"],
        "rows_in": d["rows_in"],
        "rows_out": d["rows_out"],
        "rows_rejected": d["rows_rejected"],
        "shards_scored": d["shards_scored"],
        "shards_skipped": d["shards_skipped"],
        "shards_failed": d["shards_failed"],
        "shards_not_scored": d.get("shards_not_scored", 0),
        "rows_processed": d.get("rows_processed", 0),
        "duration_s": d["duration_s"],
        # Open: an alert accepted earlier (accept-drift) ends the day succeeded, exit 0.
        "drift_alert": d["status"] == RunStatus.SUCCEEDED_WITH_WARNINGS,
        **_drift_facts(d),
        # Why a day did not simply succeed, so the backfill's summary says it without opening
        # the day's _report.json.
        "failure_reasons": list(d.get("failure_reasons") or []),
    }


def _drift_facts(report: dict[str, Any]) -> dict[str, Any]:
    """A day's PSI per output column and whether it had a drift alert at all (open or
    accepted), for the backfill's metrics; nothing for a day without a drift comparison."""
    drift = report.get("drift")
    if not isinstance(drift, dict) or not drift.get("baseline"):
        return {}
    psi = {
        str(col): stats["psi"]
        for col, stats in (drift.get("columns") or {}).items()
        if isinstance(stats, dict) and isinstance(stats.get("psi"), (int, float))
    }
    return {"drift_psi": psi, "drift_any_alert": bool(drift.get("alert"))}


def metrics_data(d: dict[str, Any]) -> dict[str, Any]:
    """The backfill summary ``d`` as the fields the metrics read (:mod:`pipeline.report.metrics`):
    its status, times and rows (every day's, skipped ones included), the shards that failed,
    the throughput over the rows it scored, and the largest PSI of each output column over
    the days, with the drift alert open if any day's is (accepted when every alert was)."""
    parts = d["partitions"]
    processed = sum(p.get("rows_processed") or 0 for p in parts)
    psi: dict[str, float] = {}
    for p in parts:
        for col, value in (p.get("drift_psi") or {}).items():
            psi[col] = max(value, psi.get(col, value))
    alerts = any(p.get("drift_any_alert") for p in parts)
    open_alert = any(p.get("drift_alert") for p in parts)
    drift = {"alert": alerts, "columns": {c: {"psi": v} for c, v in psi.items()}} if psi else None
    return {
        "job": d["job"],
        "status": d["status"],
        "started_at": d["started_at"],
        "finished_at": d["finished_at"],
        "duration_s": d["duration_s"],
        "rows_out": d["rows_out"],
        "rows_rejected": sum(p.get("rows_rejected") or 0 for p in parts),
        "shards_failed": sum(p.get("shards_failed") or 0 for p in parts),
        "rows_processed": processed,
        "rows_per_s": processed / d["duration_s"] if d["duration_s"] > 0 else None,
        "drift": drift,
        "verdict": {"accepted": alerts and not open_alert} if drift else None,
    }


def _summary(
    config: JobConfig,
    start: dt.date,
    end: dt.date,
    started_at: dt.datetime,
    duration: float,
    parts: list[dict[str, Any]],
    not_run: list[str],
) -> dict[str, Any]:
    """The backfill summary: every partition planned counts in ``partitions_total``, those a
    signal left unrun under ``not_run`` (and ``partitions_by_status["not_run"]``)."""
    counts: dict[str, int] = {}
    for p in parts:
        counts[p["status"]] = counts.get(p["status"], 0) + 1
        p.pop("missing_allowed", None)  # said once for the whole backfill, below
    if not_run:
        counts["not_run"] = len(not_run)
    missing = [p["date"] for p in parts if p["status"] == PartitionStatus.MISSING]
    allowed = config.allow_missing_partitions
    reasons = []
    if missing and not allowed:
        reasons.append(
            f"{len(missing)} of {len(parts) + len(not_run)} days "
            f"{'has' if len(missing) == 1 else 'have'} no input "
            f"({_dates_text(missing)}); rerun once their input is there (the days done are "
            "skipped), or set allow_missing_partitions = true (--allow-missing-partitions) "
            "if the archive has gaps"
        )
    drifted = [p["date"] for p in parts if p.get("drift_alert")]
    if any(p["status"] == RunStatus.INTERRUPTED for p in parts):
        status = RunStatus.INTERRUPTED
    elif reasons or any(p["status"] in FAILED_PARTITION_STATUSES for p in parts):
        status = RunStatus.FAILED
    elif drifted:
        status = RunStatus.SUCCEEDED_WITH_WARNINGS  # exit 4, as a run with a drift alert
    elif any(p["status"] == RunStatus.SUCCEEDED_WITH_ERRORS for p in parts):
        status = RunStatus.SUCCEEDED_WITH_ERRORS
    else:
        status = RunStatus.SUCCEEDED
    return {
        "job": config.name,
        "from": start.isoformat(),
        "to": end.isoformat(),
        "status": status,
        "failure_reasons": reasons,
        "drift_alerts": drifted,
        "started_at": started_at.isoformat(),
        "finished_at": (started_at + dt.timedelta(seconds=duration)).isoformat(),
        "duration_s": duration,
        "partitions_total": len(parts) + len(not_run),
        "partitions_by_status": counts,
        "partitions_missing": missing,
        "allow_missing_partitions": allowed,
        # Every day's rows in the output, the skipped days' too: they are there to be read.
        "rows_out": sum(p.get("rows_out") or 0 for p in parts),
        "partitions": parts,
        "not_run": not_run,
    }


def _dates_text(days: list[str], shown: int = 5) -> str:
    more = f" and {len(days) - shown} more" if len(days) > shown else ""
    return ", ".join(days[:shown]) + more


def problem_line(report: BackfillReport) -> str:
    """A backfill that did not exit 0, in one line (what ``-q`` prints instead of the table)."""
    d = report.data
    bad = [_problem(p) for p in d["partitions"] if _fails(p, d) or p.get("drift_alert")]
    text = f"backfill {d['job']} {d['from']}..{d['to']} {_status_text(d)}"
    if bad:
        text += ": " + "; ".join(bad[:5]) + (f" (and {len(bad) - 5} more)" if len(bad) > 5 else "")
    return f"{text} (summary: {d.get('summary_uri', '-')})"


def _problem(p: dict[str, Any]) -> str:
    """One day in the ``-q`` line: its status, and a drift alert or the message."""
    text = f"{p['date']} {p['status']}"
    if p.get("drift_alert"):
        verb = "stands" if p["status"] == PartitionStatus.SKIPPED else "is open"
        how = f"score-catalog accept-drift {p.get('output')} --reason ..."
        text += f", its drift alert {verb} (accept it: {how})"
    return text + (f" ({p['message']})" if p.get("message") else "")


def _status_text(d: dict[str, Any]) -> str:
    """The backfill's status, naming the drifted days when that is what it ended on."""
    drifted = d.get("drift_alerts") or []
    if d["status"] != RunStatus.SUCCEEDED_WITH_WARNINGS or not drifted:
        return str(d["status"])
    return f"{d['status']} (drift alert on {_dates_text(drifted)})"


def _accepted(d: dict[str, Any]) -> bool:
    return bool(d.get("partitions_missing")) and bool(d.get("allow_missing_partitions"))


def summary_table(report: BackfillReport) -> str:
    """The backfill's per-partition table for the terminal."""
    d = report.data
    lines = [
        f"score-catalog backfill {d['job']} {d['from']}..{d['to']}: {_status_text(d).upper()}",
        *(f"  reason     {r}" for r in d.get("failure_reasons") or []),
        "  partitions "
        + ", ".join(f"{n} {status}" for status, n in sorted(d["partitions_by_status"].items()))
        + (" (missing days accepted: allow_missing_partitions)" if _accepted(d) else ""),
        f"  summary    {d.get('summary_uri', '-')}",
        "",
        f"  {'date':<10}  {'status':<24} {'rows scored':>12}  note",
    ]
    for p in d["partitions"]:
        rows = "-" if p.get("rows_out") is None else f"{p['rows_out']:,}"
        reasons = p.get("failure_reasons") or []
        note = (
            p.get("message")
            or ("; ".join(reasons) if reasons else None)
            or p.get("note")
            or p.get("output")
            or p.get("input")
            or ""
        )
        if p.get("drift_alert"):
            note = "DRIFT; " + note
        lines.append(f"  {p['date']:<10}  {p['status']:<24} {rows:>12}  {note}")
    return "\n".join(lines)
