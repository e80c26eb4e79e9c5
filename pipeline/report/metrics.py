"""Prometheus metrics about each run, for alerting on a batch job that has no server to scrape.

Two ways out, both carrying the same gauges, all named ``score_catalog_*`` with their unit last
(``_seconds``, ``_rows``, ``_shards``, ``_rows_per_second``) and labelled ``job_name`` with the
job's name (the table is in docs/monitoring.md):

* a file for node_exporter's textfile collector (:func:`write_metrics_file`); the file must end
  in ``.prom`` and sit in ``--collector.textfile.directory``. Use one file per job
  (e.g. ``score_catalog_<job>.prom``): each write replaces the whole file. The label is not
  ``job`` because Prometheus sets ``job`` itself when it scrapes node_exporter (ours would be
  renamed ``exported_job``).
* a Prometheus Pushgateway (:func:`push_metrics`), in the group ``job=<job name>``: there the
  job belongs in the grouping key, which the Pushgateway adds to every series as ``job``.

Every metric is a gauge describing the last run (a batch job's counters would restart at 0 on
each run), so none ends in ``_total``. The usual alerts:
``time() - score_catalog_last_success_timestamp_seconds > 26 * 3600`` (the nightly run has not
succeeded for a day), ``score_catalog_last_run_status{status="failed"} == 1``,
``score_catalog_last_run_drift_psi > 0.25 unless on (job_name)
score_catalog_last_run_drift_accepted == 1``.
"""

from __future__ import annotations

import datetime as dt
import http.client
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, push_to_gateway, write_to_textfile
from prometheus_client.parser import text_string_to_metric_families

from pipeline.core.config import JobConfig
from pipeline.core.errors import ConfigError, StorageError
from pipeline.core.statuses import SUCCESS_STATUSES, RunStatus
from pipeline.io import runindex

logger = logging.getLogger(__name__)

PREFIX = "score_catalog"
LAST_SUCCESS = f"{PREFIX}_last_success_timestamp_seconds"
#: The label naming the job on every metric (not ``job``: Prometheus owns that one).
JOB_LABEL = "job_name"
#: The label of files written before ``job_name``; read only, to carry their last success forward.
LEGACY_JOB_LABEL = "job"
#: Every ``status`` label of ``score_catalog_last_run_status``: one sample each, 1 for the run's.
STATUSES = tuple(s.value for s in RunStatus)


def _timestamp(value: Any) -> float | None:
    """Seconds since the epoch of an ISO-8601 time with timezone; None if absent or unusable."""
    if not isinstance(value, str):
        return None
    try:
        t = dt.datetime.fromisoformat(value[:-1] + "+00:00" if value.endswith("Z") else value)
    except ValueError:
        logger.warning("metrics: %r is not an ISO-8601 time; leaving it out", value)
        return None
    # Reports always carry an offset; a bare time is UTC like every other time the tool writes.
    return (t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)).timestamp()


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def registry_for(
    report: Mapping[str, Any], *, previous_success_ts: float | None
) -> CollectorRegistry:
    """A fresh registry holding this run's gauges, labelled ``job_name=report["job"]``.

    Reads ``job``, ``status``, ``started_at``, ``finished_at``, ``duration_s``, ``rows_out``,
    ``rows_rejected``, ``shards_failed``, ``rows_per_s`` and ``drift``; a field that is missing
    or None leaves its sample out rather than exporting a made-up 0 (``report`` is a whole
    ``_report.json``, or the short summary of a run that stopped before scoring). The
    last-success timestamp is this run's end if it succeeded (a status in
    :data:`~pipeline.core.statuses.SUCCESS_STATUSES`), else ``previous_success_ts`` (carried forward
    so that a failed or interrupted run does not reset the "hours since last success" alert);
    with neither it is left out.
    """
    reg = CollectorRegistry(auto_describe=True)
    job = str(report["job"])

    def gauge(name: str, doc: str, value: float | None) -> None:
        g = Gauge(f"{PREFIX}_{name}", doc, [JOB_LABEL], registry=reg)
        if value is not None:
            g.labels(job).set(value)

    status = report.get("status")
    end = _timestamp(report.get("finished_at"))
    last_success = end if status in SUCCESS_STATUSES else previous_success_ts
    gauge(
        "last_run_start_timestamp_seconds",
        "Unix time the last run of the job started, whatever its outcome.",
        _timestamp(report.get("started_at")),
    )
    gauge(
        "last_run_end_timestamp_seconds",
        "Unix time the last run of the job finished, whatever its outcome.",
        end,
    )
    gauge(
        "last_success_timestamp_seconds",
        "Unix time the last run that did not fail finished; alert on time() minus this.",
        last_success,
    )
    gauge(
        "last_run_duration_seconds",
        "Wall-clock duration of the last run in seconds.",
        _number(report.get("duration_s")),
    )
    gauge(
        "last_run_scored_rows",
        "Rows in the scored output of the last run (scored now or skipped as already done).",
        _number(report.get("rows_out")),
    )
    gauge(
        "last_run_rejected_rows",
        "Rows the last run rejected as invalid (written to the rejects location).",
        _number(report.get("rows_rejected")),
    )
    gauge(
        "last_run_failed_shards",
        "Input shards the last run could not score.",
        _number(report.get("shards_failed")),
    )
    gauge(
        "last_run_throughput_rows_per_second",
        "Scoring throughput of the last run in rows per second, start-up included.",
        # A run that scored no row has no throughput (not 0: a dip a dashboard would draw).
        _number(report.get("rows_per_s")) if report.get("rows_processed") else None,
    )
    _incremental_gauges(reg, job, report.get("incremental"))
    _drift_gauge(reg, job, report.get("drift"))
    _accepted_gauge(reg, job, report.get("drift"), report.get("verdict"))
    _status_gauge(reg, job, status)
    _table_gauge(reg, job, report.get("output_format"))
    return reg


def _incremental_gauges(reg: CollectorRegistry, job: str, inc: Any) -> None:
    """An incremental night's carried rows and rows through the model (docs/incremental.md);
    no sample when the run was not incremental."""
    found = inc if isinstance(inc, Mapping) else {}
    for name, key, doc in (
        (
            "last_run_carried_rows",
            "rows_carried",
            "Rows whose scores the last run carried from its baseline instead of scoring them "
            "(incremental = true); no sample when the run was not incremental.",
        ),
        (
            "last_run_model_rows",
            "rows_scored",
            "Rows the last incremental run sent through the model (new and changed rows); no "
            "sample when the run was not incremental.",
        ),
    ):
        g = Gauge(f"{PREFIX}_{name}", doc, [JOB_LABEL], registry=reg)
        value = _number(found.get(key))
        if value is not None:
            g.labels(job).set(value)


def _table_gauge(reg: CollectorRegistry, job: str, fmt: Any) -> None:
    """The table's version after the last run (a table format's ``output_format.version``),
    labelled with the partition it wrote (empty: an unpartitioned table); no sample for a
    Parquet folder or a run that never read the table."""
    g = Gauge(
        f"{PREFIX}_table_version",
        "Version of the table after the last run (its commit, or the version it left).",
        [JOB_LABEL, "partition"],
        registry=reg,
    )
    if not isinstance(fmt, Mapping) or not fmt.get("table"):
        return
    version = _number(fmt.get("version"))
    if version is not None:
        g.labels(job, str(fmt.get("partition") or "")).set(version)


def _drift_gauge(reg: CollectorRegistry, job: str, drift: Any) -> None:
    """One PSI sample per output column that has one; none when drift was not computed."""
    psi = Gauge(
        f"{PREFIX}_last_run_drift_psi",
        "Population stability index (dimensionless) of each output column of the last run "
        "against the drift baseline (above 0.25: significant shift).",
        [JOB_LABEL, "output"],
        registry=reg,
    )
    columns = drift.get("columns") if isinstance(drift, Mapping) else None
    for col, stats in (columns or {}).items():
        value = _number(stats.get("psi")) if isinstance(stats, Mapping) else None
        if value is not None:
            psi.labels(job, str(col)).set(value)


def _accepted_gauge(reg: CollectorRegistry, job: str, drift: Any, verdict: Any) -> None:
    """1 when the dataset's drift alert was accepted (``score-catalog accept-drift``), 0 when
    it is open; no sample without a drift alert."""
    g = Gauge(
        f"{PREFIX}_last_run_drift_accepted",
        "Whether the drift alert on the last run's dataset was accepted (1) or is open (0).",
        [JOB_LABEL],
        registry=reg,
    )
    if isinstance(drift, Mapping) and drift.get("alert"):
        accepted = isinstance(verdict, Mapping) and bool(verdict.get("accepted"))
        g.labels(job).set(1 if accepted else 0)


def _status_gauge(reg: CollectorRegistry, job: str, status: Any) -> None:
    """A state set: one sample per run status, 1 for the last run's and 0 for the others."""
    st = Gauge(
        f"{PREFIX}_last_run_status",
        "Outcome of the last run: 1 for its status, 0 for the others.",
        [JOB_LABEL, "status"],
        registry=reg,
    )
    for s in STATUSES:
        st.labels(job, s).set(1 if s == status else 0)


def previous_success_timestamp(path: str, job: str) -> float | None:
    """The last-success timestamp of ``job`` in an existing metrics file, or None.

    None when the file is missing, unreadable, not in the text format, or has no such sample.
    A file from before the ``job_name`` label (labelled ``job``) is read too, so that the first
    run after an upgrade keeps the last success even if it fails.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        logger.warning("cannot read previous metrics file %s: %s", path, e)
        return None
    try:
        for family in text_string_to_metric_families(text):
            if family.name != LAST_SUCCESS:
                continue
            for sample in family.samples:
                labels = sample.labels
                owner = labels.get(JOB_LABEL, labels.get(LEGACY_JOB_LABEL))
                if sample.name == LAST_SUCCESS and owner == job:
                    return float(sample.value)
    except (ValueError, TypeError, IndexError, KeyError) as e:
        # The parser raises a variety of errors on garbage; a damaged file just has no history.
        logger.warning("cannot parse previous metrics file %s: %s", path, e)
    return None


def write_metrics_file(
    path: str, report: Mapping[str, Any], *, previous_success_ts: float | None = None
) -> None:
    """Replace the textfile-collector file ``path`` with this run's metrics, atomically.

    A previous last-success timestamp of the same job in the file (or ``previous_success_ts``,
    when the caller read it already) is carried forward when this run failed. The file is
    written to a temporary sibling and renamed, so node_exporter never reads half a file. The
    directory must exist; failing to write is a :class:`StorageError`.
    """
    previous = previous_success_ts
    if previous is None:
        previous = previous_success_timestamp(path, str(report["job"]))
    registry = registry_for(report, previous_success_ts=previous)
    try:
        write_to_textfile(path, registry)
    except OSError as e:
        parent = os.path.dirname(os.path.abspath(path))
        raise StorageError(
            f"cannot write metrics file {path}: {e}; check that {parent} exists and is writable "
            "(it should be node_exporter's --collector.textfile.directory)"
        ) from e


def push_metrics(
    url: str,
    report: Mapping[str, Any],
    *,
    previous_success_ts: float | None = None,
    timeout: float = 10,
) -> None:
    """Push this run's metrics to the Pushgateway at ``url`` (HTTP PUT).

    The Pushgateway group is ``/metrics/job/<report["job"]>``: the job belongs in the grouping
    key, which the Pushgateway adds to every series as ``job``; the gauges are the ones the
    textfile carries (labelled ``job_name`` with the same name), so one set of alert rules fits
    both. Each score-catalog job has a group of its own that its next push replaces whole
    (jobs never overwrite each other).
    Because a push replaces the group, pass ``previous_success_ts`` for a failed run, or its
    last-success sample disappears. Network and HTTP errors are a :class:`StorageError`.
    """
    job = str(report["job"])
    registry = registry_for(report, previous_success_ts=previous_success_ts)
    try:
        push_to_gateway(url, job=job, registry=registry, timeout=timeout)
    except (OSError, http.client.HTTPException, ValueError) as e:
        # OSError covers refused connections, timeouts and non-2xx answers (the client raises
        # OSError for those); HTTPException a server that does not speak HTTP; ValueError a URL
        # that cannot be parsed.
        raise StorageError(f"cannot push metrics to Pushgateway {url}: {e}") from e


def failure_summary(
    job: str,
    started_at: dt.datetime,
    duration: float,
    error: str,
    status: str = RunStatus.FAILED,
) -> dict[str, Any]:
    """The fields the metrics read, for a run that ended without a report: stopped before
    scoring (exit 2 or 3), an error where no report could be written, a second signal."""
    return {
        "job": job,
        "status": status,
        "started_at": started_at.isoformat(),
        "finished_at": (started_at + dt.timedelta(seconds=duration)).isoformat(),
        "duration_s": duration,
        "rows_out": 0,
        "rows_rejected": 0,
        "shards_failed": 0,
        "shards_not_scored": 0,
        "rows_processed": 0,
        "rows_per_s": None,  # nothing was scored: no throughput
        "drift": None,
        "error": error,
    }


def publish(
    metrics_file: str | None,
    pushgateway: str | None,
    data: Mapping[str, Any],
    last_success: Callable[[], float | None] | None = None,
) -> None:
    """``data`` (a report, or a :func:`failure_summary`) to ``metrics_file`` and
    ``pushgateway`` where given; ``last_success`` finds the last success for a push when the
    metrics file does not have it (a push replaces the whole group).

    Never raises: the run is over, and an error here must not hide how it ended.
    """
    try:
        _publish(metrics_file, pushgateway, data, last_success)
    except Exception as e:
        logger.error("could not publish the run's metrics: %s: %s", type(e).__name__, e)


def _publish(
    metrics_file: str | None,
    pushgateway: str | None,
    data: Mapping[str, Any],
    last_success: Callable[[], float | None] | None,
) -> None:
    previous = None
    if metrics_file is not None:
        previous = previous_success_timestamp(metrics_file, str(data["job"]))
        try:
            write_metrics_file(metrics_file, data, previous_success_ts=previous)
        except StorageError as e:
            logger.error("%s", e)
    if pushgateway is not None:
        if previous is None and data.get("status") not in SUCCESS_STATUSES and last_success:
            # A failed or interrupted run keeps the last success (a push replaces the group).
            previous = last_success()
        try:
            push_metrics(pushgateway, data, previous_success_ts=previous)
        except StorageError as e:
            logger.error("%s", e)


# -- a run's outcome ---------------------------------------------------------------------------


def check_metrics_file(config: JobConfig) -> None:
    """Refuse a metrics file that is a folder, or whose folder does not exist, before the run
    starts."""
    if config.metrics_file is None:
        return
    if os.path.isdir(config.metrics_file):
        raise ConfigError(
            f"metrics_file = {config.metrics_file!r} is a folder; give a file in it, e.g. "
            f"{os.path.join(config.metrics_file, 'score_catalog.prom')}"
        )
    parent = os.path.dirname(os.path.abspath(config.metrics_file))
    if not os.path.isdir(parent):
        raise ConfigError(
            f"metrics_file = {config.metrics_file!r}: directory {parent} does not exist "
            "(point it at node_exporter's --collector.textfile.directory)"
        )


def publish_outcome(config: JobConfig, data: Mapping[str, Any]) -> None:
    """A run's outcome (its report, or a :func:`failure_summary`) to the job's metrics file and
    Pushgateway, when configured. Never raises: the run is over, and an error here must not
    hide how it ended."""
    if config.metrics_file is None and config.pushgateway is None:
        return
    publish(config.metrics_file, config.pushgateway, data, lambda: last_success_from_index(config))


def last_success_from_index(
    config: JobConfig, *, before: dt.datetime | None = None
) -> float | None:
    """When the last success finished, from the run index (a push replaces the whole group);
    ``before``: the last one that started before then (a backfill's days are not its success)."""

    def later(entry: dict[str, Any]) -> bool:
        if before is None:
            return False
        try:
            return runindex.parse_time(entry.get("started_at")) >= before
        except (ValueError, TypeError):
            return True  # when it started is unknown: not a success known to be earlier

    try:
        entry = runindex.previous_success(
            runindex.index_root(config.output), config.storage, config.name, skip=later
        )
        if entry is None:
            return None
        return dt.datetime.fromisoformat(str(entry["finished_at"])).timestamp()
    except Exception as e:  # metrics are best effort once the run is over
        logger.warning("could not read the last success from the run index: %s", e)
        return None
