"""pipeline.io.manifest: what was scored from what, saved atomically, read back, fenced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.core.errors import LockError, StorageError
from pipeline.io import storage
from pipeline.io.layout import MANIFEST_NAME
from pipeline.io.listing import ShardRef
from pipeline.io.manifest import (
    SCHEMA_VERSION,
    FencedManifest,
    Manifest,
    expectation,
    fingerprint_hash,
)
from pipeline.io.parquet import ShardInfo

SHARD = ShardRef("/in/part-0.parquet", "part-0.parquet", 1234, "1700000000.0")
INFO = ShardInfo(num_rows=10, num_row_groups=1, schema=None, footer_hash="abc")  # type: ignore[arg-type]


def _entry(expect: dict[str, object]) -> dict[str, object]:
    return {**expect, "output": "/out/part-0.parquet", "rows_scored": 10, "rows_rejected": 0}


def test_an_entry_matches_only_the_same_input_model_and_settings() -> None:
    expect = expectation(SHARD, INFO, "sha-a", "settings-a")
    m = Manifest(storage.locate("/nowhere"))
    m.shards["part-0.parquet"] = _entry(expect)
    assert m.matches("part-0.parquet", expect)
    for other in (
        expectation(SHARD, INFO, "sha-b", "settings-a"),  # another model
        expectation(SHARD, INFO, "sha-a", "settings-b"),  # other settings
        expectation(
            ShardRef(SHARD.uri, SHARD.rel_path, 99, SHARD.version), INFO, "sha-a", "settings-a"
        ),
        expectation(SHARD, 10, "sha-a", "settings-a"),  # no footer hash: never matches one
    ):
        assert not m.matches("part-0.parquet", other)
    assert not m.matches("part-1.parquet", expect)


def test_the_fingerprint_hash_is_stable_and_content_keyed() -> None:
    fp = expectation(SHARD, INFO, "s", "h")["fingerprint"]
    assert fingerprint_hash(dict(fp)) == fingerprint_hash(dict(reversed(list(fp.items()))))  # type: ignore[union-attr]
    assert fingerprint_hash({**fp, "num_rows": 11}) != fingerprint_hash(dict(fp))  # type: ignore[dict-item]


def test_save_and_load_round_trip_with_the_verdict(tmp_path: Path) -> None:
    control = storage.locate(str(tmp_path / "control"))
    m = Manifest.load(control)
    assert m.shards == {} and m.read_from is None
    m.record("b.parquet", {"rows_scored": 2})
    m.record("a.parquet", {"rows_scored": 1})
    m.set_verdict({"dataset": "d1"})
    m.flush()
    doc = json.loads((tmp_path / "control" / MANIFEST_NAME).read_text())
    assert doc["schema_version"] == SCHEMA_VERSION
    assert list(doc["shards"]) == ["a.parquet", "b.parquet"]  # sorted: diffs stay readable
    again = Manifest.load(control)
    assert again.shards == m.shards and again.verdict == {"dataset": "d1"}
    again.forget("a.parquet")
    again.flush()
    assert list(Manifest.load(control).shards) == ["b.parquet"]


def test_an_older_place_is_read_when_the_control_folder_has_none(tmp_path: Path) -> None:
    old = tmp_path / "output"
    old.mkdir()
    doc = {"schema_version": SCHEMA_VERSION, "shards": {"a.parquet": {"rows_scored": 1}}}
    (old / MANIFEST_NAME).write_text(json.dumps(doc))
    control = storage.locate(str(tmp_path / "control"))
    m = Manifest.load(control, [storage.locate(str(old))])
    assert m.shards == doc["shards"]
    assert m.read_from == storage.locate(str(old / MANIFEST_NAME))
    assert m.loc == control.child(MANIFEST_NAME)  # saved to the new place


@pytest.mark.parametrize(
    ("text", "match"),
    [("{not json", "is not valid JSON"), ('{"schema_version": 99}', "schema_version 99")],
)
def test_an_unreadable_manifest_is_a_storage_error_naming_it(
    tmp_path: Path, text: str, match: str
) -> None:
    (tmp_path / MANIFEST_NAME).write_text(text)
    with pytest.raises(StorageError, match=match):
        Manifest.load(storage.locate(str(tmp_path)))


def test_a_fenced_manifest_saves_only_while_the_lock_is_held(tmp_path: Path) -> None:
    held = [True]

    def fence() -> None:
        if not held[0]:
            raise LockError("lost")

    loc = storage.locate(str(tmp_path / MANIFEST_NAME))
    m = FencedManifest(loc, {}, fence=fence)
    m.record("a.parquet", {"rows_scored": 1})  # the first save is at once
    assert (tmp_path / MANIFEST_NAME).exists()
    held[0] = False
    with pytest.raises(LockError):  # at the next save: right away, or at the flush
        m.record("b.parquet", {"rows_scored": 2})
        m.flush()
    assert list(json.loads((tmp_path / MANIFEST_NAME).read_text())["shards"]) == ["a.parquet"]
