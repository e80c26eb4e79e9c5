"""The min and max a Delta file's stats may hold for a column, per type, from the bounds its
Parquet footer folds over row groups: exact, or rounded outward, or none (the rules and what each
reader does with them: :mod:`pipeline.sinks.delta.stats`). pyarrow only."""

from __future__ import annotations

import datetime as dt
import decimal
import json
import math
from typing import Any

import pyarrow as pa

#: Characters of a string kept in its bounds, as Delta's reference writer's 32-character prefix:
#: a longer min is cut to it, a longer max cut and its last character incremented (module doc).
MAX_STRING_STAT_CHARS = 32

_NS_PER_UNIT = {"seconds": 1_000_000_000, "milliseconds": 1_000_000, "microseconds": 1_000}
_NS_PER_UNIT["nanoseconds"] = 1
_EPOCH_NAIVE = dt.datetime(1970, 1, 1)
_EPOCH_DAY = dt.date(1970, 1, 1)
_MAX_CODE_POINT = 0x10FFFF
_SURROGATES = range(0xD800, 0xE000)


class Number(str):
    """A JSON number written as this exact text (a decimal bound, never through a float)."""


def bounds_of(
    typ: pa.DataType, lo: Any, hi: Any, logical: Any, *, nan_free: bool
) -> tuple[Any, Any] | None:
    """(min, max) as Delta stats JSON values, or None when they cannot be written exactly."""
    if pa.types.is_signed_integer(typ):
        return int(lo), int(hi)
    if pa.types.is_boolean(typ):
        ok = isinstance(lo, bool) and isinstance(hi, bool)
        return (lo, hi) if ok else None
    if pa.types.is_floating(typ):
        ok = nan_free and all(isinstance(v, float) and math.isfinite(v) for v in (lo, hi))
        return (float(lo), float(hi)) if ok else None
    if pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_string_view(typ):
        return _string_bounds(lo, hi)
    if pa.types.is_date(typ):
        return _date_bounds(lo, hi)
    if pa.types.is_timestamp(typ):
        return _timestamp_bounds(lo, hi, logical, zoned=typ.tz is not None)
    if pa.types.is_decimal(typ):
        return _decimal_bounds(lo, hi)
    return None


def _string_bounds(lo: Any, hi: Any) -> tuple[str, str] | None:
    """The min cut to its prefix (never above it), the max cut and incremented (above every
    string that starts with that prefix): UTF-8's byte order, which every reader compares
    strings in, is code point order, so a larger last code point makes a larger string."""
    try:
        a = lo.decode("utf-8") if isinstance(lo, bytes) else lo
        b = hi.decode("utf-8") if isinstance(hi, bytes) else hi
    except UnicodeDecodeError:
        return None
    if not (isinstance(a, str) and isinstance(b, str)):
        return None
    upper = _upper_prefix(b)
    return None if upper is None else (a[:MAX_STRING_STAT_CHARS], upper)


def _upper_prefix(value: str) -> str | None:
    """``value`` if short enough, else the shortest string above every string that starts with
    its first :data:`MAX_STRING_STAT_CHARS` characters; None if there is none (all U+10FFFF)."""
    if len(value) <= MAX_STRING_STAT_CHARS:
        return value
    prefix = value[:MAX_STRING_STAT_CHARS]
    for i in range(len(prefix) - 1, -1, -1):
        code = ord(prefix[i]) + 1
        if code in _SURROGATES:
            code = _SURROGATES.stop  # not a character: the next one is U+E000
        if code <= _MAX_CODE_POINT:
            return prefix[:i] + chr(code)
    return None


def _date_bounds(lo: Any, hi: Any) -> tuple[str, str] | None:
    """Dates as days since the epoch (the stored INT32) -> ``YYYY-MM-DD``."""
    if not (isinstance(lo, int) and isinstance(hi, int)):
        return None
    try:
        return _iso_day(lo), _iso_day(hi)
    except OverflowError:
        return None  # outside years 1-9999: no ISO date to write


def _iso_day(days: int) -> str:
    return (_EPOCH_DAY + dt.timedelta(days=days)).isoformat()


def _decimal_bounds(lo: Any, hi: Any) -> tuple[Number, Number] | None:
    """Decimals as exact JSON numbers (``-12.50``): a float would round a 38-digit bound."""
    if not (isinstance(lo, decimal.Decimal) and isinstance(hi, decimal.Decimal)):
        return None
    if not (lo.is_finite() and hi.is_finite()):
        return None
    return Number(format(lo, "f")), Number(format(hi, "f"))


def _timestamp_bounds(lo: Any, hi: Any, logical: Any, *, zoned: bool) -> tuple[str, str] | None:
    """Timestamps as Delta writes them, ``2026-12-01T01:02:03.456Z`` (UTC, with a time zone)
    or ``2026-12-01T01:02:03.456`` (without), min rounded down and max rounded up to the
    millisecond. ``lo``/``hi`` are the stored integers, in the Parquet unit (an Arrow ``s``
    column is stored in ms): integer arithmetic, no float rounding."""
    try:
        spec = json.loads(logical.to_json())
    except (AttributeError, TypeError, ValueError):
        return None
    per_ns = _NS_PER_UNIT.get(str(spec.get("timeUnit", "")))
    if spec.get("Type") != "Timestamp" or bool(spec.get("isAdjustedToUTC")) != zoned:
        return None
    if per_ns is None or not (isinstance(lo, int) and isinstance(hi, int)):
        return None
    lo_ms = (lo * per_ns) // 1_000_000
    hi_ms = -((-hi * per_ns) // 1_000_000)
    zone = "Z" if zoned else ""
    try:
        return _iso_ms(lo_ms) + zone, _iso_ms(hi_ms) + zone
    except OverflowError:
        return None


def _iso_ms(ms: int) -> str:
    # isoformat, not strftime: strftime's %Y writes the year 420 as "420", not "0420"
    return (_EPOCH_NAIVE + dt.timedelta(milliseconds=ms)).isoformat(timespec="milliseconds")
