"""The driver side of a Delta table (pipeline.sinks.delta.table) on local disk, with real
delta-rs.

Data files are real Parquet files with several row groups, written into the table's folder
the way a worker writes them (tests/delta_helpers.py); what readers see is read back by
deltalake's own reader and by Polars, never from our own bookkeeping. The S3 and multi-process
cases are in tests/integration/test_deltatable_s3.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from pipeline.core.errors import (
    AlreadyCommitted,
    CommitConflict,
    CommitRefused,
    ConfigError,
    NotATableError,
    TableSchemaError,
    UsageError,
)
from pipeline.sinks.delta import commit as commit_mod
from pipeline.sinks.delta import history as history_mod
from pipeline.sinks.delta import table as delta
from pipeline.sinks.delta.stats import NewFile
from pipeline.sinks.delta.table import TableRef
from tests.delta_helpers import (
    PARTITION,
    SCHEMA,
    day,
    deltalake_rows,
    expected,
    polars_rows,
    race,
    race_create,
    rows,
    sorted_rows,
    write_file,
)

META = {"run_id": "r1", "model_sha256": "a" * 64, "settings_hash": "s1", "input_fingerprint": "f1"}


@pytest.fixture
def ref(tmp_path: Path) -> TableRef:
    r = TableRef.of(str(tmp_path / "scored"))
    assert delta.ensure_table(r, SCHEMA, [PARTITION], allow_new_columns=False)
    return r


def _commit(
    ref: TableRef, adds: list[NewFile], removes: Sequence[str] = (), *, v: int, **meta: str
) -> int:
    return delta.commit(
        ref,
        adds=adds,
        removes=list(removes),
        app_id="job",
        run_version=v,
        metadata={**META, "rows": str(sum(a.rows for a in adds)), **meta},
        expected_schema=SCHEMA,
    )


def _log(ref: TableRef, version: int) -> list[dict[str, Any]]:
    path = Path(ref.location.path) / "_delta_log" / f"{version:020d}.json"
    return [json.loads(line) for line in path.read_text().splitlines()]


# --------------------------------------------------------------------------- storage options


def test_storage_options_map_to_delta_rs() -> None:
    opts = {
        "key": "AKIAEXAMPLEKEY",
        "secret": "very-secret-value",
        "token": "session-token-value",
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000", "region_name": "eu-west-1"},
        "retry_deadline_s": 30,
        "use_listings_cache": False,
        "config_kwargs": {"retries": {"max_attempts": 2}, "s3": {"addressing_style": "path"}},
        "requester_pays": "true",
    }
    assert delta.delta_storage_options("s3://b/scored", opts) == {
        "AWS_ACCESS_KEY_ID": "AKIAEXAMPLEKEY",
        "AWS_SECRET_ACCESS_KEY": "very-secret-value",
        "AWS_SESSION_TOKEN": "session-token-value",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
        "AWS_ALLOW_HTTP": "true",
        "AWS_REGION": "eu-west-1",
        "AWS_VIRTUAL_HOSTED_STYLE_REQUEST": "false",
        "AWS_REQUEST_PAYER": "true",
        "retry_timeout": "30s",  # the job's retry deadline bounds delta-rs's own retries
    }
    https = delta.delta_storage_options(
        "s3a://b/t", {"endpoint_url": "https://s3.example", "anon": True, "profile": "p"}
    )
    assert https == {
        "AWS_ENDPOINT_URL": "https://s3.example",
        "AWS_SKIP_SIGNATURE": "true",
        "AWS_PROFILE": "p",
        "retry_timeout": "60s",
    }
    assert delta.delta_storage_options("/data/scored", opts) == {}
    assert delta.delta_storage_options("file:///data/scored", {}) == {}


def test_unknown_storage_options_are_named_never_their_values() -> None:
    opts = {
        "key": "AKIAEXAMPLEKEY",
        "secret": "very-secret-value",
        "sse": "aws:kms",
        "client_kwargs": {"verify": "/ca.pem"},
    }
    with pytest.raises(ConfigError) as e:
        delta.delta_storage_options("s3://b/t", opts)
    msg = str(e.value)
    assert "'client_kwargs.verify'" in msg and "'sse'" in msg and "s3://b/t" in msg
    assert "very-secret-value" not in msg and "AKIAEXAMPLEKEY" not in msg and "aws:kms" not in msg
    with pytest.raises(ConfigError, match="different endpoints"):
        delta.delta_storage_options(
            "s3://b/t", {"endpoint_url": "http://a", "client_kwargs": {"endpoint_url": "http://b"}}
        )
    with pytest.raises(ConfigError, match=r"local path or s3://.*gs://"):
        delta.delta_storage_options("gs://b/t", {})


def test_table_ref_hides_credentials() -> None:
    ref = TableRef.of("s3://b/t", {"key": "AKIAEXAMPLEKEY", "secret": "very-secret-value"})
    assert "very-secret-value" not in repr(ref) and "AKIAEXAMPLEKEY" not in repr(ref)
    assert ref._scrub("denied for very-secret-value") == "denied for ***"


# --------------------------------------------------------------------------- create once


def test_create_once_writes_version_zero(tmp_path: Path) -> None:
    ref = TableRef.of(str(tmp_path / "t"))
    assert delta.ensure_table(ref, SCHEMA, [PARTITION], allow_new_columns=False)
    assert not delta.ensure_table(ref, SCHEMA, [PARTITION], allow_new_columns=False)
    assert sorted(os.listdir(tmp_path / "t" / "_delta_log")) == ["00000000000000000000.json"]
    actions = _log(ref, 0)
    assert [next(iter(a)) for a in actions] == ["commitInfo", "protocol", "metaData"]
    assert actions[1]["protocol"] == {"minReaderVersion": 1, "minWriterVersion": 2}
    table = DeltaTable(ref.table_uri)
    assert table.version() == 0
    assert table.metadata().partition_columns == [PARTITION]
    assert table.metadata().configuration == {
        "delta.logRetentionDuration": "interval 30 days",
        "delta.deletedFileRetentionDuration": "interval 30 days",
        # whose table it is: a run writes only into tables this tool created
        "score_catalog.writer": "score-catalog",
    }
    assert pa.schema(table.schema().to_arrow()).names == [*SCHEMA.names, PARTITION]
    # an empty table is readable by the readers
    assert deltalake_rows(ref) == [] and polars_rows(ref) == []
    assert delta.read(ref).schema == pa.schema([*SCHEMA, pa.field(PARTITION, pa.string())])


def test_retention_is_configurable_and_consistent(tmp_path: Path) -> None:
    ref = TableRef.of(str(tmp_path / "t"))
    delta.ensure_table(
        ref,
        SCHEMA,
        [],
        allow_new_columns=False,
        log_retention_days=10,
        deleted_file_retention_days=14,
    )
    assert DeltaTable(ref.table_uri).metadata().configuration == {
        "delta.logRetentionDuration": "interval 10 days",
        "delta.deletedFileRetentionDuration": "interval 14 days",
        "score_catalog.writer": "score-catalog",
    }
    # The job's [delta] table changed since: the next run brings the table's properties to it.
    delta.ensure_table(
        ref, SCHEMA, [], allow_new_columns=False, log_retention_days=20,
        deleted_file_retention_days=20,
    )  # fmt: skip
    table = DeltaTable(ref.table_uri)
    assert table.metadata().configuration["delta.logRetentionDuration"] == "interval 20 days"
    assert table.metadata().configuration["delta.deletedFileRetentionDuration"] == (
        "interval 20 days"
    )
    assert table.history(1)[0]["operation"] == "SET TBLPROPERTIES"
    with pytest.raises(ValueError, match="must be >= log_retention_days"):
        delta.ensure_table(
            TableRef.of(str(tmp_path / "u")),
            SCHEMA,
            [],
            allow_new_columns=False,
            log_retention_days=30,
            deleted_file_retention_days=7,
        )


def test_naive_timestamps_get_the_protocol_they_need(tmp_path: Path) -> None:
    schema = pa.schema([("id", pa.int64()), ("at", pa.timestamp("us"))])
    ref = TableRef.of(str(tmp_path / "t"))
    delta.ensure_table(ref, schema, [], allow_new_columns=False)
    assert _log(ref, 0)[1]["protocol"] == {
        "minReaderVersion": 3,
        "minWriterVersion": 7,
        "readerFeatures": ["timestampNtz"],
        "writerFeatures": ["timestampNtz"],
    }
    data = pa.table(
        {"id": pa.array([1, 2], pa.int64()), "at": pa.array([0, 1_000_000], pa.timestamp("us"))}
    )
    new = write_file(ref, data)
    delta.commit(
        ref, adds=[new], removes=[], app_id="j", run_version=1, metadata={}, expected_schema=schema
    )
    assert pl.scan_delta(ref.table_uri).collect().height == 2
    assert delta.read(ref).column("at").type == pa.timestamp("us")


def test_a_table_past_its_log_retention_is_not_created_again(ref: TableRef) -> None:
    """After expired-log cleanup, version 0's JSON is gone and a checkpoint stands in for it;
    writing a new version 0 there would corrupt the table."""
    _commit(ref, [write_file(ref, rows(range(5), "m1"), day("d1"))], v=1)
    DeltaTable(ref.table_uri).create_checkpoint()
    log = Path(ref.location.path) / "_delta_log"
    (log / "00000000000000000000.json").unlink()
    assert not delta.ensure_table(ref, SCHEMA, [PARTITION], allow_new_columns=False)
    assert not (log / "00000000000000000000.json").exists()
    assert deltalake_rows(ref) == expected({"d1": (range(5), "m1")})


def test_a_creators_leftover_temporary_file_does_not_count(tmp_path: Path) -> None:
    log = tmp_path / "t" / "_delta_log"
    log.mkdir(parents=True)
    (log / ".00000000000000000000.json.tmp-0123456789ab").write_text("{")
    ref = TableRef.of(str(tmp_path / "t"))
    assert delta.ensure_table(ref, SCHEMA, [], allow_new_columns=False)
    assert DeltaTable(ref.table_uri).version() == 0


def test_racing_creators_create_one_table(tmp_path: Path) -> None:
    path = str(tmp_path / "t")
    created = race(race_create, [(path, {}, i) for i in range(3)])
    assert sorted(c for _, c in created) == [False, False, True]
    assert os.listdir(tmp_path / "t" / "_delta_log") == ["00000000000000000000.json"]
    assert DeltaTable(path).version() == 0


# --------------------------------------------------------------------------- schema


def test_partition_columns_must_match(ref: TableRef) -> None:
    with pytest.raises(TableSchemaError) as e:
        delta.ensure_table(ref, SCHEMA, ["region"], allow_new_columns=False)
    assert "partitioned by ['run_date'], this run by ['region']" in str(e.value)
    assert e.value.uri == ref.uri and e.value.exit_code == 3


def test_a_changed_type_is_refused(ref: TableRef) -> None:
    changed = SCHEMA.set(1, pa.field("score", pa.float64()))
    with pytest.raises(TableSchemaError) as e:
        delta.ensure_table(ref, changed, [PARTITION], allow_new_columns=True)
    msg = str(e.value)
    assert "column 'score' is float in the table and double in this run's output" in msg
    assert ref.uri in msg and "another table" in msg


def test_a_dropped_column_is_refused(ref: TableRef) -> None:
    with pytest.raises(TableSchemaError, match="has column 'score', which this run's output lacks"):
        delta.ensure_table(ref, SCHEMA.remove(1), [PARTITION], allow_new_columns=True)


def test_new_columns_need_schema_evolution(ref: TableRef) -> None:
    _commit(ref, [write_file(ref, rows(range(3), "m1"), day("d1"))], v=1)
    wider = SCHEMA.append(pa.field("label", pa.int64()))
    with pytest.raises(TableSchemaError, match=r"adds column 'label'.*allow schema evolution"):
        delta.ensure_table(ref, wider, [PARTITION], allow_new_columns=False)
    assert DeltaTable(ref.table_uri).version() == 1  # nothing changed
    assert not delta.ensure_table(ref, wider, [PARTITION], allow_new_columns=True)
    [entry] = delta.history(ref, 1)
    assert entry.operation == "ADD COLUMN" and entry.detail == "added column(s) label"
    data = rows(range(3, 5), "m2").append_column("label", pa.array([7, 8], pa.int64()))
    delta.commit(
        ref,
        adds=[write_file(ref, data, day("d2"))],
        removes=[],
        app_id="job",
        run_version=2,
        metadata={},
        expected_schema=wider,
    )
    got = delta.read(ref, columns=["id", "label"]).sort_by("id").to_pylist()
    assert got == [
        {"id": i, "label": label} for i, label in [(0, None), (1, None), (2, None), (3, 7), (4, 8)]
    ]
    assert polars_rows(ref, version=1) == expected({"d1": (range(3), "m1")})


@pytest.mark.parametrize(
    ("typ", "fix"),
    [
        (pa.uint64(), "no unsigned integers; cast it to int64"),
        (pa.timestamp("ns", tz="UTC"), "cast it to timestamp('us', tz='UTC')"),
        (pa.float16(), "which a Delta table cannot hold"),
        (pa.list_(pa.uint8()), "'x.element' is uint8"),
    ],
)
def test_types_delta_cannot_hold_are_refused(tmp_path: Path, typ: pa.DataType, fix: str) -> None:
    ref = TableRef.of(str(tmp_path / "t"))
    with pytest.raises(TableSchemaError, match=fix.replace("(", r"\(").replace(")", r"\)")):
        delta.ensure_table(ref, pa.schema([("x", typ)]), [], allow_new_columns=False)
    assert not (tmp_path / "t").exists()


# --------------------------------------------------------------------------- commit


def test_one_version_per_run_replacing_one_partition(ref: TableRef) -> None:
    v1_d1 = [write_file(ref, rows(range(i, i + 25), "m1"), day("d1")) for i in (0, 25)]
    v1_d2 = [write_file(ref, rows(range(100, 130), "m1"), day("d2"))]
    assert _commit(ref, v1_d1 + v1_d2, v=1) == 1
    assert pq.ParquetFile(Path(ref.location.path) / v1_d1[0].path).num_row_groups == 3
    # rescore d1 with a new model: its two files out, one in, d2 untouched; one version
    old = [f.path for f in delta.snapshot(ref, day("d1")).files]
    v2 = [write_file(ref, rows(range(50), "m2"), day("d1"))]
    assert _commit(ref, v2, old, v=2, run_id="r2") == 2
    log = _log(ref, 2)
    kinds = sorted(next(iter(a)) for a in log)
    assert kinds == ["add", "commitInfo", "remove", "remove", "txn"]
    assert next(a["txn"] for a in log if "txn" in a)["appId"] == "job"
    v1_rows = expected({"d1": (range(50), "m1"), "d2": (range(100, 130), "m1")})
    v2_rows = expected({"d1": (range(50), "m2"), "d2": (range(100, 130), "m1")})
    assert deltalake_rows(ref) == polars_rows(ref) == v2_rows
    assert deltalake_rows(ref, version=1) == polars_rows(ref, version=1) == v1_rows
    assert sorted_ids(delta.read(ref, version=1, partition=day("d1"))) == list(range(50))
    snap = delta.snapshot(ref)
    assert (snap.version, snap.rows, snap.transaction_version("job")) == (2, 80, 2)
    assert snap.transaction_version("other") is None
    assert {f.path for f in delta.snapshot(ref, day("d2")).files} == {v1_d2[0].path}


def sorted_ids(table: pa.Table) -> list[int]:
    return sorted(table.column("id").to_pylist())


def test_a_retried_run_never_commits_twice(ref: TableRef) -> None:
    first = write_file(ref, rows(range(10), "m1"), day("d1"))
    assert _commit(ref, [first], v=3) == 1
    for repeat in (3, 2):  # the same run again, and an older one
        again = write_file(ref, rows(range(10), "m1"), day("d1"))
        with pytest.raises(AlreadyCommitted) as e:
            _commit(ref, [again], v=repeat)
        assert (e.value.committed_version, e.value.table_version) == (3, 1)
        assert "already holds run version 3 of 'job' (table version 1)" in str(e.value)
    assert DeltaTable(ref.table_uri).version() == 1
    assert deltalake_rows(ref) == expected({"d1": (range(10), "m1")})
    assert _commit(ref, [write_file(ref, rows(range(10, 20), "m1"), day("d2"))], v=4) == 2


def _bad(ref: TableRef, case: str) -> NewFile:
    """A file description that does not fit the table, one way per ``case``."""
    good = write_file(ref, rows(range(10), "m1"), day("d1"))
    root = Path(ref.location.path)
    stats = json.loads(good.stats)
    stats["maxValues"]["id"] = 3  # the file holds 9
    edits: dict[str, dict[str, Any]] = {
        "absolute": {"path": str(root / good.path)},
        "outside": {"path": "run_date=d1/../../elsewhere/x.parquet"},
        "hidden": {"path": "run_date=d1/_part.parquet"},
        "wrong folder": {"partition_values": day("d2")},
        "size": {"size": good.size + 1},
        "rows": {"rows": good.rows + 1},
        "stats": {"stats": json.dumps(stats)},
    }
    if case in edits:
        return dataclasses.replace(good, **edits[case])
    if case == "missing":
        (root / good.path).unlink()
        return good
    other = {
        "extra column": rows(range(10), "m1").append_column("x", pa.array(range(10))),
        "other type": rows(range(10), "m1").set_column(
            0, "id", pa.array([str(i) for i in range(10)])
        ),
        "partition column inside": rows(range(10), "m1").append_column(
            PARTITION, pa.array(["d1"] * 10)
        ),
    }
    return write_file(ref, other[case], day("d1"))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("absolute", "not a plain relative path"),
        ("outside", "not a plain relative path"),
        ("hidden", "not a data file name"),
        ("wrong folder", "not in its partition's folder run_date=d2/"),
        ("missing", "missing (deleted, or never written)"),
        ("size", "bytes, the worker reported"),
        ("rows", "10 rows, the worker reported 11"),
        ("stats", "its stats do not match its footer"),
        ("extra column", "another schema: x: int64 (expected no such column)"),
        ("other type", "another schema: id: string (expected int64)"),
        ("partition column inside", "holds the partition column(s) ['run_date']"),
    ],
)
def test_commit_refuses_files_that_are_not_what_the_worker_wrote(
    ref: TableRef, case: str, message: str
) -> None:
    fine = write_file(ref, rows(range(100, 110), "m1"), day("d1"))
    bad = _bad(ref, case)
    with pytest.raises(CommitRefused) as e:
        _commit(ref, [fine, bad], v=1)
    assert message in str(e.value) and ref.uri in str(e.value)
    assert "Nothing was committed" in str(e.value)
    assert DeltaTable(ref.table_uri).version() == 0
    assert DeltaTable(ref.table_uri).transaction_version("job") is None


def test_a_path_already_in_the_table_is_refused(ref: TableRef) -> None:
    new = write_file(ref, rows(range(5), "m1"), day("d1"))
    _commit(ref, [new], v=1)
    with pytest.raises(CommitRefused, match="already in the table"):
        _commit(ref, [new], v=2)


def test_removing_a_file_that_is_no_longer_there_is_a_conflict(ref: TableRef) -> None:
    first = write_file(ref, rows(range(5), "m1"), day("d1"))
    _commit(ref, [first], v=1)
    replacement = write_file(ref, rows(range(5), "m2"), day("d1"))
    _commit(ref, [replacement], [first.path], v=2)
    late = write_file(ref, rows(range(5), "m3"), day("d1"))
    with pytest.raises(CommitConflict, match=r"no longer in .* at version 2.*another writer"):
        _commit(ref, [late], [first.path], v=3)
    assert DeltaTable(ref.table_uri).version() == 2


def test_commit_refuses_when_the_table_schema_moved(ref: TableRef) -> None:
    """A rollback past a schema change reverts the table's columns: files written for the
    newer schema must not be committed over it."""
    wider = SCHEMA.append(pa.field("label", pa.int64()))
    delta.ensure_table(ref, wider, [PARTITION], allow_new_columns=True)
    delta.restore(ref, 0)
    data = rows(range(2), "m1").append_column("label", pa.array([1, 2], pa.int64()))
    with pytest.raises(
        TableSchemaError, match=r"changed since this run started.*new column 'label'"
    ):
        delta.commit(
            ref,
            adds=[write_file(ref, data, day("d1"))],
            removes=[],
            app_id="job",
            run_version=1,
            metadata={},
            expected_schema=wider,
        )


def _race(monkeypatch: pytest.MonkeyPatch, module: Any, do: Callable[[TableRef], Any]) -> list[Any]:
    """Run ``do`` (another writer's commit) right after ``module``'s first table open."""
    real_open = module.open_table
    raced: list[Any] = []

    def open_then_race(r: TableRef, version: int | None = None) -> DeltaTable:
        table = real_open(r, version)
        if not raced:
            raced.append(None)  # first: the race's own commit opens the table too
            raced[0] = do(r)
        return table

    monkeypatch.setattr(module, "open_table", open_then_race)
    return raced


def test_the_same_run_version_landing_meanwhile_is_never_committed_twice(
    ref: TableRef, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit of the same token lands between our read of the table and our commit: ours
    fails (max_commit_retries=0), the table is read again, and the token refuses it."""
    raced = _race(
        monkeypatch,
        commit_mod,
        lambda r: _commit(r, [write_file(r, rows(range(90, 95), "other"), day("d9"))], v=6),
    )
    mine = write_file(ref, rows(range(5), "mine"), day("d1"))
    with pytest.raises(AlreadyCommitted, match="already holds run version 6"):
        _commit(ref, [mine], v=6)
    assert raced == [1]
    table = DeltaTable(ref.table_uri)
    assert (table.version(), table.transaction_version("job")) == (1, 6)
    assert polars_rows(ref) == expected({"d9": (range(90, 95), "other")})


def test_another_app_committing_meanwhile_does_not_block(
    ref: TableRef, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another app's commit (a run of another partition) lands between our read and our
    commit: ours is made again on the new version, and says which version it is."""

    def other(r: TableRef) -> int:
        return delta.commit(
            r,
            adds=[write_file(r, rows(range(90, 95), "other"), day("d9"))],
            removes=[],
            app_id="other-job",
            run_version=1,
            metadata={},
            expected_schema=SCHEMA,
        )

    _race(monkeypatch, commit_mod, other)
    assert _commit(ref, [write_file(ref, rows(range(5), "mine"), day("d1"))], v=1) == 2
    assert DeltaTable(ref.table_uri, version=2).transaction_version("job") == 1
    assert polars_rows(ref) == expected({"d1": (range(5), "mine"), "d9": (range(90, 95), "other")})


def test_commit_reports_its_own_version_when_another_lands_right_after(
    ref: TableRef, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The version a commit reports is the one it made, whatever lands right after it."""
    real_write = commit_mod._write
    monkeypatch.setattr(commit_mod, "_write", real_write)

    def write_then_another(*args: Any) -> None:
        real_write(*args)
        monkeypatch.setattr(commit_mod, "_write", real_write)  # the other's own commit
        r = args[0]
        other = write_file(r, rows(range(90, 95), "other"), day("d9"))
        delta.commit(
            r, adds=[other], removes=[], app_id="other-job", run_version=1, metadata={},
            expected_schema=SCHEMA,
        )  # fmt: skip

    monkeypatch.setattr(commit_mod, "_write", write_then_another)
    mine = write_file(ref, rows(range(5), "mine"), day("d1"))
    assert _commit(ref, [mine], v=1) == 1
    table = DeltaTable(ref.table_uri, version=1)
    assert table.transaction_version("job") == 1 and table.transaction_version("other-job") is None


def test_history_numbers_versions_right_when_a_commit_lands_meanwhile(
    ref: TableRef, monkeypatch: pytest.MonkeyPatch
) -> None:
    _commit(ref, [write_file(ref, rows(range(5), "m1"), day("d1"))], v=1)

    def other(r: TableRef) -> int:
        return delta.commit(
            r,
            adds=[write_file(r, rows(range(90, 95), "other"), day("d9"))],
            removes=[],
            app_id="other-job",
            run_version=1,
            metadata={},
            expected_schema=SCHEMA,
        )

    _race(monkeypatch, history_mod, other)
    got = [(v.version, v.metadata.get("app_id")) for v in delta.history(ref)]
    assert got == [(2, "other-job"), (1, "job"), (0, None)]


def test_metadata_keys_commit_writes_itself_are_reserved(ref: TableRef) -> None:
    with pytest.raises(ValueError, match="app_version"):
        _commit(ref, [], v=1, app_version="7")


# --------------------------------------------------------------------------- stats in readers


def test_readers_skip_files_by_our_stats_and_return_exactly_the_matching_rows(
    ref: TableRef,
) -> None:
    """Eight files with disjoint id ranges; filters must return exactly the matching rows
    (a wrong bound would make every reader drop a file's rows), and the stats must be tight
    enough to skip (the files' min/max are the data's)."""
    ranges = [range(k * 100, k * 100 + 37) for k in range(8)]
    adds = [
        write_file(ref, rows(r, "m1"), day("d1" if k < 4 else "d2"), row_group_rows=8)
        for k, r in enumerate(ranges)
    ]
    _commit(ref, adds, v=1)
    actions = pa.table(DeltaTable(ref.table_uri).get_add_actions(flatten=True)).to_pylist()
    bounds = sorted((a["min.id"], a["max.id"]) for a in actions)
    assert bounds == [(r.start, r.stop - 1) for r in ranges]
    everything = [i for r in ranges for i in r]
    for lo, hi in [(0, 0), (136, 236), (250, 299), (736, 736), (-5, 10_000)]:
        want = sorted(i for i in everything if lo <= i <= hi)
        got = deltalake_rows(ref, filters=[("id", ">=", lo), ("id", "<=", hi)])
        assert [r[0] for r in got] == want, (lo, hi)
        got_pl = polars_rows(ref, predicate=(pl.col("id") >= lo) & (pl.col("id") <= hi))
        assert [r[0] for r in got_pl] == want, (lo, hi)
    scores = polars_rows(ref, predicate=pl.col("score") > 0.7)
    assert [r[0] for r in scores] == sorted(i for i in everything if i / 1000 > 0.7)


# --------------------------------------------------------------------------- history, maintenance


def _two_runs(ref: TableRef) -> tuple[list[str], list[str]]:
    """v1: d1 by m1 (3 files); v2: d1 rescored by m2 (1 file). Returns (v1 paths, v2 paths)."""
    v1 = [write_file(ref, rows(range(i, i + 20), "m1"), day("d1")) for i in (0, 20, 40)]
    _commit(ref, v1, v=1)
    v2 = [write_file(ref, rows(range(60), "m2"), day("d1"))]
    _commit(ref, v2, [f.path for f in v1], v=2, run_id="r2", model_sha256="b" * 64)
    return [f.path for f in v1], [f.path for f in v2]


def test_history_lists_our_metadata(ref: TableRef) -> None:
    _two_runs(ref)
    latest, first, created = delta.history(ref)
    assert [latest.version, first.version, created.version] == [2, 1, 0]
    assert (latest.operation, latest.run_id, latest.model_sha256, latest.rows) == (
        "WRITE",
        "r2",
        "b" * 64,
        60,
    )
    assert latest.partition == "run_date=d1"
    assert latest.detail == "1 file(s) added, 3 removed"
    assert latest.metadata["app_id"] == "job" and latest.metadata["app_version"] == "2"
    assert latest.metadata["settings_hash"] == "s1" and latest.metadata["input_fingerprint"] == "f1"
    assert latest.metadata["rows_removed"] == "60"
    assert first.timestamp <= latest.timestamp
    # Version 0 is delta-rs's own (pipeline.sinks.delta.create), published by this tool.
    assert created.operation == "CREATE TABLE" and "delta-rs" in str(created.engine)
    assert [v.version for v in delta.history(ref, limit=1)] == [2]


def test_restore_brings_back_exactly_the_old_rows(ref: TableRef) -> None:
    _two_runs(ref)
    v1_rows = deltalake_rows(ref, version=1)
    assert delta.restore(ref, 1, {"run_id": "rollback-1"}) == 3
    assert deltalake_rows(ref) == polars_rows(ref) == v1_rows
    assert sorted_rows(delta.read(ref)) == v1_rows
    [entry] = delta.history(ref, 1)
    assert (entry.operation, entry.detail, entry.run_id) == (
        "RESTORE",
        "restored version 1",
        "rollback-1",
    )
    assert entry.metadata["restored_to"] == "1" and "token" not in entry.metadata
    # the app's run version is not rolled back: run 2 is not committed again by a retry
    assert DeltaTable(ref.table_uri).transaction_version("job") == 2
    with pytest.raises(AlreadyCommitted):
        _commit(ref, [write_file(ref, rows(range(60), "m2"), day("d1"))], v=2)
    for bad in (3, 4, -1):
        with pytest.raises(UsageError, match=f"cannot restore .* to version {bad}"):
            delta.restore(ref, bad)


def test_vacuum_keeps_what_the_retention_keeps(ref: TableRef) -> None:
    v1_paths, v2_paths = _two_runs(ref)
    root = Path(ref.location.path)
    stray = write_file(ref, rows(range(3), "never-committed"), day("d1"))  # an in-flight run's
    assert delta.vacuum(ref) == []  # dry run, the table's 30-day retention: nothing is due
    assert delta.vacuum(ref, dry_run=False) == []
    assert all((root / p).exists() for p in v1_paths)
    assert deltalake_rows(ref, version=1) == expected({"d1": (range(60), "m1")})
    with pytest.raises(UsageError, match=r"retention of 24 h refused.*keeps removed files 30 days"):
        delta.vacuum(ref, 24, dry_run=False)
    # forced: the files removed by version 2 go; current files and unlisted files stay
    assert delta.vacuum(ref, 0, dry_run=True, force=True) == sorted(v1_paths)
    assert delta.vacuum(ref, 0, dry_run=False, force=True) == sorted(v1_paths)
    assert not any((root / p).exists() for p in v1_paths)
    assert all((root / p).exists() for p in v2_paths) and (root / stray.path).exists()
    assert deltalake_rows(ref) == expected({"d1": (range(60), "m2")})
    assert [v.operation for v in delta.history(ref, 2)] == ["VACUUM END", "VACUUM START"]
    assert delta.history(ref, 1)[0].detail == "deleted 3 file(s)"
    with pytest.raises(UsageError, match="files of that version were deleted by a VACUUM"):
        delta.restore(ref, 1)


def test_optimize_compacts_a_partition(ref: TableRef) -> None:
    small = [write_file(ref, rows(range(i, i + 5), "m1"), day("d1")) for i in range(0, 30, 5)]
    other = [write_file(ref, rows(range(100, 105), "m1"), day("d2"))]
    _commit(ref, small + other, v=1)
    before = deltalake_rows(ref)
    metrics = delta.optimize(ref, day("d1"))
    assert (metrics["numFilesRemoved"], metrics["numFilesAdded"]) == (6, 1)
    assert deltalake_rows(ref) == polars_rows(ref) == before
    assert len(delta.snapshot(ref, day("d1")).files) == 1
    assert [f.path for f in delta.snapshot(ref, day("d2")).files] == [other[0].path]
    [entry] = delta.history(ref, 1)
    assert (entry.operation, entry.detail) == ("OPTIMIZE", "compacted 6 file(s) into 1")
    assert DeltaTable(ref.table_uri).transaction_version("job") == 1
    with pytest.raises(UsageError, match="no partition column region"):
        delta.optimize(ref, {"region": "eu"})


def test_optimize_writes_stats_every_reader_filters_right_on(tmp_path: Path) -> None:
    """delta-rs's own OPTIMIZE wrote stats deltalake read wrong for a float column holding an
    infinity (0 rows for x = 1.0 where 1 matched): the compacted file here has this tool's."""
    schema = pa.schema([("id", pa.int64()), ("x", pa.float64()), ("model_version", pa.string())])
    ref = TableRef.of(str(tmp_path / "t"))
    delta.ensure_table(ref, schema, [PARTITION], allow_new_columns=False)
    xs = [[1.0, 2.0, float("inf")], [0.5, 3.0, float("nan")], [1.0, -float("inf"), 4.0]]
    adds = []
    for k, values in enumerate(xs):
        data = pa.table(
            {
                "id": pa.array(range(3 * k, 3 * k + 3), pa.int64()),
                "x": pa.array(values, pa.float64()),
                "model_version": pa.array(["m"] * 3),
            },
            schema=schema,
        )
        adds.append(write_file(ref, data, day("d1"), row_group_rows=2))
    delta.commit(
        ref, adds=adds, removes=[], app_id="job", run_version=1, metadata={},
        expected_schema=schema,
    )  # fmt: skip
    assert delta.optimize(ref, day("d1"))["numFilesAdded"] == 1
    got = [r[0] for r in deltalake_rows(ref, filters=[("x", "=", 1.0)])]
    assert got == [0, 6]
    got = [r[0] for r in deltalake_rows(ref, filters=[("x", "<=", 2.0)])]
    assert got == [0, 1, 3, 6, 7]  # 1.0, 2.0, 0.5, 1.0, -inf; NaN compares false
    assert len(polars_rows(ref)) == 9


def test_read_and_errors_name_the_table(tmp_path: Path, ref: TableRef) -> None:
    _two_runs(ref)
    assert delta.read(ref, columns=["id"], partition=day("d1")).column_names == ["id"]
    with pytest.raises(UsageError, match="no column 'nope'"):
        delta.read(ref, columns=["nope"])
    with pytest.raises(UsageError, match=r"version 99 of the Delta table .* cannot be read"):
        delta.read(ref, version=99)
    missing = TableRef.of(str(tmp_path / "nothing"))
    for call in (
        lambda: delta.history(missing),
        lambda: delta.snapshot(missing),
        lambda: delta.read(missing),
    ):
        with pytest.raises(NotATableError, match=f"no Delta table at {missing.uri}"):
            call()
