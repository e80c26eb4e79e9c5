"""Score-distribution drift between two runs, from the compact sketches in their reports.

Every output column in ``_report.json`` carries a *sketch*: its weighted quantiles at
``SKETCH_POINTS`` evenly spaced levels (index 0 is the minimum, the last index the maximum).
101 floats per column are enough to compare any two runs from their reports alone, long after
the scored rows themselves are gone, at a resolution of 1% of the rows.

A sketch is read as a piecewise-linear CDF through the points ``(sketch[i], i / 100)``; runs of
equal values (point masses, e.g. a score that is exactly 0 for half the rows) make vertical steps,
and the CDF takes the top of the step (right-continuous, like an empirical CDF).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.report.schema import DriftColumn, DriftComparison
from pipeline.worker.sketch import LEVELS, SKETCH_POINTS

# Floor for a bin's fraction in the PSI: an empty bin would otherwise make ln(cur / base)
# infinite. 1e-4 is below the sketch's own resolution, so it never masks a real difference.
PSI_EPSILON = 1e-4


def _as_sketch(s: Sequence[float], name: str) -> np.ndarray:
    a = np.asarray(s, dtype=float)
    if a.shape != (SKETCH_POINTS,):
        raise ValueError(f"{name} sketch has {a.size} points, expected {SKETCH_POINTS}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} sketch has non-finite values")
    if np.any(np.diff(a) < 0):
        raise ValueError(f"{name} sketch is not non-decreasing")
    return a


def _cdf(q: np.ndarray, x: np.ndarray, *, right: bool = True) -> np.ndarray:
    """The sketch's piecewise-linear CDF at ``x``.

    ``right=True`` gives F(x) (the top of each step at a point mass), ``right=False`` the left
    limit F(x-) (the bottom of the step); between distinct sketch values both are linear.
    """
    x = np.asarray(x, dtype=float)
    n = q.size
    # Index of the last sketch point <= x (right) or < x (left).
    j = np.searchsorted(q, x, side="right" if right else "left") - 1
    jc = np.clip(j, 0, n - 2)
    lo, hi = q[jc], q[jc + 1]
    span = hi - lo
    # Where span is 0 the value is never used below (x is outside [lo, hi) there).
    frac = np.divide(x - lo, span, out=np.zeros_like(x), where=span > 0)
    f = LEVELS[jc] + np.clip(frac, 0.0, 1.0) * (LEVELS[jc + 1] - LEVELS[jc])
    # Below the minimum nothing is <= x; at or above the maximum (right) or above it (left),
    # everything is.
    return np.where(j < 0, 0.0, np.where(j >= n - 1, 1.0, f))


def psi(baseline: Sequence[float], current: Sequence[float], bins: int = 10) -> float:
    """Population stability index of ``current`` against ``baseline`` (both sketches).

    ``PSI = sum over bins of (cur - base) * ln(cur / base)``, where ``base`` and ``cur`` are the
    fractions of each distribution in each bin. Bins are the baseline's quantiles at
    ``1/bins, 2/bins, ...`` (deciles by default) with open-ended first and last bins; equal
    edges from point masses collapse into one, so a point mass is one bin. Fractions are read
    from each sketch's piecewise-linear CDF and floored at ``PSI_EPSILON`` so an empty bin gives
    a large but finite term. Every term is >= 0, so PSI >= 0, and PSI(a, a) == 0.
    Rule of thumb: < 0.1 stable, 0.1-0.25 moderate shift, > 0.25 significant shift.
    Raises ValueError for a sketch that is not ``SKETCH_POINTS`` finite, sorted values.
    """
    if bins < 2:
        raise ValueError(f"bins must be at least 2, got {bins}")
    b = _as_sketch(baseline, "baseline")
    c = _as_sketch(current, "current")
    inner = np.interp(np.linspace(0.0, 1.0, bins + 1)[1:-1], LEVELS, b)
    edges = np.unique(inner)
    # Bins are (-inf, e1], (e1, e2], ..., (ek, inf): right-closed so that a point mass sitting
    # exactly on an edge is counted in the bin the edge closes, for both runs alike.
    fb = np.diff(np.concatenate(([0.0], _cdf(b, edges), [1.0])))
    fc = np.diff(np.concatenate(([0.0], _cdf(c, edges), [1.0])))
    fb = np.maximum(fb, PSI_EPSILON)
    fc = np.maximum(fc, PSI_EPSILON)
    return float(np.sum((fc - fb) * np.log(fc / fb)))


def ks(baseline: Sequence[float], current: Sequence[float]) -> float:
    """Kolmogorov-Smirnov statistic ``max |F_b(x) - F_c(x)|`` between two sketches.

    Each CDF is piecewise linear through its sketch's points (right-continuous at point masses,
    see the module docstring). The difference of two such functions is linear between the union
    of both sketches' points, so the supremum is found exactly by checking every union point on
    both sides of any step. The result is in [0, 1] and symmetric; its resolution is that of the
    sketches, 0.01 (1% of the rows), so values below ~0.02 mean "no measurable difference".
    Raises ValueError for a sketch that is not ``SKETCH_POINTS`` finite, sorted values.
    """
    b = _as_sketch(baseline, "baseline")
    c = _as_sketch(current, "current")
    xs = np.union1d(b, c)
    d_right = np.abs(_cdf(b, xs) - _cdf(c, xs))
    d_left = np.abs(_cdf(b, xs, right=False) - _cdf(c, xs, right=False))
    return float(min(1.0, max(d_right.max(), d_left.max())))


@dataclass(frozen=True)
class DriftThresholds:
    """Alert when a column's PSI or KS exceeds these, or rows scored change by more than
    ``rows_change`` (a fraction: 0.5 allows anything from half to one and a half times the
    previous run's rows)."""

    psi: float = 0.25
    ks: float = 0.2
    rows_change: float = 0.5


def _count(x: Any) -> float | None:
    """A row count from a report, or None where it is missing or not a count."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not x >= 0:
        return None
    return float(x)


def _column_sketch(report: Mapping[str, Any], col: str) -> list[float] | None:
    """The column's sketch if usable; reports written before sketches existed have none."""
    entry = (report.get("outputs") or {}).get(col) or {}
    s = entry.get("sketch") if isinstance(entry, Mapping) else None
    if not s or not entry.get("count"):
        return None
    try:
        _as_sketch(s, col)
    except (TypeError, ValueError):
        return None
    return list(s)


def _rows_change(
    prev_rows: Any, cur_rows: Any, thresholds: DriftThresholds, against: str, reasons: list[str]
) -> float | None:
    """``current / previous - 1`` of the rows scored (None when either is unknown), adding to
    ``reasons`` when it is beyond the threshold or the previous run scored none."""
    prev_n, cur_n = _count(prev_rows), _count(cur_rows)
    if prev_n is None or cur_n is None:
        return None
    if prev_n > 0:
        change = cur_n / prev_n - 1.0
        if abs(change) > thresholds.rows_change:
            reasons.append(
                f"rows scored: {cur_rows:,} vs {prev_rows:,} ({change:+.1%}, allowed "
                f"±{thresholds.rows_change:.0%}) {against}"
            )
        return change
    if cur_n == 0:
        return 0.0
    reasons.append(f"rows scored: {cur_rows:,} vs 0 {against}")
    return None


def compare(
    baseline: Mapping[str, Any], current: Mapping[str, Any], thresholds: DriftThresholds
) -> DriftComparison:
    """Compare the ``current`` run's report with a ``baseline`` run's report.

    Uses only ``run_id``, ``output``, ``finished_at``, ``rows_out`` and ``outputs`` (per column
    ``count`` and ``sketch``) of each report; the baseline may be a run-index entry or a report
    of any schema version, so a missing key there means "unknown", never an error. Returns the
    report's ``drift`` section (:class:`~pipeline.report.schema.DriftComparison`)::

        {"baseline": {"run_id", "output", "finished_at"},
         "rows": {"previous", "current", "change"},
         "columns": {col: {"psi", "ks", "alert"}},
         "thresholds": {"psi", "ks", "rows_change"},
         "alert": bool, "reasons": [str, ...]}

    ``change`` is ``current / previous - 1`` (None when either count is unknown, or when the
    previous run scored no rows but this one did, which alerts). A column present on only one
    side has None values and alerts (the output schema changed). A column whose sketch is empty
    or absent on either side (no rows scored, or an older report) has None values and does not
    alert. ``reasons`` says why, in words, for every alert.
    """
    base_id = baseline.get("run_id")
    against = f"against run {base_id}"
    reasons: list[str] = []
    prev_rows, cur_rows = baseline.get("rows_out"), current.get("rows_out")
    change = _rows_change(prev_rows, cur_rows, thresholds, against, reasons)
    base_cols = list((baseline.get("outputs") or {}).keys())
    cur_cols = list((current.get("outputs") or {}).keys())
    columns: dict[str, DriftColumn] = {}
    for col in cur_cols + [c for c in base_cols if c not in cur_cols]:
        if col not in base_cols or col not in cur_cols:
            columns[col] = {"psi": None, "ks": None, "alert": True}
            if col in cur_cols:
                reasons.append(f"{col}: new output column, not in run {base_id}")
            else:
                reasons.append(f"{col}: output column missing, present in run {base_id}")
            continue
        sb, sc = _column_sketch(baseline, col), _column_sketch(current, col)
        if sb is None or sc is None:
            columns[col] = {"psi": None, "ks": None, "alert": False}
            continue
        p, k = psi(sb, sc), ks(sb, sc)
        alert = False
        if p > thresholds.psi:
            alert = True
            reasons.append(f"{col}: PSI {p:.3g} > {thresholds.psi:g} {against}")
        if k > thresholds.ks:
            alert = True
            reasons.append(f"{col}: KS {k:.3g} > {thresholds.ks:g} {against}")
        columns[col] = {"psi": p, "ks": k, "alert": alert}

    return {
        "baseline": {
            "run_id": base_id,
            "output": baseline.get("output"),
            "finished_at": baseline.get("finished_at"),
        },
        "rows": {"previous": prev_rows, "current": cur_rows, "change": change},
        "columns": columns,
        "thresholds": {
            "psi": thresholds.psi,
            "ks": thresholds.ks,
            "rows_change": thresholds.rows_change,
        },
        "alert": bool(reasons),
        "reasons": reasons,
    }
