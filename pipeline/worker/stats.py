"""What one shard's scoring learned besides its rows: score statistics, latencies, reject reasons.

A worker fills a :class:`ShardStats` batch by batch and sends it back inside the shard's result; the
report merges them (:class:`pipeline.report.build.ScoreProfile`) without knowing how they were kept.
Everything here is per batch and vectorised, never per row in Python.

A scored shard's score statistics also go into its manifest entry, compactly
(:meth:`ShardStats.summary`: exact count, sum, min and max, and a 101-point quantile sketch per
column), so that a later run which skips the shard still reports on the whole output
(:meth:`ShardStats.from_summary`). Such a shard's quantiles are approximate: its distribution is
rebuilt from the sketch, linear between the sketch's percentiles.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.model.columns import cause_of
from pipeline.model.features import LossyCast
from pipeline.worker.sketch import LEVELS, SKETCH_POINTS, sketch

SAMPLE_ROWS = 10_000  # per shard, for output quantiles in the report
# A shard known only by its sketch stands for this many equally weighted values, read off the
# sketch's piecewise-linear quantile function: 5 per percentile keeps the rebuilt CDF within
# the sketch's own 1% resolution.
SKETCH_SAMPLE = 500
LATENCY_SAMPLES = 10_000  # per shard
MAX_REASONS = 50  # distinct reject reasons kept per shard; the rest are counted as "other"


@dataclass
class ColumnStats:
    """One numeric output column of one shard: exact count, sum, min, max, and a sample.

    The sample is every ``step``-th scored row (each weighs ``step`` rows) for a shard scored in
    this run, or ``sketch`` (101 quantiles) for a shard known from its manifest entry only.
    """

    count: int = 0
    total: float = 0.0
    min: float = float("inf")
    max: float = float("-inf")
    samples: list[float] = field(default_factory=list)  # every ``step``-th scored row
    sketch: list[float] = field(default_factory=list)  # set only when rebuilt from a summary

    def add(self, values: np.ndarray, first: int, step: int) -> None:
        """Fold in one batch of scores; ``first`` is the batch's first sampled row."""
        if not len(values):
            return
        self.count += len(values)
        self.total += float(values.sum())
        self.min = min(self.min, float(values.min()))
        self.max = max(self.max, float(values.max()))
        self.samples.extend(values[first::step].astype(float).tolist())

    def weighted_sample(self, weight: float) -> tuple[np.ndarray, np.ndarray]:
        """Values and how many rows each stands for: the samples at ``weight`` each, or
        SKETCH_SAMPLE values read off the sketch, sharing ``count`` equally."""
        if self.samples or len(self.sketch) != SKETCH_POINTS or not self.count:
            v = np.asarray(self.samples, dtype=float)
            return v, np.full(len(v), weight)
        levels = (np.arange(SKETCH_SAMPLE) + 0.5) / SKETCH_SAMPLE
        points = np.asarray(self.sketch, dtype=float)
        v = np.interp(levels, LEVELS, points)
        if np.all(points == np.rint(points)):
            # A whole-number column (argmax labels): reading between two sketch points must not
            # invent values such as 0.4 that no row has; the nearest whole number keeps the step
            # where it was, within the sketch's 1% resolution.
            v = np.rint(v)
        return v, np.full(SKETCH_SAMPLE, self.count / SKETCH_SAMPLE)

    def summary(self, weight: float) -> dict[str, Any]:
        """The column in a manifest entry: count, sum, min, max (None without rows), sketch."""
        v, w = self.weighted_sample(weight)
        points = sketch(v, w)
        if points:  # the sample's extremes are the exact ones when the ends are pinned
            points[0], points[-1] = self.min, self.max
        return {
            "count": self.count,
            "sum": self.total,
            "min": self.min if self.count else None,
            "max": self.max if self.count else None,
            # Not rounded: a sketch must stay sorted with its exact ends, and a rounded point
            # mass can fall below the exact minimum it sits on.
            "sketch": points,
        }

    @classmethod
    def from_summary(cls, d: Mapping[str, Any]) -> ColumnStats:
        """The column as :meth:`summary` wrote it (its sketch stands in for the sample)."""
        count = int(d.get("count") or 0)
        lo, hi = d.get("min"), d.get("max")
        return cls(
            count=count,
            total=float(d.get("sum") or 0.0),
            min=float(lo) if count and lo is not None else float("inf"),
            max=float(hi) if count and hi is not None else float("-inf"),
            sketch=[float(x) for x in d.get("sketch") or []],
        )


@dataclass
class ShardStats:
    """Statistics of one shard's scored rows, kept as it is scored.

    Scores are sampled systematically (every ``step``-th row, so each sample weighs ``step``
    rows), which keeps the sample a fixed size per shard whatever its row count.
    """

    step: int = 1
    columns: dict[str, ColumnStats] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)
    rejects_by_reason: dict[str, int] = field(default_factory=dict)
    rows_out: int = 0
    oom_splits: int = 0
    # False for a shard skipped by a run whose manifest entry holds no score statistics (it was
    # written before they were kept): the report's outputs then miss that shard's rows.
    summarised: bool = True
    # Feature columns whose cast to float32 changed a value (pipeline.model.features.lossy_cast), by
    # name.
    lossy_casts: dict[str, LossyCast] = field(default_factory=dict)

    @classmethod
    def for_outputs(cls, names: Sequence[str], num_rows: int) -> ShardStats:
        """Empty statistics for the numeric output columns ``names`` of a shard of ``num_rows``."""
        return cls(step=max(1, num_rows // SAMPLE_ROWS), columns={n: ColumnStats() for n in names})

    @property
    def sample_weight(self) -> float:
        """How many scored rows each sampled score stands for."""
        return float(self.step)

    def add_model_call(self, seconds: float, oom_splits: int) -> None:
        """Record one batch's model time and how often it was split after running out of memory."""
        self.latencies_ms.append(seconds * 1000.0)
        self.oom_splits += oom_splits

    def add_scores(self, columns: Mapping[str, pa.Array], rows: int) -> None:
        """Fold in one batch of ``rows`` written rows: its numeric output columns by name."""
        first = (-self.rows_out) % self.step  # systematic sample: every step-th scored row
        for name, array in columns.items():
            self.columns[name].add(array.to_numpy(zero_copy_only=False), first, self.step)
        self.rows_out += rows

    def count_rejects(self, reasons: Mapping[int, str]) -> None:
        """Count reject reasons by cause (the row's value left out: :func:`cause_of`); past
        MAX_REASONS distinct ones, new causes count as "other"."""
        counts = self.rejects_by_reason
        for reason in reasons.values():
            cause = cause_of(reason)
            key = cause if cause in counts or len(counts) < MAX_REASONS else "other"
            counts[key] = counts.get(key, 0) + 1

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per numeric output column, what the manifest keeps: count, sum, min, max, sketch."""
        return {name: c.summary(self.sample_weight) for name, c in self.columns.items()}

    @classmethod
    def from_summary(cls, summary: Mapping[str, Any] | None, rows_out: int) -> ShardStats:
        """A skipped shard's score statistics from its manifest entry's :meth:`summary`
        (None for an entry written before they were kept)."""
        if summary is None:
            return cls(rows_out=rows_out, summarised=False)
        columns = {name: ColumnStats.from_summary(d) for name, d in summary.items()}
        return cls(columns=columns, rows_out=rows_out)

    def finish(self) -> None:
        """Thin the latencies to at most LATENCY_SAMPLES (evenly spaced) before sending."""
        if len(self.latencies_ms) > LATENCY_SAMPLES:
            self.latencies_ms = self.latencies_ms[:: len(self.latencies_ms) // LATENCY_SAMPLES + 1]


class DuplicateIds:
    """Counts rows whose id already appeared in the shard: 8 bytes per row, hashed per batch."""

    def __init__(self) -> None:
        self._hashes: list[np.ndarray] = []
        self.nulls = 0  # rows with no id at all: scored, but no one can join them back

    def add(self, ids: pa.Array) -> None:
        """Remember one batch of ids (integers by value, anything else by a 64-bit hash)."""
        if ids.null_count:
            self.nulls += ids.null_count
            ids = pc.drop_null(ids)  # no id is not a repeated id
        if pa.types.is_integer(ids.type):
            self._hashes.append(ids.to_numpy().astype(np.int64, copy=False).view(np.uint64))
        else:
            values = np.asarray(ids.to_numpy(zero_copy_only=False), dtype=object)
            self._hashes.append(pd.util.hash_array(values))

    def count(self) -> int:
        """Rows whose id (by 64-bit value or hash) already appeared in the shard."""
        if not self._hashes:
            return 0
        # Rows less distinct ids, through pandas' hash table: 28 ms for a W1 x 10 shard's
        # 1.25M ids here, against 76 ms to sort them (np.unique, which sorts too, took 14 ms
        # for 125,000 ids: 8% of a W1 worker's time).
        allh = np.concatenate(self._hashes)
        return int(allh.size - pd.unique(allh).size)
