"""The FORMATS bench (issue 32): W1 written as a Parquet folder, a Delta table and an Iceberg
table side by side, and what a table's history costs a night. ``python -m bench.formats``
(``make bench-formats``; ``FORMATS_ARGS="--smoke"`` for a small development run).

1. **Nights.** The same input, model and flags through the CLI with ``--format parquet``,
   ``delta`` and ``iceberg`` into ``scored/run_date={date}`` (the nightly job's shape), whole
   processes, interleaved (folder, delta, iceberg, folder, ...). Night 0 makes each output (a
   table's creation; untimed, its wall noted); round r is night r, a new partition, as a nightly
   job writes one. Per round: each format's wall time, the ratios delta/folder and
   iceberg/folder, and the run report's ``output_format.commit_s`` (the commit, which comes
   after the report's ``duration_s``); then the medians of each column.
2. **History.** For Delta and Iceberg: a backfill of N nights (16 small shards a night, as W1
   has 16: a commit costs per file and per snapshot, not per row), each night's ``commit_s``
   read from its report; then, alternating, a forced rescore of night 1 with W1's input on the
   N-night table (``run --date <night 1> --force``): its wall and ``commit_s``, beside night 1's
   and night N's commits.

The section it prints (and writes to ``--output``) is ready to paste into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

from bench import report, workloads
from bench.mdtable import Column, markdown_table
from bench.procs import run_measured
from bench.stats import Sample
from bench.suites import (
    BATCH,
    RUN_TIMEOUT_S,
    Comparator,
    Runner,
    WorkloadResult,
    clear_output,
    score_digest,
)

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / ".bench"
FORMATS = ("parquet", "delta", "iceberg")
TABLES = ("delta", "iceberg")
FIRST = dt.date(2026, 1, 1)
#: Shards of each history night: W1's count, so that each night commits as many files.
HISTORY_SHARDS = 16


@dataclass(frozen=True)
class Plan:
    """What one invocation measures."""

    rows: int
    shards: int
    rounds: int
    days: int
    history_rows: int
    smoke: bool


def _parse(argv: Sequence[str]) -> tuple[Plan, str]:
    p = argparse.ArgumentParser(prog="python -m bench.formats", description=__doc__)
    p.add_argument("--rounds", type=int, help="rounds of each comparator (default 5; smoke 1)")
    p.add_argument("--days", type=int, help="nights of history before the rescore (default 30)")
    p.add_argument("--rows", type=int, help="W1 rows (default 2,000,000; smoke 100,000)")
    p.add_argument("--shards", type=int, default=16, help="W1 shards (default 16)")
    p.add_argument(
        "--smoke", action="store_true", help="a small size to check the bench, not to measure"
    )
    p.add_argument("--output", default="BENCHMARKS_FORMATS.md", help="relative to the repo")
    a = p.parse_args(argv)
    plan = Plan(
        rows=a.rows or (100_000 if a.smoke else 2_000_000),
        shards=a.shards,
        rounds=a.rounds or (1 if a.smoke else 5),
        days=a.days or (3 if a.smoke else 30),
        history_rows=HISTORY_SHARDS * (256 if a.smoke else 4096),
        smoke=a.smoke,
    )
    if min(plan.rounds, plan.days, plan.rows, plan.shards) < 1:
        p.error("--rounds, --days, --rows and --shards must be >= 1")
    return plan, a.output


def day(k: int) -> str:
    """Night ``k`` (0-based): the value of ``{date}``."""
    return (FIRST + dt.timedelta(days=k)).isoformat()


def report_path(table: Path, date: str) -> Path:
    """The ``_report.json`` of the night ``date`` of the output template ``table/run_date=``."""
    return table.parent / "_score_catalog" / table.name / f"run_date={date}" / "_report.json"


def _cli(runner: Runner, data: Path, table: Path, model: Path, fmt: str, night: int) -> list[str]:
    flags = ("--format", fmt, "--date", day(night))
    return runner.cli_argv(data, table / "run_date={date}", model, BATCH, extra=flags)


def _loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in psutil.getloadavg())


def nights(runner: Runner, data: Path, model: Path, plan: Plan) -> WorkloadResult:
    """Part 1: W1 in each format, interleaved: night 0 makes each output (its table), untimed;
    round r is night r, a new partition of it, as a nightly job writes one."""
    tables = {fmt: runner.out_dir("formats", fmt) / "scored" for fmt in FORMATS}
    comps = {
        fmt: Comparator(
            f"cli-{fmt}",
            f"score-catalog CLI, --format {fmt}",
            "Dask LocalCluster",
            BATCH,
            [],
            "cli",
            plan.rows,
        )
        for fmt in FORMATS
    }
    title = "FORMATS: W1 as a folder, a Delta and an Iceberg table"
    wl = WorkloadResult("FORMATS", title, [], list(comps.values()))
    first = WorkloadResult("FIRST", "night 0", [], [])
    wl.load_before = _loadavg()
    for night in range(plan.rounds + 1):
        runner.log(
            f"[FORMATS] night {night} of {plan.rounds}" + (" (untimed)" if not night else "")
        )
        for fmt, comp in comps.items():
            if not night:
                clear_output(tables[fmt])
            comp.argv = _cli(runner, data, tables[fmt], model, fmt, night)
            comp.report = report_path(tables[fmt], day(night))
            runner.run_one(first if not night else wl, comp, night - 1)
    wl.load_after = _loadavg()
    wl.meta["first"] = {k: v[0].wall_s for k, v in first.samples.items()}
    wl.failures.update({f"{k} (night 0)": v for k, v in first.failures.items()})
    digests = {fmt: json_key(score_digest(t / f"run_date={day(1)}")) for fmt, t in tables.items()}
    wl.checks.append(
        f"night 1 holds the same rows, ids and score sum in the {len(FORMATS)} formats: "
        + ("yes" if len(set(digests.values())) == 1 else f"NO: {digests}")
    )
    return wl


def json_key(d: Mapping[str, Any]) -> str:
    """A digest as one comparable string."""
    return repr(sorted(d.items()))


def _history_input(plan: Plan) -> Path:
    """``dt=<night>/`` folders, each a link to the same small catalog of 16 shards."""
    src = workloads.catalog(
        ROOT / "data" / f"formats-history-{plan.history_rows}",
        rows=plan.history_rows,
        shards=HISTORY_SHARDS,
    )
    days = ROOT / "data" / f"formats-days-{plan.history_rows}"
    for k in range(plan.days):
        link = days / f"dt={day(k)}"
        if not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(src, target_is_directory=True)
    return days


def _backfill(runner: Runner, days: Path, model: Path, fmt: str, plan: Plan) -> dict[str, Any]:
    """N nights into a new ``fmt`` table by one ``score-catalog backfill``: each night's
    ``commit_s``, the backfill's wall, and the table's metadata after it."""
    table = runner.out_dir("history", fmt) / "scored"
    clear_output(table)
    job = table.parent / "history.toml"
    job.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        f'input = "{days}/dt={{date}}"',
        f'output = "{table}/run_date={{date}}"',
        f'model = "{model}"',
        f'format = "{fmt}"',
        f"batch_size = {BATCH}",
        'scheduler = "local"',
        # The rescore's W1 input is 24-30x a history night's rows: a drift alert, not a cost.
        "[monitoring]",
        "drift = false",
    ]
    job.write_text("\n".join(lines) + "\n")
    argv = [runner.cli, "backfill", str(job), "--from", day(0), "--to", day(plan.days - 1)]
    log = ROOT / "logs" / "FORMATS" / f"backfill-{fmt}.log"
    pr = run_measured(argv, log_path=log, cwd=REPO, timeout_s=RUN_TIMEOUT_S * plan.days)
    if pr.returncode != 0:
        raise RuntimeError(f"backfill of {fmt} failed (exit {pr.returncode}): {pr.log_tail()}")
    commits = [_commit_s(report_path(table, day(k))) for k in range(plan.days)]
    meta = table / ("_delta_log" if fmt == "delta" else "metadata")
    files = [p for p in meta.rglob("*") if p.is_file()]
    return {
        "job": job,
        "table": table,
        "wall_s": pr.wall_s,
        "commit_s": commits,
        "metadata_files": len(files),
        "metadata_bytes": sum(p.stat().st_size for p in files),
        # The newest metadata file: Iceberg's (each commit reads and rewrites it whole, and it
        # lists every snapshot) against Delta's (one version's actions).
        "newest_bytes": _newest(files).stat().st_size,
    }


def _newest(files: Sequence[Path]) -> Path:
    # Both number their JSON files, zero-padded: 00031-<uuid>.metadata.json, 000...031.json.
    return max((p for p in files if p.suffix == ".json"), key=lambda p: p.name)


def _commit_s(path: Path) -> float | None:
    value = (json.loads(path.read_text()).get("output_format") or {}).get("commit_s")
    return None if value is None else float(value)


#: The rescore's flags: night 1 again, though it is done.
_night_one = ("--date", day(0), "--force")


def history(runner: Runner, data: Path, model: Path, plan: Plan) -> WorkloadResult:
    """Part 2: N nights of history per table format, then night 1 rescored with W1's input."""
    days = _history_input(plan)
    built, failures = {}, {}
    for fmt in TABLES:
        runner.log(f"[HISTORY] {plan.days} nights into a {fmt} table ...")
        try:
            built[fmt] = _backfill(runner, days, model, fmt, plan)
        except (RuntimeError, OSError, ValueError, KeyError) as e:
            failures[f"backfill-{fmt}"] = [str(e)]
    comps = [
        Comparator(
            f"rescore-{fmt}",
            f"night 1 rescored with W1 (--force) after {plan.days} nights, --format {fmt}",
            "Dask LocalCluster",
            BATCH,
            # The history's own job (an output belongs to one job), W1's shards as its input.
            [runner.cli, "run", str(built[fmt]["job"]), "--input", str(data), *_night_one],
            "cli",
            plan.rows,
            report=report_path(built[fmt]["table"], day(0)),
        )
        for fmt in built
    ]
    wl = WorkloadResult("HISTORY", "a table's history", [], comps, meta={"built": built})
    wl.failures.update(failures)
    runner.run_alternating(wl, plan.rounds)
    return wl


# ---------------------------------------------------------------------------------------------
# The section
# ---------------------------------------------------------------------------------------------


def _median(values: Sequence[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def round_rows(samples: Mapping[str, Sequence[Sample]], rounds: int) -> list[dict[str, Any]]:
    """One row per round (each format's wall and commit seconds, the ratios to the folder),
    then the row of medians (of each column, the ratios' included)."""
    rows: list[dict[str, Any]] = []
    for r in range(1, rounds + 1):
        row: dict[str, Any] = {"round": str(r)}
        for fmt in FORMATS:
            got = [s for s in samples.get(f"cli-{fmt}", []) if s.extra.get("round") == r]
            row[fmt] = got[0].wall_s if got else None
            row[f"{fmt}_commit"] = got[0].extra.get("commit_s") if got else None
        for fmt in TABLES:
            a, b = row[fmt], row["parquet"]
            row[f"{fmt}_ratio"] = a / b if a is not None and b else None
        rows.append(row)
    keys = [k for k in rows[0] if k != "round"] if rows else []
    rows.append({"round": "**median**", **{k: _median([r[k] for r in rows]) for k in keys}})
    return rows


def _num(digits: int, suffix: str = "") -> Callable[[Any], str]:
    return lambda v: "—" if v is None else f"{v:.{digits}f}{suffix}"


NIGHT_COLUMNS = [
    Column("round", "round"),
    Column("folder wall s", "parquet", _num(2), right=True),
    Column("delta wall s", "delta", _num(2), right=True),
    Column("iceberg wall s", "iceberg", _num(2), right=True),
    Column("delta / folder", "delta_ratio", _num(3, "x"), right=True),
    Column("iceberg / folder", "iceberg_ratio", _num(3, "x"), right=True),
    Column("delta commit s", "delta_commit", _num(3), right=True),
    Column("iceberg commit s", "iceberg_commit", _num(3), right=True),
]


#: The phases of a CLI run (bench.suites.cli_phases), in order.
PHASES = ("start-up", "planning", "scoring", "finish", "exit")


def phase_rows(samples: Mapping[str, Sequence[Sample]]) -> list[dict[str, Any]]:
    """Where each format's wall went: the median of each phase over the rounds."""
    rows = []
    for fmt in FORMATS:
        got = samples.get(f"cli-{fmt}", [])
        row: dict[str, Any] = {
            "format": fmt,
            "commit": _median([s.extra.get("commit_s") for s in got]),
        }
        for phase in PHASES:
            row[phase] = _median([(s.extra.get("phases") or {}).get(phase) for s in got])
        rows.append(row)
    return rows


PHASE_COLUMNS = [
    Column("format", "format"),
    *(Column(f"{p} s", p, _num(2), right=True) for p in PHASES),
    Column("of which commit s", "commit", _num(3), right=True),
]


def history_rows(wl: WorkloadResult) -> list[dict[str, Any]]:
    """One row per table format: its commit on night 1 and night N, the rescore's."""
    rows = []
    for fmt in TABLES:
        built = wl.meta["built"].get(fmt)
        if built is None:  # its backfill failed: the section lists why
            continue
        samples = wl.samples.get(f"rescore-{fmt}", [])
        commits = built["commit_s"]
        rows.append(
            {
                "format": fmt,
                "first": commits[0],
                "last": commits[-1],
                # One night is one sample: the first three and last three, beside them.
                "head": _median(commits[:3]),
                "tail": _median(commits[-3:]),
                "rescore_commit": _median([s.extra.get("commit_s") for s in samples]),
                "rescore_wall": _median([s.wall_s for s in samples]),
                "meta": f"{built['metadata_files']:,} / {built['metadata_bytes'] / 2**10:,.0f}",
                "newest": built["newest_bytes"] / 2**10,
            }
        )
    return rows


def history_columns(days: int) -> list[Column]:
    """The history table's columns (night N named)."""
    return [
        Column("format", "format"),
        Column("commit s, night 1", "first", _num(3), right=True),
        Column(f"commit s, night {days}", "last", _num(3), right=True),
        Column("median, nights 1-3", "head", _num(3), right=True),
        Column(f"median, nights {max(1, days - 2)}-{days}", "tail", _num(3), right=True),
        Column(f"rescore of night 1 after {days}: commit s", "rescore_commit", _num(3), right=True),
        Column("its wall s", "rescore_wall", _num(2), right=True),
        Column(f"metadata files / KiB after {days}", "meta", right=True),
        Column("newest metadata file, KiB", "newest", _num(1), right=True),
    ]


def _rounds(n: int) -> str:
    return f"{n} round" + ("" if n == 1 else "s")


def _facts() -> list[str]:
    facts = report.machine_facts(REPO)
    keep = ("date (UTC)", "CPU", "SIMD flags", "cores (affinity / os.cpu_count)", "git commit")
    versions = {k: facts[k] for k in ("python", "pyarrow")}
    for pkg in ("deltalake", "pyiceberg"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = "not installed"
    return [
        *(f"- {k}: {facts[k]}" for k in keep),
        "- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
    ]


def section(
    plan: Plan, command: str, night: WorkloadResult, hist: WorkloadResult, minutes: float
) -> list[str]:
    """The Markdown section, headed for BENCHMARKS.md."""
    size = "SMOKE size: checks the bench, measures nothing" if plan.smoke else "measured"
    lines = [
        "## FORMATS: W1 as a Parquet folder, a Delta table and an Iceberg table",
        "",
        f"Generated by `{command}` ({size}) in {minutes:.1f} min.",
        "",
        *_facts(),
        "",
        f"W1: {plan.rows:,} rows in {plan.shards} shards, the W1 MLP, batch {BATCH}, "
        f"`--scheduler local`, into `scored/run_date={{date}}`; {_rounds(plan.rounds)} of whole "
        "processes, folder, Delta and Iceberg interleaved in each. Night 0 makes each output (a "
        "table's creation), untimed; round r writes night r, a new partition, as a nightly job "
        "does. Wall: the whole process. Commit: the run report's "
        "`output_format.commit_s` (the commit, after the report's `duration_s`; a folder has "
        "none: its files are published shard by shard).",
        "",
        *markdown_table(round_rows(night.samples, plan.rounds), NIGHT_COLUMNS),
        "",
        "Where the wall went (medians; `bench.suites.cli_phases`: start-up to the run's start, "
        "planning to the first shard, scoring to the last shard's end, finish to the report's "
        "`duration_s`, exit to the process's end: the commit, the report, `_SUCCESS`, the "
        "cluster's shutdown):",
        "",
        *markdown_table(phase_rows(night.samples), PHASE_COLUMNS),
        "",
        *(f"- {c}" for c in night.checks),
        "- night 0 (makes the output; one untimed run each, the first of the bench): "
        + ", ".join(f"{k.removeprefix('cli-')} {v:.2f} s" for k, v in night.meta["first"].items()),
        f"- load average before / after: {night.load_before} / {night.load_after}",
        *(f"- {k} failed: {'; '.join(v)}" for k, v in night.failures.items()),
        "",
        f"### A table's history: night 1 rescored after {plan.days} nights",
        "",
        f"Each table: {plan.days} nights by one `score-catalog backfill` (each night "
        f"{plan.history_rows:,} rows in {HISTORY_SHARDS} shards: a commit costs per file and "
        "per snapshot, not per row), then night 1 rescored with W1's input (`run --force`), "
        f"Delta and Iceberg alternating, {_rounds(plan.rounds)} (each rescore adds a version).",
        "",
        *markdown_table(history_rows(hist), history_columns(plan.days)),
        "",
        *(f"- {k} failed: {'; '.join(v)}" for k, v in hist.failures.items()),
        f"- load average before / after: {hist.load_before} / {hist.load_after}",
        "",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run both parts; returns the exit code (1 when a run failed or left a process)."""
    raw = sys.argv[1:] if argv is None else argv
    plan, output = _parse(raw)
    t0 = time.perf_counter()
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731 - progress on stderr
    data = workloads.catalog(
        ROOT / "data" / f"formats-w1-{plan.rows}-{plan.shards}", rows=plan.rows, shards=plan.shards
    )
    model = workloads.w1_bundle(ROOT / "models" / "w1-mlp", REPO)
    # The CLI's caches (program, chosen batch sizes) are the bench's own, as in bench.run.
    cache = ROOT / "cache-formats"
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    os.environ["XDG_CACHE_HOME"] = str(cache)
    runner = Runner(REPO, ROOT, log)
    night = nights(runner, data, model, plan)
    hist = history(runner, data, model, plan)
    command = "make bench-formats" + (f" FORMATS_ARGS={shlex.quote(' '.join(raw))}" if raw else "")
    text = "\n".join(section(plan, command, night, hist, (time.perf_counter() - t0) / 60))
    print(text)
    (REPO / output).write_text(text)
    log(f"wrote {output}")
    failed = night.failures or hist.failures or runner.leaks
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
