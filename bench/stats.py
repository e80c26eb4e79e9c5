"""Samples of repeated measurements and their medians.

Medians, with the min-max range and n beside them: on a shared 2-core machine a single run can
be slowed several-fold by a neighbour, and the median of alternating runs is what survives that.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    """One run of one comparator."""

    rows: int
    wall_s: float  # the whole subprocess, interpreter start-up and imports included
    timed_s: float | None  # the comparator's own timed region (None if it has none)
    peak_rss_bytes: int  # whole process tree, sampled every ~50 ms
    rate_override: float | None = None  # multi-process ceilings: procs x mean per-process rate
    per_proc_rates: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def wall_rate(self) -> float:
        """Rows per second of the whole process."""
        return self.rows / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def timed_rate(self) -> float | None:
        """Rows per second of the timed region."""
        if self.rate_override is not None:
            return self.rate_override
        if self.timed_s is None or self.timed_s <= 0:
            return None
        return self.rows / self.timed_s

    @property
    def per_proc_mean(self) -> float | None:
        """Mean rows/s of one process in a multi-process layout."""
        if not self.per_proc_rates:
            return None
        return sum(self.per_proc_rates) / len(self.per_proc_rates)


@dataclass(frozen=True)
class Summary:
    """Median, range and count of one metric."""

    median: float
    lo: float
    hi: float
    n: int

    @staticmethod
    def of(values: Sequence[float]) -> Summary | None:
        """The summary of ``values``, or None when there are none."""
        if not values:
            return None
        return Summary(statistics.median(values), min(values), max(values), len(values))


def summarize(
    samples: Sequence[Sample], metric: Callable[[Sample], float | None]
) -> Summary | None:
    """Summary of ``metric`` over the samples where it is defined."""
    return Summary.of([v for s in samples if (v := metric(s)) is not None])


def ratio(a: Summary | None, b: Summary | None) -> float | None:
    """Ratio of medians (None when either is missing)."""
    if a is None or b is None or b.median == 0:
        return None
    return a.median / b.median
