"""Issue 13: the text summary says why first; exit code and status agree; -q is errors only.

Real runs of the CLI on real Parquet shards (several row groups each): a run failed by its
rejected fraction, a run whose schema-skipped shard is beyond the budget, the same summaries
read back by ``score-catalog report``, and a run that drifted while rejecting rows within its
budget.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from pipeline.cli.demo import FEATURES
from pipeline.core.errors import EXIT_CODES_HELP, EXIT_DRIFT, EXIT_OK, EXIT_RUN_FAILED
from pipeline.core.statuses import RunStatus
from pipeline.report.build import EXIT_CODE_BY_STATUS, RunReport
from tests.integration.helpers import CliResult, cli, job_args, report, report_path

pytestmark = pytest.mark.integration


def _run(inp: Path, out: Path, bundle: Path, *extra: str) -> CliResult:
    return cli("run", *job_args(inp, out, bundle), "--scheduler", "sync", *extra, in_process=True)


def _null_features(path: Path, rows: int, column: str = "f2") -> None:
    """Null ``column`` in the first ``rows`` rows of a shard (those rows will be rejected)."""
    t = pq.read_table(path)
    values = t.column(column).to_pylist()
    values[:rows] = [None] * rows
    i = t.schema.get_field_index(column)
    pq.write_table(t.set_column(i, column, pa.array(values, pa.float32())), path, 300)


def _head(stdout: str) -> list[str]:
    """The summary's lines up to its ``job`` line: what cron's mail shows first."""
    lines = stdout.splitlines()
    end = next(i for i, line in enumerate(lines) if line.startswith("  job "))
    return lines[:end]


def test_a_run_failed_by_its_rejected_fraction_says_so_first(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    _null_features(catalog / "part-00001.parquet", 200)  # 200 of 7,300 rows: 2.7% > 1%
    out = tmp_path / "o"
    r = _run(catalog, out, bundle_dir)
    assert r.returncode == EXIT_RUN_FAILED, r.output
    rep = report(out)
    assert rep["status"] == "failed"
    head = _head(r.stdout)
    assert head[0].endswith(": FAILED")
    assert head[1] == f"  reason    {rep['failure_reasons'][0]}"
    assert "rejected fraction 0.0274 > errors.max_rejected_fraction = 0.01" in head[1]

    # The same summary, read back from the report.
    again = cli("report", str(out), in_process=True)
    assert again.returncode == 0, again.output
    assert _head(again.stdout) == head


def test_a_skipped_shard_beyond_the_budget_is_named_with_its_kind_and_message(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    p = catalog / "part-00001.parquet"
    pq.write_table(pq.read_table(p).drop_columns(["f3"]), p, row_group_size=500)
    out = tmp_path / "o"
    r = _run(catalog, out, bundle_dir, "--on-schema-error", "skip_shard")
    assert r.returncode == EXIT_RUN_FAILED, r.output
    head = _head(r.stdout)
    assert head[1] == "  reason    1 failed shards > errors.max_failed_shards = 0"
    assert head[2].startswith("  failed    [schema] ")
    assert str(p) in head[2] and "feature column 'f3' is missing" in head[2]
    # One warning says which shards are skipped and why, with the columns they do have.
    (warning,) = [line for line in r.stderr.splitlines() if "they are skipped" in line]
    assert "1 of 3 shards do not fit" in warning

    within = _run(
        catalog, tmp_path / "o2", bundle_dir, "--on-schema-error", "skip_shard",
        "--max-failed-shards", "1",
    )  # fmt: skip
    assert within.returncode == EXIT_OK, within.output
    head = _head(within.stdout)
    assert head[0].endswith(": SUCCEEDED_WITH_ERRORS")
    assert head[1].startswith("  failed    [schema] ")  # no reason: within the budget


def test_quiet_prints_no_summary_and_one_error_line_for_a_failed_run(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    ok = _run(catalog, tmp_path / "ok", bundle_dir, "-q")
    assert ok.returncode == 0, ok.output
    assert ok.stdout == "" and ok.stderr == ""

    _null_features(catalog / "part-00001.parquet", 200)
    bad = _run(catalog, tmp_path / "bad", bundle_dir, "-q")
    assert bad.returncode == EXIT_RUN_FAILED
    assert bad.stdout == ""
    (line,) = bad.stderr.splitlines()
    assert line.startswith("error: run ") and " failed: rejected fraction 0.0274 > " in line
    # The report it points to is where the report is: the control folder beside the output.
    assert f"(report: {report_path(tmp_path / 'bad')})" in line
    assert report_path(tmp_path / "bad").is_file()

    as_json = _run(catalog, tmp_path / "bad2", bundle_dir, "-q", "--log-format", "json")
    assert as_json.stdout == ""
    (rec,) = [json.loads(x) for x in as_json.stderr.splitlines()]
    assert rec["event"] == "error" and rec["exit_code"] == EXIT_RUN_FAILED
    assert rec["run_id"] == report(tmp_path / "bad2")["run_id"]


def test_the_exit_code_is_a_function_of_the_status() -> None:
    """One rule, as the README's table and --help say: 0 for both successes, 4 for drift
    (succeeded_with_warnings), 1 for failed, 143/130 for interrupted."""
    assert set(EXIT_CODE_BY_STATUS) | {RunStatus.INTERRUPTED} == set(RunStatus)
    for status, code in EXIT_CODE_BY_STATUS.items():
        assert RunReport({"status": status, "failure_reasons": []}).exit_code == code
        assert RunReport({"status": status, "drift": {"alert": True}}).exit_code == code
    assert EXIT_CODE_BY_STATUS[RunStatus.SUCCEEDED_WITH_WARNINGS] == EXIT_DRIFT
    assert "0 success (status succeeded or succeeded_with_errors" in EXIT_CODES_HELP
    assert "(status succeeded_with_warnings, whatever the rejects)" in EXIT_CODES_HELP


def test_drift_with_rejects_within_budget_is_a_warning_and_exit_4(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    """The case that gave exit 4 with status succeeded_with_errors: drift now wins."""
    root = tmp_path / "scored"
    first = cli(
        "run", *job_args(catalog, root / "{date}", bundle_dir), "--date", "2026-11-01",
        "--scheduler", "sync", in_process=True,
    )  # fmt: skip
    assert first.returncode == 0, first.output
    shifted = tmp_path / "shifted"
    shifted.mkdir()
    for p in sorted(catalog.glob("*.parquet")):
        t = pq.read_table(p)
        for name in FEATURES:
            i = t.schema.get_field_index(name)
            t = t.set_column(i, name, pc.add(t.column(name), pa.scalar(3.0, pa.float32())))
        pq.write_table(t, shifted / p.name, row_group_size=1000)
    _null_features(shifted / "part-00000.parquet", 20)  # 0.3% rejected: within the budget
    moved = cli(
        "run", *job_args(shifted, root / "{date}", bundle_dir), "--date", "2026-11-02",
        "--scheduler", "sync", in_process=True,
    )  # fmt: skip
    rep = report(root / "2026-11-02")
    assert rep["rows_rejected"] == 20 and rep["drift"]["alert"] is True
    assert rep["status"] == "succeeded_with_warnings"
    assert moved.returncode == EXIT_DRIFT == RunReport(rep).exit_code, moved.output
    assert (root / "2026-11-02" / "_SUCCESS").exists()


def _line(stdout: str, label: str) -> str | None:
    """The value of the summary's ``label`` line (``  report    VALUE``), or None."""
    found = [ln[12:] for ln in stdout.splitlines() if ln.startswith(f"  {label:<9} ")]
    assert len(found) <= 1, stdout
    return found[0] if found else None


def test_the_summary_names_the_html_page_and_where_the_rejects_are(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    """Issue 22: the summary named neither. The page is named always (every run that prints a
    summary wrote it); the rejects only when there are some (a clean night writes none, and
    its summary names no folder that does not exist)."""
    clean = _run(catalog, tmp_path / "clean", bundle_dir)
    assert clean.returncode == EXIT_OK, clean.output
    page = _line(clean.stdout, "report")
    assert page == str(report_path(tmp_path / "clean").with_name("_report.html"))
    assert Path(page).is_file() and "<html" in Path(page).read_text().lower()
    assert _line(clean.stdout, "rejects") is None

    _null_features(catalog / "part-00001.parquet", 20)  # within the 1% budget
    out = tmp_path / "some"
    r = _run(catalog, out, bundle_dir)
    assert r.returncode == EXIT_OK, r.output
    rep = report(out)
    assert rep["rows_rejected"] == 20
    where = _line(r.stdout, "rejects")
    assert where == rep["rejects"]
    rejected = pq.read_table(where)  # the folder the summary names holds exactly those rows
    assert rejected.num_rows == 20 and "reject_reason" in rejected.column_names
    assert Path(_line(r.stdout, "report") or "").is_file()

    # The same lines when the summary is read back.
    again = cli("report", str(out), in_process=True)
    assert _line(again.stdout, "report") == _line(r.stdout, "report")
    assert _line(again.stdout, "rejects") == where


def test_a_rerun_that_scores_nothing_says_so_instead_of_zero_rows_per_second(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "o"
    assert _run(catalog, out, bundle_dir).returncode == 0
    again = _run(catalog, out, bundle_dir)
    assert again.returncode == 0, again.output
    rep = report(out)
    assert rep["shards_skipped"] == rep["shards_total"] == 3 and rep["rows_processed"] == 0
    (speed,) = [line for line in again.stdout.splitlines() if line.startswith("  speed ")]
    assert speed.startswith("  speed     nothing scored in this run (")
    assert speed.endswith("): 3 shard(s) already done"), speed
    page = (report_path(out).parent / "_report.html").read_text()
    assert "nothing scored in this run" in page
    assert "Nothing was scored in this run: all 3 shards were already done" in page
    assert ">0 rows/s<" not in page and "0 rows/s" not in again.stdout
