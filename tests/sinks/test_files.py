"""What a table's folder holds before its table is made (pipeline.sinks.files.foreign_files):
files of this tool's runs that never committed, named by their partition's manifest, are no
reason to refuse the folder; anything else is. On real folders and real manifests."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.core.config import JobConfig
from pipeline.io import layout, storage
from pipeline.io.manifest import Manifest
from pipeline.sinks import sink_for
from pipeline.sinks.files import folder_of, foreign_files
from pipeline.sinks.partition import TablePartitionSink

DAY = "2026-12-01"


def _manifest(control: Path, runs: list[str]) -> None:
    manifest = Manifest.load(storage.locate(str(control)))
    manifest.set_format_state({"format": "delta", "app_id": "a", "runs": runs})
    manifest.save()


def _touch(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")


def test_only_files_of_a_run_the_partitions_manifest_lists_are_ours(tmp_path: Path) -> None:
    table, area = tmp_path / "scored", tmp_path / "_score_catalog" / "scored"
    a, b = "run_date=2026-12-01", "run_date=2026-12-02"
    _manifest(area / a, ["r1", "r2"])
    ours = [f"{a}/part-00000-abc-r1.parquet", f"{a}/.part-00001-abc-r2.parquet.tmp-r2-0f0f"]
    theirs = [
        f"{a}/part-00002-abc-r9.parquet",  # a run the manifest does not list
        f"{a}/part-00003-abc-r1.parquet.bak",  # not a data file of r1
        f"{a}/notes.txt",
        f"{b}/part-00000-abc-r1.parquet",  # a partition without a manifest
        "part-00000-abc-r1.parquet",  # the table's root: its manifest would be the area's
        "metadata/v1.metadata.json",
    ]
    for rel in ours + theirs:
        _touch(table / rel)
    root = storage.locate(str(table))

    def control_of(folder: str) -> storage.Location:
        return storage.locate(str(area / folder) if folder else str(area))

    assert foreign_files(root, control_of) == sorted(theirs)
    skipped = foreign_files(root, control_of, skip=("metadata",))
    assert skipped == sorted(set(theirs) - {"metadata/v1.metadata.json"})
    for rel in theirs:
        (table / rel).unlink()
    assert foreign_files(root, control_of) == []
    assert foreign_files(storage.locate(str(tmp_path / "absent")), control_of) == []


@pytest.mark.parametrize("fmt", ["delta", "iceberg"])
@pytest.mark.parametrize("below", ["run_date={date}", "run_date={date}/day={date}"])
def test_a_sinks_control_of_names_each_partitions_control_folder(
    tmp_path: Path, fmt: str, below: str
) -> None:
    if fmt == "iceberg":
        pytest.importorskip("pyiceberg")
    output = str(tmp_path / "scored" / below)
    config = JobConfig(input=str(tmp_path / "in"), output=output, model="m", format=fmt, date=DAY)
    sink = sink_for(config, layout.for_run(config, "r1"), "r1")
    assert isinstance(sink, TablePartitionSink)
    own = folder_of(sink.partition).rstrip("/")
    assert sink.control_of(own) == sink.control
    other = own.replace(DAY, "2026-12-02")
    area = tmp_path / "_score_catalog" / "scored"
    assert sink.control_of(other).path == str(area / other)
    assert sink.control_of("").path == str(area)
