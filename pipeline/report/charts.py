"""The pieces ``_report.html`` is drawn with: escaping and number formats, tables, and
hand-built inline SVG charts (bars, lines, histograms, counts). No scripts, no fonts, no
network references (:mod:`pipeline.report.html` puts them together into the page).
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

_W = 720  # SVG user-space width; CSS scales it to the page


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def num(value: float | None) -> float | None:
    """The value as a float, None for null (and for NaN, which the schema refuses anyway)."""
    if value is None:
        return None
    f = float(value)
    return f if math.isfinite(f) else None


def fmt(value: float | None, digits: int = 0, suffix: str = "") -> str:
    f = num(value)
    if f is None:
        return "-"
    if digits == 0 and isinstance(value, int):
        return f"{value:,}{suffix}"
    return f"{f:,.{digits}f}{suffix}"


#: Decimal places at most: a score of 1.898e-13 reads "<0.000001", never in exponent notation.
MAX_DECIMALS = 6


def sig(value: float | None) -> str:
    """A number as plain decimals, for quantiles, statistics and axis ticks.

    Whole numbers with thousands separators (``74,900``); from 1,000 up, rounded to a whole
    number; below, 4 significant digits with trailing zeros dropped (``0.9673``, ``12.35``,
    ``0.5``) but never more than :data:`MAX_DECIMALS` places, so a value too small to show is
    ``<0.000001`` (or ``>-0.000001``) rather than ``1.898e-13``.
    """
    f = num(value)
    if f is None:
        return "-"
    if f == int(f) and abs(f) < 1e15:
        return f"{int(f):,}"
    if abs(f) >= 1000:
        return f"{f:,.0f}"
    places = min(MAX_DECIMALS, 3 - math.floor(math.log10(abs(f))))
    text = f"{f:.{places}f}".rstrip("0").rstrip(".")
    if text in ("0", "-0"):
        tiny = f"0.{'0' * (MAX_DECIMALS - 1)}1"
        return f"<{tiny}" if f > 0 else f">-{tiny}"
    return text


def pct(value: float | None, signed: bool = False) -> str:
    f = num(value)
    return "-" if f is None else f"{f * 100:{'+' if signed else ''}.2f}%"


def plain(value: Any) -> str:
    """Any JSON value as text: "-" for None, compact JSON for lists and dicts."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, separators=(",", ":"), default=str, sort_keys=True)
    if isinstance(value, (int, float)):
        return sig(value)
    return str(value)


def table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], row_classes: Sequence[str] = ()
) -> str:
    """A table; cells are escaped, numeric-looking cells right-aligned."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        cls = f' class="{esc(row_classes[i])}"' if i < len(row_classes) and row_classes[i] else ""
        cells = "".join(
            f'<td class="n">{esc(c)}</td>' if looks_numeric(c) else f"<td>{esc(c)}</td>"
            for c in row
        )
        body.append(f"<tr{cls}>{cells}</tr>")
    table = f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
    return f'<div class="tw">{table}</div>'


def looks_numeric(cell: Any) -> bool:
    s = str(cell).replace(",", "").replace("%", "").replace(" s", "").replace(" ms", "")
    s = s.lstrip("<>").lstrip("+-")
    return s.replace(".", "", 1).isdigit()


def kv(pairs: Sequence[tuple[str, Any]]) -> str:
    """A two-column table of names and values; a numeric value never wraps (class ``num``)."""
    rows = []
    for k, v in pairs:
        text = plain(v)
        cls = ' class="num"' if looks_numeric(text) else ""
        rows.append(f"<tr><th>{esc(k)}</th><td{cls}>{esc(text)}</td></tr>")
    return f'<div class="tw"><table class="kv"><tbody>{"".join(rows)}</tbody></table></div>'


def ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values covering [lo, hi]."""
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    return [start + i * step for i in range(math.ceil((hi - start) / step - 1e-9) + 1)]


def svg(height: float, label: str, body: str) -> str:
    return (
        f'<svg viewBox="0 0 {_W} {height:.0f}" role="img" '
        f'aria-label="{esc(label)}"><title>{esc(label)}</title>{body}</svg>'
    )


def bar_chart(items: Sequence[tuple[str, float, bool]], title: str, unit: str = "") -> str:
    """Horizontal bars ``(label, value, highlighted)``; values printed at the bar ends."""
    if not items:
        return ""
    left, right, row_h, top = 230, 90, 18, 8
    vmax = max(v for _, v, _ in items) or 1.0
    marks = ticks(0.0, vmax)
    scale = (_W - left - right) / marks[-1]
    axis_y = top + len(items) * row_h + 4
    parts = []
    for t in marks:
        x = left + t * scale
        parts.append(
            f'<line class="grid" x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{axis_y}"/>'
            f'<text x="{x:.1f}" y="{axis_y + 14}" text-anchor="middle">{esc(sig(t))}</text>'
        )
    for i, (label, value, hi) in enumerate(items):
        y = top + i * row_h
        shown = label if len(label) <= 34 else "…" + label[-33:]
        val = f"{sig(value)}{unit}"
        parts.append(
            f"<g><title>{esc(label)}: {esc(val)}{' (slow)' if hi else ''}</title>"
            f'<text x="{left - 6}" y="{y + 13}" text-anchor="end">{esc(shown)}</text>'
            f'<rect class="bar{" hi" if hi else ""}" x="{left}" y="{y + 3}" '
            f'width="{max(value * scale, 1):.1f}" height="{row_h - 5}"/>'
            f'<text x="{left + value * scale + 4:.1f}" y="{y + 13}">{esc(val)}'
            f"{' ▲' if hi else ''}</text></g>"
        )
    parts.append(f'<line class="axis" x1="{left}" y1="{axis_y}" x2="{_W - right}" y2="{axis_y}"/>')
    parts.append(
        f'<text x="{(left + _W - right) / 2}" y="{axis_y + 30}" text-anchor="middle">'
        f"{esc(title)}</text>"
    )
    return svg(axis_y + 38, title, "".join(parts))


#: Draws a chart's data given its x and y scales (data value -> SVG coordinate).
_Body = Callable[[Callable[[float], float], Callable[[float], float]], str]


def plot(
    xs: Sequence[float], ys: Sequence[float], xlabel: str, ylabel: str, title: str, body: _Body
) -> str:
    """Axes with ticks for x in [min(xs), max(xs)] and y in [0, max(ys)]; ``body`` draws data."""
    left, right, top, bottom, h = 80, 20, 12, 48, 280
    xt, yt = ticks(min(xs), max(xs)), ticks(0.0, max(max(ys), 0.0) or 1.0)
    x0, x1, y1 = xt[0], xt[-1], yt[-1]

    def px(x: float) -> float:
        return left + (x - x0) / ((x1 - x0) or 1.0) * (_W - left - right)

    def py(y: float) -> float:
        return top + (1 - y / (y1 or 1.0)) * (h - top - bottom)

    parts = []
    for t in yt:
        parts.append(
            f'<line class="grid" x1="{left}" y1="{py(t):.1f}" x2="{_W - right}" y2="{py(t):.1f}"/>'
            f'<text x="{left - 6}" y="{py(t) + 4:.1f}" text-anchor="end">{esc(sig(t))}</text>'
        )
    for t in xt:
        parts.append(
            f'<text x="{px(t):.1f}" y="{h - bottom + 16}" text-anchor="middle">{esc(sig(t))}</text>'
        )
    parts.append(body(px, py))
    base = h - bottom
    parts.append(
        f'<line class="axis" x1="{left}" y1="{base}" x2="{_W - right}" y2="{base}"/>'
        f'<line class="axis" x1="{left}" y1="{top}" x2="{left}" y2="{base}"/>'
        f'<text x="{(left + _W - right) / 2}" y="{h - 10}" text-anchor="middle">'
        f"{esc(xlabel)}</text>"
        f'<text transform="translate(14 {(top + base) / 2}) rotate(-90)" text-anchor="middle">'
        f"{esc(ylabel)}</text>"
    )
    return svg(h, title, "".join(parts))


def line_chart(points: Sequence[tuple[float, float]], xlabel: str, ylabel: str, title: str) -> str:
    pts = sorted(points)
    if len(pts) > 2000:  # keep the page small; the shape survives a stride
        stride = math.ceil(len(pts) / 2000)
        pts = pts[::stride] + ([pts[-1]] if (len(pts) - 1) % stride else [])

    def body(px: Callable[[float], float], py: Callable[[float], float]) -> str:
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        return f'<polyline class="line" points="{coords}"/>'

    return plot([p[0] for p in pts], [p[1] for p in pts], xlabel, ylabel, title, body)


def histogram(edges: Sequence[float], counts: Sequence[float], xlabel: str, title: str) -> str:
    def body(px: Callable[[float], float], py: Callable[[float], float]) -> str:
        out = []
        for i, c in enumerate(counts):
            a, b = edges[i], edges[i + 1]
            x, w = px(a), max(px(b) - px(a) - 0.5, 0.5)
            if b == a:  # all values equal: one degenerate bin, drawn as a narrow bar
                x, w = px(a) - 4, 8.0
            out.append(
                f"<g><title>[{esc(sig(a))}, {esc(sig(b))}): {esc(sig(c))} rows</title>"
                f'<rect class="bar" x="{x:.1f}" y="{py(c):.1f}" width="{w:.1f}" '
                f'height="{py(0) - py(c):.1f}"/></g>'
            )
        return "".join(out)

    return plot(list(edges), list(counts), xlabel, "rows", title, body)


def count_chart(values: Sequence[float], counts: Sequence[float], xlabel: str, title: str) -> str:
    """Vertical bars, one per value of a discrete column (argmax labels, 0/1 outputs).

    Each bar stands over its value's label with its row count on top: a 0/1 column shows two
    bars labelled 0 and 1, not 20 histogram bins with ticks at 0.2 to 0.8.
    """
    left, right, top, bottom, h = 80, 20, 20, 48, 280
    base = h - bottom
    yt = ticks(0.0, max(max(counts, default=0.0), 0.0) or 1.0)

    def py(y: float) -> float:
        return top + (1 - y / (yt[-1] or 1.0)) * (base - top)

    slot = (_W - left - right) / max(len(values), 1)
    width = min(slot * 0.7, 80.0)
    parts = [
        f'<line class="grid" x1="{left}" y1="{py(t):.1f}" x2="{_W - right}" y2="{py(t):.1f}"/>'
        f'<text x="{left - 6}" y="{py(t) + 4:.1f}" text-anchor="end">{esc(sig(t))}</text>'
        for t in yt
    ]
    for i, (v, c) in enumerate(zip(values, counts, strict=True)):
        mid = left + (i + 0.5) * slot
        label, n = sig(v), sig(c)
        parts.append(
            f"<g><title>{esc(xlabel)} = {esc(label)}: {esc(n)} rows</title>"
            f'<rect class="bar" x="{mid - width / 2:.1f}" y="{py(c):.1f}" width="{width:.1f}" '
            f'height="{base - py(c):.1f}"/>'
            f'<text x="{mid:.1f}" y="{py(c) - 4:.1f}" text-anchor="middle">{esc(n)}</text>'
            f'<text x="{mid:.1f}" y="{base + 16}" text-anchor="middle">{esc(label)}</text></g>'
        )
    parts.append(
        f'<line class="axis" x1="{left}" y1="{base}" x2="{_W - right}" y2="{base}"/>'
        f'<line class="axis" x1="{left}" y1="{top}" x2="{left}" y2="{base}"/>'
        f'<text x="{(left + _W - right) / 2}" y="{h - 10}" text-anchor="middle">'
        f"{esc(xlabel)}</text>"
        f'<text transform="translate(14 {(top + base) / 2}) rotate(-90)" text-anchor="middle">'
        "rows</text>"
    )
    return svg(h, title, "".join(parts))


def figure(svg: str, caption: str) -> str:
    return f"<figure>{svg}<figcaption class='note'>{esc(caption)}</figcaption></figure>"


def ul(items: Sequence[str]) -> str:
    return "<ul>" + "".join(f"<li>{esc(x)}</li>" for x in items) + "</ul>"


def para(text: str, cls: str = "note") -> str:
    return f'<p class="{cls}">{esc(text)}</p>'
