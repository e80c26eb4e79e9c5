"""An output belongs to one job (break-it review of issue 22, C2), through the real CLI, on disk
and on S3 (moto).

The cases as a user met them: a second job file copied from the nightly one (another name,
input and model, the same output template) ran into the nightly's output for the same date and
removed every one of its scored shards, saying "its input shard no longer exists" (it did
exist), exit 0; an ad-hoc run into a ``latest`` symlink that pointed at a nightly output
overwrote part of it with another model's scores. Now the manifest records the owning job (its
name, output template and the output's real path) and any other job, or the same job through
another template or a symlink, is refused before anything is written (exit 2, naming the owner
and the fix).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import duckdb
import pytest

from pipeline.cli.demo import export_bundle
from tests.conftest import demo_toml, make_model, write_shards
from tests.integration.helpers import CliResult, cli, job_args, manifest_path, report
from tests.integration.servers import S3Bucket

pytestmark = pytest.mark.integration

DAY = "2026-11-02"


@pytest.fixture(scope="module")
def other_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another model (other weights, version 4): its scores must never mix with version 1's."""
    d = tmp_path_factory.mktemp("bundle_v4")
    export_bundle(make_model(seed=4), d, demo_toml(version="4"), n_in=16)
    return d


def _job(path: Path, inp: Path, out: str, model: Path, *extra: str) -> Path:
    lines = [
        f'input = "{inp}"',
        f'output = "{out}"',
        f'model = "{model}"',
        'scheduler = "sync"',
        "batch_size = 512",
        *extra,
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _files(root: Path, *skip: str) -> dict[str, str]:
    """Every file below ``root`` (but the top-level folders ``skip``) and its SHA-256."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.relative_to(root).parts[0] not in skip
    }


def _run(job: Path, *extra: str) -> CliResult:
    return cli("run", str(job), "--date", DAY, *extra)


@pytest.fixture
def nightly(tmp_path: Path, catalog: Path, bundle_dir: Path) -> Path:
    """The nightly job, run once for DAY; a second input (other shard names) for other jobs."""
    other = write_shards(tmp_path / "other_in", [900, 700], row_group_rows=300, seed=9)
    for p in other:
        p.rename(p.with_name(f"b-{p.name}"))
    job = _job(
        tmp_path / "nightly.toml", catalog, f"{tmp_path}/scored/run_date={{date}}", bundle_dir
    )
    first = _run(job)
    assert first.returncode == 0, first.output
    return job


def test_another_job_on_the_same_template_is_refused_and_the_owner_keeps_its_scores(
    nightly: Path, tmp_path: Path, other_bundle: Path
) -> None:
    out = tmp_path / "scored" / f"run_date={DAY}"
    promo = _job(
        tmp_path / "promo.toml",
        tmp_path / "other_in",
        f"{tmp_path}/scored/run_date={{date}}",
        other_bundle,
    )
    before = _files(tmp_path, "catalog", "other_in")

    r = _run(promo)
    assert r.returncode == 2, r.output
    text = " ".join(r.stderr.split())
    assert f"output {out} belongs to job 'nightly'" in text
    assert f"output template {tmp_path}/scored/run_date={{date}}" in text
    assert "this run is job 'promo'" in text and "Nothing was written" in text
    assert 'put name = "nightly" in its job file' in text  # the deliberate rename, spelled out
    assert "REMOVED" not in r.output and "no longer exists" not in r.output
    assert _files(tmp_path, "catalog", "other_in") == before  # byte for byte, reports included

    # The owner's next run finds everything as it left it: nothing to score again.
    again = _run(nightly)
    assert again.returncode == 0, again.output
    rep = report(out)
    assert rep["shards_skipped"] == rep["shards_total"] == 3 and rep["removed_outputs"] == []


def test_a_renamed_job_file_is_refused_until_it_keeps_the_job_s_name(
    nightly: Path, tmp_path: Path
) -> None:
    """A job is named after its job file: renamed, it is another job, and the output (with its
    run index and drift history) stays the old name's until the file says ``name``."""
    renamed = tmp_path / "scoring.toml"
    shutil.copy(nightly, renamed)
    r = _run(renamed)
    assert r.returncode == 2, r.output
    assert "belongs to job 'nightly'" in r.stderr and "this run is job 'scoring'" in r.stderr

    renamed.write_text(nightly.read_text() + 'name = "nightly"\n')
    kept = _run(renamed)
    assert kept.returncode == 0, kept.output
    rep = report(tmp_path / "scored" / f"run_date={DAY}")
    assert rep["job"] == "nightly" and rep["shards_skipped"] == rep["shards_total"] == 3


def test_a_symlink_to_another_job_s_output_is_refused(
    nightly: Path, tmp_path: Path, other_bundle: Path
) -> None:
    out = tmp_path / "scored" / f"run_date={DAY}"
    latest = tmp_path / "latest"
    latest.symlink_to(out)
    before = _files(tmp_path, "catalog", "other_in")

    r = cli("run", *job_args(tmp_path / "other_in", latest, other_bundle), "--scheduler", "sync")
    assert r.returncode == 2, r.output
    text = " ".join(r.stderr.split())
    assert f"output {latest} (real path {out}) belongs to job 'nightly'" in text
    assert "this run is job 'score-catalog'" in text  # flags only: the default job name
    assert _files(tmp_path, "catalog", "other_in") == before
    sql = f"select distinct model_version from read_parquet('{out}/*.parquet')"
    assert duckdb.connect().execute(sql).fetchall() == [("1",)]  # one model's scores only


def test_a_manifest_without_an_owner_is_adopted_by_the_next_run(
    nightly: Path, tmp_path: Path
) -> None:
    """Manifests written before owners were recorded: the next run takes the output as its own
    (its entries are files of this output) and records itself."""
    out = tmp_path / "scored" / f"run_date={DAY}"
    path = manifest_path(out)
    doc = json.loads(path.read_text())
    assert doc["owner"] == {
        "job": "nightly",
        "template": f"{tmp_path}/scored/run_date={{date}}",
        "output": str(out),
    }
    del doc["owner"]
    path.write_text(json.dumps(doc))

    r = _run(nightly)
    assert r.returncode == 0, r.output
    assert report(out)["shards_skipped"] == 3
    assert json.loads(path.read_text())["owner"]["job"] == "nightly"


def test_removed_says_no_longer_exists_only_of_an_input_shard_that_is_gone(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    """The same job with another input (``--input``): the outputs of shards that left it go
    (the output is the current input), and the reason says where their input is."""
    out = tmp_path / "out"
    job = _job(
        tmp_path / "job.toml", catalog, str(out), bundle_dir, "[monitoring]", "drift = false"
    )
    assert cli("run", str(job)).returncode == 0
    smaller = tmp_path / "smaller"
    smaller.mkdir()
    for name in ("part-00000.parquet", "part-00001.parquet"):
        shutil.copy2(catalog / name, smaller / name)  # the same shards, in another folder

    r = cli("run", str(job), "--input", str(smaller))
    assert r.returncode == 0, r.output
    rep = report(out)
    assert rep["shards_skipped"] == 2  # same content: not scored again
    (removal,) = rep["removed_outputs"]
    assert removal["output"] == str(out / "part-00002.parquet")
    assert removal["reason"] == (
        f"its input shard {catalog / 'part-00002.parquet'} still exists but is no longer in "
        f"this job's input ({smaller})"
    )
    assert "no longer exists" not in r.output

    (smaller / "part-00001.parquet").unlink()  # now one really is gone
    r = cli("run", str(job), "--input", str(smaller))
    assert r.returncode == 0, r.output
    (removal,) = report(out)["removed_outputs"]
    assert removal["output"] == str(out / "part-00001.parquet")
    assert removal["reason"] == "its input shard no longer exists"


# ---------------------------------------------------------------- on object storage


def test_another_job_is_refused_on_s3(
    s3_bucket: S3Bucket, bundle_dir: Path, other_bundle: Path, tmp_path: Path
) -> None:
    write_shards(tmp_path / "catalog", [1200, 900], row_group_rows=400)
    write_shards(tmp_path / "other_in", [800], row_group_rows=400, seed=3)
    s3_bucket.upload_tree(tmp_path / "catalog", "catalog")
    s3_bucket.upload_tree(tmp_path / "other_in", "other_in")
    jobs = {}
    for name, inp, model in (
        ("nightly", "catalog/", bundle_dir),
        ("promo", "other_in/", other_bundle),
    ):
        jobs[name] = s3_bucket.write_job(
            tmp_path / f"{name}.toml",
            input=s3_bucket.uri(inp),
            output=s3_bucket.uri("scored/run_date={date}"),
            model=str(model),
            batch_size=512,
            scheduler="sync",
        )
    r = cli("run", str(jobs["nightly"]), "--date", DAY)
    assert r.returncode == 0, r.output
    fs, b = s3_bucket.fs, s3_bucket.name

    def objects() -> dict[str, str]:
        return {k: str(fs.info(k)["ETag"]) for k in sorted(fs.find(b))}

    before = objects()
    out = s3_bucket.uri(f"scored/run_date={DAY}")
    assert f"{b}/scored/run_date={DAY}/part-00000.parquet" in before

    r = cli("run", str(jobs["promo"]), "--date", DAY)
    assert r.returncode == 2, r.output
    text = " ".join(r.stderr.split())
    assert f"output {out} belongs to job 'nightly'" in text
    assert f"output template {s3_bucket.uri('scored/run_date={date}')}" in text
    assert objects() == before
