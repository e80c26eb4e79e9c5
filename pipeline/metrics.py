"""Prometheus metrics about each run, for alerting on a batch job that has no server to scrape.

Two ways out, both carrying the same gauges (every one labelled ``job`` with the job's name):

* a file for node_exporter's textfile collector (:func:`write_metrics_file`); the file must end
  in ``.prom`` and sit in ``--collector.textfile.directory``. Use one file per job
  (e.g. ``score_catalog_<job>.prom``): each write replaces the whole file.
* a Prometheus Pushgateway (:func:`push_metrics`).

The usual alerts: ``time() - score_catalog_last_success_timestamp_seconds > 26 * 3600`` (the
nightly run has not succeeded for a day), ``score_catalog_run_status{status="failed"} == 1``,
``score_catalog_drift_psi > 0.25``.
"""

from __future__ import annotations

import datetime as dt
import http.client
import logging
import os
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, push_to_gateway, write_to_textfile
from prometheus_client.parser import text_string_to_metric_families

from pipeline.errors import StorageError
from pipeline.statuses import SUCCESS_STATUSES, RunStatus

logger = logging.getLogger(__name__)

PREFIX = "score_catalog"
LAST_SUCCESS = f"{PREFIX}_last_success_timestamp_seconds"
#: Every ``status`` label of ``score_catalog_run_status``: one sample per status, 1 for the run's.
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
    """A fresh registry holding this run's gauges, labelled ``job=report["job"]``.

    Reads ``job``, ``status``, ``started_at``, ``finished_at``, ``duration_s``, ``rows_out``,
    ``rows_rejected``, ``shards_failed``, ``rows_per_s`` and ``drift``; a field that is missing
    or None leaves its sample out rather than exporting a made-up 0 (``report`` is a whole
    ``_report.json``, or the short summary of a run that stopped before scoring). The
    last-success timestamp is this run's end if it succeeded (a status in
    :data:`~pipeline.statuses.SUCCESS_STATUSES`), else ``previous_success_ts`` (carried forward
    so that a failed or interrupted run does not reset the "hours since last success" alert);
    with neither it is left out.
    """
    reg = CollectorRegistry(auto_describe=True)
    job = str(report["job"])

    def gauge(name: str, doc: str, value: float | None) -> None:
        g = Gauge(f"{PREFIX}_{name}", doc, ["job"], registry=reg)
        if value is not None:
            g.labels(job=job).set(value)

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
        "run_duration_seconds",
        "Wall-clock duration of the last run in seconds.",
        _number(report.get("duration_s")),
    )
    gauge(
        "rows_scored",
        "Rows scored and written by the last run.",
        _number(report.get("rows_out")),
    )
    gauge(
        "rows_rejected",
        "Rows the last run rejected as invalid (written to the rejects location).",
        _number(report.get("rows_rejected")),
    )
    gauge(
        "shards_failed",
        "Input shards the last run could not score.",
        _number(report.get("shards_failed")),
    )
    gauge(
        "rows_per_second",
        "Scoring throughput of the last run in rows per second.",
        _number(report.get("rows_per_s")),
    )

    psi = Gauge(
        f"{PREFIX}_drift_psi",
        "Population stability index of each output column of the last run against the "
        "previous successful run (above 0.25: significant shift).",
        ["job", "output"],
        registry=reg,
    )
    drift = report.get("drift")
    columns = drift.get("columns") if isinstance(drift, Mapping) else None
    for col, stats in (columns or {}).items():
        value = _number(stats.get("psi")) if isinstance(stats, Mapping) else None
        if value is not None:
            psi.labels(job=job, output=str(col)).set(value)

    st = Gauge(
        f"{PREFIX}_run_status",
        "Outcome of the last run: 1 for its status, 0 for the others.",
        ["job", "status"],
        registry=reg,
    )
    for s in STATUSES:
        st.labels(job=job, status=s).set(1 if s == status else 0)
    return reg


def previous_success_timestamp(path: str, job: str) -> float | None:
    """The last-success timestamp of ``job`` in an existing metrics file, or None.

    None when the file is missing, unreadable, not in the text format, or has no such sample.
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
                if sample.name == LAST_SUCCESS and sample.labels.get("job") == job:
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

    The Pushgateway group is ``/metrics/job/<report["job"]>``: the group's ``job`` label equals
    the ``job`` label on every gauge, so the two never disagree, and each score-catalog job has
    a group of its own that its next push replaces whole (jobs never overwrite each other).
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
