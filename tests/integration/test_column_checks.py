"""Issue 13: column problems said once, and casts to float32 that change values reported.

Real CLI runs on real Parquet shards: an id column missing from 12 shards is one line that
names the columns those shards do have, whether the run stops (``fail``) or skips them
(``skip_shard``), and missing from every shard it is a configuration mistake (exit 2, "did you
mean", never a suggestion to skip every shard); an int64 feature beyond 2**24 and a float64
feature float32 rounds are reported once per column, in the log and in ``_report.json``'s
``lossy_casts``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from pipeline.core.errors import EXIT_INPUT, EXIT_OK, EXIT_USAGE
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


def test_an_id_column_missing_from_every_shard_is_a_configuration_mistake(
    renamed_ids: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    # Issue 22, 9c: a typo in the job, not shards to skip (skip_shard would skip all 12).
    r = cli("run", *job_args(renamed_ids, tmp_path / "o", bundle_dir), in_process=True)
    assert r.returncode == EXIT_USAGE, r.output
    assert "skip_shard" not in r.output
    (line,) = [ln for ln in r.output.splitlines() if "item_id" in ln]  # said once
    assert line.startswith(
        "error: invalid configuration: id_column = 'item_id' is not a column of any input "
        f"shard ({SHARDS} read; their columns: id, category, f0, f1,"
    ), line
    assert "label); did you mean 'id'? Set id_column in the job file" in line, line
    assert "SCORE_CATALOG_ID_COLUMN or --id-column" in line
    assert not (tmp_path / "o").exists()


def test_a_pass_through_column_missing_from_every_shard_names_its_key(
    bundle_dir: Path, tmp_path: Path
) -> None:
    cat = tmp_path / "catalog"
    write_shards(cat, [300, 300], row_group_rows=100)
    args = job_args(cat, tmp_path / "o", bundle_dir)
    for command in ("run", "plan"):
        r = cli(command, *args, "--passthrough", "category,f_1", in_process=True)
        assert r.returncode == EXIT_USAGE, r.output
        assert "skip_shard" not in r.output
        text = " ".join(r.output.split())
        assert "passthrough names 'f_1', which is not a column of any input shard" in text
        assert "did you mean 'f1'? Set passthrough in the job file" in text


def test_a_model_input_missing_from_every_shard_does_not_suggest_skipping_them(
    bundle_dir: Path, tmp_path: Path
) -> None:
    cat = tmp_path / "catalog"
    for p in write_shards(cat, [300, 300], row_group_rows=100):
        t = pq.read_table(p)
        pq.write_table(t.drop_columns(["f7"]), p, row_group_size=100)
    r = cli("run", *job_args(cat, tmp_path / "o", bundle_dir), in_process=True)
    assert r.returncode == EXIT_INPUT, r.output
    assert "2 of 2 shards do not fit model" in r.output
    assert "Fix the input or the model bundle" in r.output and "skip_shard" not in r.output
    # Where some shards fit, skipping the others is still offered.
    write_shards(tmp_path / "good", [300], row_group_rows=100, start=10**6)
    (cat / "zz.parquet").write_bytes((tmp_path / "good" / "part-00000.parquet").read_bytes())
    r = cli("run", *job_args(cat, tmp_path / "o", bundle_dir), in_process=True)
    assert r.returncode == EXIT_INPUT and "set errors.on_schema_error = 'skip_shard'" in r.output


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


@pytest.mark.parametrize("fmt", ["delta", "iceberg"])
@pytest.mark.parametrize("key", ["category", "model_version", "Category"])
def test_a_column_named_like_the_partition_key_is_refused_before_scoring(
    bundle_dir: Path, tmp_path: Path, fmt: str, key: str
) -> None:
    """A pass-through column (``category``) or an output column (``model_version``) named like
    the template's partition folder: a table's files hold no partition column, so it is refused
    before any row is scored (it used to be scored, then refused at the commit, every night).
    ``Category`` against the column ``category``: case aside too, as DuckDB and Spark read
    names (an Iceberg table holding both read the wrong column under the partition's name)."""
    cat = tmp_path / "catalog" / "2026-12-01"
    write_shards(cat, [300, 200], row_group_rows=100)
    out = f"{tmp_path}/scored/{key}={{date}}"
    args = job_args(tmp_path / "catalog" / "{date}", out, bundle_dir, "--format", fmt)
    r = cli("run", *args, "--passthrough", "category", "--date", "2026-12-01")
    assert r.returncode == EXIT_INPUT, r.output
    assert f"the output has a column {key.lower()!r}" in r.output, r.output
    assert f"the name of the output template's partition folder {key}=" in r.output
    assert not list((tmp_path / "scored").rglob("*.parquet"))  # nothing scored or written
