"""bench.formats: the per-round table (each format's wall, the ratios to the folder per round and
their medians, the commit seconds) and the history table, from samples as the runner records
them; the CLI runs themselves are the bench's (`make bench-formats FORMATS_ARGS=--smoke`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.formats import (
    NIGHT_COLUMNS,
    day,
    history_columns,
    history_rows,
    phase_rows,
    report_path,
    round_rows,
)
from bench.mdtable import markdown_table
from bench.stats import Sample
from bench.suites import WorkloadResult


def sample(wall: float, rnd: int, commit: float | None = None, **phases: float) -> Sample:
    extra: dict[str, Any] = {"round": rnd, "commit_s": commit, "phases": phases or None}
    return Sample(rows=10, wall_s=wall, timed_s=None, peak_rss_bytes=0, extra=extra)


def test_each_round_has_its_own_ratios_and_the_last_row_their_medians() -> None:
    samples = {
        "cli-parquet": [sample(10.0, 1), sample(20.0, 2), sample(10.0, 3)],
        "cli-delta": [sample(11.0, 1, 0.05), sample(20.0, 2, 0.07), sample(12.0, 3, 0.06)],
        # Round 2's Iceberg run failed: no sample, and its cells say so.
        "cli-iceberg": [sample(13.0, 1, 0.2), sample(14.0, 3, 0.4)],
    }
    rows = round_rows(samples, 3)
    assert [r["round"] for r in rows] == ["1", "2", "3", "**median**"]
    assert rows[0]["delta_ratio"] == pytest.approx(1.1)
    assert rows[1]["iceberg"] is None and rows[1]["iceberg_ratio"] is None
    median = rows[-1]
    # The median of the per-round ratios (1.1, 1.0, 1.2), not the ratio of the median walls.
    assert median["delta_ratio"] == pytest.approx(1.1)
    assert median["iceberg_ratio"] == pytest.approx((1.3 + 1.4) / 2)
    assert median["parquet"] == 10.0 and median["iceberg_commit"] == pytest.approx(0.3)
    table = markdown_table(rows, NIGHT_COLUMNS)
    assert table[0].startswith("| round | folder wall s | delta wall s | iceberg wall s |")
    assert table[3] == "| 2 | 20.00 | 20.00 | — | 1.000x | — | 0.070 | — |"
    assert table[-1].startswith("| **median** | 10.00 | 12.00 | 13.50 | 1.100x | 1.350x |")


def test_the_phases_are_medians_per_format() -> None:
    samples = {
        "cli-iceberg": [
            sample(5.0, 1, 0.1, **{"start-up": 2.0, "exit": 0.4}),
            sample(6.0, 2, 0.3, **{"start-up": 3.0, "exit": 0.6}),
        ]
    }
    rows = {r["format"]: r for r in phase_rows(samples)}
    assert rows["iceberg"]["start-up"] == 2.5 and rows["iceberg"]["exit"] == pytest.approx(0.5)
    assert rows["iceberg"]["commit"] == pytest.approx(0.2) and rows["iceberg"]["scoring"] is None
    assert rows["parquet"]["commit"] is None  # not measured: no sample


def test_the_history_row_puts_night_1_beside_night_n_and_the_rescore() -> None:
    built = {
        "commit_s": [0.5, 0.1, 0.2, 0.3, 0.4, 0.9],
        "metadata_files": 1234,
        "metadata_bytes": 10 * 2**10,
        "newest_bytes": 3 * 2**9,
    }
    wl = WorkloadResult("HISTORY", "t", [], [], meta={"built": {"iceberg": built}})
    wl.samples["rescore-iceberg"] = [sample(8.0, 1, 0.6), sample(9.0, 2, 0.8)]
    rows = history_rows(wl)  # Delta's backfill failed: no row for it
    assert [r["format"] for r in rows] == ["iceberg"]
    row = rows[0]
    assert (row["first"], row["last"], row["head"], row["tail"]) == (0.5, 0.9, 0.2, 0.4)
    assert row["rescore_commit"] == pytest.approx(0.7) and row["rescore_wall"] == 8.5
    lines = markdown_table(rows, history_columns(6))
    assert "commit s, night 6" in lines[0] and "median, nights 4-6" in lines[0]
    assert lines[2] == (
        "| iceberg | 0.500 | 0.900 | 0.200 | 0.400 | 0.700 | 8.50 | 1,234 / 10 | 1.5 |"
    )


def test_a_night_s_report_is_in_its_partition_s_control_folder() -> None:
    assert day(0) == "2026-01-01" and day(30) == "2026-01-31"
    table = Path("/x/out/scored")
    assert report_path(table, day(1)) == Path(
        "/x/out/_score_catalog/scored/run_date=2026-01-02/_report.json"
    )
