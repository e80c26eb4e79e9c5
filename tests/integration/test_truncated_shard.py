"""A night with a truncated input shard (its Parquet footer unreadable: a half-copied upload),
in the three output formats, through the real CLI (docs/failure-handling.md, the error budget).

Within the budget the shard fails alone as ``unreadable`` and the other shards are the night's
output: a Parquet folder with ``_SUCCESS``, a table's one commit (exit 0,
``succeeded_with_errors``). Beyond it the run fails and a table keeps what it held; once the
shard is fixed upstream, the rerun scores it and the output holds every row once. A table's
folder that a failed run of an older version left holding only its uncommitted files (no
table made: such a run had no output schema) is taken by the next run, not refused as
another writer's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import write_shards
from tests.integration.helpers import cli, read_tree, report

pytestmark = pytest.mark.integration

DAY = "2026-11-01"
# Two shards, one truncated: as many failed shards as readable ones, the count an earlier
# version took for "no shard left to score" (it made no output schema, so no table).
SIZES = [1200, 800]  # ids 0..1199, 1200..1999
BAD = "part-00001.parquet"
BAD_IDS = set(range(1200, 2000))
ALL_IDS = set(range(sum(SIZES)))
FORMATS = ["parquet", "delta", "iceberg"]


def _job(tmp_path: Path, bundle: Path, fmt: str) -> Path:
    """A job over ``in/dt={date}`` writing ``out/run_date={date}`` as ``fmt`` (no drift check:
    a rerun's row count would otherwise be compared with the failed night's)."""
    job = tmp_path / "nightly.toml"
    job.write_text(
        "\n".join(
            [
                f'input = "{tmp_path}/in/dt={{date}}"',
                f'output = "{tmp_path}/out/run_date={{date}}"',
                f'model = "{bundle}"',
                f'format = "{fmt}"',
                'scheduler = "sync"',
                "batch_size = 512",
                "[monitoring]",
                "drift = false",
            ]
        )
        + "\n"
    )
    return job


def _truncate(tmp_path: Path) -> bytes:
    """Cut the night's second shard in half (no footer); returns its good bytes."""
    path = tmp_path / "in" / f"dt={DAY}" / BAD
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])
    return good


@pytest.fixture
def night(tmp_path: Path) -> Path:
    write_shards(tmp_path / "in" / f"dt={DAY}", SIZES, row_group_rows=400)
    return tmp_path


def _out(tmp_path: Path) -> Path:
    return tmp_path / "out" / f"run_date={DAY}"


def _ids(tmp_path: Path, fmt: str) -> list[int]:
    """The ids a reader of the night's output sees, sorted (duplicates kept)."""
    if fmt == "delta":
        from pipeline.sinks.delta.client import TableRef
        from pipeline.sinks.delta.read import read

        table = read(TableRef.of(str(tmp_path / "out"), {}), partition={"run_date": DAY})
    elif fmt == "iceberg":
        from pyiceberg.catalog.sql import SqlCatalog
        from pyiceberg.expressions import EqualTo

        section = report(_out(tmp_path))["output_format"]
        found = SqlCatalog("score_catalog", uri=section["catalog"]).load_table(
            section["identifier"]
        )
        table = found.scan(EqualTo("run_date", DAY)).to_arrow()
    else:
        parts = read_tree(_out(tmp_path))
        table = pa.concat_tables(parts.values()) if parts else pa.table({"item_id": []})
    return sorted(table.column("item_id").to_pylist())


def _commits(tmp_path: Path, fmt: str) -> int | None:
    """How many commits the table holds (Delta: versions after the one that made it; Iceberg:
    snapshots); None for a Parquet folder."""
    if fmt == "delta":
        from deltalake import DeltaTable

        return int(DeltaTable(str(tmp_path / "out")).version())
    if fmt == "iceberg":
        from pyiceberg.catalog.sql import SqlCatalog

        section = report(_out(tmp_path))["output_format"]
        table = SqlCatalog("score_catalog", uri=section["catalog"]).load_table(
            section["identifier"]
        )
        return len(table.snapshots())
    return None


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_truncated_shard_within_the_budget_fails_alone_and_the_rest_commits(
    night: Path, bundle_dir: Path, fmt: str
) -> None:
    _truncate(night)
    job = _job(night, bundle_dir, fmt)
    r = cli("run", str(job), "--date", DAY, "--max-failed-shards", "1", "-q")
    assert r.returncode == 0, r.stderr
    rep = report(_out(night))
    assert rep["status"] == "succeeded_with_errors"
    assert (rep["shards_scored"], rep["shards_failed"]) == (1, 1)
    (failed,) = [s for s in rep["shards"] if s["status"] == "failed"]
    bad_uri = str(night / "in" / f"dt={DAY}" / BAD)
    assert failed["input"] == bad_uri and failed["kind"] == "unreadable"
    assert failed["rows_in"] is None and BAD in failed["message"]
    assert [e["kind"] for e in rep["errors"]] == ["unreadable"]
    assert _ids(night, fmt) == sorted(ALL_IDS - BAD_IDS)  # exactly the good shards' rows
    assert _commits(night, fmt) in (None, 1)  # the run's one commit
    if fmt == "parquet":
        assert (_out(night) / "_SUCCESS").exists()

    # A rerun of the same night: the good shards are kept, the bad one fails again, and a
    # table gets no second commit.
    again = cli("run", str(job), "--date", DAY, "--max-failed-shards", "1", "-q")
    assert again.returncode == 0, again.stderr
    rep = report(_out(night))
    assert rep["status"] == "succeeded_with_errors"
    assert (rep["shards_skipped"], rep["shards_failed"]) == (1, 1)
    assert _ids(night, fmt) == sorted(ALL_IDS - BAD_IDS)
    assert _commits(night, fmt) in (None, 1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_beyond_the_budget_the_run_fails_and_its_rerun_after_the_fix_has_every_row_once(
    night: Path, bundle_dir: Path, fmt: str
) -> None:
    good = _truncate(night)
    job = _job(night, bundle_dir, fmt)
    r = cli("run", str(job), "--date", DAY, "-q")  # max_failed_shards = 0
    assert r.returncode == 1, r.stderr
    assert "1 failed shards > errors.max_failed_shards = 0" in r.stderr
    rep = report(_out(night))
    assert rep["status"] == "failed" and rep["shards_failed"] == 1
    assert not (_out(night) / "_SUCCESS").exists()
    if fmt != "parquet":
        assert _ids(night, fmt) == [] and _commits(night, fmt) == 0  # nothing committed

    (night / "in" / f"dt={DAY}" / BAD).write_bytes(good)  # fixed upstream
    fixed = cli("run", str(job), "--date", DAY, "-q")
    assert fixed.returncode == 0, fixed.stderr
    rep = report(_out(night))
    assert rep["status"] == "succeeded" and rep["shards_failed"] == 0
    assert rep["shards_scored"] + rep["shards_skipped"] == 2
    assert _ids(night, fmt) == sorted(ALL_IDS)  # every row once
    assert _commits(night, fmt) in (None, 1)


def _drop_table(tmp_path: Path, fmt: str) -> None:
    """Leave the table's folder as a failed run of an older version did: its uncommitted files
    in the partition folder, no table (that version made none for a run without an output
    schema)."""
    if fmt == "delta":
        shutil.rmtree(tmp_path / "out" / "_delta_log")
        return
    from pyiceberg.catalog.sql import SqlCatalog

    section = report(_out(tmp_path))["output_format"]
    SqlCatalog("score_catalog", uri=section["catalog"]).drop_table(section["identifier"])
    shutil.rmtree(tmp_path / "out" / "metadata")


@pytest.mark.parametrize("fmt", ["delta", "iceberg"])
def test_a_folder_left_with_only_a_failed_runs_uncommitted_files_is_taken(
    night: Path, bundle_dir: Path, fmt: str
) -> None:
    good = _truncate(night)
    job = _job(night, bundle_dir, fmt)
    assert cli("run", str(job), "--date", DAY, "-q").returncode == 1
    _drop_table(night, fmt)
    left = sorted(p.name for p in (night / "out").rglob("*.parquet"))
    assert len(left) == 1 and all(report(_out(night))["run_id"] in n for n in left)

    # Another file there is not this tool's: the folder is refused, nothing written.
    stray = _out(night) / "notes.parquet"
    pq.write_table(pa.table({"x": [1]}), stray)
    refused = cli("run", str(job), "--date", DAY, "-q")
    assert refused.returncode == 2, refused.stderr
    assert "needs a folder of its own" in refused.stderr
    stray.unlink()

    (night / "in" / f"dt={DAY}" / BAD).write_bytes(good)
    fixed = cli("run", str(job), "--date", DAY, "-q")
    assert fixed.returncode == 0, fixed.stderr
    rep = report(_out(night))
    assert rep["status"] == "succeeded" and rep["shards_failed"] == 0
    assert _ids(night, fmt) == sorted(ALL_IDS)
    assert _commits(night, fmt) == 1
    # The failed run's files were reused (their footers check out) or deleted: none is left
    # outside the table.
    on_disk = sorted(p.name for p in _out(night).glob("*.parquet"))
    assert len(on_disk) == 2
