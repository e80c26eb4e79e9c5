"""The output-format seam (pipeline.sinks) and its Parquet folder, through the protocol.

What the driver relies on of any format: a stable or fresh target per shard, withdraw and seal
of completion, resume asking is_done, settle taking out what the run does not vouch for,
verify comparing what readers see with the report, describe for the report. Real Parquet
files with the footer metadata a run writes.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.core.config import JobConfig
from pipeline.io import layout, storage
from pipeline.io.layout import SUCCESS_NAME, footer_metadata
from pipeline.sinks import output_format
from pipeline.sinks.base import Expected, OutputFormat
from pipeline.sinks.folder.sink import ParquetFolder

SHA = "a" * 64
SETTINGS = "0123456789abcdef"


def _ours(path: Path, rows: int, source: str) -> None:
    """An output file as a run writes it (footer: writer, model, settings, its input)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = footer_metadata(SHA, SETTINGS, source, "fp")
    schema = pa.schema([pa.field("item_id", pa.int64())], metadata=meta)
    pq.write_table(pa.table({"item_id": list(range(rows))}, schema=schema), path)


def _expected(rel: str, rows: int) -> Expected:
    return Expected(rows, SHA, SETTINGS, rel, "fp")


def _fmt(root: Path) -> OutputFormat:
    config = JobConfig(input=str(root.parent / "in"), output=str(root), model="m")
    return output_format(config, layout.places(str(root), str(root)), "run")


def test_the_folder_is_todays_format_and_describes_itself(tmp_path: Path) -> None:
    fmt = _fmt(tmp_path / "out")
    assert isinstance(fmt, ParquetFolder)
    assert fmt.name == "parquet_folder"
    assert fmt.file_facts is None  # a file's size is all it keeps
    assert fmt.describe(None) == {"format": "parquet_folder"}
    assert fmt.commit_shard(None) == {}


def test_a_shards_file_has_the_same_name_every_run(tmp_path: Path) -> None:
    fmt = _fmt(tmp_path / "out")
    first, second = (fmt.target("d/part-0.parquet", run) for run in ("r1", "r2"))
    assert first == second == str(tmp_path / "out" / "d" / "part-0.parquet")


def test_withdraw_and_seal_are_the_success_marker(tmp_path: Path) -> None:
    fmt = _fmt(tmp_path / "out")
    (tmp_path / "out").mkdir()
    fmt.seal()
    assert (tmp_path / "out" / SUCCESS_NAME).read_bytes() == b""
    fmt.withdraw()
    fmt.withdraw()  # idempotent
    assert not (tmp_path / "out" / SUCCESS_NAME).exists()
    assert fmt.commit_run("r1", {}).details == {}  # each file was published as it finished


def test_is_done_reads_the_file_the_manifest_names(tmp_path: Path) -> None:
    fmt = _fmt(tmp_path / "out")
    _ours(tmp_path / "out" / "part-0.parquet", 5, "part-0.parquet")
    entry = {"rows_scored": 5}
    assert fmt.is_done("part-0.parquet", entry, _expected("part-0.parquet", 5)) == []
    assert fmt.is_done("part-0.parquet", entry, _expected("part-0.parquet", 6))  # rows differ
    missing = fmt.is_done("part-1.parquet", entry, _expected("part-1.parquet", 5))
    assert missing and "cannot be read back" in missing[0]


def test_settle_takes_out_what_the_run_does_not_vouch_for_and_verify_agrees(
    tmp_path: Path,
) -> None:
    out, rejects = tmp_path / "out", tmp_path / "rejects"
    for rel in ("part-0.parquet", "part-1.parquet", "gone.parquet"):
        _ours(out / rel, 3, rel)
    _ours(rejects / "gone.parquet", 1, "gone.parquet")
    fmt = _fmt(out)
    keep = {"part-0.parquet"}
    ours = {"part-0.parquet", "part-1.parquet", "gone.parquet"}
    reasons = {"part-1.parquet": "its shard failed in this run (model)"}
    settled = fmt.settle(storage.locate(str(rejects)), keep, ours, reasons)
    removed = {r.rel_path: r.reason for r in settled.removed}
    assert removed == {
        "part-1.parquet": "its shard failed in this run (model)",
        "gone.parquet": "its input shard no longer exists",
    }
    assert sorted(p.name for p in out.iterdir()) == ["part-0.parquet"]
    assert not (rejects / "gone.parquet").exists()  # its rejects go with it
    assert fmt.verify({"part-0.parquet": _expected("part-0.parquet", 3)}) == []
    problems = fmt.verify({"part-0.parquet": _expected("part-0.parquet", 4)})
    assert problems and "holds 3 rows, the report says 4" in problems[0]


def test_clear_takes_away_an_output_in_the_way_of_a_shard_that_changed_shape(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    _ours(out / "d", 3, "d")  # once a file named d, now a folder d/ of shards
    fmt = _fmt(out)
    cleared = fmt.clear(storage.locate(str(tmp_path / "rejects")), ["d/part-0.parquet"], {"d"})
    assert [r.rel_path for r in cleared] == ["d"]
    assert not (out / "d").exists()
