"""A template's fixed part holds one template's outputs and nothing else (review 22, C1-C4).

Readers query a template's root as one dataset. Each case below used to exit 0 and leave
readers of the root counting rows that no report of the run's template accounts for (or
failing): another job's template whose fixed part equals the nightly's root (C1, in either
order), the same job under a second template (C2), a template one level too high whose older-
layout migration also moved other jobs' control areas and rejects into its own (C3), and a root
that already held other data (C4). Each is now refused before anything is written or moved
(exit 2), naming the root, what is in it and the template; every file stays as it was.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import write_shards
from tests.integration.helpers import CliResult, cli, reader_counts, report
from tests.integration.servers import S3Bucket

pytestmark = pytest.mark.integration

DAYS = ("2026-11-01", "2026-11-02")
OPTS = ('passthrough = ["category"]\n', 'scheduler = "sync"\n', "batch_size = 512\n")


def _job(path: Path, catalog: Path, output: Path | str, bundle: Path) -> Path:
    """A job file (the job is named after it) writing ``output``."""
    path.write_text(
        f'input = "{catalog}"\noutput = "{output}"\nmodel = "{bundle}"\n' + "".join(OPTS)
    )
    return path


def _run(job: Path, day: str, *extra: str, in_process: bool = False) -> CliResult:
    return cli("run", str(job), "--date", day, *extra, in_process=in_process)


def _files(root: Path) -> dict[str, str]:
    """Every file below ``root`` and the SHA-256 of its bytes."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _refused(r: CliResult, root: Path, *names: str) -> None:
    """Exit 2 naming the root, the offending entries and the fix; no report written."""
    assert r.returncode == 2, r.output
    assert f"its fixed part {root} holds" in r.stderr
    for name in names:
        assert name in r.stderr
    assert "Nothing was written" in r.stderr
    assert "choose an output template whose fixed part holds only this job's outputs" in r.stderr
    assert r.report is None


@pytest.fixture
def nightly(tmp_path: Path, catalog: Path, bundle_dir: Path) -> Path:
    """The nightly job ``data/scored/run_date={date}``, run for the first day."""
    job = _job(
        tmp_path / "nightly.toml", catalog, tmp_path / "data/scored/run_date={date}", bundle_dir
    )
    assert _run(job, DAYS[0], in_process=True).returncode == 0
    return job


def _sum_rows_out(root: Path) -> int:
    return sum(report(out)["rows_out"] for out in sorted(root.iterdir()) if out.is_dir())


# ---------------------------------------------------------------- C1: another job, same root


def test_another_job_s_template_with_the_nightly_s_root_is_refused(
    tmp_path: Path, catalog: Path, bundle_dir: Path, nightly: Path
) -> None:
    root = tmp_path / "data" / "scored"
    before = _files(tmp_path / "data")
    other = _job(tmp_path / "other.toml", catalog, f"{root}/{{date}}", bundle_dir)
    r = _run(other, DAYS[1])
    _refused(r, root, f"run_date={DAYS[0]}", f"{root}/{{date}}", f"named like {DAYS[1]}")
    assert _files(tmp_path / "data") == before
    assert set(reader_counts(root).values()) == {_sum_rows_out(root)}


def test_the_nightly_is_refused_under_a_root_another_job_s_template_took_first(
    tmp_path: Path, catalog: Path, bundle_dir: Path
) -> None:
    root = tmp_path / "data" / "scored"
    other = _job(tmp_path / "other.toml", catalog, f"{root}/{{date}}", bundle_dir)
    assert _run(other, DAYS[0], in_process=True).returncode == 0
    before = _files(tmp_path / "data")
    job = _job(tmp_path / "nightly.toml", catalog, f"{root}/run_date={{date}}", bundle_dir)
    r = _run(job, DAYS[1])
    _refused(r, root, f"holds 1 entry that this template did not write ({DAYS[0]})")
    assert f"named like run_date={DAYS[1]}" in r.stderr
    assert _files(tmp_path / "data") == before


# ---------------------------------------------------------------- C2: same job, second template


def test_the_same_job_under_a_second_template_in_its_root_is_refused(
    tmp_path: Path, nightly: Path
) -> None:
    root = tmp_path / "data" / "scored"
    before = _files(tmp_path / "data")
    r = _run(nightly, DAYS[1], "--output", f"{root}/{{date}}")
    _refused(r, root, f"run_date={DAYS[0]}")
    assert _files(tmp_path / "data") == before


def test_a_deeper_template_with_the_same_first_folder_is_refused_from_the_run_index(
    tmp_path: Path, nightly: Path
) -> None:
    """``run_date={date}/v2``: the root's folders fit its first segment, but the nightly's run
    index entry names an output that the template does not."""
    root = tmp_path / "data" / "scored"
    before = _files(tmp_path / "data")
    r = _run(nightly, DAYS[1], "--output", f"{root}/run_date={{date}}/v2")
    assert r.returncode == 2, r.output
    assert f"its fixed part {root} holds outputs of another template" in r.stderr
    assert f"wrote {root}/run_date={DAYS[0]} " in r.stderr
    assert "Nothing was written" in r.stderr
    assert _files(tmp_path / "data") == before
    # The nightly itself goes on.
    assert _run(nightly, DAYS[1]).returncode == 0
    assert set(reader_counts(root).values()) == {_sum_rows_out(root)}


# ---------------------------------------------------------------- C3: one level too high


@pytest.mark.parametrize("segment", ["{date}", "run_date={date}"])
def test_a_template_one_level_too_high_is_refused_and_moves_nothing(
    tmp_path: Path, bundle_dir: Path, segment: str
) -> None:
    data = tmp_path / "data"
    write_shards(data / "catalog", [1200, 800], row_group_rows=400)
    job = _job(
        tmp_path / "nightly.toml", data / "catalog", f"{data}/scored/run_date={{date}}", bundle_dir
    )
    assert _run(job, DAYS[0], in_process=True).returncode == 0
    assert (data / "_score_catalog" / "scored" / "_runs").is_dir()
    before = _files(tmp_path)
    r = cli("run", str(job), "--date", DAYS[1], env={"SCORE_CATALOG_OUTPUT": f"{data}/{segment}"})
    _refused(r, data, "catalog", "scored")
    assert _files(tmp_path) == before  # the nightly's control area and rejects did not move
    assert not (tmp_path / "_score_catalog").exists()


# ---------------------------------------------------------------- C4: a root with other data


@pytest.mark.parametrize(
    ("foreign", "named"),
    [("legacy_2025/part-00000.parquet", "legacy_2025"), ("README.txt", "README.txt (a file)")],
)
def test_a_template_root_that_holds_other_data_is_refused(
    tmp_path: Path, catalog: Path, bundle_dir: Path, foreign: str, named: str
) -> None:
    root = tmp_path / "warehouse" / "scores"
    (root / foreign).parent.mkdir(parents=True)
    if foreign.endswith(".parquet"):
        pq.write_table(pq.read_table(next(catalog.glob("*.parquet"))), root / foreign)
    else:
        (root / foreign).write_text("scores of the legacy pipeline\n")
    before = _files(tmp_path / "warehouse")
    job = _job(tmp_path / "scores.toml", catalog, f"{root}/run_date={{date}}", bundle_dir)
    r = _run(job, DAYS[0])
    _refused(r, root, f"1 entry that this template did not write ({named})")
    assert f"move it out of {root}" in r.stderr
    assert _files(tmp_path / "warehouse") == before
    # Moved out (the fix), and a hidden file left there (every reader skips it): the run goes.
    shutil.rmtree(root)
    root.mkdir()
    (root / ".keep").write_text("")
    assert _run(job, DAYS[0]).returncode == 0


# ---------------------------------------------------------------- on object storage


@pytest.mark.slow
def test_another_job_s_template_with_the_nightly_s_root_is_refused_on_s3(
    s3_bucket: S3Bucket, bundle_dir: Path, tmp_path: Path
) -> None:
    """C1 against a real S3 API, in both orders: the root's children are one listing."""
    write_shards(tmp_path / "catalog", [1200, 900], row_group_rows=400)
    s3_bucket.upload_tree(tmp_path / "catalog", "catalog")

    def job(name: str, output: str) -> Path:
        return s3_bucket.write_job(
            tmp_path / f"{name}.toml",
            input=s3_bucket.uri("catalog/"),
            output=s3_bucket.uri(output),
            model=str(bundle_dir),
            passthrough=["category"],
            batch_size=512,
            scheduler="sync",
        )

    nightly, other = job("nightly", "scored/run_date={date}"), job("other", "scored/{date}")
    assert cli("run", str(nightly), "--date", DAYS[0]).returncode == 0
    fs, b = s3_bucket.fs, s3_bucket.name

    def objects() -> dict[str, str]:
        return {k: str(fs.info(k)["ETag"]) for k in sorted(fs.find(b))}

    before = objects()
    r = cli("run", str(other), "--date", DAYS[1])
    assert r.returncode == 2, r.output
    assert f"its fixed part {s3_bucket.uri('scored')} holds" in r.stderr
    assert f"run_date={DAYS[0]}" in r.stderr
    assert objects() == before

    # The other order: the other job's date folder is no run_date=... folder.
    fs.rm(f"{b}/scored", recursive=True)
    fs.rm(f"{b}/_score_catalog", recursive=True)
    assert cli("run", str(other), "--date", DAYS[0]).returncode == 0
    before = objects()
    r = cli("run", str(nightly), "--date", DAYS[1])
    assert r.returncode == 2, r.output
    assert f"that this template did not write ({DAYS[0]})" in r.stderr
    assert objects() == before
