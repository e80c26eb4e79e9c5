"""Outputs never nest (issue 22, case 1), through the real CLI, on disk and on S3 (moto).

The case as a new user met it: two nightly runs into ``scored/run_date={date}``, then one run
with ``--output scored`` (a forgotten ``{date}``, an environment override, or the Python API
example run after the Quickstart). That run used to remove every scored file of both dates as
"its input shard no longer exists", leave ``_SUCCESS`` in the emptied date folders, move the
nightly job's run index, and exit 0. Now it is refused before anything is written (exit 2,
naming both outputs and the fix), and reconcile deletes only what an output's own manifest
lists.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import write_shards
from tests.integration.helpers import (
    CliResult,
    cli,
    control_of,
    job_args,
    reader_counts,
    report,
)
from tests.integration.servers import S3Bucket

pytestmark = pytest.mark.integration

DAYS = ("2026-11-28", "2026-11-29", "2026-11-30")


def _run(catalog: Path, out: Path | str, bundle: Path, *extra: str) -> CliResult:
    opts = ("--passthrough", "category", "--batch-size", "400", "--scheduler", "sync")
    return cli("run", *job_args(catalog, out, bundle, *opts, *extra), in_process=True)


def _files(root: Path, *skip: str) -> dict[str, str]:
    """Every file below ``root`` (but the folders ``skip``) and the SHA-256 of its bytes."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.relative_to(root).parts[0] not in skip
    }


def _nightly(catalog: Path, bundle: Path, tmp_path: Path, *days: str) -> list[dict[str, object]]:
    template = tmp_path / "scored" / "run_date={date}"
    reps = []
    for day in days:
        r = _run(catalog, template, bundle, "--date", day)
        assert r.returncode == 0, r.output
        reps.append(report(tmp_path / "scored" / f"run_date={day}"))
    return reps


def test_the_root_of_two_dated_runs_is_refused_and_nothing_is_removed(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    first, second = _nightly(catalog, bundle_dir, tmp_path, *DAYS[:2])
    before = _files(tmp_path, "catalog")

    r = _run(catalog, tmp_path / "scored", bundle_dir)
    assert r.returncode == 2, r.output
    root, dated = tmp_path / "scored", tmp_path / "scored" / f"run_date={DAYS[0]}"
    assert f"output {root} contains {dated}" in r.stderr  # both outputs named
    assert f"--output '{root}/run_date={{date}}'" in r.stderr  # and the fix
    assert "REMOVED" not in r.output
    # Nothing removed, moved or written: every score, _SUCCESS, report, rejects and run index
    # entry is where it was, byte for byte.
    assert _files(tmp_path, "catalog") == before
    for day in DAYS[:2]:
        assert pq.read_table(tmp_path / "scored" / f"run_date={day}").num_rows == 7300

    # The next night still finds its predecessor to compare drift against.
    (third,) = _nightly(catalog, bundle_dir, tmp_path, DAYS[2])
    assert third["drift"]["baseline"]["run_id"] == second["run_id"] != first["run_id"]


def test_a_plan_with_the_root_as_output_is_refused_too(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    _nightly(catalog, bundle_dir, tmp_path, DAYS[0])
    r = cli("plan", *job_args(catalog, tmp_path / "scored", bundle_dir), in_process=True)
    assert r.returncode == 2 and "Outputs never nest" in r.stderr, r.output


def test_an_output_inside_another_output_is_refused(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    assert _run(catalog, out, bundle_dir).returncode == 0
    before = _files(tmp_path, "catalog")
    inner = out / "inner"
    r = _run(catalog, inner, bundle_dir)
    assert r.returncode == 2, r.output
    assert f"output {inner} lies inside {out}" in r.stderr
    assert not inner.exists() and _files(tmp_path, "catalog") == before


def test_a_dated_output_under_an_output_without_placeholder_is_refused(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    """The other order: ``scored`` was an output of its own first; a dated job under it would
    be removed by its next run."""
    assert _run(catalog, tmp_path / "scored", bundle_dir).returncode == 0
    r = _run(catalog, tmp_path / "scored" / "run_date={date}", bundle_dir, "--date", DAYS[0])
    assert r.returncode == 2, r.output
    assert f"lies inside {tmp_path / 'scored'}" in r.stderr


def test_the_root_another_job_writes_under_is_refused_from_its_run_index(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    """The dated outputs are gone (retention deleted them), the run index says which job
    writes under the root: an output there would take that job's next outputs for its own."""
    _nightly(catalog, bundle_dir, tmp_path, DAYS[0])
    shutil.rmtree(tmp_path / "scored" / f"run_date={DAYS[0]}")
    r = _run(catalog, tmp_path / "scored", bundle_dir)
    assert r.returncode == 2, r.output
    assert f"output {tmp_path / 'scored'} is the fixed part of the template job" in r.stderr
    assert f"run_date={DAYS[0]}" in r.stderr and not list((tmp_path / "scored").iterdir())


def test_a_scored_file_copied_in_from_another_output_is_never_deleted(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    """Reconcile deletes only what this output's manifest lists. A scored file of another
    output copied in carries this tool's footer mark, but nothing ties it to this output: it is
    kept, and since readers would count its rows the run refuses ``_SUCCESS`` (exit 1, naming
    it); ``--on-foreign-output replace`` is the explicit way to delete it."""
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        assert _run(catalog, out, bundle_dir).returncode == 0
    copied = b / "part-00009.parquet"
    shutil.copy(a / "part-00000.parquet", copied)
    before = hashlib.sha256(copied.read_bytes()).hexdigest()

    r = _run(catalog, b, bundle_dir)
    assert r.returncode == 1, r.output
    assert hashlib.sha256(copied.read_bytes()).hexdigest() == before
    assert not (b / "_SUCCESS").exists()
    rep = report(b)
    assert rep["status"] == "failed" and rep["removed_outputs"] == []
    assert any(str(copied) in reason for reason in rep["failure_reasons"])

    replaced = _run(catalog, b, bundle_dir, "--on-foreign-output", "replace")
    assert replaced.returncode == 0, replaced.output
    assert not copied.exists() and report(b)["foreign_removed"] == [str(copied)]


# ---------------------------------------------------------------- places inside a dataset
# (break-it review of issue 22: C1, C3 and M2). Each was accepted, and left rejects or control
# files where readers of a dataset count them, or took another output's control files.


def _with_rejects(tmp_path: Path) -> Path:
    """Two days of input, each with a few rows the model cannot score (a null feature)."""
    for k, day in enumerate(DAYS[:2]):
        paths = write_shards(
            tmp_path / "archive" / f"dt={day}", [900, 700], row_group_rows=300, start=10_000 * k
        )
        t = pq.read_table(paths[0])
        vals = t.column("f2").to_pylist()
        vals[k + 3] = None
        t = t.set_column(t.schema.get_field_index("f2"), "f2", pa.array(vals, pa.float32()))
        pq.write_table(t, paths[0], row_group_size=300)
    job = tmp_path / "nightly.toml"
    job.write_text(
        f'input = "{tmp_path}/archive/dt={{date}}"\n'
        f'output = "{tmp_path}/scored/run_date={{date}}"\n'
        f'model = "{tmp_path}/bundle"\nscheduler = "sync"\nbatch_size = 512\n'
        "[errors]\nmax_rejected_fraction = 0.2\n"
    )
    return job


@pytest.mark.slow
@pytest.mark.parametrize("case", ["its manifest", "control folder deleted", "another name"])
def test_a_hand_run_inside_the_nightly_root_is_refused_and_the_root_reads_only_scores(
    bundle_dir: Path, tmp_path: Path, case: str
) -> None:
    """C1: rerunning one night with the path the summary prints as ``--output`` made that
    folder its own root, so its rejects and report went inside the nightly's root (DuckDB and
    Dask counted rejects as scores, Polars failed). Now refused, with the command to use."""
    shutil.copytree(bundle_dir, tmp_path / "bundle")
    job = _with_rejects(tmp_path)
    root = tmp_path / "scored"
    for day in DAYS[:2]:
        r = cli("run", str(job), "--date", day, "-q")
        assert r.returncode == 0, r.output
    reps = [report(root / f"run_date={day}") for day in DAYS[:2]]
    assert all(rep["rows_rejected"] > 0 for rep in reps)  # rejects exist, beside the root
    out = root / f"run_date={DAYS[1]}"
    if case == "control folder deleted":
        shutil.rmtree(control_of(out))
    elif case == "another name":
        out = root / "adhoc"
    before = _files(tmp_path)

    r = cli("run", str(job), "--date", DAYS[1], "--output", str(out), "-q")
    assert r.returncode == 2, r.output
    text = " ".join(r.stderr.split())
    assert f"output {out}" in text and "Nothing was written" in text
    if case == "its manifest":
        assert f"This is the output of template {root}/run_date={{date}} of job 'nightly'" in text
        assert f"rerun it with --date {DAYS[1]}" in text
    elif case == "control folder deleted":
        assert f"lies inside {root}, the fixed part of an output template" in text
        assert f"--date {DAYS[1]} instead of --output" in text and "job(s) 'nightly'" in text
    else:
        assert f"lies inside {root}" in text and f"Choose an output outside {root}" in text
    assert _files(tmp_path) == before
    counts = reader_counts(root)
    total = sum(rep["rows_out"] for rep in reps)
    assert counts == dict.fromkeys(counts, total), counts


@pytest.mark.parametrize(
    "rejects",
    [
        "scored/_rejects/run_date={date}",
        "scored/rejects/run_date={date}",
        "scored/run_date={date}/_rejects",
    ],
)
def test_rejects_inside_the_job_s_own_template_root_are_refused_before_scoring(
    catalog: Path, bundle_dir: Path, tmp_path: Path, rejects: str
) -> None:
    """C3: accepted, and readers of the root counted rejects as scores; the last one was found
    only after every shard was scored. Now refused before anything is written."""
    template = tmp_path / "scored" / "run_date={date}"
    r = cli(
        "run",
        *job_args(catalog, template, bundle_dir),
        "--rejects",
        f"{tmp_path}/{rejects}",
        "--date",
        DAYS[0],
        "--scheduler",
        "sync",
    )
    assert r.returncode == 2, r.output
    text = " ".join(r.stderr.split())
    where = f"{tmp_path}/{rejects}".replace("{date}", DAYS[0])
    assert f"rejects {where} lies inside {tmp_path / 'scored'}, the fixed part of" in text
    assert "Leave rejects unset" in text
    assert not (tmp_path / "scored").exists() and not (tmp_path / "_score_catalog").exists()


@pytest.mark.slow
@pytest.mark.parametrize("other", ["an output", "a template root"])
def test_rejects_inside_another_job_s_dataset_are_refused(
    catalog: Path, bundle_dir: Path, tmp_path: Path, other: str
) -> None:
    """C3: job B's rejects inside job A's output (or template root) were accepted; A's readers
    counted them as scores and A's next run failed on files it did not write."""
    a_root = tmp_path / "scored"
    # A writes scored itself, or scored/d={date} (then its control area beside scored says so).
    a_args = job_args(catalog, a_root, bundle_dir)
    if other == "a template root":
        a_args = [*job_args(catalog, a_root / "d={date}", bundle_dir), "--date", DAYS[0]]
    first = cli("run", *a_args, "--scheduler", "sync")
    assert first.returncode == 0, first.output
    a_out = a_root if other == "an output" else a_root / f"d={DAYS[0]}"
    before = _files(tmp_path, "catalog")

    r = cli(
        "run",
        *job_args(catalog, tmp_path / "b" / "run_date={date}", bundle_dir),
        "--rejects",
        str(a_root / "rej" / "{date}"),
        "--date",
        DAYS[1],
        "--scheduler",
        "sync",
    )
    assert r.returncode == 2, r.output
    text = " ".join(r.stderr.split())
    sign = f"{a_root}/_SCORE_CATALOG is there" if other == "an output" else "holds its control"
    assert f"rejects {a_root}/rej/{DAYS[1]} lies inside {a_root}" in text and sign in text
    assert _files(tmp_path, "catalog") == before and not (tmp_path / "b").exists()
    counts = reader_counts(a_root)
    assert counts == dict.fromkeys(counts, report(a_out)["rows_out"]), counts
    again = cli("run", *a_args, "--scheduler", "sync")
    assert again.returncode == 0, again.output


@pytest.mark.parametrize("what", ["output", "rejects"])
def test_a_control_folder_is_never_an_output_or_rejects(
    catalog: Path, bundle_dir: Path, tmp_path: Path, what: str
) -> None:
    """M2: ``--output`` the control folder the summary names took that output's manifest and
    report for an older layout's and moved them away; its report was gone."""
    (nightly,) = _nightly(catalog, bundle_dir, tmp_path, DAYS[0])
    out = tmp_path / "scored" / f"run_date={DAYS[0]}"
    control = control_of(out)
    before = _files(tmp_path, "catalog")
    places = ["--output", str(control)]
    if what == "rejects":
        places = ["--output", str(tmp_path / "adhoc"), "--rejects", str(control)]
    r = cli("run", "--input", str(catalog), "--model", str(bundle_dir), *places)
    assert r.returncode == 2, r.output
    text = " ".join(r.stderr.split())
    assert f"{what} {control} lies inside {tmp_path / '_score_catalog'}" in text
    assert "a control area of score-catalog" in text and "Nothing was written" in text
    assert _files(tmp_path, "catalog") == before
    shown = cli("report", str(out), "--json")
    assert shown.returncode == 0, shown.output
    assert json.loads(shown.stdout)["run_id"] == nightly["run_id"]


def test_report_out_prints_where_the_html_page_is(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    """LOW: ``report OUT`` printed the older in-root place of ``_report.html``, which did not
    exist; the run's own summary printed the right one."""
    _nightly(catalog, bundle_dir, tmp_path, DAYS[0])
    out = tmp_path / "scored" / f"run_date={DAYS[0]}"
    shown = cli("report", str(out))
    assert shown.returncode == 0, shown.output
    (line,) = [ln.split()[1] for ln in shown.stdout.splitlines() if ln.split()[:1] == ["report"]]
    assert Path(line) == control_of(out) / "_report.html" and Path(line).is_file()


# ---------------------------------------------------------------- on object storage


@pytest.mark.slow
def test_nesting_is_refused_on_s3(s3_bucket: S3Bucket, bundle_dir: Path, tmp_path: Path) -> None:
    """The same refusals against a real S3 API: the check lists only the output's own prefix
    and asks ``exists`` of the folders above it."""
    write_shards(tmp_path / "catalog", [1200, 900], row_group_rows=400)
    s3_bucket.upload_tree(tmp_path / "catalog", "catalog")
    job = s3_bucket.write_job(
        tmp_path / "nightly.toml",
        input=s3_bucket.uri("catalog/"),
        output=s3_bucket.uri("scored/run_date={date}"),
        model=str(bundle_dir),
        passthrough=["category"],
        batch_size=512,
        scheduler="sync",
    )
    for day in DAYS[:2]:
        r = cli("run", str(job), "--date", day)
        assert r.returncode == 0, r.output
    fs, b = s3_bucket.fs, s3_bucket.name

    def objects() -> dict[str, str]:
        return {k: str(fs.info(k)["ETag"]) for k in sorted(fs.find(b))}

    before = objects()
    assert f"{b}/_score_catalog/scored/run_date={DAYS[0]}/_report.json" in before
    assert not [k for k in before if k.startswith(f"{b}/scored/") and k.endswith(".json")]

    root = cli("run", str(job), "--output", s3_bucket.uri("scored"))
    assert root.returncode == 2, root.output
    assert f"contains {s3_bucket.uri('scored')}/run_date=" in root.stderr
    inside = cli("run", str(job), "--output", s3_bucket.uri(f"scored/run_date={DAYS[0]}/x"))
    assert inside.returncode == 2, inside.output
    assert f"lies inside {s3_bucket.uri(f'scored/run_date={DAYS[0]}')}" in inside.stderr
    assert objects() == before


def test_no_output_nests_in_or_around_an_iceberg_table(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    """A run makes an Iceberg table (its embedded catalog beside it); a Parquet folder output
    inside it, and a Delta table one level above it (holding it), are refused before anything
    is written, naming the Iceberg table; a folder output of its own template root is told to
    set the format."""
    pytest.importorskip("pyiceberg")
    lake = tmp_path / "lake"
    template = lake / "scored" / "run_date={date}"
    first = _run(catalog, template, bundle_dir, "--date", DAYS[0], "--format", "iceberg")
    assert first.returncode == 0, first.output
    before = _files(tmp_path, "catalog")

    inside = lake / "scored" / "run_date=2026-11-29" / "extra"
    r = _run(catalog, inside, bundle_dir)
    assert r.returncode == 2, r.output
    assert f"output {inside} lies inside {lake / 'scored'}, an Iceberg table" in r.stderr

    r = _run(catalog, template, bundle_dir, "--date", DAYS[1])  # format parquet
    assert r.returncode == 2, r.output
    assert "which is this template's own root" in r.stderr
    assert 'format = "iceberg" (--format iceberg' in r.stderr

    r = _run(catalog, lake, bundle_dir, "--format", "delta")
    assert r.returncode == 2, r.output
    assert f"output {lake} contains {lake / 'scored'}, an Iceberg table" in r.stderr
    assert _files(tmp_path, "catalog") == before
