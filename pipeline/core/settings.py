"""How a job's keys are declared: value rules, kinds and settings, derived from dataclasses.

A configuration dataclass declares each key as a field (``pipeline.core.config``): its type hint
gives the key's :class:`Kind` (how to check it and parse it from text), its metadata (:func:`meta`)
the value rules and the command-line text. :func:`settings_of` turns the fields into
:class:`Setting` records, which the loaders (``pipeline.core.jobfile``), the validator and the
command line read. Nothing here knows a particular job: the keys are
:mod:`pipeline.core.config`'s.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import difflib
import math
import re
import string
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

ENV_PREFIX = "SCORE_CATALOG_"
SCHEDULER_NAMES = ("local", "threads", "sync")
TEMPLATE_FIELDS = frozenset({"date", "run_id"})
_DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
_SCHEDULER_URI_RE = re.compile(r"^(tcp|tls|inproc|ucx)://\S+$")
_URL_RE = re.compile(r"^https?://\S+$")

# A value rule: (dotted key, a value of the right type) -> the problems, each naming key and value.
Check = Callable[[str, Any], list[str]]
# A problem and the dotted key (or environment variable) it is about, so that build_config
# can name where that key's value came from.
Keyed = tuple[str, str]


# --------------------------------------------------------------------------------------------
# Value rules, attached to fields through their metadata


def nonempty(key: str, value: Any) -> list[str]:
    return [] if value else [f"{key} must not be empty"]


def at_least(low: float, word: str = "an integer", *, strictly: bool = False) -> Check:
    """``value >= low`` (``> low`` if strictly); NaN and infinities fail too."""
    op = ">" if strictly else ">="

    def check(key: str, value: Any) -> list[str]:
        ok = math.isfinite(value) and (value > low if strictly else value >= low)
        return [] if ok else [f"{key} = {value!r} must be {word} {op} {low:g}"]

    return check


def fraction(key: str, value: float) -> list[str]:
    if 0.0 <= value <= 1.0:  # also false for NaN
        return []
    return [f"{key} = {value!r} must be in [0, 1]"]


def batch_size_rule(key: str, value: int | str) -> list[str]:
    if value == "auto" or (isinstance(value, int) and value >= 1):
        return []
    return [f'{key} = {value!r} must be an integer >= 1 or "auto"']


def template(*allowed: str) -> Check:
    names = frozenset(allowed)

    def check(key: str, value: str) -> list[str]:
        return template_problems(key, value, names)

    return check


def template_problems(key: str, template: str, allowed: frozenset[str]) -> list[str]:
    try:
        parsed = [
            (f, spec, conv)
            for _, f, spec, conv in string.Formatter().parse(template)
            if f is not None
        ]
    except ValueError as e:
        return [f"{key} = {template!r} is not a valid template: {e}"]
    if any(spec or conv for _, spec, conv in parsed):
        return [f"{key} = {template!r}: placeholders take no format spec; write {{date}}"]
    bad = {f for f, _, _ in parsed} - allowed
    if bad:
        names = ", ".join(f"{{{a}}}" for a in sorted(allowed))
        return [f"{key} = {template!r} uses unknown placeholder(s) {sorted(bad)}; allowed: {names}"]
    return []


def device_rule(key: str, value: str) -> list[str]:
    if _DEVICE_RE.match(value):
        return []
    return [f"{key} = {value!r} is not one of auto, cpu, cuda, cuda:N"]


def scheduler_rule(key: str, value: str) -> list[str]:
    if value in SCHEDULER_NAMES or _SCHEDULER_URI_RE.match(value):
        return []
    return [
        f"{key} = {value!r} is not one of {', '.join(SCHEDULER_NAMES)} or a scheduler address "
        "such as tcp://HOST:PORT"
    ]


def date_rule(key: str, value: str) -> list[str]:
    try:
        if not _DATE_RE.match(value):
            raise ValueError(value)
        dt.date.fromisoformat(value)
    except ValueError:
        return [f"{key} = {value!r} is not a date in YYYY-MM-DD form"]
    return []


def distinct(key: str, value: tuple[str, ...] | list[str]) -> list[str]:
    if len(set(value)) == len(value):
        return []
    return [f"{key} = {list(value)} names a column twice"]


def positive_entries(key: str, value: Mapping[str, Any]) -> list[str]:
    return [
        f"{key}.{name} = {v!r} must be a number > 0"
        for name, v in value.items()
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0
    ]


def url(key: str, value: str) -> list[str]:
    return [] if _URL_RE.match(value) else [f"{key} = {value!r} must be an http:// or https:// URL"]


def meta(
    help: str = "",
    *,
    checks: tuple[Check, ...] = (),
    flag: str | None = "",
    metavar: str | None = None,
    commands: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """A field's metadata: ``help`` (the --help text), value ``checks``, the command-line
    ``flag`` (default ``--field-name``; None: not a command-line option) and its ``metavar``,
    and the ``commands`` that take the flag (None: run, plan and backfill). The job key and its
    environment variable are read by every command; the others ignore them."""
    return {"help": help, "checks": checks, "flag": flag, "metavar": metavar, "commands": commands}


# --------------------------------------------------------------------------------------------
# Settings derived from the dataclasses


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _parse_bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(raw)


def _given(raw: str) -> str:
    """``raw``, unless it is empty: a key that can be a word ("auto") has no empty value."""
    if not raw.strip():
        raise ValueError(raw)
    return raw


def _parse_list(raw: str) -> list[str]:
    return [p.strip() for p in raw.split(",") if p.strip()]


@dataclass(frozen=True)
class Kind:
    """A key's type, read from its type hint: how to check it, parse it from text, name it."""

    name: str  # str, int, float, bool, list, int_or_word, bool_or_word, table, str_or_table
    word: str  # for messages: "an integer"
    accepts: Callable[[Any], bool]
    # From the text of an environment variable or a flag; raises ValueError. None: no text form.
    parse: Callable[[str], Any] | None
    choices: tuple[str, ...] = ()  # Literal[...]: the allowed values
    optional: bool = False  # None allowed (meaning "not set")
    entry: Callable[[str], Any] | None = None  # a table's values from text (None: kept as text)


_SCALARS = {
    str: Kind("str", "a string", lambda v: isinstance(v, str), str),
    int: Kind("int", "an integer", _is_int, int),
    float: Kind("float", "a number", _is_number, float),
    bool: Kind("bool", "true or false", lambda v: isinstance(v, bool), _parse_bool),
}


def kind_of(hint: Any) -> Kind:
    """The :class:`Kind` of a field's type hint (the hints this module uses, nothing more)."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        rest = tuple(a for a in args if a is not type(None))
        if len(rest) == 1:
            return dataclasses.replace(kind_of(rest[0]), optional=len(rest) < len(args))
        if len(rest) == 2 and rest[0] is str and get_origin(rest[1]) is Mapping:
            # str | Mapping[str, Any]: a word (from text too: a variable, a flag) or a table
            # (a job file only), never merged key by key across the layers.
            return Kind(
                "str_or_table",
                "a string or a table",
                lambda v: isinstance(v, (str, Mapping)),
                str,
                optional=len(rest) < len(args),
            )
        if len(rest) == 2 and rest[0] in (bool, int) and get_origin(rest[1]) is Literal:
            # bool | Literal["auto"], int | Literal["auto"]: a value, or one of a few words.
            scalar, words = _SCALARS[rest[0]], get_args(rest[1])
            shown = " or ".join(f'"{w}"' for w in words)
            what = "true, false" if rest[0] is bool else scalar.word
            parse = scalar.parse
            assert parse is not None
            return Kind(
                f"{scalar.name}_or_word",
                f"{what} or {shown}",
                lambda v: v in words or scalar.accepts(v),
                lambda raw: w if (w := raw.strip().lower()) in words else parse(_given(raw)),
                choices=words,
            )
    elif origin is Literal:
        return dataclasses.replace(_SCALARS[str], choices=tuple(args))
    elif origin is tuple and args[1:] == (Ellipsis,) and args[0] is str:
        return Kind(
            "list",
            "a list of strings",
            lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v),
            _parse_list,
        )
    elif origin is Mapping:
        entry = _SCALARS[args[1]].parse if args[1] in _SCALARS else None
        return Kind("table", "a table", lambda v: isinstance(v, Mapping), None, entry=entry)
    elif hint in _SCALARS:
        return _SCALARS[hint]
    raise TypeError(f"config field type {hint!r} has no Kind; add it to settings.kind_of")


@dataclass(frozen=True)
class Setting:
    """One job key as the dataclasses declare it, for the loaders, the validator and the CLI."""

    key: str  # as written in messages: "batch_size", "errors.max_failed_shards"
    name: str  # the field's name
    table: str | None  # the [table] of the job file it sits in, or None (top level)
    kind: Kind
    default: Any  # dataclasses.MISSING for a required key
    help: str  # the --help text, without the default
    flag: str | None  # the command-line option, e.g. "--batch-size"; None: none
    metavar: str | None
    checks: tuple[Check, ...]
    commands: tuple[str, ...] | None = None  # the commands whose flags include it; None: all

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING

    @property
    def env(self) -> str | None:
        """``SCORE_CATALOG_<NAME>``; None for free tables (storage, resources)."""
        return None if self.kind.parse is None else ENV_PREFIX + self.name.upper()


def settings_of(cls: type, table: str | None = None) -> Iterator[Setting]:
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            yield from settings_of(hint, f.name)
            continue
        factory = f.default_factory
        default = f.default if factory is dataclasses.MISSING else factory()
        meta = f.metadata
        flag = meta.get("flag", "")
        yield Setting(
            key=f"{table}.{f.name}" if table else f.name,
            name=f.name,
            table=table,
            kind=kind_of(hint),
            default=default,
            help=meta.get("help", ""),
            flag="--" + f.name.replace("_", "-") if flag == "" else flag,
            metavar=meta.get("metavar"),
            checks=meta.get("checks", ()),
            commands=meta.get("commands"),
        )


def closest_names(name: str, known: list[str], prefix: str = "") -> list[str]:
    """Up to two of ``known`` that look like a typo of ``name``, compared without the
    ``prefix`` they all share (which would make every SCORE_CATALOG_* name look alike)."""
    bare = {k.removeprefix(prefix).lower(): k for k in known}
    close = difflib.get_close_matches(name.removeprefix(prefix).lower(), list(bare), n=2)
    return [bare[c] for c in close]
