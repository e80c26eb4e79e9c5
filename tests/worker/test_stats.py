"""Per-shard score statistics: what a manifest entry keeps of them, and how a skipped shard's
summary stands in for its rows in the report; and the strict JSON every document is written as."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.core import jsontext
from pipeline.core.statuses import ShardStatus
from pipeline.report import drift
from pipeline.report.build import output_summary
from pipeline.worker import sketch
from pipeline.worker.shard import ShardResult
from pipeline.worker.stats import ColumnStats, DuplicateIds, ShardStats


def _strict(text: str) -> Any:
    def refuse(token: str) -> None:
        raise AssertionError(f"{token} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _scored(values: np.ndarray, batch: int = 4096) -> ShardStats:
    """A shard's statistics as a worker keeps them, batch by batch."""
    stats = ShardStats.for_outputs(["s"], len(values))
    for i in range(0, len(values), batch):
        chunk = values[i : i + batch]
        stats.add_scores({"s": pa.array(chunk)}, len(chunk))
    return stats


def _result(name: str, stats: ShardStats, status: str = ShardStatus.SCORED) -> ShardResult:
    return ShardResult(
        name, name, status, rows_in=stats.rows_out, rows_out=stats.rows_out, stats=stats
    )


def _values(n: int, seed: int, shift: float = 0.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.gamma(2.0, 1.0, n) + shift).astype(np.float32)


def test_summary_keeps_exact_totals_and_a_compact_sketch() -> None:
    v = _values(123_457, 1)
    summary = _scored(v).summary()
    (col,) = summary.values()
    assert col["count"] == len(v)
    assert col["sum"] == pytest.approx(float(v.astype(float).sum()), rel=1e-6)
    assert col["min"] == float(v.min()) and col["max"] == float(v.max())
    assert len(col["sketch"]) == sketch.SKETCH_POINTS
    assert col["sketch"][0] == col["min"] and col["sketch"][-1] == col["max"]
    assert np.all(np.diff(col["sketch"]) >= 0)
    # The manifest is rewritten after every shard: one column costs about 2 kB (101 floats),
    # not its 10,000 samples.
    assert len(jsontext.to_json(summary, compact=True)) < 2500


def test_a_summary_stands_in_for_the_shard_within_sketch_resolution() -> None:
    v = _values(80_000, 2)
    text = jsontext.to_json(_scored(v).summary(), compact=True)  # through the manifest's JSON
    back = ShardStats.from_summary(_strict(text), len(v))
    c = back.columns["s"]
    assert (c.count, c.min, c.max) == (len(v), float(v.min()), float(v.max()))
    sample, weights = c.weighted_sample(back.sample_weight)
    assert weights.sum() == pytest.approx(len(v))
    exact = sketch.sketch(v)
    assert drift.ks(exact, sketch.sketch(sample, weights)) < 0.02
    assert drift.psi(exact, sketch.sketch(sample, weights)) < 0.01


def test_the_report_over_scored_and_skipped_shards_matches_all_scored() -> None:
    parts = [_values(20_000 + 3_000 * k, 10 + k, shift=2.0 * k) for k in range(4)]
    all_scored = output_summary(_result(f"p{k}", _scored(v)) for k, v in enumerate(parts))
    skipped = [
        _result(
            f"p{k}",
            ShardStats.from_summary(_strict(jsontext.to_json(_scored(v).summary())), len(v)),
            ShardStatus.SKIPPED,
        )
        for k, v in enumerate(parts[:3])
    ]
    resumed = output_summary([*skipped, _result("p3", _scored(parts[3]))])
    a, b = all_scored["s"], resumed["s"]
    assert a["count"] == b["count"] == sum(len(v) for v in parts)
    assert (a["min"], a["max"]) == (b["min"], b["max"])
    assert b["mean"] == pytest.approx(a["mean"], rel=1e-9)
    assert drift.ks(a["sketch"], b["sketch"]) < 0.02
    assert drift.psi(a["sketch"], b["sketch"]) < 0.01
    for q, x in a["quantiles"].items():
        assert b["quantiles"][q] == pytest.approx(x, abs=0.02 * (a["max"] - a["min"])), q
    assert sum(b["histogram"]["counts"]) == pytest.approx(b["count"], abs=len(parts))
    # The shards really differ: the last one alone is far from the whole (what a report over
    # only the rescored shard would have compared).
    alone = output_summary([_result("p3", _scored(parts[3]))])["s"]["sketch"]
    assert drift.psi(a["sketch"], alone) > 1.0


def test_a_column_without_rows() -> None:
    stats = ShardStats.for_outputs(["s"], 0)
    summary = stats.summary()
    assert summary == {"s": {"count": 0, "sum": 0.0, "min": None, "max": None, "sketch": []}}
    back = ShardStats.from_summary(_strict(jsontext.to_json(summary)), 0)
    c = back.columns["s"]
    assert c.count == 0 and c.min == math.inf and c.max == -math.inf
    assert len(c.weighted_sample(1.0)[0]) == 0
    assert output_summary([_result("p", back, ShardStatus.SKIPPED)]) == {"s": {"count": 0}}


def test_an_entry_without_statistics_is_marked() -> None:
    stats = ShardStats.from_summary(None, 500)
    assert not stats.summarised and stats.columns == {} and stats.rows_out == 500
    assert ShardStats.for_outputs(["s"], 10).summarised


def test_column_stats_samples_win_over_a_sketch() -> None:
    c = ColumnStats(count=3, total=6.0, min=1.0, max=3.0, samples=[1.0, 2.0, 3.0])
    v, w = c.weighted_sample(2.0)
    assert v.tolist() == [1.0, 2.0, 3.0] and w.tolist() == [2.0, 2.0, 2.0]


# --- strict JSON ---------------------------------------------------------------------------


def test_to_json_writes_null_for_non_finite_numbers() -> None:
    doc = {
        "mean": float("nan"),
        "min": float("inf"),
        "nested": [1.0, float("-inf"), {"x": np.float32("nan"), "y": np.float64(2.5)}],
        "arr": np.array([1.0, np.nan]),
        "n": np.int64(7),
        (1, 2): "tuple key",
    }
    for compact in (False, True):
        text = jsontext.to_json(doc, compact=compact)
        assert "NaN" not in text and "Infinity" not in text
        assert _strict(text) == {
            "mean": None,
            "min": None,
            "nested": [1.0, None, {"x": None, "y": 2.5}],
            "arr": [1.0, None],
            "n": 7,
            "(1, 2)": "tuple key",
        }
    assert "\n" not in jsontext.to_json(doc, compact=True)


def test_to_json_of_a_finite_document_is_plain_json() -> None:
    doc = {"a": [1, 2.5, None, True, "x"], "b": {"c": np.float32(0.5), "d": np.int64(3)}}
    assert _strict(jsontext.to_json(doc)) == {
        "a": [1, 2.5, None, True, "x"],
        "b": {"c": 0.5, "d": 3},
    }
    plain = {"a": [1, 2.5, None], "b": "é"}
    assert jsontext.to_json(plain) == json.dumps(plain, indent=2)
    assert jsontext.to_json(plain, compact=True) == json.dumps(plain, separators=(",", ":"))


def _labels(n: int, seed: int, p: float) -> np.ndarray:
    """An argmax label column: 0 or 1, a share ``p`` of ones."""
    return (np.random.default_rng(seed).random(n) < p).astype(np.int64)


def test_a_discrete_column_gets_rows_per_value() -> None:
    v = _labels(8_000, 3, 0.3)  # under SAMPLE_ROWS: every row is in the sample, counts exact
    s = output_summary([_result("p", _scored(v))])["s"]
    ones = int(v.sum())
    assert s["value_counts"] == {"values": [0, 1], "counts": [len(v) - ones, ones]}
    # Sampled (every 12th row of 120,000): still whole rows per value, adding up to the count.
    big = _labels(120_000, 4, 0.3)
    counts = output_summary([_result("p", _scored(big))])["s"]["value_counts"]
    assert counts["values"] == [0, 1] and sum(counts["counts"]) == len(big)
    assert counts["counts"][1] == pytest.approx(int(big.sum()), rel=0.03)


def test_a_continuous_or_many_valued_column_gets_none() -> None:
    assert "value_counts" not in output_summary([_result("p", _scored(_values(5_000, 5)))])["s"]
    many = np.arange(5_000) % 21  # 21 distinct whole numbers: a histogram
    assert "value_counts" not in output_summary([_result("p", _scored(many))])["s"]
    few = np.arange(5_000) % 20 - 7  # 20, negative ones included: bars
    assert output_summary([_result("p", _scored(few))])["s"]["value_counts"]["values"] == list(
        range(-7, 13)
    )


def test_a_skipped_discrete_shard_stays_discrete() -> None:
    # Read back from its manifest sketch, a 0/1 shard must not come back with values like 0.4
    # (linear between the sketch's last 0 and first 1): the resumed report keeps its bars.
    v = _labels(60_000, 6, 0.37)
    text = jsontext.to_json(_scored(v).summary(), compact=True)
    back = ShardStats.from_summary(_strict(text), len(v))
    sample, _ = back.columns["s"].weighted_sample(back.sample_weight)
    assert set(np.unique(sample)) == {0.0, 1.0}
    resumed = output_summary([_result("p", back, ShardStatus.SKIPPED)])["s"]["value_counts"]
    assert resumed["values"] == [0, 1]
    assert resumed["counts"][1] / len(v) == pytest.approx(v.mean(), abs=0.01)  # sketch: 1%


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.one_of(st.none(), st.integers(-3, 40)), max_size=300),
    st.integers(1, 64),
    st.booleans(),
)
def test_duplicate_ids_are_the_rows_whose_id_came_before(
    ids: list[int | None], batch: int, as_text: bool
) -> None:
    # Counted across batches, by value for integers and by hash for anything else; a null is
    # no id, never a repeat of another null.
    values: list[Any] = [None if i is None else (f"sku-{i}" if as_text else i) for i in ids]
    dup = DuplicateIds()
    for lo in range(0, len(values), batch):
        dup.add(pa.array(values[lo : lo + batch], pa.string() if as_text else pa.int64()))
    present = [v for v in values if v is not None]
    assert dup.count() == len(present) - len(set(present))
    assert dup.nulls == len(values) - len(present)
