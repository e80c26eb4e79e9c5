"""The Iceberg sink's own refusals and its schema rules, before anything is written: a folder
that is not its table, a table another writer made, a model that adds a column (refused unless
schema evolution is allowed; then the older rows read it as null). What every sink does is
tests/sinks/test_contract.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pyarrow as pa
import pytest

pytest.importorskip("pyiceberg")

from pyiceberg.catalog.sql import SqlCatalog

from pipeline.core.config import JobConfig
from pipeline.core.errors import ConfigError, TableSchemaError
from pipeline.io import layout, storage
from pipeline.io.manifest import Manifest
from pipeline.sinks import sink_for
from pipeline.sinks.iceberg import catalog
from pipeline.sinks.iceberg.schema import iceberg_schema
from pipeline.sinks.iceberg.sink import IcebergSink

DAY = "2026-12-01"
SCHEMA = pa.schema([("item_id", pa.int64()), ("score", pa.float32())])


def _sink(tmp_path: Path, **changes: object) -> IcebergSink:
    config = JobConfig(
        input=str(tmp_path / "in"),
        output=str(tmp_path / "scored" / "run_date={date}"),
        model="m",
        format="iceberg",
        date=DAY,
        name="nightly",
    )
    config = dataclasses.replace(config, **changes)
    sink = sink_for(config, layout.for_run(config, "r1"), "r1")
    assert isinstance(sink, IcebergSink)
    return sink


def _begin(sink: IcebergSink, schema: pa.Schema) -> None:
    manifest = Manifest.load(sink.control)
    rejects = storage.locate(str(Path(sink.control.path).parent / "rejects"))
    sink.check("refuse", schema)
    sink.begin(manifest, rejects, (), "refuse", schema)


def test_the_table_is_named_after_its_folder_in_an_embedded_catalog(tmp_path: Path) -> None:
    sink = _sink(tmp_path)
    assert sink.name == "iceberg" and sink.places.table and sink.places.mark is None
    assert sink.table.identifier == "score_catalog.scored"
    assert sink.table.catalog_path == str(
        tmp_path / "_score_catalog" / "scored" / "_iceberg" / "catalog.db"
    )
    _begin(sink, SCHEMA)
    table = catalog.load(sink.table)
    assert table is not None and table.current_snapshot() is None  # made empty
    assert [f.name for f in table.schema().fields] == ["item_id", "score", "run_date"]
    assert table.properties[catalog.WRITER_PROPERTY] == catalog.WRITER_PROPERTY_VALUE


def test_a_folder_that_holds_something_else_is_refused(tmp_path: Path) -> None:
    (tmp_path / "scored").mkdir()
    (tmp_path / "scored" / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match="needs a folder of its own"):
        _sink(tmp_path).check("refuse", SCHEMA)


def test_a_table_another_writer_made_is_refused(tmp_path: Path) -> None:
    sink = _sink(tmp_path)
    _begin(sink, SCHEMA)
    table = catalog.load(sink.table)
    assert table is not None
    with table.transaction() as tx:
        tx.remove_properties(catalog.WRITER_PROPERTY)
    with pytest.raises(ConfigError, match="not made by score-catalog"):
        sink.check("refuse", SCHEMA)


def test_a_new_column_is_refused_unless_schema_evolution_is_allowed(tmp_path: Path) -> None:
    _begin(_sink(tmp_path), SCHEMA)
    wider = SCHEMA.append(pa.field("label", pa.int64()))
    with pytest.raises(TableSchemaError, match="adds column 'label'"):
        _sink(tmp_path).check("refuse", wider)
    narrower = pa.schema([("item_id", pa.int64()), ("score", pa.float64())])
    with pytest.raises(TableSchemaError, match="'score' is float in the table and double"):
        _sink(tmp_path).check("refuse", narrower)
    evolving = _sink(tmp_path, allow_schema_evolution=True)
    _begin(evolving, wider)
    table = catalog.load(evolving.table)
    assert table is not None
    assert [f.name for f in table.schema().fields] == ["item_id", "score", "run_date", "label"]
    assert "label" in table.metadata.name_mapping()._field_by_name  # type: ignore[union-attr]


def test_object_storage_needs_a_catalog_and_s3(tmp_path: Path) -> None:
    area = storage.locate(str(tmp_path / "area"))
    with pytest.raises(ConfigError, match="needs a catalog that every run reaches") as e:
        catalog.IcebergRef.of(storage.locate("memory://bucket/scored"), area)
    assert "--catalog sqlite:///PATH" in str(e.value)
    with pytest.raises(ConfigError, match="a local path or s3:// here, not memory://"):
        catalog.IcebergRef.of(
            storage.locate("memory://bucket/scored"), area, f"sqlite:///{tmp_path}/c.db"
        )


def test_an_unpartitioned_table_is_replaced_whole_by_each_run(tmp_path: Path) -> None:
    from tests.sinks.test_contract import Output, ids_of, run, shards

    config = JobConfig(
        input=str(tmp_path / "in"), output=str(tmp_path / "scored"), model="m", format="iceberg"
    )
    output = Output("iceberg", config, tmp_path / "scored")
    run(output, shards(3), "r1")
    run(output, shards(2, start=1), "r2")
    sink = output.sink("check")
    assert isinstance(sink, IcebergSink) and sink.partition == {}
    table = catalog.load(sink.table)
    assert table is not None and table.spec().fields == ()
    ids = sorted(table.scan().to_arrow().column("item_id").to_pylist())
    assert ids == ids_of(shards(2, start=1))
    assert len(table.snapshots()) == 2
    assert sink.state(output.manifest()).complete


def test_a_given_sql_catalog_and_identifier_hold_the_table(tmp_path: Path) -> None:
    db = tmp_path / "lake" / "catalog.db"
    sink = _sink(tmp_path, catalog=f"sqlite:///{db}", table="analytics.scores")
    assert (sink.table.identifier, sink.table.catalog_path) == ("analytics.scores", str(db))
    assert not sink.table.embedded
    _begin(sink, SCHEMA)
    table = SqlCatalog("score_catalog", uri=f"sqlite:///{db}").load_table("analytics.scores")
    assert table.metadata.location == (tmp_path / "scored").as_uri()
    assert not (tmp_path / "_score_catalog" / "scored" / "_iceberg").exists()  # none embedded
    bare = _sink(tmp_path, catalog=f"sqlite:///{db}", table="scores")
    assert bare.table.identifier == "score_catalog.scores"


def test_a_table_of_another_writer_in_a_given_catalog_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "catalog.db"
    theirs = SqlCatalog("score_catalog", uri=f"sqlite:///{db}")
    theirs.create_namespace("analytics")
    theirs.create_table(
        "analytics.scores",
        schema=iceberg_schema("x", SCHEMA, ["run_date"]),
        location=(tmp_path / "scored").as_uri(),
    )
    sink = _sink(tmp_path, catalog=f"sqlite:///{db}", table="analytics.scores")
    with pytest.raises(ConfigError, match="not made by score-catalog"):
        sink.check("refuse", SCHEMA)


def test_a_table_a_given_catalog_places_elsewhere_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "catalog.db"
    _begin(_sink(tmp_path, catalog=f"sqlite:///{db}", table="analytics.scores"), SCHEMA)
    elsewhere = _sink(
        tmp_path,
        catalog=f"sqlite:///{db}",
        table="analytics.scores",
        output=str(tmp_path / "other" / "run_date={date}"),
    )
    with pytest.raises(ConfigError) as e:
        elsewhere.check("refuse", SCHEMA)
    assert f"has a table analytics.scores at {(tmp_path / 'scored').as_uri()}" in str(e.value)
    assert "name another table (table, --table)" in str(e.value)


def test_a_catalog_that_does_not_answer_is_named_without_its_secrets(tmp_path: Path) -> None:
    """A REST catalog nothing listens at: a StorageError naming the catalog, no credential."""
    from pipeline.core.errors import StorageError
    from tests.integration.servers import free_port

    url = f"http://127.0.0.1:{free_port()}/api"
    sink = _sink(
        tmp_path,
        catalog={"name": "lake", "type": "rest", "uri": url, "token": "S3CRET-bearer"},
    )
    with pytest.raises(StorageError) as e:
        sink.check("refuse", SCHEMA)
    text = str(e.value)
    assert f"the Iceberg catalog 'lake' (type=rest, uri={url})" in text
    assert "S3CRET" not in text and "check that the catalog runs" in text


def test_a_catalog_pyiceberg_cannot_open_is_a_config_error_without_its_secrets(
    tmp_path: Path,
) -> None:
    sink = _sink(tmp_path, catalog={"type": "no-such-kind", "password": "S3CRET-pw"})
    with pytest.raises(ConfigError) as e:
        sink.check("refuse", SCHEMA)
    text = str(e.value)
    assert "catalog 'score_catalog' (type=no-such-kind): pyiceberg cannot open it" in text
    assert "Fix the catalog key (--catalog, [catalog])" in text and "S3CRET" not in text
