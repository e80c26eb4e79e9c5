"""The command line's options: the job's, made from the configuration's settings
(:data:`pipeline.core.config.SETTINGS`, so their names, choices and defaults are the
dataclasses'), and the output options every command that runs something shares."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from pipeline.cli import logs
from pipeline.core import config as cfg
from pipeline.core.settings import Kind, Setting

F = TypeVar("F", bound=Callable[..., Any])


class _Text(click.ParamType):  # type: ignore[type-arg]  # generic from click 8.2; >=8.1 here
    """A value parsed as its :class:`~pipeline.core.settings.Kind` parses an environment
    variable."""

    def __init__(self, kind: Kind) -> None:
        self.kind = kind
        self.name = kind.name

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str) or self.kind.parse is None:
            return value
        try:
            return self.kind.parse(value)
        except ValueError:
            self.fail(f"{value!r} is not {self.kind.word}", param, ctx)


class Pair(click.ParamType):  # type: ignore[type-arg]  # generic from click 8.2; >=8.1 here
    """``KEY=VALUE`` -> ``(key, value)``, the value parsed by ``entry`` (None: kept as text)."""

    name = "pair"

    def __init__(self, metavar: str, *, entry: Callable[[str], Any] | None) -> None:
        self.metavar = metavar
        self.entry = entry

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[str, Any]:
        if isinstance(value, tuple):
            return value
        key, sep, text = str(value).partition("=")
        try:
            if not sep or not key:
                raise ValueError(value)
            return key, text if self.entry is None else self.entry(text)
        except ValueError:
            self.fail(f"{value!r} is not {self.metavar}", param, ctx)


def as_dict(_ctx: click.Context, _param: click.Parameter, value: Any) -> dict[str, Any] | None:
    return dict(value) if value else None  # None: not given, the lower layers stay


def _as_list(_ctx: click.Context, _param: click.Parameter, value: Any) -> list[str] | None:
    """Repeated values, each also split at commas: ``--passthrough a,b`` is ``--passthrough a
    --passthrough b``, as ``SCORE_CATALOG_PASSTHROUGH=a,b`` is."""
    if not value:
        return None
    return [part.strip() for v in value for part in str(v).split(",") if part.strip()]


def _job_option(s: Setting, flag: str) -> Callable[[F], F]:
    """The option ``flag`` of one setting: its kind gives the type, choices and default shown."""
    decls = [flag, s.name]
    help_text = s.help
    kw: dict[str, Any] = {"metavar": s.metavar, "default": None}
    kind = s.kind.name
    if kind == "bool" and s.default:
        decls[0] = f"{flag}/--no-{flag[2:]}"
        help_text += " (default on)"
    elif kind == "bool_or_word":
        # Neither flag given: the job file, the environment or the default (auto) decide.
        decls[0] = f"{flag}/--no-{flag[2:]}"
    elif kind == "bool":
        kw["is_flag"] = True
    elif kind == "table":
        kw.update(multiple=True, callback=as_dict)
        kw["type"] = Pair(s.metavar or "KEY=VALUE", entry=s.kind.entry)
    elif kind == "list":
        kw.update(multiple=True, callback=_as_list)
        help_text += " Also a comma-separated list."
    elif s.kind.choices and kind == "str":
        kw["type"] = click.Choice(s.kind.choices)
    else:
        kw["type"] = {"int": click.INT, "float": click.FLOAT}.get(kind) or _Text(s.kind)
    if not s.required and s.default not in (None, (), {}) and kind not in ("bool", "bool_or_word"):
        help_text += f" (default {s.default})"
    return click.option(*decls, help=help_text, **kw)


def job_options(f: F, *, command: str = "run", without: frozenset[str] = frozenset()) -> F:
    """The options shared by run, plan and backfill: each overrides one job-file key (except
    the keys in ``without``, which the command sets itself, and the keys only other commands
    take: see ``commands`` in :func:`pipeline.core.settings.meta`)."""
    for s in reversed(cfg.SETTINGS):
        if s.flag is None or s.key in without:
            continue
        if s.commands is None or command in s.commands:
            f = _job_option(s, s.flag)(f)
    return f


def backfill_job_options(f: F) -> F:
    """:func:`job_options` without ``--date``: each day of a backfill sets its own."""
    return job_options(f, command="backfill", without=frozenset({"date"}))


def plan_job_options(f: F) -> F:
    """:func:`job_options` for ``plan``."""
    return job_options(f, command="plan")


def output_options(f: F) -> F:
    """Logging options shared by every command that runs a job."""
    options = [
        click.option(
            "--log-format",
            type=click.Choice(logs.FORMATS),
            default="text",
            show_default=True,
            help="json: one JSON object per line on stderr and the summary as a JSON line on "
            "stdout.",
        ),
        click.option("-v", "--verbose", count=True, help="More log output (-vv for debug)."),
        click.option(
            "-q", "--quiet", is_flag=True, help="Errors only; no progress or shard lines."
        ),
        click.option(
            "--log-file",
            metavar="PATH",
            type=click.Path(dir_okay=False),
            help="Also append every log line (INFO, or DEBUG with -v, whatever -q says) and the "
            "summary to this local file.",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def progress_option(f: F) -> F:
    """``run``'s progress lines where no bar is drawn (not a terminal, or JSON logs)."""
    return click.option(
        "--progress-interval",
        metavar="S",
        type=click.FloatRange(min=0),
        default=60.0,
        show_default=True,
        help="Not on a terminal (cron) or with JSON logs: a progress line (rows, rows/s, ETA) "
        "every S seconds; 0: none. Off with -q.",
    )(f)
