"""Issue 22, 9b: a timestamp pass-through column whose unit or time zone differs between shards
gets one type in the output, as docs/output.md promises; a column with a time zone in some
shards and none in others is refused, naming a shard of each. Real shards, the real CLI."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from pipeline.core.errors import EXIT_INPUT, EXIT_OK
from tests.conftest import write_shards
from tests.integration.helpers import cli, data_files, job_args, rejects_of

pytestmark = pytest.mark.integration

BASE_MS = 1_700_000_000_000  # 2023-11-14T22:13:20Z


def _with_stamps(root: Path, kinds: list[tuple[str, str | None]]) -> None:
    """One shard per (unit, zone) with a ``seen_at`` column: row i is BASE_MS + i seconds, as an
    instant (zoned) or as the same UTC wall-clock time (no zone); row 7 of each has a NaN
    feature, so that every shard also writes rejects."""
    for k, (path, (unit, tz)) in enumerate(
        zip(write_shards(root, [600] * len(kinds), row_group_rows=200, start=0), kinds, strict=True)
    ):
        t = pq.read_table(path)
        ms = pa.array(BASE_MS + 1000 * np.arange(t.num_rows) + k, pa.timestamp("ms", "UTC"))
        seen = ms.cast(pa.timestamp(unit, "UTC"))
        seen = pc.local_timestamp(seen) if tz is None else seen.cast(pa.timestamp(unit, tz))
        f0 = t.column("f0").to_numpy().copy()
        f0[7] = np.nan
        t = t.set_column(t.schema.get_field_index("f0"), "f0", pa.array(f0, pa.float32()))
        pq.write_table(t.append_column("seen_at", seen), path, row_group_size=200)


def test_units_and_time_zones_are_promoted_to_one_type(tmp_path: Path, bundle_dir: Path) -> None:
    inp, out = tmp_path / "in", tmp_path / "out"
    _with_stamps(inp, [("ms", "UTC"), ("us", "Europe/Paris"), ("ns", "+05:30")])
    r = cli(
        "run", *job_args(inp, out, bundle_dir), "--passthrough", "seen_at",
        "--scheduler", "sync", "--max-rejected-fraction", "0.1",
    )  # fmt: skip
    assert r.returncode == EXIT_OK, r.output
    want = pa.timestamp("ns", "UTC")  # the finest unit; zones differ, so UTC: the same instants
    for root in (out, rejects_of(out)):
        files = data_files(root)
        assert len(files) == 3
        assert {pq.read_schema(f).field("seen_at").type for f in files} == {want}
        table = ds.dataset(root, format="parquet").to_table()  # the whole folder reads as one
        expected = BASE_MS + 1000 * (table.column("item_id").to_numpy() % 600)
        expected += table.column("item_id").to_numpy() // 600  # each shard's k
        got = table.column("seen_at").cast(pa.timestamp("ms", "UTC")).cast(pa.int64())
        assert got.to_pylist() == expected.tolist()  # every instant kept


@pytest.mark.slow
def test_a_zone_in_some_shards_and_none_in_others_is_refused_naming_both(
    tmp_path: Path, bundle_dir: Path
) -> None:
    inp, out = tmp_path / "in", tmp_path / "out"
    _with_stamps(inp, [("us", "UTC"), ("us", None), ("us", "UTC")])
    for command in ("run", "plan"):
        r = cli(command, *job_args(inp, out, bundle_dir), "--passthrough", "seen_at")
        assert r.returncode == EXIT_INPUT, r.output
        err = " ".join(r.stderr.split())
        assert f"column 'seen_at' of input {inp} is a timestamp with time zone UTC" in err
        assert "in shard part-00000.parquet" in err  # a shard with a zone...
        assert (
            "without a time zone (timestamp[us]) in shard part-00001.parquet" in err
        )  # ...and one without
        assert "(2 shard(s) with a zone, 1 without)" in err
    assert not out.exists() and not rejects_of(out).exists()
