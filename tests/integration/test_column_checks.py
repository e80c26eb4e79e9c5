"""Issue 13: column problems said once, and casts to float32 that change values reported.

Real CLI runs on real Parquet shards: an id column missing from 12 shards is one line that
names the columns those shards do have, whether the run stops (``fail``) or skips them
(``skip_shard``); an int64 feature beyond 2**24 and a float64 feature float32 rounds are
reported once per column, in the log and in ``_report.json``'s ``lossy_casts``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from pipeline.errors import EXIT_INPUT, EXIT_OK
from tests.conftest import write_shards
from tests.integration.helpers import cli, job_args, report

pytestmark = pytest.mark.integration

SHARDS = 12


@pytest.fixture
def renamed_ids(tmp_path: Path) -> Path:
    """12 shards whose id column is called ``id``, not ``item_id``."""
    cat = tmp_path / "catalog"
    for p in write_shards(cat, [300] * SHARDS, row_group_rows=100):
        t = pq.read_table(p)
        pq.write_table(t.rename_columns(["id", *t.column_names[1:]]), p, row_group_size=100)
    return cat


def test_a_column_missing_from_every_shard_is_said_once_with_the_columns_there(
    renamed_ids: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    r = cli("run", *job_args(renamed_ids, tmp_path / "o", bundle_dir), in_process=True)
    assert r.returncode == EXIT_INPUT, r.output
    problems = [line for line in r.output.splitlines() if line.startswith("  - ")]
    assert len(problems) == 1, r.output  # not one line per shard
    (line,) = problems
    assert line.startswith(
        f"  - id column 'item_id' is missing in {SHARDS} of {SHARDS} shards "
        "(part-00000.parquet, part-00001.parquet, part-00002.parquet and 9 more); "
        "the columns there: id, category, f0, f1,"
    ), line
    assert line.endswith("label (did you mean 'id'?)"), line
    assert len(r.output.splitlines()) <= 3, r.output


def test_skipping_those_shards_warns_once(
    renamed_ids: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    good = tmp_path / "good"
    write_shards(good, [500], row_group_rows=100, start=10**6)
    (renamed_ids / "zz-good.parquet").write_bytes((good / "part-00000.parquet").read_bytes())
    out = tmp_path / "o"
    r = cli(
        "run", *job_args(renamed_ids, out, bundle_dir), "--scheduler", "sync",
        "--on-schema-error", "skip_shard", "--max-failed-shards", str(SHARDS),
        "--log-format", "json", in_process=True,
    )  # fmt: skip
    assert r.returncode == EXIT_OK, r.output
    recs = [json.loads(line) for line in r.stderr.splitlines()]
    skipped = [rec for rec in recs if "skip_shard" in rec["message"]]
    assert len(skipped) == 1, r.stderr
    assert f"{SHARDS} of {SHARDS + 1} shards do not fit model" in skipped[0]["message"]
    assert "is missing in 12 of 13 shards" in skipped[0]["message"]
    assert not [rec for rec in recs if rec["level"] == "error"], r.stderr
    assert report(out)["shards_failed"] == SHARDS


def test_lossy_casts_are_reported_once_per_column(bundle_dir: Path, tmp_path: Path) -> None:
    cat = tmp_path / "catalog"
    paths = write_shards(cat, [1000, 1000, 1000], row_group_rows=250)
    for k, p in enumerate(paths):
        t = pq.read_table(p)
        if k < 2:  # f0 as int64 counts, two of them past 2**24 (16,777,217 is not a float32)
            counts = pa.array([7] * 999 + [2**24 + 1 + 2 * k], pa.int64())
            t = t.set_column(t.schema.get_field_index("f0"), "f0", counts)
        # f1 as float64: ordinary doubles (rounded to float32, not reported) in every shard,
        # and in the last two one value float32 cannot hold (it becomes 0)
        f1 = pc.add(pc.cast(t.column("f1"), pa.float64()), pa.scalar(0.1, pa.float64()))
        if k > 0:
            f1 = pa.concat_arrays([f1.combine_chunks()[:-1], pa.array([1e-50])])
        t = t.set_column(t.schema.get_field_index("f1"), "f1", f1)
        pq.write_table(t, p, row_group_size=250)
    out = tmp_path / "o"
    r = cli(
        "run", *job_args(cat, out, bundle_dir), "--scheduler", "sync", "--log-format", "json",
        in_process=True,
    )  # fmt: skip
    assert r.returncode == EXIT_OK, r.output
    casts = {c["column"]: c for c in report(out)["lossy_casts"]}
    assert set(casts) == {"f0", "f1"}
    assert casts["f0"]["from_type"] == "int64" and casts["f0"]["shards"] == 2
    assert casts["f0"]["example"] == {
        "shard": "part-00000.parquet",
        "value": 16_777_217.0,
        "as_float32": 16_777_216.0,
    }
    assert casts["f1"]["from_type"] == "double" and casts["f1"]["shards"] == 2
    ex = casts["f1"]["example"]
    assert ex["shard"] == "part-00001.parquet" and ex["value"] != ex["as_float32"]
    logged = [json.loads(line) for line in r.stderr.splitlines() if '"event":"lossy_cast"' in line]
    assert sorted(rec["message"].split(":")[0] for rec in logged) == ["feature f0", "feature f1"]
    assert all(rec["level"] == "warning" for rec in logged)
