"""What :func:`pipeline.sinks.sink_for` makes of a job, and the Parquet folder's own rules: a
stable name per shard, ``_SUCCESS`` as the seal, outputs in the way of a shard that changed
shape taken away. Real Parquet files with the footer metadata a run writes. (What every sink
does is tests/sinks/test_contract.py.)"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.core.config import JobConfig
from pipeline.io import layout, storage
from pipeline.io.layout import SUCCESS_NAME, footer_metadata
from pipeline.io.manifest import Manifest
from pipeline.sinks import sink_for
from pipeline.sinks.base import Committed
from pipeline.sinks.folder.sink import FolderSink
from pipeline.sinks.token import TokenState

SHA = "a" * 64
SETTINGS = "0123456789abcdef"


def _ours(path: Path, rows: int, source: str) -> None:
    """An output file as a run writes it (footer: writer, model, settings, its input)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = footer_metadata(SHA, SETTINGS, source, "fp")
    schema = pa.schema([pa.field("item_id", pa.int64())], metadata=meta)
    pq.write_table(pa.table({"item_id": list(range(rows))}, schema=schema), path)


def _sink(root: Path) -> FolderSink:
    config = JobConfig(input=str(root.parent / "in"), output=str(root), model="m")
    sink = sink_for(config, layout.places(str(root), str(root)), "run")
    assert isinstance(sink, FolderSink)
    return sink


def test_the_folder_is_the_default_and_describes_itself(tmp_path: Path) -> None:
    sink = _sink(tmp_path / "out")
    assert sink.name == "parquet_folder"
    assert sink.writer().file_facts is None  # a file's size is all it keeps
    assert sink.section(None, None).public() == {"format": "parquet_folder"}
    assert sink.entry_of(None) == {}
    places = sink.places
    assert places.lock_root == places.output == places.dataset and not places.table


def test_a_shards_file_has_the_same_name_every_run(tmp_path: Path) -> None:
    spec = _sink(tmp_path / "out").writer()
    first, second = (spec.target("d/part-0.parquet", run) for run in ("r1", "r2"))
    assert first == second == str(tmp_path / "out" / "d" / "part-0.parquet")


def test_abort_and_seal_are_the_success_marker(tmp_path: Path) -> None:
    sink = _sink(tmp_path / "out")
    (tmp_path / "out").mkdir()
    manifest = Manifest.load(storage.locate(str(tmp_path / "ctl")))
    begun = sink.state(manifest)
    sink.seal(begun, manifest, Committed())
    assert (tmp_path / "out" / SUCCESS_NAME).read_bytes() == b""
    assert sink.state(manifest).complete
    sink.abort()
    sink.abort()  # idempotent
    assert not (tmp_path / "out" / SUCCESS_NAME).exists()


def test_begin_takes_away_an_output_in_the_way_of_a_shard_that_changed_shape(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    _ours(out / "d", 3, "d")  # once a file named d, now a folder d/ of shards
    manifest = Manifest.load(storage.locate(str(tmp_path / "ctl")))
    manifest.record("d", {"output": "d"})
    begun = _sink(out).begin(
        manifest, storage.locate(str(tmp_path / "rejects")), ("d/part-0.parquet",), "refuse", None
    )
    assert [r.rel_path for r in begun.cleared] == ["d"]
    assert not (out / "d").exists()


def test_the_token_state_keeps_the_sinks_words_through_every_step() -> None:
    """What a table sink writes beside the token (its table, partition, an Iceberg table's
    catalog and identifier) survives a read and every later state: readers of the manifest
    find the table from it."""
    where = {"table": "t", "partition": "d=1", "catalog": "sqlite:///c.db", "identifier": "n.t"}
    state = TokenState("app", "iceberg").begun("r1", **where).committing(2, "r1", 1)
    again = TokenState.read(state.public(), "app", "iceberg").made(2, 3, "r1").sealed()
    public = again.public()
    assert {k: public[k] for k in where} == where
    assert public["format"] == "iceberg" and public["committed"] == 2
    assert TokenState.read(public, "another app", "iceberg").extra == {}
