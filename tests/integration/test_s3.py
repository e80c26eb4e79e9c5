"""The real CLI against a real S3-compatible server (moto, over HTTP on 127.0.0.1).

Input shards, the output root, the rejects and (in one test) the model bundle all live in a
bucket; credentials and the endpoint reach s3fs only through the job's ``[storage]`` table or
``--storage-option`` flags.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from pipeline.cli.demo import FEATURES, make_rows
from tests.conftest import reference_scores, write_shards
from tests.integration.helpers import CliResult, check_report, cli, job_args
from tests.integration.servers import S3Bucket, free_port

pytestmark = pytest.mark.integration

SIZES = [2500, 1700, 3100]  # rows per shard; 1,000-row row groups: 3 + 2 + 4 of them
SHARDS = [f"part-{k:05d}.parquet" for k in range(len(SIZES))]
OUTPUT_COLUMNS = ["item_id", "category", "score", "label", "model_version"]


def _catalog(tmp_path: Path, bucket: S3Bucket) -> Path:
    """The conftest catalog, written locally and uploaded to s3://bucket/catalog/."""
    local = tmp_path / "catalog"
    write_shards(local, SIZES, row_group_rows=1000)
    for p in sorted(local.glob("*.parquet")):
        assert pq.ParquetFile(p).num_row_groups >= 2
    bucket.upload_tree(local, "catalog")
    return local


def _job(tmp_path: Path, bucket: S3Bucket, *, name: str = "s3job", **keys: Any) -> Path:
    return bucket.write_job(
        tmp_path / f"{name}.toml",
        input=bucket.uri("catalog/"),
        output=bucket.uri("scored/"),
        passthrough=["category"],
        batch_size=512,
        **keys,
    )


def _run(*args: str) -> CliResult:
    """`run ARGS`, which must succeed."""
    r = cli("run", *args)
    assert r.returncode == 0, f"rc={r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r


def _json(bucket: S3Bucket, path: str) -> dict[str, Any]:
    """A JSON object in the bucket; a run report is checked against the report schema."""
    data: dict[str, Any] = json.loads(bucket.fs.cat_file(f"{bucket.name}/{path}"))
    if path.endswith("_report.json"):
        check_report(data, bucket.uri(path))
    return data


def _read(bucket: S3Bucket, path: str) -> pa.Table:
    return pq.read_table(io.BytesIO(bucket.fs.cat_file(f"{bucket.name}/{path}")))


def _etag(bucket: S3Bucket, path: str) -> str:
    return str(bucket.fs.info(f"{bucket.name}/{path}")["ETag"]).strip('"')


def _assert_scores(bundle: Path, t_in: pa.Table, t_out: pa.Table) -> None:
    assert t_out.column_names == OUTPUT_COLUMNS
    assert t_out.column("item_id").equals(t_in.column("item_id"))
    assert t_out.column("category").equals(t_in.column("category"))
    score, label = reference_scores(bundle, t_in)
    np.testing.assert_allclose(t_out.column("score").to_numpy(), score, atol=1e-6, rtol=0)
    np.testing.assert_array_equal(t_out.column("label").to_numpy(), label)


@pytest.mark.slow
def test_cli_scores_an_s3_catalog_into_s3(
    s3_bucket: S3Bucket, bundle_dir: Path, tmp_path: Path
) -> None:
    local = _catalog(tmp_path, s3_bucket)
    job = _job(tmp_path, s3_bucket, model=str(bundle_dir))
    # The default scheduler: forked local Dask workers, each using s3fs on its own.
    r = _run(str(job), "--scheduler", "local", "--workers", "2")
    assert "SUCCEEDED" in r.stdout and "7,300 scored" in r.stdout

    fs, b = s3_bucket.fs, s3_bucket.name
    rel = sorted(p[len(f"{b}/scored/") :] for p in fs.find(f"{b}/scored/"))
    assert {"_SUCCESS", "_SCORE_CATALOG"} <= set(rel), rel
    # The report and manifest are beside the output, in its control folder (pipeline.io.layout).
    control = sorted(fs.find(f"{b}/_score_catalog/scored/"))
    assert {p.rsplit("/", 1)[1] for p in control} >= {"_manifest.json", "_report.json"}, control
    # Everything else in the output root is hidden from dataset readers (_ or . in its path).
    assert [r for r in rel if not any(c.startswith(("_", ".")) for c in r.split("/"))] == SHARDS
    assert not any(".tmp-" in r for r in rel), rel
    for name in SHARDS:
        _assert_scores(bundle_dir, pq.read_table(local / name), _read(s3_bucket, f"scored/{name}"))

    rep = _json(s3_bucket, "_score_catalog/scored/_report.json")
    assert rep["status"] == "succeeded"
    assert rep["rows_in"] == rep["rows_out"] == sum(SIZES) and rep["rows_rejected"] == 0
    assert rep["shards_total"] == rep["shards_scored"] == len(SIZES)
    assert rep["input"] == s3_bucket.uri("catalog/")
    assert rep["output"] == s3_bucket.uri("scored/")
    assert [s["output"] for s in rep["shards"]] == [s3_bucket.uri(f"scored/{n}") for n in SHARDS]

    # The manifest fingerprints each input object by size and ETag (here the MD5 of its bytes).
    man = _json(s3_bucket, "_score_catalog/scored/_manifest.json")
    assert sorted(man["shards"]) == SHARDS
    for name in SHARDS:
        fp = man["shards"][name]["fingerprint"]
        data = (local / name).read_bytes()
        assert fp["version"] == _etag(s3_bucket, f"catalog/{name}")
        assert fp["version"] == hashlib.md5(data).hexdigest()
        assert fp["size"] == len(data)
        assert fp["num_rows"] == pq.ParquetFile(local / name).metadata.num_rows

    # The output root reads back as a dataset, straight from S3.
    table = ds.dataset(f"{b}/scored/", filesystem=fs, format="parquet").to_table()
    ids = table.column("item_id").to_numpy()
    assert len(ids) == sum(SIZES) and np.array_equal(np.sort(ids), np.arange(sum(SIZES)))
    assert table.column_names == OUTPUT_COLUMNS


def _replace_features(path: Path, seed: int) -> pa.Table:
    """The same ids and categories with other feature values; written as the original was."""
    t = pq.read_table(path)
    other = make_rows(int(t.column("item_id")[0].as_py()), t.num_rows, seed)
    for c in FEATURES:
        t = t.set_column(t.schema.get_field_index(c), c, other.column(c))
    return t


@pytest.mark.slow
def test_rerun_resumes_with_nothing_to_do(
    s3_bucket: S3Bucket, bundle_dir: Path, tmp_path: Path
) -> None:
    _catalog(tmp_path, s3_bucket)
    job = _job(tmp_path, s3_bucket, model=str(bundle_dir), scheduler="sync")
    _run(str(job))
    first = _json(s3_bucket, "_score_catalog/scored/_manifest.json")
    outputs = {n: s3_bucket.fs.info(f"{s3_bucket.name}/scored/{n}")["ETag"] for n in SHARDS}

    again = cli("run", str(job))
    rep = _json(s3_bucket, "_score_catalog/scored/_report.json")
    assert rep["shards_skipped"] == len(SIZES) and rep["shards_scored"] == 0
    assert rep["rows_out"] == sum(SIZES) and rep["rows_processed"] == 0
    assert _json(s3_bucket, "_score_catalog/scored/_manifest.json")["shards"] == first["shards"]
    # Nothing was rewritten: the output objects are the same objects.
    assert {n: s3_bucket.fs.info(f"{s3_bucket.name}/scored/{n}")["ETag"] for n in SHARDS} == outputs
    assert s3_bucket.fs.exists(f"{s3_bucket.name}/scored/_SUCCESS")
    assert (again.returncode, rep["status"]) == (0, "succeeded"), (
        f"a rerun that skipped every shard (nothing scored, nothing changed) should succeed "
        f"with exit 0; got exit {again.returncode}, status {rep['status']!r}, "
        f"warnings {rep.get('warnings')}"
    )


@pytest.mark.slow
def test_replaced_object_is_rescored_alone(
    s3_bucket: S3Bucket, bundle_dir: Path, tmp_path: Path
) -> None:
    local = _catalog(tmp_path, s3_bucket)
    job = _job(tmp_path, s3_bucket, model=str(bundle_dir), scheduler="sync")
    _run(str(job))
    first = _json(s3_bucket, "_score_catalog/scored/_manifest.json")

    # Overwrite one object with other content: same key, new ETag.
    name = SHARDS[1]
    new = _replace_features(local / name, seed=7)
    buf = io.BytesIO()
    pq.write_table(new, buf, row_group_size=1000)
    s3_bucket.fs.pipe_file(f"{s3_bucket.name}/catalog/{name}", buf.getvalue())
    assert _etag(s3_bucket, f"catalog/{name}") != first["shards"][name]["fingerprint"]["version"]

    _run(str(job))
    rep = _json(s3_bucket, "_score_catalog/scored/_report.json")
    assert rep["shards_scored"] == 1 and rep["shards_skipped"] == len(SIZES) - 1
    assert [s["status"] for s in rep["shards"]] == ["skipped", "scored", "skipped"]
    assert rep["rows_processed"] == SIZES[1] and rep["rows_out"] == sum(SIZES)
    _assert_scores(bundle_dir, new, _read(s3_bucket, f"scored/{name}"))
    for other in (SHARDS[0], SHARDS[2]):
        _assert_scores(
            bundle_dir, pq.read_table(local / other), _read(s3_bucket, f"scored/{other}")
        )
    man = _json(s3_bucket, "_score_catalog/scored/_manifest.json")["shards"]
    assert man[name]["fingerprint"]["version"] == hashlib.md5(buf.getvalue()).hexdigest()
    assert man[name]["run_id"] == rep["run_id"]
    for other in (SHARDS[0], SHARDS[2]):
        assert man[other] == first["shards"][other]


@pytest.mark.slow
def test_same_size_object_with_new_etag_is_rescored(
    s3_bucket: S3Bucket, bundle_dir: Path, tmp_path: Path
) -> None:
    """Only the ETag tells the rewritten object apart: same size, same row count."""
    local = tmp_path / "catalog"
    local.mkdir()
    # Plain encoding, no compression, no dictionary: float32 features take fixed space, so new
    # feature values give a file of exactly the same size.
    opts = {"row_group_size": 500, "compression": "none", "use_dictionary": False}
    pq.write_table(make_rows(0, 1200, 0), local / "a.parquet", **opts)
    pq.write_table(make_rows(1200, 900, 0), local / "b.parquet", **opts)
    s3_bucket.upload_tree(local, "catalog")
    job = _job(tmp_path, s3_bucket, model=str(bundle_dir), scheduler="sync")
    _run(str(job))

    new = _replace_features(local / "b.parquet", seed=3)
    buf = io.BytesIO()
    pq.write_table(new, buf, **opts)
    assert len(buf.getvalue()) == (local / "b.parquet").stat().st_size
    s3_bucket.fs.pipe_file(f"{s3_bucket.name}/catalog/b.parquet", buf.getvalue())

    _run(str(job))
    rep = _json(s3_bucket, "_score_catalog/scored/_report.json")
    assert [s["status"] for s in rep["shards"]] == ["skipped", "scored"]
    _assert_scores(bundle_dir, new, _read(s3_bucket, "scored/b.parquet"))


SECRET_KEY = "AKIASCORECATALOGTEST7"
SECRET = "s3cr3t-Zq9vXw7Lp2Kd8Rt5-never-log-me"


@pytest.mark.slow
def test_model_from_s3_and_credentials_never_appear(
    s3_bucket: S3Bucket, bundle_dir: Path, tmp_path: Path
) -> None:
    local = _catalog(tmp_path, s3_bucket)
    s3_bucket.upload_tree(bundle_dir, "models/test-mlp")
    # Only the flags carry these credentials (moto accepts any); the environment has others.
    s3_bucket.key, s3_bucket.secret = SECRET_KEY, SECRET
    flags = [
        f"--storage-option=endpoint_url={s3_bucket.endpoint}",
        f"--storage-option=key={SECRET_KEY}",
        f"--storage-option=secret={SECRET}",
    ]
    args = [
        *job_args(
            s3_bucket.uri("catalog"), s3_bucket.uri("scored"), s3_bucket.uri("models/test-mlp")
        ),
        "--passthrough",
        "category",
        "--scheduler",
        "sync",
        "--batch-size",
        "1000",
        *flags,
    ]
    r = _run(*args)  # default verbosity: INFO
    rep = _json(s3_bucket, "_score_catalog/scored/_report.json")
    assert rep["model"]["uri"] == s3_bucket.uri("models/test-mlp")
    bundle_sha = hashlib.sha256(
        (bundle_dir / "model.toml").read_bytes() + (bundle_dir / "model.pt2").read_bytes()
    ).hexdigest()
    assert rep["model"]["sha256"] == bundle_sha
    assert rep["rows_out"] == sum(SIZES)
    for name in SHARDS:
        _assert_scores(bundle_dir, pq.read_table(local / name), _read(s3_bucket, f"scored/{name}"))

    # A failing run (the model's weights vanished) prints its errors too: still no credentials.
    s3_bucket.fs.rm_file(f"{s3_bucket.name}/models/test-mlp/model.pt2")
    failed = cli("run", *args, "--force", "-v")  # -v: DEBUG
    assert failed.returncode == 3, failed.stderr
    assert "model.pt2" in failed.stderr

    texts = {
        "stdout": r.stdout,
        "stderr": r.stderr,
        "failed stdout": failed.stdout,
        "failed stderr": failed.stderr,
    }
    found = s3_bucket.fs.find(f"{s3_bucket.name}/scored/")
    found += s3_bucket.fs.find(f"{s3_bucket.name}/_score_catalog/scored/")
    for path in found:
        if not path.endswith(".parquet"):
            texts[path] = s3_bucket.fs.cat_file(path).decode()
    assert any(k.endswith("_report.json") for k in texts)
    assert any(k.endswith("_manifest.json") for k in texts)
    for where, text in texts.items():
        assert SECRET not in text, f"the secret appears in {where}"
        if where != "failed stderr":  # -v: see test_debug_log_does_not_show_the_access_key_id
            assert SECRET_KEY not in text, f"the access key id appears in {where}"


def test_debug_log_does_not_show_the_access_key_id(s3_bucket: S3Bucket, tmp_path: Path) -> None:
    """docs/failure-handling.md: storage option values are never logged; -v turns on botocore's
    DEBUG logging."""
    _catalog(tmp_path, s3_bucket)
    r = cli(
        "run",
        "--input",
        s3_bucket.uri("catalog"),
        "--output",
        s3_bucket.uri("scored"),
        "--model",
        s3_bucket.uri("models/none"),  # exits 3 after listing and reading footers
        "--scheduler",
        "sync",
        f"--storage-option=endpoint_url={s3_bucket.endpoint}",
        f"--storage-option=key={SECRET_KEY}",
        f"--storage-option=secret={SECRET}",
        "-v",
    )
    assert r.returncode == 3, r.stderr[-3000:]
    assert SECRET not in r.stdout + r.stderr
    leaks = [line[:200] for line in r.stderr.splitlines() if SECRET_KEY in line]
    assert not leaks, (
        f"with -v the access key id given by --storage-option key=... is logged "
        f"{len(leaks)} times (botocore's DEBUG request logging), e.g. {leaks[0]}"
    )


def test_missing_bucket_is_an_input_error_naming_the_uri(
    s3_bucket: S3Bucket, bundle_dir: Path, tmp_path: Path
) -> None:
    missing = "no-such-bucket-" + s3_bucket.name[-8:]
    job = s3_bucket.write_job(
        tmp_path / "job.toml",
        input=f"s3://{missing}/catalog/",
        output=s3_bucket.uri("scored/"),
        model=str(bundle_dir),
        scheduler="sync",
    )
    r = cli("run", str(job))
    assert r.returncode == 3, f"rc={r.returncode}\n{r.stderr}"
    assert f"s3://{missing}/catalog/" in r.stderr
    assert "Traceback" not in r.stderr
    assert not s3_bucket.fs.exists(f"{s3_bucket.name}/scored/")


@pytest.mark.slow
def test_unreachable_endpoint_is_a_storage_error_naming_the_uri(
    s3_bucket: S3Bucket, bundle_dir: Path, tmp_path: Path
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    storage = {**s3_bucket.storage_options, "endpoint_url": dead}
    job = s3_bucket.write_job(
        tmp_path / "job.toml",
        storage=storage,
        input=s3_bucket.uri("catalog/"),
        output=s3_bucket.uri("scored/"),
        model=str(bundle_dir),
        scheduler="sync",
    )
    r = cli("run", str(job), timeout=120)
    # Exit 1 (a run that failed on storage: alert and rerun), with one clear line, no traceback.
    assert r.returncode == 1, f"rc={r.returncode}\n{r.stderr}"
    assert "Traceback" not in r.stderr, r.stderr
    assert s3_bucket.uri("catalog/") in r.stderr, r.stderr
    assert "error:" in r.stderr


@pytest.mark.parametrize("size", [1_000, 12 * 2**20], ids=["one-put", "multipart"])
def test_an_aborted_staged_write_publishes_nothing(s3_bucket: S3Bucket, size: int) -> None:
    """A write that fails (or whose fence refuses) must not complete the upload: fsspec's
    ``with fs.open(...)`` would close the file, and so publish the partial object."""
    from pipeline.io import storage

    loc = storage.locate(s3_bucket.uri("out/part-0.parquet"), s3_bucket.storage_options)

    def refuse() -> None:
        raise RuntimeError("lost the lock")

    with (
        pytest.raises(RuntimeError, match="lost the lock"),
        storage.staged_open(loc, before_publish=refuse) as f,
    ):
        f.write(b"x" * size)
    with pytest.raises(ValueError, match="mid-write"), storage.staged_open(loc) as f:
        f.write(b"y" * size)
        raise ValueError("mid-write")
    assert not s3_bucket.new_fs().exists(s3_bucket.uri("out/part-0.parquet"))
    with storage.staged_open(loc) as f:  # and a write that succeeds is published
        f.write(b"z" * size)
    assert s3_bucket.new_fs().cat(s3_bucket.uri("out/part-0.parquet")) == b"z" * size
