"""pipeline.report.build's text helpers: the ``change`` column of ``report --vs``."""

from __future__ import annotations

import pytest

from pipeline.report.text import MAX_RATIO, change


@pytest.mark.parametrize(
    ("now", "then", "fmt", "relative", "shown"),
    [
        (7_300, 7_300, ",.0f", True, "+0.0%"),
        (110, 100, ",.0f", True, "+10.0%"),
        (25, 100, ",.0f", True, "-75.0%"),
        (1_099, 100, ",.0f", True, "+999.0%"),
        (5_000, 100, ",.0f", True, "50x"),  # beyond +999%: a ratio, not +4900.0%
        (10**12, 1, ",.0f", True, f">{MAX_RATIO:,}x"),  # capped
        (250, 0, ",.0f", True, "+250"),  # against none: the count, not a percentage of 0
        (0, 0, ",.0f", True, "+0"),
        (1.5, 0.0, ",.1f", True, "+1.5"),
        # Scores: the difference, whatever the base (a p05 near 0 gave +4e14 %).
        (0.4969, 2e-16, ".4f", False, "+0.4969"),
        (0.10, 0.25, ".4f", False, "-0.1500"),
        (None, 3, ",.0f", True, "-"),
        (float("nan"), 3.0, ",.0f", True, "-"),
    ],
)
def test_change_is_readable_whatever_the_base(
    now: float | None, then: float, fmt: str, relative: bool, shown: str
) -> None:
    assert change(now, then, fmt, relative=relative) == shown
    assert len(shown) <= len(f">{MAX_RATIO:,}x")  # fits the table's column
