"""``format = "iceberg"`` on object storage through the real CLI: the table on the S3 test server
(moto over HTTP on 127.0.0.1), its catalog a local SQLite file given by the ``catalog`` key
(the embedded one cannot live on S3: refused with the fix). Workers write the data files
through fsspec; pyiceberg writes the metadata to the bucket with the job's ``[storage]``
options as its FileIO properties. The table is read back here by pyiceberg through the catalog
the report names: each day's rows exact, a rescore of a day one new snapshot."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import demo_bundles, reference_scores, write_shards
from tests.integration.helpers import check_report, cli
from tests.integration.servers import REGION, S3Bucket, toml_job

pytest.importorskip("pyiceberg")
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.table import Table

pytestmark = pytest.mark.integration

DAYS = ["2025-01-01", "2025-01-02", "2025-01-03"]
ID = "item_id"
#: moto takes any credentials: the catalog's own (a secret the report must never show).
CATALOG_SECRET = "catalog-S3CRET-value"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return demo_bundles(tmp_path_factory.mktemp, 2)


@pytest.fixture
def archive(tmp_path: Path, s3_bucket: S3Bucket) -> Path:
    """Three daily partitions of two shards, local and uploaded to s3://bucket/archive/."""
    local = tmp_path / "archive"
    for k, day in enumerate(DAYS):
        write_shards(local / f"dt={day}", [700, 500], row_group_rows=300, start=10_000 * k, seed=k)
    s3_bucket.upload_tree(local, "archive")
    return local


def _job(
    tmp_path: Path, bucket: S3Bucket, model: Path, catalog: str | dict[str, str] | None
) -> Path:
    keys: dict[str, Any] = {
        "input": bucket.uri("archive/dt={date}"),
        "output": bucket.uri("scored/dt={date}"),
        "model": str(model),
        "format": "iceberg",
        "scheduler": "sync",
        "batch_size": 512,
    }
    if isinstance(catalog, str):
        keys["catalog"] = catalog
    text = toml_job(keys, bucket.storage_options)
    if isinstance(catalog, dict):
        text += "[catalog]\n" + "".join(f'"{k}" = "{v}"\n' for k, v in catalog.items())
    path = tmp_path / "nightly.toml"
    path.write_text(text + "[monitoring]\ndrift = false\n")
    return path


def _report(bucket: S3Bucket, day: str) -> dict[str, Any]:
    key = f"{bucket.name}/_score_catalog/scored/dt={day}/_report.json"
    rep: dict[str, Any] = json.loads(bucket.fs.cat_file(key))
    check_report(rep, key)
    return rep


def _table(bucket: S3Bucket, section: dict[str, Any]) -> Table:
    """The table the report names (its catalog and identifier), opened as any reader would:
    with the bucket's endpoint and credentials as pyiceberg's S3 properties."""
    uri = section["catalog"] if isinstance(section["catalog"], str) else section["catalog"]["uri"]
    assert uri.startswith("sqlite:///")
    props = {
        "s3.endpoint": bucket.endpoint,
        "s3.access-key-id": bucket.key,
        "s3.secret-access-key": bucket.secret,
        "s3.region": REGION,
    }
    return SqlCatalog("score_catalog", uri=uri, **props).load_table(section["identifier"])


def _check_day(table: Table, archive: Path, bundle: Path, day: str, version: str) -> None:
    """The table's rows of ``day`` are exactly the day's input ids, scored by ``bundle``."""
    inputs = pa.concat_tables(
        [pq.read_table(p) for p in sorted((archive / f"dt={day}").glob("*.parquet"))]
    ).sort_by(ID)
    rows = table.scan(row_filter=f"dt == '{day}'").to_arrow().sort_by(ID)
    assert rows.column(ID).to_pylist() == inputs.column(ID).to_pylist()
    assert set(rows.column("model_version").to_pylist()) == {version}
    score, _ = reference_scores(bundle, inputs)
    np.testing.assert_allclose(rows.column("score").to_numpy(), score, atol=1e-6, rtol=0)


def test_a_backfill_to_s3_with_a_local_sql_catalog_and_a_rescore_as_one_snapshot(
    tmp_path: Path, s3_bucket: S3Bucket, archive: Path, models: dict[str, Path]
) -> None:
    db = tmp_path / "catalogs" / "lake.db"
    job = _job(tmp_path, s3_bucket, models["1"], f"sqlite:///{db}")
    done = cli("backfill", str(job), "--from", DAYS[0], "--to", DAYS[-1])
    assert done.returncode == 0, done.output
    section = _report(s3_bucket, DAYS[0])["output_format"]
    assert section["catalog"] == f"sqlite:///{db}"
    assert section["identifier"] == "score_catalog.scored"
    table = _table(s3_bucket, section)
    assert table.metadata.location == s3_bucket.uri("scored")
    assert table.metadata_location.startswith(s3_bucket.uri("scored/metadata/"))
    for day in DAYS:
        _check_day(table, archive, models["1"], day, "1")
    assert len(table.snapshots()) == 3
    # Nothing of the table on local disk but the catalog file (no embedded catalog made).
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file() and ".db" in p.name) == [
        "lake.db"
    ]
    before = table.current_snapshot()
    assert before is not None

    rescore = cli("run", str(job), "--date", DAYS[1], "--model", str(models["2"]))
    assert rescore.returncode == 0, rescore.output
    rep = _report(s3_bucket, DAYS[1])["output_format"]
    table = table.refresh()
    assert len(table.snapshots()) == 4  # exactly one new snapshot
    now = table.current_snapshot()
    assert now is not None and now.parent_snapshot_id == before.snapshot_id
    assert rep["snapshot_id"] == now.snapshot_id and rep["committed"] is True
    assert now.summary is not None and now.summary["changed-partition-count"] == "1"
    _check_day(table, archive, models["2"], DAYS[1], "2")
    for day in (DAYS[0], DAYS[2]):
        _check_day(table, archive, models["1"], day, "1")
    # The replaced files are gone from the partition as readers see it, not from the bucket
    # (earlier snapshots still read them).
    old = table.scan(row_filter=f"dt == '{DAYS[1]}'", snapshot_id=before.snapshot_id)
    assert set(old.to_arrow().column("model_version").to_pylist()) == {"1"}


def test_the_embedded_catalog_is_refused_on_s3_and_a_catalog_table_keeps_its_secrets(
    tmp_path: Path, s3_bucket: S3Bucket, archive: Path, models: dict[str, Path]
) -> None:
    refused = cli("run", str(_job(tmp_path, s3_bucket, models["1"], None)), "--date", DAYS[0])
    assert refused.returncode == 2, refused.output
    assert "is on object storage, where the embedded SQLite catalog cannot live" in refused.output
    assert "set catalog (--catalog, SCORE_CATALOG_CATALOG)" in refused.output
    assert not s3_bucket.fs.exists(f"{s3_bucket.name}/scored")

    db = tmp_path / "lake.db"
    props = {
        "name": "lake",
        "type": "sql",
        "uri": f"sqlite:///{db}",
        "s3.access-key-id": "catalog-key-id",
        "s3.secret-access-key": CATALOG_SECRET,
    }
    job = _job(tmp_path, s3_bucket, models["1"], props)
    done = cli("run", str(job), "--date", DAYS[0], "-v")
    assert done.returncode == 0, done.output
    assert CATALOG_SECRET not in done.output and "catalog-key-id" not in done.output
    rep = _report(s3_bucket, DAYS[0])
    assert rep["output_format"]["catalog"] == {
        "name": "lake",
        "type": "sql",
        "uri": f"sqlite:///{db}",
    }
    for key in ("_report.json", "_manifest.json", "_report.html"):
        found = s3_bucket.fs.cat_file(f"{s3_bucket.name}/_score_catalog/scored/dt={DAYS[0]}/{key}")
        assert CATALOG_SECRET.encode() not in found and b"catalog-key-id" not in found, key
    table = SqlCatalog(
        "lake",
        uri=f"sqlite:///{db}",
        **{
            "s3.endpoint": s3_bucket.endpoint,
            "s3.access-key-id": "any",
            "s3.secret-access-key": "any",
            "s3.region": REGION,
        },
    ).load_table("score_catalog.scored")
    _check_day(table, archive, models["1"], DAYS[0], "1")
    assert os.path.getsize(db) > 0
    data = s3_bucket.fs.find(f"{s3_bucket.name}/scored/dt={DAYS[0]}/")
    assert len(data) == 2 and all(k.endswith(".parquet") for k in data)
    assert pq.read_table(io.BytesIO(s3_bucket.fs.cat_file(data[0]))).num_rows in (700, 500)
