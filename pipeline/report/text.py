"""A run's report for people: the summary cron mails (:func:`summary_table`), the one line of
``-q`` (:func:`problem_line`), two runs side by side (:func:`diff_table`), and reading a report
back from storage (:func:`load_report`, for ``score-catalog report``). Imports no torch."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from pipeline.core import templates
from pipeline.core.errors import UsageError
from pipeline.core.statuses import FailureKind
from pipeline.io import layout, runindex, storage
from pipeline.io.layout import HTML_NAME, REPORT_NAME
from pipeline.report import drift as drift_mod
from pipeline.report.build import NOT_SCORED_KINDS, RunReport


def _fmt_int(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


MAX_LISTED = 10  # failed shards, removals and warnings shown before "... N more"


def why_lines(d: Mapping[str, Any], *, max_listed: int = MAX_LISTED) -> list[str]:
    """Why a run did not simply succeed, for the top of its summary: the failure reasons, the
    failed shards with their kind and message (shards never scored because the run stopped are
    counted by kind, not listed) and the other errors (accounting). Empty for a clean run."""
    lines = [f"  reason    {r}" for r in d.get("failure_reasons") or []]
    errors = list(d.get("errors") or [])
    listed = _grouped_errors(d, [e for e in errors if e.get("kind") not in NOT_SCORED_KINDS])
    for i, text in enumerate(listed[:max_listed]):
        head = "  failed   " if i == 0 else "           "
        lines.append(f"{head} {text}")
    if len(listed) > max_listed:
        lines.append(f"            ... {len(listed) - max_listed} more in {REPORT_NAME}")
    for kind in (FailureKind.INTERRUPTED, FailureKind.CANCELLED):
        n = sum(1 for e in errors if e.get("kind") == kind)
        if n:
            lines.append(
                f"  {kind:<9} {n} shard{'s' if n != 1 else ''} not scored"
                + (" (a rerun resumes them)" if kind == FailureKind.INTERRUPTED else "")
            )
    return lines


def problem_line(d: Mapping[str, Any], control: str | None = None) -> str:
    """A run that did not succeed cleanly, in one line (what ``-q`` prints instead of the
    summary): its status, why, and where its report is (``control``: its folder, as
    :attr:`RunReport.control`; by default where an output without placeholders keeps it)."""
    why = list(d.get("failure_reasons") or []) or list(d.get("warnings") or [])
    text = f"run {d.get('run_id')} {d.get('status')}"
    if why:
        text += ": " + "; ".join(why[:3]) + (f" (and {len(why) - 3} more)" if len(why) > 3 else "")
    return f"{text} (report: {control_uri(d, control)}/{REPORT_NAME})"


def control_uri(d: Mapping[str, Any], control: str | None = None) -> str:
    """The folder of a run's ``_report.json``, ``_report.html`` and manifest: ``control`` (as
    :attr:`RunReport.control`) when known, else where an output without placeholders keeps it
    (:func:`pipeline.io.layout.beside`; the output itself at a bucket root)."""
    if control is None:
        out = str(d.get("output"))
        control = templates.beside(out, layout.CONTROL_DIR) or out
    return control.rstrip("/")


def _grouped_errors(d: Mapping[str, Any], errors: list[dict[str, Any]]) -> list[str]:
    """``[kind] message`` per error; shards failing with the same message (once its shard is
    taken out) are one line naming a few of them, not one line each."""
    rel = {s.get("input"): s.get("rel_path") for s in d.get("shards") or []}
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for e in errors:
        shard, message = str(e.get("shard")), str(e.get("message"))
        general = message.replace(f"shard {shard}: ", "").replace(shard, "<shard>")
        groups.setdefault((str(e.get("kind")), general), []).append(e)
    out = []
    for (kind, general), group in groups.items():
        if len(group) == 1:
            out.append(f"[{kind}] {group[0].get('message')}")
            continue
        names = [str(rel.get(e.get("shard")) or e.get("shard")) for e in group]
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        out.append(f"[{kind}] {len(group)} shards ({', '.join(names[:3])}{more}): {general}")
    return out


def _table_lines(d: Mapping[str, Any]) -> list[str]:
    """``table`` under ``output`` for a table: the line its sink wrote into the report's
    ``output_format`` (``summary``: its version after the run, the partition, whether this run
    committed it); none for a Parquet folder."""
    fmt = d.get("output_format") or {}
    summary = fmt.get("summary")
    return [f"  table     {summary}"] if summary else []


def incremental_line(d: Mapping[str, Any]) -> str | None:
    """What an incremental night did, in one line (None when the run is not incremental):
    rows carried from the baseline and through the model, or why every row was scored."""
    inc = d.get("incremental")
    if not inc:
        return None
    scored = f"{inc['rows_scored']:,} through the model"
    kept = f", {inc['rows_kept']:,} kept from an earlier run" if inc.get("rows_kept") else ""
    base = inc.get("baseline")
    if not base:
        return f"{scored}{kept}: every row scored, {inc.get('full_reason') or 'no baseline'}"
    night = base.get("date") or base.get("output")
    version = f", version {base['version']}" if base.get("version") is not None else ""
    removed = inc.get("rows_removed")
    gone = f", {removed:,} ids gone since" if removed else ""
    return (
        f"{inc['rows_carried']:,} carried from run {base.get('run_id')} ({night}{version}), "
        f"{scored} ({inc['rows_new']:,} new, {inc['rows_changed']:,} changed){kept}{gone}"
    )


def summary_table(report: RunReport, *, max_shards: int = 20) -> str:
    """A short human summary of the run for the terminal (and cron's mail).

    For a run that failed, was interrupted or lost shards or rows within its budget, why comes
    first (:func:`why_lines`), right under the status line: cron's mail is read from the top.
    """
    d = report.data
    lines = [f"score-catalog run {d['run_id']}: {str(d['status']).upper()}", *why_lines(d)]
    lines += [
        f"  job       {d['job']}",
        f"  model     {d['model']['name']} v{d['model']['version']} ({d['model']['sha256'][:12]}) "
        f"on {d['device']}, batch {d['batch_size']}",
        f"  output    {d['output']}",
        *_table_lines(d),
        f"  report    {control_uri(d, report.control)}/{HTML_NAME}",
        f"  shards    {d['shards_total']} total: {d['shards_scored']} scored, "
        f"{d['shards_skipped']} skipped (already done), {d['shards_failed']} failed"
        + (f", {d['shards_not_scored']} not scored" if d.get("shards_not_scored") else ""),
        f"  rows      {_fmt_int(d['rows_in'])} in, {_fmt_int(d['rows_out'])} scored, "
        f"{_fmt_int(d['rows_rejected'])} rejected",
    ]
    if d.get("rows_rejected") and d.get("rejects"):
        # Only where there are some: rejects are written for the shards that had any, so a
        # clean night's folder does not exist, and its summary stays as short as before.
        lines.append(f"  rejects   {d['rejects']}")
    if d["rows_processed"]:
        speed = (
            f"{d['rows_per_s']:,.0f} rows/s over {d['rows_processed']:,} rows scored in "
            f"{d['duration_s']:.1f}s"
        )
    else:  # a rerun over a finished output, say: no speed to speak of, not "0 rows/s"
        speed = f"nothing scored in this run ({d['duration_s']:.1f}s)"
        if d["shards_skipped"]:
            speed += f": {d['shards_skipped']} shard(s) already done"
    lines.append(f"  speed     {speed}")
    night = incremental_line(d)
    if night is not None:
        lines.append(f"  changed   {night}")
    reg = d["model"].get("registry")
    if reg:
        alias = f" (alias {reg['alias']})" if reg["alias"] else ""
        lines.insert(3, f"  registry  models:/{reg['name']}/{reg['version']}{alias}")
    lat = d["batch_latency_ms"]
    if lat["p50"] is not None:
        lines.append(
            f"  batch ms  p50 {lat['p50']:.2f}  p95 {lat['p95']:.2f}  p99 {lat['p99']:.2f}"
        )
    verdict = d.get("verdict") or {}
    if verdict.get("reused") and (d.get("drift") or {}).get("alert"):
        lines.append(
            f"  drift     the verdict of run {verdict['judged_by']}: the data is unchanged since"
        )
    lines += _shard_lines(d["shards"], max_shards)
    for warning in d.get("warnings", []):
        lines.append(f"  WARNING {warning}")
    removed = d.get("removed_outputs", [])
    for r in removed[:MAX_LISTED]:
        lines.append(f"  REMOVED {r['output']}: {r['reason']}")
    if len(removed) > MAX_LISTED:
        lines.append(f"  ... {len(removed) - MAX_LISTED} more removals in {REPORT_NAME}")
    return "\n".join(lines)


def _shard_lines(shards: list[dict[str, Any]], max_shards: int) -> list[str]:
    """The per-shard table (the first ``max_shards`` shards)."""
    if not shards:
        return []
    w = max(len("shard"), *(len(s["rel_path"]) for s in shards[:max_shards]))
    lines = [
        "",
        f"  {'shard':<{w}}  {'status':<8} {'rows in':>10} {'scored':>10} "
        f"{'rejected':>9} {'rows/s':>11}",
    ]
    for s in shards[:max_shards]:
        rate = f"{s['rows_per_s']:,.0f}" if s["status"] == "scored" else "-"
        # A shard the run never got to is not a failure of its data (shards_not_scored).
        status = "not scored" if s.get("kind") in NOT_SCORED_KINDS else s["status"]
        lines.append(
            f"  {s['rel_path']:<{w}}  {status:<8} {_fmt_int(s['rows_in']):>10} "
            f"{_fmt_int(s['rows_out']):>10} {_fmt_int(s['rows_rejected']):>9} {rate:>11}"
        )
    if len(shards) > max_shards:
        lines.append(f"  ... {len(shards) - max_shards} more shards in {REPORT_NAME}")
    return lines


def rolled_back_by(
    data: Mapping[str, Any], options: Mapping[str, Any] | None = None
) -> dict[str, Any] | None:
    """The rollback that undid this run's table commit (``score-catalog rollback``, recorded in
    the run index beside the table), or None: the run's report still describes its run, and
    without this line a reader of the report would take rows the table no longer holds as
    served. None for a Parquet folder, or when the index cannot be read. ``report`` asks the
    table's history first (pipeline.driver.tables.run_rolled_back, as ``history`` decides:
    a record stays after a later rollback serves the run again); this is its answer where
    the table cannot be read."""
    fmt = data.get("output_format")
    if not isinstance(fmt, Mapping) or not fmt.get("table"):
        return None
    try:
        records = runindex.rollbacks(
            runindex.index_root(str(fmt["table"])), options, str(data.get("job"))
        )
    except Exception:  # a hint on top of the report: never the reason it cannot be shown
        return None
    undone = [r for r in records if data.get("run_id") in (r.get("rolled_back") or [])]
    return min(undone, key=lambda r: str(r.get("at")), default=None)


def rolled_back_line(record: Mapping[str, Any]) -> str:
    """The line :func:`summary_table`'s caller puts first for a run a rollback undid."""
    # A partition's rollback names it: the table's other partitions still serve their runs.
    of = f" of partition {record['partition']}" if record.get("partition") else ""
    return (
        f"ROLLED BACK: rollback{of} to version {record.get('to_version')} (table version "
        f"{record.get('version')}, {record.get('at')}, by {record.get('by')}: "
        f"{record.get('reason')!r}) undid this run; the table no longer serves its rows "
        f"(score-catalog history {record.get('table')})"
    )


def load_report(uri: str, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``_report.json`` of a run: ``uri`` is its output root, its control folder or the
    report file itself.

    Nothing there, or something that is not a run report, is a :class:`UsageError` (exit 2)
    saying what to give instead.
    """
    return find_report(uri, options).data


def find_report(uri: str, options: Mapping[str, Any] | None = None) -> RunReport:
    """:func:`load_report`, with the folder it was found in as the report's ``control`` (where
    its ``_report.html`` is too), so that what is printed names the real place."""
    given = storage.locate(uri, options)
    hint = (
        f"give a run's output root (its {REPORT_NAME} is in the control folder beside the "
        "output template's fixed part, e.g. data/_score_catalog/scored/run_date=X/ for "
        "data/scored/run_date=X, written when a run ends) or the report file"
    )
    where = ""
    try:
        loc = given
        if not given.path.endswith(".json"):
            # The output's control folder (pipeline.io.layout: beside its template's root, which
            # is the output itself or a folder above it), an older layout's, or the control
            # folder given directly.
            loc = layout.find(given, REPORT_NAME) or given.child(REPORT_NAME)
        data = storage.read_json(loc)
    except NotADirectoryError:
        loc, data, where = given, None, "is a file, not a run's output folder"
    except IsADirectoryError:
        loc, data, where = given, None, "is a folder, not a report file"
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{loc.uri} is not a run report (not JSON: {e}); {hint}") from e
    if data is None:
        if not where:
            where = "does not exist" if not storage.exists(given) else f"has no {REPORT_NAME}"
        raise UsageError(f"no run report at {given.uri}: it {where}; {hint}")
    if not isinstance(data, dict) or "run_id" not in data:
        raise UsageError(f"{loc.uri} is not a run report (no run_id); {hint}")
    return RunReport(data, control=loc.uri.rsplit("/", 1)[0])


def _num(v: Any, fmt: str = ",.0f") -> str:
    return "-" if v is None else format(v, fmt)


#: Beyond this many times the other run's value, ``report --vs`` prints a capped ratio.
MAX_RATIO = 1_000_000


def change(now: Any, then: Any, fmt: str = ",.0f", *, relative: bool = True) -> str:
    """How ``now`` differs from ``then`` in the ``change`` column of ``report --vs``.

    ``relative`` (counts, rates, durations, which are never negative): a percentage of ``then``
    up to +999.9%, then a ratio (``12x``, at most ``>1,000,000x``); where ``then`` is 0 (no rows
    rejected in the other run) the plain difference (``+250``): no percentage of nothing means
    anything. Otherwise (score quantiles) the difference on the score's own scale
    (``+0.0123``): a score's relative change is noise near 0, where a p05 of 2e-16 against 0.08
    printed ``+402501073323306.0%``. ``-`` when either side is missing or not finite.
    """
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (now, then)):
        return "-"
    if not relative or then <= 0 or now < 0:
        return format(now - then, "+" + fmt)
    ratio = now / then
    if ratio > MAX_RATIO:
        return f">{MAX_RATIO:,}x"
    if ratio - 1 >= 10:  # +1000% and more reads better as "11x"
        return f"{ratio:,.0f}x"
    return f"{(ratio - 1) * 100:+.1f}%"


def diff_table(current: dict[str, Any], other: dict[str, Any]) -> str:
    """Two runs side by side: counts, throughput, score quantiles and drift of ``current``."""
    a, b = current, other
    lines = [
        f"score-catalog report: {a['run_id']} vs {b['run_id']}",
        f"  {'':<22} {'this run':>22} {'other run':>22} {'change':>10}",
    ]

    def row(label: str, x: Any, y: Any, fmt: str = ",.0f", *, relative: bool = True) -> None:
        diff = change(x, y, fmt, relative=relative)
        lines.append(f"  {label:<22} {_num(x, fmt):>22} {_num(y, fmt):>22} {diff:>10}")

    lines.append(f"  {'status':<22} {a.get('status', '-'):>22} {b.get('status', '-'):>22}")
    lines.append(
        f"  {'model':<22} {str((a.get('model') or {}).get('sha256', '-'))[:12]:>22} "
        f"{str((b.get('model') or {}).get('sha256', '-'))[:12]:>22}"
    )
    for key in ("rows_in", "rows_out", "rows_rejected", "shards_total", "shards_failed"):
        row(key, a.get(key), b.get(key))
    row("rows_per_s", a.get("rows_per_s"), b.get("rows_per_s"))
    row("duration_s", a.get("duration_s"), b.get("duration_s"), ",.1f")
    cols = sorted(set(a.get("outputs") or {}) | set(b.get("outputs") or {}))
    for col in cols:
        qa = ((a.get("outputs") or {}).get(col) or {}).get("quantiles") or {}
        qb = ((b.get("outputs") or {}).get(col) or {}).get("quantiles") or {}
        for q in ("p05", "p50", "p95"):
            row(f"{col} {q}", qa.get(q), qb.get(q), ".4f", relative=False)
    d = drift_mod.compare(b, a, drift_mod.DriftThresholds())
    lines.append("")
    lines.append(f"  drift of this run against the other (default thresholds {d['thresholds']}):")
    for col, c in d["columns"].items():
        flag = "  ALERT" if c["alert"] else ""
        lines.append(
            f"    {col:<20} PSI {_num(c['psi'], '.4f'):>8}  KS {_num(c['ks'], '.4f'):>8}{flag}"
        )
    for reason in d["reasons"]:
        lines.append(f"    - {reason}")
    return "\n".join(lines)
