"""A drift verdict belongs to the dataset, not to the run that happened to write it last.

The dataset is what an output holds: the scored shards its manifest lists, each scored from one
version of its input shard with one model and one set of settings. :func:`dataset_id` names that
content with a short hash. The first run that leaves an output holding a given dataset compares
its score distributions with an earlier dataset of the job (:func:`judge`) and
keeps the outcome with the manifest (its ``verdict`` key): the comparison, who made it and when.
The baseline is the newest *earlier* dataset of the job whose verdict was clean or accepted
(:func:`_baseline`): by the partition's date with a ``{date}`` template, and never a dataset
whose drift alert nobody accepted, so a shift that persists keeps alerting until accepted.
A later run that leaves the dataset unchanged (a rerun that finds every shard done, a resume
after an interrupted commit) reports that same verdict, with the same warnings, status and exit
code, instead of comparing the dataset with itself or saying it scored nothing. A run that
changes the dataset (one shard rescored) judges the whole dataset again: the report's
``outputs`` cover every shard in the output, the skipped ones from their manifest sketches.

A drift alert stays until the dataset changes or someone accepts it: ``score-catalog
accept-drift OUTPUT --reason TEXT`` records who, when and why in the run index
(``<index>/_runs/<job>/_accepted/``, :func:`pipeline.io.runindex.record_acceptance`); the next run
over the same dataset then ends ``succeeded`` (exit 0) and its report says the drift was
accepted, by whom, when and why.
"""

from __future__ import annotations

import datetime as dt
import getpass
import hashlib
import json
import logging
import re
import socket
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline.core.config import JobConfig
from pipeline.core.errors import UsageError
from pipeline.core.statuses import RunStatus
from pipeline.io import layout, runindex, storage
from pipeline.io.layout import MANIFEST_NAME
from pipeline.io.manifest import Manifest, fingerprint_hash
from pipeline.report import drift as drift_mod

logger = logging.getLogger(__name__)

#: The version of the record kept in the manifest's ``verdict`` key.
RECORD_VERSION = 1


def dataset_id(output: str, shards: Mapping[str, Mapping[str, Any]]) -> str:
    """A short hash naming an output and its content: per shard in it (its manifest entry), the
    input version it was scored from, the model, the settings and the rows written. Two runs
    that leave the same entries in the same output have the same dataset, whichever of them
    scored which shard; two days scored from identical input are two datasets."""
    items: list[Any] = [output]
    items += [
        [
            rel,
            fingerprint_hash(dict(e.get("fingerprint") or {})),
            e.get("model_sha256"),
            e.get("settings_hash"),
            e.get("rows_scored"),
            e.get("rows_rejected"),
        ]
        for rel, e in sorted(shards.items())
    ]
    return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Judgement:
    """What :func:`judge` found: the report's ``drift`` and ``verdict`` sections, the record to
    keep with the manifest, the warnings, and whether an alert is open (not accepted)."""

    drift: dict[str, Any] | None = None
    verdict: dict[str, Any] | None = None
    record: dict[str, Any] | None = None
    warnings: list[str] = field(default_factory=list)
    alert_open: bool = False


def thresholds_of(config: JobConfig) -> dict[str, float]:
    m = config.monitoring
    return {"psi": m.psi_threshold, "ks": m.ks_threshold, "rows_change": m.rows_change_threshold}


def has_placeholder(template: str) -> bool:
    """Whether an output template names a placeholder (``{date}``, ``{run_id}``)."""
    try:
        return any(f is not None for _, f, _, _ in string.Formatter().parse(template))
    except ValueError:
        return False


def _reusable(
    kept: Mapping[str, Any] | None, dataset: str, config: JobConfig
) -> dict[str, Any] | None:
    """The kept drift section if ``kept`` judged this very dataset with today's thresholds."""
    if not kept or kept.get("version") != RECORD_VERSION or kept.get("dataset") != dataset:
        return None
    if kept.get("job") != config.name or not kept.get("complete", True):
        return None  # another job's, or judged while the run index could not be read
    drift = kept.get("drift")
    if not isinstance(drift, dict):
        return None
    baseline = drift.get("baseline")
    if baseline is not None and drift.get("thresholds") != thresholds_of(config):
        return None  # thresholds changed since: judge again
    day = run_day(config)
    if isinstance(baseline, Mapping) and day is not None:
        before = template_day(config.output, baseline.get("output"))
        if before is not None and before >= day:
            return None  # judged by an older version against a later day: judge it again
    return drift


def template_day(template: str, output: Any) -> str | None:
    """The ``{date}`` an output of ``template`` was written for (``YYYY-MM-DD``), read back from
    its URI: ``data/scored/run_date={date}`` and ``/srv/data/scored/run_date=2026-11-03`` give
    ``2026-11-03``. None where the template has no ``{date}`` or the URI does not fit it."""
    if not isinstance(output, str) or not has_field(template, "date"):
        return None
    pattern = ""
    for literal, name, _, _ in string.Formatter().parse(template.removeprefix("./").rstrip("/")):
        pattern += re.escape(literal)
        if name == "date":
            pattern += "(?P=date)" if "(?P<date>" in pattern else r"(?P<date>\d{4}-\d{2}-\d{2})"
        elif name is not None:
            pattern += "[^/]+"
    found = re.search(pattern + "$", output.rstrip("/"))
    return found.group("date") if found else None


def has_field(template: str, name: str) -> bool:
    """Whether ``template`` names the placeholder ``name``."""
    try:
        return any(f == name for _, f, _, _ in string.Formatter().parse(template))
    except ValueError:
        return False


def entry_day(config: JobConfig, entry: Mapping[str, Any]) -> str | None:
    """The partition date of a run-index entry: recorded since this version (``date``), read
    back from its output for an older entry."""
    day = entry.get("date")
    return day if isinstance(day, str) else template_day(config.output, entry.get("output"))


def run_day(config: JobConfig) -> str | None:
    """The partition date this run writes (``--date``), for a ``{date}`` template; else None."""
    return config.run_date if has_field(config.output, "date") else None


@dataclass
class _Acceptances:
    """The drift acceptances recorded in the job's run index: ``(dataset, baseline)`` pairs,
    and the datasets (for entries from before the baseline was recorded with them)."""

    pairs: set[tuple[Any, Any]] = field(default_factory=set)
    datasets: set[Any] = field(default_factory=set)

    @classmethod
    def read(cls, config: JobConfig, index_root: str) -> _Acceptances:
        found = cls()
        for entry in runindex.acceptances(index_root, config.storage, config.name):
            found.pairs.add((entry.get("dataset"), entry.get("baseline")))
            found.datasets.add(entry.get("dataset"))
        return found

    def settled(self, entry: Mapping[str, Any]) -> bool:
        """Whether the run-index entry's verdict was clean or its drift alert accepted (then,
        or since, with ``accept-drift``): only such a dataset is a baseline."""
        verdict = entry.get("verdict")
        accepted = isinstance(verdict, Mapping) and bool(verdict.get("accepted"))
        if "drift_alert" in entry:
            alert = bool(entry["drift_alert"])
            pair = (entry.get("dataset"), entry.get("drift_baseline"))
            return not alert or accepted or pair in self.pairs
        # Recorded before the alert was: a drift alert was the only way to this status.
        if entry.get("status") != RunStatus.SUCCEEDED_WITH_WARNINGS:
            return True
        return accepted or entry.get("dataset") in self.datasets


def _baseline(
    config: JobConfig,
    data: Mapping[str, Any],
    dataset: str,
    index_root: str,
    *,
    versioned: bool = False,
) -> dict[str, Any] | None:
    """The newest earlier dataset of the job whose verdict was clean or accepted.

    Never this dataset, never a run that scored no rows (it has no sample of its own), and
    never a dataset whose drift alert is open: a shift nobody accepted is no norm, so a shift
    that persists alerts every night until someone accepts it (and from then on that dataset is
    a baseline). With a ``{date}`` template "earlier" is by the partition's date, whatever the
    finish times: a day is compared with the days before it (the newest of them, and of that
    day its newest such dataset), never with itself or a later day, so rerunning a drifted day
    after the next days ran still compares it with the days before it. With ``{run_id}`` alone
    every run is an output of its own: the newest such run of the job. A job without
    placeholders is compared with its own output's previous such dataset."""
    output = data["output"]
    day = run_day(config)
    fixed = not has_placeholder(config.output)
    accepted = _Acceptances.read(config, index_root)

    def skip(entry: dict[str, Any]) -> bool:
        if entry.get("dataset") == dataset:
            return True
        if day is not None:
            before = entry_day(config, entry)
            if before is None or before >= day:
                return True
        elif fixed and entry.get("output") != output:
            return True  # another output (the job's output setting changed since)
        # An entry from before datasets were recorded, of this output, while this run scored
        # nothing: most likely this very dataset.
        if "dataset" not in entry and entry.get("output") == output and not data["rows_processed"]:
            return True
        return not accepted.settled(entry)

    def rank(entry: dict[str, Any]) -> str:
        # With a {date} template the newest day first, then the newest run of that day.
        return (entry_day(config, entry) or "") if day is not None else ""

    # A Delta table rolled back holds an older run's scores again (score-catalog rollback):
    # the runs it undid are no baseline, and what it restored counts as of the rollback's time.
    # A partition's rollback lists only that partition's runs and scores: the other
    # partitions' baselines stand.
    restores = runindex.rollbacks(index_root, config.storage, config.name)
    undone = {r for rec in restores for r in rec.get("rolled_back") or []}
    if versioned:
        # A table keeps its versions: a partition's new version is compared with the newest
        # clean or accepted version of the same partition (or, after a rollback, the one
        # restored); only a
        # partition's first version is compared with the days before it, as a folder is.
        previous = _newest(
            index_root,
            config,
            data,
            restores,
            # A version whose drift alert is open is no baseline here either (as for days):
            # else a rerun would be compared with the very scores it alerted on.
            lambda e: (
                e.get("dataset") == dataset or e.get("output") != output or not accepted.settled(e)
            ),
            undone,
        )
        if previous is not None:
            return previous
    return _newest(index_root, config, data, restores, skip, undone, rank)


def baseline_entry(
    config: JobConfig, run_id: str, output: str, index_root: str, *, versioned: bool = False
) -> dict[str, Any] | None:
    """The run-index entry a drift check of run ``run_id`` (writing ``output``) would compare
    it with, found before the run scores anything: an incremental night's baseline
    (docs/incremental.md). Raises where the run index cannot be read."""
    data = {"output": output, "run_id": run_id, "rows_processed": 1}
    return _baseline(config, data, "", index_root, versioned=versioned)


def _newest(
    index_root: str,
    config: JobConfig,
    data: Mapping[str, Any],
    restores: list[dict[str, Any]],
    skip: Callable[[dict[str, Any]], bool],
    undone: set[str],
    rank: Callable[[dict[str, Any]], str] | None = None,
) -> dict[str, Any] | None:
    """The newest successful run that scored rows, or dataset a rollback restored, that
    ``skip`` keeps; runs a rollback undid are never one. ``rank`` orders the runs before
    their finish time does (runindex.previous_success)."""
    found = runindex.previous_success(
        index_root,
        config.storage,
        config.name,
        exclude_run_id=data["run_id"],
        scored_only=True,
        skip=lambda e: e.get("run_id") in undone or skip(e),
        rank=rank,
    )
    restored = [e for e in _restored(restores, config.name) if not skip(e)]
    candidates = [e for e in (found, *restored) if e is not None]
    # Ranked as runindex.previous_success ranks the runs: a partition a rollback restored is
    # no newer *day* for having been restored lately (the rollback's time is its finish time).
    return max(
        candidates,
        key=lambda e: (rank(e) if rank is not None else "", runindex.finished_time(e)),
        default=None,
    )


def _restored(restores: list[dict[str, Any]], job: str) -> list[dict[str, Any]]:
    """What each rollback made a partition hold again, as a run index entry (its run's score
    sketches, finished when the rollback was made)."""
    out = []
    for rec in restores:
        for part in rec.get("partitions") or []:
            if not part.get("run_id") or not part.get("outputs"):
                continue  # the partition held nothing at that version
            out.append(
                {
                    "run_id": part["run_id"],
                    "job": job,
                    "status": "succeeded",
                    "output": part.get("output"),
                    "finished_at": rec.get("at"),
                    "rows_out": part.get("rows_out"),
                    "rows_processed": part.get("rows_out"),
                    "outputs": part["outputs"],
                    "dataset": f"restored:{rec.get('version')}:{part.get('output')}",
                    "restored_by": rec.get("version"),
                    **({"scorer": part["scorer"]} if isinstance(part.get("scorer"), dict) else {}),
                }
            )
    return out


def _compare(
    config: JobConfig,
    data: Mapping[str, Any],
    dataset: str,
    index_root: str,
    *,
    versioned: bool = False,
) -> tuple[dict[str, Any], bool]:
    """The drift section against the baseline, and whether the index could be read."""
    try:
        baseline = _baseline(config, data, dataset, index_root, versioned=versioned)
    except Exception as e:  # drift is a check on top of a finished run: never fail it
        logger.warning("could not read the run index at %s: %s", index_root, e)
        return {"baseline": None, "note": f"run index unreadable: {e}"}, False
    if baseline is None:
        day = run_day(config)
        earlier = f"before {day} " if day is not None else ""
        note = (
            f"no previous dataset of job {config.name!r} {earlier}with a clean or accepted "
            f"verdict in {index_root}/{runindex.INDEX_DIR}"
        )
        return {"baseline": None, "note": note}, True
    th = thresholds_of(config)
    thresholds = drift_mod.DriftThresholds(
        psi=th["psi"], ks=th["ks"], rows_change=th["rows_change"]
    )
    return dict(drift_mod.compare(baseline, data, thresholds)), True


def judge(
    config: JobConfig,
    data: Mapping[str, Any],
    manifest: Manifest,
    index_root: str,
    *,
    versioned: bool = False,
) -> Judgement:
    """The drift verdict on the dataset the output now holds (``manifest.shards``).

    Kept from the manifest when it judged this same dataset (with the same thresholds), else
    compared afresh with its baseline (:func:`_baseline`; ``versioned``: the output is a
    table's partition, which keeps its versions). An alert is open unless the run index
    records its acceptance (:func:`accept`).
    """
    if not config.monitoring.drift:
        return Judgement()
    dataset = dataset_id(str(data["output"]), manifest.shards)
    kept = _reusable(manifest.verdict, dataset, config)
    complete = True
    if kept is not None:
        assert manifest.verdict is not None
        drift = kept
        judged_by = str(manifest.verdict.get("run_id"))
        judged_at = str(manifest.verdict.get("judged_at"))
    else:
        drift, complete = _compare(config, data, dataset, index_root, versioned=versioned)
        judged_by, judged_at = str(data["run_id"]), str(data["finished_at"])
    record = {
        "version": RECORD_VERSION,
        "dataset": dataset,
        "run_id": judged_by,
        "judged_at": judged_at,
        "job": config.name,
        "index": index_root,
        "drift": drift,
        "complete": complete,
    }
    found = Judgement(drift=drift, record=record)
    accepted = None
    if drift.get("alert"):
        accepted = _accepted(config, index_root, dataset, drift)
        found.alert_open = accepted is None
    found.verdict = {
        "dataset": dataset,
        "judged_by": judged_by,
        "judged_at": judged_at,
        "reused": kept is not None,
        "accepted": accepted,
    }
    found.warnings = _warnings(drift, accepted)
    if kept is not None and drift.get("alert"):
        logger.warning(
            "the dataset is unchanged since run %s judged it: its drift verdict stands", judged_by
        )
    return found


def _accepted(
    config: JobConfig, index_root: str, dataset: str, drift: Mapping[str, Any]
) -> dict[str, Any] | None:
    """``{by, at, reason}`` of the acceptance of this alert in the run index, or None."""
    baseline = (drift.get("baseline") or {}).get("run_id")
    try:
        entry = runindex.acceptance(index_root, config.storage, config.name, dataset, baseline)
    except Exception as e:  # an unreadable index: the alert stays open
        logger.warning("could not read drift acceptances in the run index at %s: %s", index_root, e)
        return None
    if entry is None:
        return None
    return {
        "by": str(entry.get("by")),
        "at": str(entry.get("at")),
        "reason": str(entry.get("reason")),
    }


def _warnings(drift: Mapping[str, Any], accepted: Mapping[str, Any] | None) -> list[str]:
    """The report's drift warnings: each reason, or one line saying the drift was accepted."""
    reasons = [str(r) for r in drift.get("reasons") or []]
    if not reasons:
        return []
    if accepted is None:
        return [f"drift: {r}" for r in reasons]
    return [
        f"drift accepted by {accepted['by']} at {accepted['at']}: {accepted['reason']!r} "
        f"({'; '.join(reasons)})"
    ]


def open_alert(config: JobConfig, report: Mapping[str, Any]) -> bool:
    """Whether a finished run's report (of a day a backfill skips as done) ended on a drift
    alert that nobody has accepted since: that day's verdict still stands (exit 4)."""
    if report.get("status") != "succeeded_with_warnings":
        return False
    verdict, drift = report.get("verdict"), report.get("drift")
    if not isinstance(verdict, Mapping) or not isinstance(drift, Mapping):
        return True  # written before verdicts were kept: its status is all there is
    index_root = runindex.index_root(config.output)
    return _accepted(config, index_root, str(verdict.get("dataset")), drift) is None


# -- score-catalog accept-drift ----------------------------------------------------------------


def default_actor() -> str:
    """``user@host`` of whoever runs the command."""
    try:
        user = getpass.getuser()
    except Exception:  # no login name (a container without /etc/passwd entry)
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def accept(
    output: str, reason: str, *, by: str | None = None, options: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Record in the run index that the drift alert of the dataset ``output`` holds is accepted.

    Reads the verdict kept with the output's manifest; refuses (:class:`UsageError`, exit 2) an
    output without one, or whose verdict has no alert. Returns the acceptance entry (with
    ``uri``, where it was recorded). The output itself is not touched: the next run over the
    same dataset reports the acceptance and ends ``succeeded``.
    """
    if not reason.strip():
        raise UsageError(
            "--reason must say why the drift is accepted (it is kept in the run index)"
        )
    out = storage.locate(output, options)
    # The template is not known here: the manifest is found where ``report OUT`` finds reports
    # (the control area beside the template's root, or an older layout's place).
    found = layout.find(out, MANIFEST_NAME)
    kept = (
        Manifest.load(storage.sibling(out, found.uri.rsplit("/", 1)[0])).verdict if found else None
    )
    if not kept or kept.get("version") != RECORD_VERSION or not isinstance(kept.get("drift"), dict):
        raise UsageError(
            f"no drift verdict for {out.uri}: give the output folder of a run that finished "
            "(a run of this version keeps its verdict with the manifest)"
        )
    drift = kept["drift"]
    if not drift.get("alert"):
        raise UsageError(
            f"the dataset in {out.uri} has no drift alert to accept (judged by run "
            f"{kept.get('run_id')})"
        )
    entry = {
        "event": "drift_accepted",
        "job": kept.get("job"),
        "output": out.uri,
        "dataset": kept.get("dataset"),
        "baseline": (drift.get("baseline") or {}).get("run_id"),
        "judged_by": kept.get("run_id"),
        "reasons": list(drift.get("reasons") or []),
        "by": by or default_actor(),
        "at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "reason": reason.strip(),
    }
    entry["uri"] = runindex.record_acceptance(
        str(kept.get("index")), options, str(kept.get("job")), entry
    )
    return entry
