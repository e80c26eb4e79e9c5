"""A Delta table on the S3 test server (moto over HTTP on 127.0.0.1), through delta-rs's own
object store, with the job's s3fs-style ``[storage]`` options translated by
``pipeline.sinks.delta.table``; data files written through ``pipeline.io.storage`` (s3fs),
as workers do.

Racing writers are real processes (spawned: a forked child that calls delta-rs after its
parent did panics), released together by a barrier.
"""

from __future__ import annotations

from typing import Any

import polars as pl
import pyarrow as pa
import pytest
from deltalake import DeltaTable

from pipeline.core.errors import AlreadyCommitted, TableSchemaError, UsageError
from pipeline.sinks.delta import table as delta
from pipeline.sinks.delta.table import TableRef
from tests.delta_helpers import (
    PARTITION,
    SCHEMA,
    day,
    deltalake_rows,
    expected,
    polars_rows,
    race,
    race_commit,
    race_create,
    rows,
    sorted_rows,
    write_file,
)
from tests.integration.servers import S3Bucket

pytestmark = pytest.mark.integration


def _table(bucket: S3Bucket, name: str = "scored") -> TableRef:
    return TableRef.of(bucket.uri(name), bucket.storage_options)


def _commit(ref: TableRef, adds: list[Any], removes: list[str], v: int, **meta: str) -> int:
    return delta.commit(
        ref,
        adds=adds,
        removes=removes,
        app_id="nightly",
        run_version=v,
        metadata={"run_id": f"run-{v}", "model_sha256": "c" * 64, **meta},
        expected_schema=SCHEMA,
    )


def test_options_reach_delta_rs(s3_bucket: S3Bucket) -> None:
    ref = _table(s3_bucket)
    assert dict(ref.delta_options) == {
        "AWS_ACCESS_KEY_ID": s3_bucket.key,
        "AWS_SECRET_ACCESS_KEY": s3_bucket.secret,
        "AWS_ENDPOINT_URL": s3_bucket.endpoint,
        "AWS_ALLOW_HTTP": "true",
        "AWS_REGION": "us-east-1",
        "retry_timeout": "60s",  # the default retry deadline bounds delta-rs's own retries
    }
    assert delta.ensure_table(ref, SCHEMA, [PARTITION], allow_new_columns=False)
    keys = sorted(s3_bucket.fs.find(f"{s3_bucket.name}/scored/"))
    assert keys == [f"{s3_bucket.name}/scored/_delta_log/00000000000000000000.json"]
    # credentials from the environment (the fixture's), only the endpoint in [storage]
    env_only = TableRef.of(ref.uri, {"endpoint_url": s3_bucket.endpoint})
    assert delta.snapshot(env_only).version == 0


@pytest.mark.slow
def test_racing_creators_on_s3_create_one_table(s3_bucket: S3Bucket) -> None:
    uri = s3_bucket.uri("raced")
    created = race(race_create, [(uri, s3_bucket.storage_options, i) for i in range(3)])
    assert sorted(c for _, c in created) == [False, False, True]
    log = s3_bucket.fs.find(f"{s3_bucket.name}/raced/_delta_log/")
    assert [k.rsplit("/", 1)[1] for k in log] == ["00000000000000000000.json"]
    assert (
        DeltaTable(uri, storage_options=dict(_table(s3_bucket, "raced").delta_options)).version()
        == 0
    )


@pytest.mark.slow
def test_racing_commits_land_once_each(s3_bucket: S3Bucket) -> None:
    ref = _table(s3_bucket)
    delta.ensure_table(ref, SCHEMA, [PARTITION], allow_new_columns=False)
    opts = s3_bucket.storage_options
    # two jobs, two partitions: both land, one version each
    a = [write_file(ref, rows(range(0, 30), "m1"), day("d1"))]
    b = [write_file(ref, rows(range(100, 130), "m1"), day("d2"))]
    out = race(race_commit, [(ref.uri, opts, a, "job-a", 1), (ref.uri, opts, b, "job-b", 1)])
    assert sorted((app, kind, v) for app, kind, v in out) in (
        [("job-a", "committed", 1), ("job-b", "committed", 2)],
        [("job-a", "committed", 2), ("job-b", "committed", 1)],
    )
    table = DeltaTable(ref.table_uri, storage_options=dict(ref.delta_options))
    assert (
        table.version(),
        table.transaction_version("job-a"),
        table.transaction_version("job-b"),
    ) == (2, 1, 1)
    # the same job twice at once (a retry racing the original): exactly one lands
    c = [write_file(ref, rows(range(200, 210), "m2"), day("d3"))]
    d = [write_file(ref, rows(range(300, 310), "m2"), day("d4"))]
    out = race(race_commit, [(ref.uri, opts, c, "job-a", 2), (ref.uri, opts, d, "job-a", 2)])
    kinds = sorted(kind for _, kind, _ in out)
    assert kinds[0] in ("AlreadyCommitted", "CommitConflict") and kinds[1] == "committed", out
    loser = next(msg for _, kind, msg in out if kind != "committed")
    assert ref.uri in loser and ("another writer committed" in loser or "already holds" in loser)
    table = DeltaTable(ref.table_uri, storage_options=dict(ref.delta_options))
    assert (table.version(), table.transaction_version("job-a")) == (3, 2)
    landed = {r[2] for r in polars_rows(ref)} - {"d1", "d2"}
    assert landed in ({"d3"}, {"d4"})


def test_a_table_on_s3_end_to_end(s3_bucket: S3Bucket) -> None:
    """Two runs, a refused retry, filters, time travel, rollback, vacuum and history on S3."""
    ref = _table(s3_bucket)
    delta.ensure_table(ref, SCHEMA, [PARTITION], allow_new_columns=False)
    v1 = [
        write_file(ref, rows(range(k * 100, k * 100 + 40), "m1"), day("d1"), row_group_rows=9)
        for k in range(3)
    ]
    v1 += [write_file(ref, rows(range(900, 920), "m1"), day("d2"))]
    assert _commit(ref, v1, [], 1, rows="140") == 1
    v2 = [write_file(ref, rows(range(300), "m2"), day("d1"), row_group_rows=64)]
    replaced = [f.path for f in delta.snapshot(ref, day("d1")).files]
    assert _commit(ref, v2, replaced, 2, rows="300") == 2
    with pytest.raises(AlreadyCommitted):
        _commit(ref, [write_file(ref, rows(range(5), "m2"), day("d1"))], [], 2)
    with pytest.raises(AlreadyCommitted):
        _commit(ref, [write_file(ref, rows(range(5), "m1"), day("d1"))], [], 1)

    first = expected(
        {
            "d1": ([i for k in range(3) for i in range(k * 100, k * 100 + 40)], "m1"),
            "d2": (range(900, 920), "m1"),
        }
    )
    second = expected({"d1": (range(300), "m2"), "d2": (range(900, 920), "m1")})
    assert deltalake_rows(ref) == polars_rows(ref) == sorted_rows(delta.read(ref)) == second
    assert deltalake_rows(ref, version=1) == polars_rows(ref, version=1) == first
    # stats-pruned reads return exactly the matching rows
    want = [r for r in first if 110 <= r[0] <= 215]
    assert deltalake_rows(ref, version=1, filters=[("id", ">=", 110), ("id", "<=", 215)]) == want
    assert polars_rows(ref, version=1, predicate=pl.col("id").is_between(110, 215)) == want

    assert delta.restore(ref, 1, {"run_id": "rollback"}) == 3
    assert deltalake_rows(ref) == polars_rows(ref) == first
    assert delta.vacuum(ref, dry_run=False) == []  # the retention keeps version 2's file
    assert polars_rows(ref, version=2) == second
    with pytest.raises(UsageError, match="refused"):
        delta.vacuum(ref, 1, dry_run=False)

    entries = delta.history(ref)
    assert [(e.version, e.operation) for e in entries] == [
        (3, "RESTORE"),
        (2, "WRITE"),
        (1, "WRITE"),
        (0, "CREATE TABLE"),
    ]
    assert (entries[1].run_id, entries[1].rows, entries[1].partition) == (
        "run-2",
        300,
        "run_date=d1",
    )
    assert entries[1].metadata["app_id"] == "nightly" and entries[1].model_sha256 == "c" * 64
    assert entries[0].detail == "restored version 1" and entries[0].run_id == "rollback"


def test_schema_changes_are_refused_on_s3(s3_bucket: S3Bucket) -> None:
    ref = _table(s3_bucket)
    delta.ensure_table(ref, SCHEMA, [PARTITION], allow_new_columns=False)
    with pytest.raises(TableSchemaError, match="'id' is long in the table and string"):
        delta.ensure_table(
            ref, SCHEMA.set(0, pa.field("id", pa.string())), [PARTITION], allow_new_columns=True
        )
    with pytest.raises(TableSchemaError, match="partitioned by"):
        delta.ensure_table(ref, SCHEMA, [], allow_new_columns=False)


def test_a_partition_rolls_back_alone_on_s3(s3_bucket: S3Bucket) -> None:
    """One partition back to version 1 on S3: its files as they were, the other partition as
    it is now, the run's token kept; a file a VACUUM deleted is refused, nothing committed."""
    ref = _table(s3_bucket)
    delta.ensure_table(ref, SCHEMA, [PARTITION], allow_new_columns=False)
    a = [write_file(ref, rows(range(40), "m1"), day("d1"), row_group_rows=9)]
    _commit(ref, [*a, write_file(ref, rows(range(900, 920), "m1"), day("d2"))], [], 1)
    d2 = [write_file(ref, rows(range(900, 930), "m2"), day("d2"))]
    replaced = [f.path for f in delta.snapshot(ref, day("d2")).files]
    _commit(ref, d2, replaced, 2)
    _commit(ref, [write_file(ref, rows(range(40), "m2"), day("d1"))], [a[0].path], 3)

    assert delta.restore_partition(ref, 1, day("d1"), {"reason": "m2 bad"}) == 4
    want = expected({"d1": (range(40), "m1"), "d2": (range(900, 930), "m2")})
    assert deltalake_rows(ref) == polars_rows(ref) == sorted_rows(delta.read(ref)) == want
    assert (
        DeltaTable(ref.table_uri, storage_options=dict(ref.delta_options)).transaction_version(
            "nightly"
        )
        == 3
    )

    delta.vacuum(ref, 0, dry_run=False, force=True)  # deletes d1's m2 file, d2's m1 file
    with pytest.raises(UsageError, match="gone or changed"):
        delta.restore_partition(ref, 3, day("d1"))
    assert delta.history(ref, 1)[0].operation == "VACUUM END"
    assert deltalake_rows(ref) == want
