"""The sink seam's contract, run against every sink on local disk (the Parquet folder, a Delta
table's partition and an Iceberg table's): a run's calls in order (begin -> plan ->
delete_stale -> verify -> commit -> seal) make exactly the run's shards visible, once; a run
stopped after any step leaves readers the previous output, whole, and the next run ends where
an uninterrupted one would; a commit retried after it landed does not land twice; a file
storage lost is work to do; abort takes back the claim of completeness. Real Parquet files
written the way a worker writes them (its footer marks; a table's stats from
:data:`~pipeline.sinks.base.WriterSpec.file_facts`), a real manifest, real tables read back by
Polars (Delta) and pyiceberg (Iceberg).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.core.config import JobConfig
from pipeline.core.errors import AlreadyCommitted
from pipeline.io import layout, storage
from pipeline.io.layout import footer_metadata
from pipeline.io.manifest import Manifest
from pipeline.sinks import sink_for
from pipeline.sinks.base import Expected, Outcome, Sink, WrittenFile

_HAS_ICEBERG = importlib.util.find_spec("pyiceberg") is not None
SHA = "a" * 64
SETTINGS = "0123456789abcdef"
DAY = "2026-12-01"
SCHEMA = pa.schema(
    [("item_id", pa.int64()), ("score", pa.float32()), ("model_version", pa.string())]
)
STEPS = ("begin", "write", "plan", "verify", "commit")


@dataclass
class Output:
    """A job's output in one format, and how a reader sees it."""

    kind: str
    config: JobConfig
    root: Path  # the template's fixed part: the folder's parent, or the table

    def sink(self, run_id: str) -> Sink[Any, Any]:
        return sink_for(self.config, self.places(run_id), run_id)

    def places(self, run_id: str) -> layout.Places:
        return layout.for_run(self.config, run_id)

    def manifest(self) -> Manifest:
        return Manifest.load(self.places("any").control)

    def rejects(self) -> storage.Location:
        return storage.locate(self.config.rejects_uri("any"))

    def seen(self) -> list[int] | None:
        """The ids a reader sees, sorted: the folder's only once ``_SUCCESS`` vouches for them
        (None before), the table's latest version (None before it exists)."""
        if self.kind == "parquet":
            out = self.root / f"run_date={DAY}"
            if not (out / layout.SUCCESS_NAME).exists():
                return None
            files = sorted(p for p in out.rglob("*.parquet") if layout.is_visible(p.name))
            return sorted(i for f in files for i in pq.read_table(f).column("item_id").to_pylist())
        if self.kind == "iceberg":
            return _iceberg_ids(self)
        if not (self.root / "_delta_log").exists():
            return None
        frame = pl.scan_delta(str(self.root)).filter(pl.col("run_date") == DAY).collect()
        return sorted(frame["item_id"].to_list())

    @property
    def table(self) -> bool:
        return self.kind != "parquet"


def _iceberg_ids(output: Output) -> list[int] | None:
    """The ids pyiceberg's scan of the day's partition returns (None: no table yet)."""
    from pyiceberg.catalog.sql import SqlCatalog

    db = output.root.parent / "_score_catalog" / output.root.name / "_iceberg" / "catalog.db"
    if not db.exists():
        return None
    cat = SqlCatalog("score_catalog", uri=f"sqlite:///{db}")  # the name is part of its rows
    if not cat.table_exists(f"score_catalog.{output.root.name}"):
        return None
    table = cat.load_table(f"score_catalog.{output.root.name}")
    if table.current_snapshot() is None:
        return None
    rows = table.scan(row_filter=f"run_date == '{DAY}'").to_arrow()
    return sorted(rows.column("item_id").to_pylist())


@pytest.fixture(
    params=[
        "parquet",
        "delta",
        pytest.param("iceberg", marks=pytest.mark.skipif(not _HAS_ICEBERG, reason="no pyiceberg")),
    ]
)
def output(request: pytest.FixtureRequest, tmp_path: Path) -> Output:
    config = JobConfig(
        input=str(tmp_path / "in"),
        output=str(tmp_path / "scored" / "run_date={date}"),
        model="m",
        format=request.param,
        date=DAY,
        name="nightly",
    )
    return Output(request.param, config, tmp_path / "scored")


def _write(sink: Sink[Any, Any], rel: str, ids: range, run_id: str) -> WrittenFile:
    """Shard ``rel``'s data file, as a worker writes it: at the sink's target, the footer marks,
    the sink's facts of it."""
    spec = sink.writer()
    loc = storage.locate(spec.target(rel, run_id))
    schema = SCHEMA.with_metadata(footer_metadata(SHA, SETTINGS, rel, _fp(ids)))
    data = pa.table(
        {
            "item_id": pa.array(list(ids), pa.int64()),
            "score": pa.array([i / 1000 for i in ids], pa.float32()),
            "model_version": pa.array(["1"] * len(ids)),
        },
        schema=schema,
    )
    with storage.staged_open(loc) as f:
        writer = pq.ParquetWriter(f, schema)
        for start in range(0, len(ids), 4):
            writer.write_table(data.slice(start, 4))
        writer.close()
    facts = spec.file_facts(writer.writer.metadata, frozenset()) if spec.file_facts else {}
    return WrittenFile(loc.uri, int(storage.size_of(loc) or 0), facts)


def _fp(ids: range) -> str:
    """The input fingerprint a shard of these rows names (another input, another one)."""
    return f"fp-{ids.start}-{ids.stop}"


def _entry(rel: str, rows: int, run_id: str) -> dict[str, Any]:
    """The manifest entry the driver keeps of a scored shard (the keys the sinks read)."""
    return {
        "output": rel,
        "rows_in": rows,
        "rows_scored": rows,
        "rows_rejected": 0,
        "model_sha256": SHA,
        "settings_hash": SETTINGS,
        "run_id": run_id,
    }


def run(
    output: Output,
    shards: Mapping[str, range],
    run_id: str,
    stop_after: str = "",
    record: Callable[[], object] | None = None,
) -> None:
    """One run of the job over ``shards`` through the seam, in the driver's order; it stops
    (as a killed run does: no later call, nothing cleaned up) right after ``stop_after``."""
    sink = output.sink(run_id)
    manifest = output.manifest()
    sink.abort()  # the driver's claim: what says the previous run is complete is withdrawn
    previous = frozenset(manifest.shards)
    begun = sink.begin(manifest, output.rejects(), tuple(shards), "refuse", SCHEMA)
    if stop_after == "begin":
        return
    expected = {}
    for rel, ids in shards.items():
        entry = manifest.shards.get(rel)
        want = Expected(len(ids), SHA, SETTINGS, rel, _fp(ids))
        expected[rel] = want
        # As the lock phase judges it: the manifest's entry matches the input (the driver's
        # Manifest.matches), and the sink says its file is there and is that entry's.
        matches = entry is not None and entry.get("fp") == _fp(ids)
        if matches and not begun.done(rel, entry, want):
            continue  # done by an earlier run: skipped
        written = _write(sink, rel, ids, run_id)
        entry = {**_entry(rel, len(ids), run_id), "fp": _fp(ids), **sink.entry_of(written)}
        manifest.record(rel, entry)
        manifest.save()
    if stop_after == "write":
        return
    outcome = Outcome(frozenset(shards), previous | frozenset(manifest.shards), {})
    plan = sink.plan(begun, manifest, outcome, output.rejects())
    sink.delete_stale(plan)
    for rel in set(manifest.shards) - set(shards):
        manifest.forget(rel)
    manifest.save()
    if stop_after == "plan":
        return
    assert sink.verify(begun, plan, manifest, expected) == []
    if stop_after == "verify":
        return
    committed = sink.commit(begun, plan, manifest, run_id, record=record)
    if stop_after == "commit":
        return
    sink.seal(begun, manifest, committed)


def shards(n: int, start: int = 0) -> dict[str, range]:
    return {f"part-{k}.parquet": range(start + 100 * k, start + 100 * k + 9) for k in range(n)}


def ids_of(found: Mapping[str, range]) -> list[int]:
    return sorted(i for r in found.values() for i in r)


def test_a_run_makes_exactly_its_shards_visible_once(output: Output) -> None:
    run(output, shards(3), "r1")
    assert output.seen() == ids_of(shards(3))
    assert output.sink("check").state(output.manifest()).complete


def test_an_empty_shard_is_part_of_a_complete_run(output: Output) -> None:
    """An input shard of no rows gives an output file of no rows, which the run commits and
    checks like any other, and the next run finds done (Iceberg's scan planning leaves out a
    file of 0 rows unless asked: every night failed its post-commit check, then committed
    again)."""
    found = {**shards(2), "part-empty.parquet": range(0)}
    run(output, found, "r1")
    assert output.seen() == ids_of(found)
    sink = output.sink("check")
    manifest = output.manifest()
    begun = sink.state(manifest)
    assert begun.complete
    empty = manifest.shards["part-empty.parquet"]
    assert (
        begun.done(
            "part-empty.parquet",
            empty,
            Expected(0, SHA, SETTINGS, "part-empty.parquet", _fp(range(0))),
        )
        == []
    )


def test_the_run_index_entry_is_recorded_once_where_the_next_run_can_settle_it(
    output: Output,
) -> None:
    """``record`` (the driver writes the run's run-index entry there) is called once per
    commit; for a table, after the sink saved its pending token (a run killed right after the
    entry is then settled by the next run) and before the new version is visible."""
    run(output, shards(2), "r1")
    before = output.seen()
    calls: list[tuple[list[int] | None, dict[str, Any]]] = []
    run(
        output,
        shards(3, start=1),
        "r2",
        record=lambda: calls.append((output.seen(), dict(output.manifest().format_state or {}))),
    )
    assert len(calls) == 1
    seen, state = calls[0]
    if output.table:
        assert seen == before  # nothing of r2 is visible yet
        assert state["pending"]["run_id"] == "r2", state  # the next run finds the token
    assert output.seen() == ids_of(shards(3, start=1))


def test_a_shard_that_left_the_input_leaves_the_output(output: Output) -> None:
    run(output, shards(3), "r1")
    run(output, shards(2), "r2")
    assert output.seen() == ids_of(shards(2))


@pytest.mark.parametrize("stop_after", STEPS)
def test_a_run_stopped_after_any_step_leaves_readers_whole_and_its_rerun_ends_as_one(
    output: Output, stop_after: str
) -> None:
    run(output, shards(2), "r1")
    before = output.seen()
    newer = shards(3, start=1)  # every shard rescored (other rows), one more
    run(output, newer, "r2", stop_after=stop_after)
    seen = output.seen()
    if output.table:
        # A table: the previous version, whole, until the commit; then the new one.
        assert seen == (ids_of(newer) if stop_after == "commit" else before)
    else:
        assert seen is None  # no _SUCCESS: nothing vouched for
    # Complete only where the previous output is still all there is (a table whose run stopped
    # before it wrote anything); the folder's _SUCCESS was withdrawn as the run began.
    complete = output.table and stop_after == "begin"
    assert output.sink("check").state(output.manifest()).complete is complete
    run(output, newer, "r3")
    assert output.seen() == ids_of(newer)
    assert output.sink("check").state(output.manifest()).complete


def test_a_commit_retried_after_it_landed_does_not_land_twice(output: Output) -> None:
    run(output, shards(2), "r1")
    sink = output.sink("r2")
    manifest = output.manifest()
    begun = sink.begin(manifest, output.rejects(), tuple(shards(2, 5)), "refuse", SCHEMA)
    for rel, ids in shards(2, 5).items():
        written = _write(sink, rel, ids, "r2")
        manifest.record(rel, {**_entry(rel, len(ids), "r2"), **sink.entry_of(written)})
    outcome = Outcome(frozenset(shards(2)), frozenset(manifest.shards), {})
    plan = sink.plan(begun, manifest, outcome, output.rejects())
    sink.delete_stale(plan)
    sink.commit(begun, plan, manifest, "r2")
    seen = output.seen() if output.table else None
    if output.table:
        with pytest.raises(AlreadyCommitted, match="is not committed again"):
            sink.commit(begun, plan, manifest, "r2")
        assert output.seen() == seen == ids_of(shards(2, 5))
    else:
        sink.commit(begun, plan, manifest, "r2")  # each file was published as it finished


def test_a_file_storage_lost_is_work_to_do(output: Output) -> None:
    run(output, shards(3), "r1")
    manifest = output.manifest()
    lost = storage.locate(str(output.root)).child(
        manifest.shards["part-1.parquet"].get("file") or f"run_date={DAY}/part-1.parquet"
    )
    storage.remove(lost)
    state = output.sink("check").state(manifest)
    assert not state.complete
    problems = {
        rel: state.done(rel, e, Expected(9, SHA, SETTINGS, rel, _fp(shards(3)[rel])))
        for rel, e in manifest.shards.items()
    }
    assert [rel for rel, p in problems.items() if p] == ["part-1.parquet"]
    run(output, shards(3), "r2")
    assert output.seen() == ids_of(shards(3))


def test_abort_takes_back_the_claim_of_completeness_and_nothing_else(output: Output) -> None:
    run(output, shards(2), "r1")
    output.sink("r2").abort()
    if output.table:
        assert output.seen() == ids_of(shards(2))  # a table keeps its version
    else:
        assert output.seen() is None  # no _SUCCESS
    files = sorted(p.name for p in output.root.rglob("*.parquet"))
    assert len(files) == 2


def test_sections_are_rendered_without_knowing_the_format(output: Output) -> None:
    run(output, shards(1), "r1")
    section = output.sink("r2").section(None, None).public()
    assert section["format"] in ("parquet_folder", "delta", "iceberg")
    if output.table:
        title = {"delta": "Delta table", "iceberg": "Iceberg table"}[output.kind]
        assert section["title"] == title and section["summary"].startswith(str(output.root))
    else:
        assert "summary" not in section and "title" not in section
