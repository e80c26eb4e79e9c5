"""Strict JSON (RFC 8259): every JSON document the tool writes or prints goes through
:func:`to_json`, which never writes ``NaN`` or ``Infinity`` tokens (a non-finite float, an
undefined statistic, is written as null)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON values: NaN and infinities become null (``NaN`` is not JSON),
    mapping keys str, numpy scalars and arrays Python numbers and lists, anything else str()."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, int, bool)):
        return value
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if getattr(value, "ndim", 0):  # a numpy array
        return jsonable(value.tolist())
    try:  # numpy scalars and the like
        item = value.item()
    except (AttributeError, TypeError, ValueError):
        return str(value)
    return jsonable(item) if isinstance(item, (str, int, float, bool)) else str(value)


def _plain(value: Any) -> Any:
    """``json.dumps``'s fallback for what it cannot encode: numpy values, else str()."""
    if getattr(value, "ndim", 0):
        return value.tolist()
    try:
        item = value.item()
    except (AttributeError, TypeError, ValueError):
        return str(value)
    return item if isinstance(item, (str, int, float, bool)) else str(value)


def to_json(obj: Any, *, compact: bool = False) -> str:
    """``obj`` as strict JSON text (RFC 8259): no ``NaN`` or ``Infinity`` tokens, ever.

    A non-finite float (an undefined statistic) is written as null. Every JSON document the tool
    writes or prints goes through here. The common case (nothing to replace) is one C-encoder
    pass; only a document that holds a non-finite number or an odd key is walked in Python.
    ``compact`` gives one line without spaces (big documents, log lines); otherwise indent 2.
    """
    kwargs: dict[str, Any] = (
        {"separators": (",", ":")} if compact else {"indent": 2, "sort_keys": False}
    )
    try:
        return json.dumps(obj, allow_nan=False, default=_plain, **kwargs)
    except (ValueError, TypeError):  # NaN/inf somewhere, or a key json cannot take
        return json.dumps(jsonable(obj), allow_nan=False, default=_plain, **kwargs)
