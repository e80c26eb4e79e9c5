"""Drift from quantile sketches, checked against exact statistics on the raw samples."""

from __future__ import annotations

import itertools
import json
from typing import Any

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.report.drift import PSI_EPSILON, DriftThresholds, compare, ks, psi
from pipeline.report.schema import report_schema
from pipeline.worker.sketch import SKETCH_POINTS, histogram, sketch

N = 50_000


def check_section(out: Any) -> None:
    """``out`` is what the report's ``drift`` key may hold, per the committed schema."""
    defs = report_schema()["$defs"]
    schema = {"$defs": defs, "$ref": "#/$defs/drift_comparison"}
    jsonschema.Draft202012Validator(schema).validate(json.loads(json.dumps(out)))


def exact_ks(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample KS on the raw samples: ECDFs compared at every observed value."""
    a, b = np.sort(a), np.sort(b)
    xs = np.concatenate([a, b])
    fa = np.searchsorted(a, xs, side="right") / a.size
    fb = np.searchsorted(b, xs, side="right") / b.size
    return float(np.abs(fa - fb).max())


def exact_psi(a: np.ndarray, b: np.ndarray, bins: int = 10) -> float:
    """PSI on the raw samples with the baseline's exact deciles as right-closed bin edges."""
    edges = np.unique(np.quantile(a, np.linspace(0, 1, bins + 1)[1:-1]))

    def fractions(x: np.ndarray) -> np.ndarray:
        cum = np.searchsorted(np.sort(x), edges, side="right") / x.size
        return np.maximum(np.diff(np.concatenate(([0.0], cum, [1.0]))), PSI_EPSILON)

    fa, fb = fractions(a), fractions(b)
    return float(np.sum((fb - fa) * np.log(fb / fa)))


def report(
    run_id: str, outputs: dict[str, Any], rows_out: int = 50_000, **extra: Any
) -> dict[str, Any]:
    """A report dict with the fields compare() reads, as pipeline.run writes them."""
    return {
        "run_id": run_id,
        "job": "nightly-catalog",
        "status": "succeeded",
        "output": f"/data/scored/{run_id[:8]}",
        "started_at": "2026-03-01T02:00:00.125000+00:00",
        "finished_at": "2026-03-01T02:14:31.500000+00:00",
        "rows_out": rows_out,
        "outputs": outputs,
        **extra,
    }


def column(values: np.ndarray) -> dict[str, Any]:
    return {
        "count": int(values.size),
        "mean": float(values.mean()) if values.size else None,
        "sketch": sketch(values),
    }


@pytest.fixture(scope="module")
def rng() -> np.random.Generator:
    return np.random.default_rng(20260301)


# --- sketch and histogram ------------------------------------------------------------------


def test_sketch_ends_are_min_and_max_and_middle_is_median(rng: np.random.Generator) -> None:
    x = rng.normal(size=10_001)
    s = sketch(x)
    assert len(s) == SKETCH_POINTS
    assert s[0] == x.min() and s[-1] == x.max()
    assert s[50] == pytest.approx(np.median(x))
    assert all(a <= b for a, b in itertools.pairwise(s))


def test_sketch_weights_count_rows(rng: np.random.Generator) -> None:
    # Two sampled values, the second standing for 3x as many rows: 75% of rows are 10.
    s = sketch(np.array([0.0, 10.0]), np.array([1.0, 3.0]))
    assert s[0] == 0.0 and s[-1] == 10.0
    assert s[80] == 10.0
    # Weighted and expanded samples agree to the sketch's resolution.
    x = rng.uniform(size=2000)
    w = rng.integers(1, 5, size=2000)
    assert ks(sketch(x, w.astype(float)), sketch(np.repeat(x, w))) <= 0.01


def test_sketch_empty_and_non_finite() -> None:
    assert sketch(np.array([])) == []
    assert sketch(np.array([np.nan, np.inf])) == []
    assert sketch(np.array([1.0, np.nan, 3.0]))[-1] == 3.0
    assert sketch(np.array([1.0, 2.0]), np.array([0.0, 0.0])) == []
    with pytest.raises(ValueError, match="differ in length"):
        sketch(np.array([1.0, 2.0]), np.array([1.0]))


def test_histogram_counts_and_edges(rng: np.random.Generator) -> None:
    x = rng.uniform(2.0, 3.0, size=1000)
    h = histogram(x, np.full(1000, 2.5), bins=20)
    assert len(h["edges"]) == 21 and len(h["counts"]) == 20
    assert h["edges"][0] == x.min() and h["edges"][-1] == x.max()
    assert all(isinstance(c, int) for c in h["counts"])
    assert sum(h["counts"]) == pytest.approx(2500, abs=20)  # rounding per bin
    json.dumps(h)


def test_histogram_degenerate_and_empty() -> None:
    assert histogram(np.full(7, 0.25)) == {"edges": [0.25, 0.25], "counts": [7]}
    assert histogram(np.array([])) == {"edges": [], "counts": []}
    with pytest.raises(ValueError):
        histogram(np.ones(3), bins=0)


# --- psi and ks against the raw samples ----------------------------------------------------


def test_identical_samples_have_no_drift(rng: np.random.Generator) -> None:
    s = sketch(rng.normal(size=N))
    assert psi(s, s) == pytest.approx(0.0, abs=1e-12)
    assert ks(s, s) == pytest.approx(0.0, abs=1e-12)


def test_two_samples_of_one_distribution_have_tiny_drift(rng: np.random.Generator) -> None:
    a, b = rng.normal(size=N), rng.normal(size=N)
    assert psi(sketch(a), sketch(b)) < 0.01
    assert ks(sketch(a), sketch(b)) < 0.02


# Normal(0, 1) against Normal(shift, 1) at 50k samples: PSI is about 0.011 at 0.1, 0.24 at 0.5
# (too close to 0.25 to test either way) and 0.93 at 1.0; KS 0.04, 0.20, 0.38.
@pytest.mark.parametrize(("shift", "crosses"), [(0.1, False), (1.0, True)])
def test_shift_matches_exact_statistics(
    rng: np.random.Generator, shift: float, crosses: bool
) -> None:
    a, b = rng.normal(size=N), rng.normal(shift, 1.0, size=N)
    sa, sb = sketch(a), sketch(b)
    p, k = psi(sa, sb), ks(sa, sb)
    assert k == pytest.approx(exact_ks(a, b), abs=0.02)
    assert p == pytest.approx(exact_psi(a, b), rel=0.1, abs=0.005)
    t = DriftThresholds()
    assert (p > t.psi) is crosses
    assert (k > t.ks) is crosses


def test_skewed_scores_match_exact_statistics(rng: np.random.Generator) -> None:
    # Scores like a classifier's: squashed into [0, 1], most near 0.
    a = 1 / (1 + np.exp(-rng.normal(-3.0, 1.0, size=N)))
    b = 1 / (1 + np.exp(-rng.normal(-2.2, 1.3, size=N)))
    sa, sb = sketch(a), sketch(b)
    assert ks(sa, sb) == pytest.approx(exact_ks(a, b), abs=0.02)
    assert psi(sa, sb) == pytest.approx(exact_psi(a, b), rel=0.1)


def test_point_masses_give_finite_values() -> None:
    zeros = sketch(np.zeros(1000))
    half = sketch(np.r_[np.zeros(500), np.ones(500)])
    ones = sketch(np.ones(1000))
    for a, b in [(zeros, half), (half, zeros), (zeros, ones), (half, half), (zeros, zeros)]:
        assert np.isfinite(psi(a, b))
        assert 0.0 <= ks(a, b) <= 1.0
    assert psi(zeros, zeros) == 0.0 and ks(zeros, zeros) == 0.0
    assert ks(zeros, ones) == 1.0
    # True KS between "all 0" and "half 0, half 1" is 0.5; the sketch resolves it to 0.01.
    assert ks(zeros, half) == pytest.approx(0.5, abs=0.011)
    assert psi(zeros, half) > 1.0


def test_mass_at_zero_matches_exact(rng: np.random.Generator) -> None:
    # 30% exact zeros (e.g. clipped scores) then a continuum; then 60% zeros.
    a = np.where(rng.uniform(size=N) < 0.3, 0.0, rng.uniform(size=N))
    b = np.where(rng.uniform(size=N) < 0.6, 0.0, rng.uniform(size=N))
    assert ks(sketch(a), sketch(b)) == pytest.approx(exact_ks(a, b), abs=0.02)
    assert psi(sketch(a), sketch(b)) == pytest.approx(exact_psi(a, b), rel=0.1)


def test_invalid_sketches_are_rejected() -> None:
    good = list(np.linspace(0, 1, SKETCH_POINTS))
    with pytest.raises(ValueError, match="101"):
        psi(good[:50], good)
    with pytest.raises(ValueError, match="101"):
        ks(good, [])
    with pytest.raises(ValueError, match="non-decreasing"):
        ks(good[::-1], good)
    with pytest.raises(ValueError, match="non-finite"):
        psi(good, [*good[:-1], float("nan")])


samples = st.lists(
    st.floats(min_value=-1e6, max_value=1e6, allow_nan=False), min_size=1, max_size=300
).map(lambda xs: sketch(np.asarray(xs)))


@settings(max_examples=200, deadline=None)
@given(a=samples, b=samples)
def test_properties(a: list[float], b: list[float]) -> None:
    p, k = psi(a, b), ks(a, b)
    assert np.isfinite(p) and p >= 0.0
    assert 0.0 <= k <= 1.0
    assert ks(b, a) == pytest.approx(k, abs=1e-12)
    assert psi(a, a) == pytest.approx(0.0, abs=1e-12)
    assert ks(a, a) == pytest.approx(0.0, abs=1e-12)


# --- compare -------------------------------------------------------------------------------


def test_compare_no_drift(rng: np.random.Generator) -> None:
    x = rng.normal(size=N)
    base = report("20260301T020000Z-a1b2c3", {"score_p1": column(x)})
    cur = report("20260302T020000Z-d4e5f6", {"score_p1": column(x)}, rows_out=52_000)
    out = compare(base, cur, DriftThresholds())
    check_section(out)
    assert out["alert"] is False and out["reasons"] == []
    assert out["baseline"] == {
        "run_id": base["run_id"],
        "output": base["output"],
        "finished_at": base["finished_at"],
    }
    assert out["rows"] == {"previous": 50_000, "current": 52_000, "change": pytest.approx(0.04)}
    assert out["columns"]["score_p1"]["psi"] == pytest.approx(0.0, abs=1e-12)
    assert out["columns"]["score_p1"]["alert"] is False
    assert out["thresholds"] == {"psi": 0.25, "ks": 0.2, "rows_change": 0.5}
    json.dumps(out)


def test_compare_drift_and_row_change_alert(rng: np.random.Generator) -> None:
    base = report(
        "20260301T020000Z-a1b2c3",
        {"score_p1": column(rng.normal(size=N)), "label": column(rng.integers(0, 2, N) * 1.0)},
    )
    cur = report(
        "20260302T020000Z-d4e5f6",
        {"score_p1": column(rng.normal(1.0, 1.0, N)), "label": column(rng.integers(0, 2, N) * 1.0)},
        rows_out=20_000,
    )
    out = compare(base, cur, DriftThresholds())
    check_section(out)
    assert out["alert"] is True
    assert out["columns"]["score_p1"]["alert"] is True
    assert out["columns"]["label"]["alert"] is False
    assert out["rows"]["change"] == pytest.approx(-0.6)
    text = "\n".join(out["reasons"])
    assert "score_p1: PSI 0.9" in text and "> 0.25 against run 20260301T020000Z-a1b2c3" in text
    assert "score_p1: KS 0.3" in text and "> 0.2 against run" in text
    assert "rows scored: 20,000 vs 50,000 (-60.0%, allowed ±50%)" in text
    assert "label" not in text
    # Looser thresholds: nothing alerts.
    loose = compare(base, cur, DriftThresholds(psi=2.0, ks=0.5, rows_change=0.7))
    assert loose["alert"] is False and loose["reasons"] == []


def test_compare_schema_change_and_missing_sketches(rng: np.random.Generator) -> None:
    x = rng.normal(size=1000)
    base = report(
        "20260301T020000Z-a1b2c3",
        {"score": column(x), "old": column(x), "legacy": {"count": 1000, "mean": 0.1}},
    )
    cur = report(
        "20260302T020000Z-d4e5f6",
        {"score": column(np.array([])), "new": column(x), "legacy": column(x)},
    )
    out = compare(base, cur, DriftThresholds())
    check_section(out)
    cols = out["columns"]
    # No rows scored / a report from before sketches existed: nothing to compare, no alert.
    assert cols["score"] == {"psi": None, "ks": None, "alert": False}
    assert cols["legacy"] == {"psi": None, "ks": None, "alert": False}
    assert cols["new"] == {"psi": None, "ks": None, "alert": True}
    assert cols["old"] == {"psi": None, "ks": None, "alert": True}
    assert list(cols) == ["score", "new", "legacy", "old"]
    assert out["alert"] is True
    assert any(r.startswith("new: new output column") for r in out["reasons"])
    assert any(r.startswith("old: output column missing") for r in out["reasons"])


def test_compare_zero_and_unknown_rows() -> None:
    base = report("20260301T020000Z-a1b2c3", {}, rows_out=0)
    same = compare(base, report("20260302T020000Z-d4e5f6", {}, rows_out=0), DriftThresholds())
    assert same["rows"] == {"previous": 0, "current": 0, "change": 0.0}
    out = compare(base, report("20260302T020000Z-d4e5f6", {}, rows_out=10), DriftThresholds())
    assert out["rows"]["change"] is None and out["alert"] is True
    unknown = report("20260302T020000Z-d4e5f6", {})
    del unknown["rows_out"]
    out = compare(base, unknown, DriftThresholds())
    assert out["rows"] == {"previous": 0, "current": None, "change": None}
    assert out["alert"] is False
    check_section(out)
