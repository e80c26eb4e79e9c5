"""What one shard's scoring learned besides its rows: score statistics, latencies, reject reasons.

A worker fills a :class:`ShardStats` batch by batch and sends it back inside the shard's result;
the report merges them (:class:`pipeline.report.ScoreProfile`) without knowing how they were kept.
Everything here is per batch and vectorised, never per row in Python.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa

SAMPLE_ROWS = 10_000  # per shard, for output quantiles in the report
LATENCY_SAMPLES = 10_000  # per shard
MAX_REASONS = 50  # distinct reject reasons kept per shard; the rest are counted as "other"


@dataclass
class ColumnStats:
    """One numeric output column of one shard: exact count, sum, min, max, and a sample."""

    count: int = 0
    total: float = 0.0
    min: float = float("inf")
    max: float = float("-inf")
    samples: list[float] = field(default_factory=list)  # every ``step``-th scored row

    def add(self, values: np.ndarray, first: int, step: int) -> None:
        """Fold in one batch of scores; ``first`` is the batch's first sampled row."""
        if not len(values):
            return
        self.count += len(values)
        self.total += float(values.sum())
        self.min = min(self.min, float(values.min()))
        self.max = max(self.max, float(values.max()))
        self.samples.extend(values[first::step].astype(float).tolist())


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
        """Count reject reasons; past MAX_REASONS distinct ones, new reasons count as "other"."""
        counts = self.rejects_by_reason
        for reason in reasons.values():
            key = reason if reason in counts or len(counts) < MAX_REASONS else "other"
            counts[key] = counts.get(key, 0) + 1

    def finish(self) -> None:
        """Thin the latencies to at most LATENCY_SAMPLES (evenly spaced) before sending."""
        if len(self.latencies_ms) > LATENCY_SAMPLES:
            self.latencies_ms = self.latencies_ms[:: len(self.latencies_ms) // LATENCY_SAMPLES + 1]


class DuplicateIds:
    """Counts rows whose id already appeared in the shard: 8 bytes per row, hashed per batch."""

    def __init__(self) -> None:
        self._hashes: list[np.ndarray] = []

    def add(self, ids: pa.Array) -> None:
        """Remember one batch of ids (integers by value, anything else by a 64-bit hash)."""
        if pa.types.is_integer(ids.type) and ids.null_count == 0:
            self._hashes.append(ids.to_numpy().astype(np.int64, copy=False).view(np.uint64))
        else:
            self._hashes.append(pd.util.hash_array(np.asarray(ids.to_pylist(), dtype=object)))

    def count(self) -> int:
        """Rows whose id (by 64-bit value or hash) already appeared in the shard."""
        if not self._hashes:
            return 0
        allh = np.concatenate(self._hashes)
        return int(len(allh) - len(np.unique(allh)))
