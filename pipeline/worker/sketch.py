"""Score sketches: the compact form of a score distribution that shards, manifests and reports
carry, and the one quantile definition they share.

A column's *sketch* is its weighted quantiles at ``SKETCH_POINTS`` evenly spaced levels (index 0
is the minimum, the last index the maximum): 101 floats, enough to compare two runs from their
reports alone (:mod:`pipeline.report.drift`) at a resolution of 1% of the rows. A worker makes
one per scored shard (:mod:`pipeline.worker.stats`); the driver merges them into the report's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

SKETCH_POINTS = 101
LEVELS = np.linspace(0.0, 1.0, SKETCH_POINTS)


def _clean(values: np.ndarray, weights: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Finite values with positive weights, as float arrays (NaN scores say nothing about drift)."""
    v = np.asarray(values, dtype=float).ravel()
    w = np.ones_like(v) if weights is None else np.asarray(weights, dtype=float).ravel()
    if v.shape != w.shape:
        raise ValueError(f"values ({v.size}) and weights ({w.size}) differ in length")
    keep = np.isfinite(v) & np.isfinite(w) & (w > 0)
    return v[keep], w[keep]


def weighted_quantiles(v: np.ndarray, w: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Weighted quantiles of ``v`` at ``levels``: each value sits at the midpoint of its weight
    on the cumulative scale, linear in between (the one definition the reports use)."""
    order = np.argsort(v, kind="stable")
    v, w = v[order], w[order]
    cum = (np.cumsum(w) - 0.5 * w) / w.sum()
    out: np.ndarray = np.asarray(np.interp(levels, cum, v), dtype=float)
    return out


def sketch(values: np.ndarray, weights: np.ndarray | None = None) -> list[float]:
    """The weighted quantiles of ``values`` at ``numpy.linspace(0, 1, SKETCH_POINTS)``.

    ``weights`` says how many rows each (sampled) value stands for; None means one row each.
    Non-finite values and non-positive weights are dropped. The quantile definition is the one
    ``pipeline.report.build`` uses for its p01..p99 (each value sits at the midpoint of its weight
    on the cumulative scale, linear in between), so ``sketch[50]`` equals the report's p50; levels
    below the first midpoint give the minimum and above the last the maximum. Returns ``[]`` when
    nothing is left.
    """
    v, w = _clean(values, weights)
    if not v.size:
        return []
    q = weighted_quantiles(v, w, LEVELS)
    # Interpolation is exact at the ends only up to rounding; pin them to the true extremes.
    q[0], q[-1] = v.min(), v.max()
    return [float(x) for x in q]


def histogram(
    values: np.ndarray, weights: np.ndarray | None = None, bins: int = 20
) -> dict[str, list[Any]]:
    """Equal-width histogram over ``[min, max]`` of the values, for plots in reports.

    Returns ``{"edges": [bins + 1 floats], "counts": [bins ints]}`` where counts are summed
    weights rounded to whole rows. All-equal values give one degenerate bin
    (``edges == [v, v]``); empty input gives empty lists.
    """
    if bins < 1:
        raise ValueError(f"bins must be at least 1, got {bins}")
    v, w = _clean(values, weights)
    if not v.size:
        return {"edges": [], "counts": []}
    lo, hi = float(v.min()), float(v.max())
    if lo == hi:
        return {"edges": [lo, hi], "counts": [round(float(w.sum()))]}
    counts, edges = np.histogram(v, bins=bins, range=(lo, hi), weights=w)
    return {"edges": [float(e) for e in edges], "counts": [round(float(c)) for c in counts]}


def value_counts(
    values: np.ndarray, weights: np.ndarray | None = None, max_values: int = 20
) -> dict[str, list[Any]] | None:
    """Rows per distinct value, for a discrete column; None for any other.

    A column is discrete when every (finite) value is a whole number and there are at most
    ``max_values`` distinct ones: argmax labels, 0/1 outputs. Their histogram would spread two
    values over 20 bins; this says how many rows took each value. Returns ``{"values":
    [ascending], "counts": [summed weights rounded to whole rows]}``; None when nothing is left.
    """
    v, w = _clean(values, weights)
    if not v.size or not np.all(v == np.rint(v)):
        return None
    distinct, index = np.unique(v, return_inverse=True)
    if len(distinct) > max_values:
        return None
    sums = np.bincount(index, weights=w, minlength=len(distinct))
    # Whole numbers as ints (JSON 1, not 1.0) while they are exact in a float.
    shown = [int(x) if abs(x) < 2**53 else float(x) for x in distinct]
    return {"values": shown, "counts": [round(float(c)) for c in sums]}
