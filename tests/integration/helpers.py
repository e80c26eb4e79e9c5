"""Running the real CLI, reading what it wrote, and comparing output trees.

:func:`cli` is the one way the integration tests run ``score-catalog``: a real process by
default, or in this process (Click's ``CliRunner``) where a suite makes dozens of calls and only
the exit code and the output matter. Either way it returns a :class:`CliResult` and checks every
``_report.json`` the run wrote against the report schema, once ``pipeline.report.schema`` exists.
:func:`start_cli` starts the same command in the background, for tests that kill it part-way.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10, as pipeline/core/config.py does
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
# The CLI's fault-injection hook (pipeline/core/faults.py): a run that reaches the named point
# SIGKILLs itself, so it must never be set in the pytest process or leak into a run by accident.
KILL_AT = "_SCORE_CATALOG_KILL_AT"
# The same module's full-disk hook: every staged write fails from a named point on.
FAIL_AT = "_SCORE_CATALOG_FAIL_AT"
# And its pause: a run holds at a named point until the test releases it (:class:`Pause`).
PAUSE_AT = "_SCORE_CATALOG_PAUSE_AT"


class CliResult(NamedTuple):
    """What one ``score-catalog`` run did."""

    returncode: int
    stdout: str
    stderr: str
    report: dict[str, Any] | None  # the _report.json this run wrote, if it wrote one locally

    @property
    def output(self) -> str:
        """stdout then stderr, for assertions that do not care which stream a line went to."""
        return self.stdout + self.stderr


def cli_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a CLI process: this one's without SCORE_CATALOG_* settings (so the
    developer's shell cannot change a test's config), plus ``env``."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("SCORE_CATALOG_")}
    full.pop(KILL_AT, None)
    full.pop(FAIL_AT, None)
    full.pop(PAUSE_AT, None)
    full.update(env or {})
    full.setdefault("PYTHONPATH", str(REPO))
    return full


def cli_argv(*args: str) -> list[str]:
    """The command line of ``score-catalog ARGS``: ``python -m pipeline`` in this venv, which
    starts as the console script does (pipeline.cli.launch: signals handled from the first line)."""
    return [sys.executable, "-m", "pipeline", *args]


def cli(
    *args: str,
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
    cwd: Path | None = None,
    in_process: bool = False,
    output: Path | None = None,
) -> CliResult:
    """Run ``score-catalog ARGS`` and return its exit code, output and report.

    ``in_process`` runs it through Click's ``CliRunner`` instead of a new interpreter: a new
    process costs about 2 s of imports before it does anything (`score-catalog --help` took
    2.0 s here), which over the ~50 calls of test_failures and test_end_to_end is minutes of
    ``make test``. It cannot take ``env`` with the fault-injection hook (it would kill pytest).

    ``output`` is where to look for ``_report.json``; by default the ``--output`` flag, or the
    job file's ``output`` (``{date}`` filled in from ``--date``). A report counts only if this
    run wrote it (it is new or its modification time changed), and it is checked against the
    report schema (see :func:`check_report`).
    """
    out = output if output is not None else output_of(args)
    before = _stamp(out)
    if in_process:
        code, stdout, stderr = _invoke(args, env)
    else:
        done = subprocess.run(
            cli_argv(*args),
            capture_output=True,
            text=True,
            env=cli_env(env),
            timeout=timeout,
            cwd=cwd or REPO,
        )
        code, stdout, stderr = done.returncode, done.stdout, done.stderr
    rep = None
    if out is not None and _stamp(out) not in (None, before):
        rep = report(out)
    return CliResult(code, stdout, stderr, rep)


def start_cli(
    *args: str,
    env: Mapping[str, str] | None = None,
    stdout: int | IO[Any] | None = subprocess.PIPE,
    stderr: int | IO[Any] | None = subprocess.PIPE,
) -> subprocess.Popen[str]:
    """Start ``score-catalog ARGS`` in the background (same command and environment as
    :func:`cli`), for a test that kills it or a worker part-way; the caller waits for it."""
    return subprocess.Popen(
        cli_argv(*args), cwd=REPO, env=cli_env(env), stdout=stdout, stderr=stderr, text=True
    )


class Pause:
    """A run held at a named point until the test lets it go on (``_SCORE_CATALOG_PAUSE_AT``,
    :mod:`pipeline.core.faults`): how a test acts while a run is at a known step, whatever the
    machine's speed. Every process that reaches ``point`` for the ``n``-th time (the CLI, or
    each Dask worker) appends its pid to ``marker`` and waits until :meth:`release`.

    Make them with the ``pauses`` fixture (tests/integration/conftest.py), which releases every
    one when the test ends, passed or failed, so that no held process outlives it.
    """

    def __init__(self, point: str, marker: Path, n: int = 1) -> None:
        self.point, self.marker, self.n = point, marker, n

    @property
    def spec(self) -> str:
        return f"{self.point}:{self.n}:{self.marker}"

    def pids(self) -> list[int]:
        """The processes held here so far (each wrote one line)."""
        try:
            return [int(x) for x in self.marker.read_text().split()]
        except FileNotFoundError:
            return []

    def wait(
        self,
        proc: subprocess.Popen[Any] | Sequence[subprocess.Popen[Any]] = (),
        count: int = 1,
        timeout: float = 180,
    ) -> list[int]:
        """Until ``count`` processes are held here; their pids. Fails if the run ``proc`` (or
        every one of several runs) ends first: it never got there. ``timeout`` is a safety
        net for a run that hangs."""
        procs = [proc] if isinstance(proc, subprocess.Popen) else list(proc)
        deadline = time.monotonic() + timeout
        while len(pids := self.pids()) < count:
            if procs and all(p.poll() is not None for p in procs):
                ended = [(p.returncode, p.communicate()) for p in procs]
                raise AssertionError(
                    f"the run ended before {count} process(es) reached {self.point}:{self.n} "
                    f"(held: {pids}): {ended}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"no {count} process(es) held at {self.spec} in {timeout} s")
            time.sleep(0.01)
        return pids

    def release(self) -> None:
        """Let every process held here (and any that gets here later) go on."""
        Path(f"{self.marker}.release").touch()


def pause_env(*pauses: Pause) -> dict[str, str]:
    """The environment that sets ``pauses`` in a CLI run (or, through ``os.environ``, in the
    Dask workers of a tcp:// cluster: :func:`tests.integration.servers.set_env`)."""
    return {PAUSE_AT: ",".join(p.spec for p in pauses)}


def wait_for_text(
    path: Path, text: str, proc: subprocess.Popen[Any] | None = None, timeout: float = 180
) -> str:
    """Until the file ``path`` (a log the run appends to) holds ``text``; its content. Fails
    if ``proc`` ends first; ``timeout`` is a safety net for a run that hangs."""
    deadline = time.monotonic() + timeout
    while True:
        content = path.read_text(errors="replace") if path.exists() else ""
        if text in content:
            return content
        if proc is not None and proc.poll() is not None:
            raise AssertionError(
                f"the run ended (exit {proc.returncode}) before {path} said {text!r}:\n{content}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not say {text!r} in {timeout} s:\n{content}")
        time.sleep(0.01)


def _invoke(args: Sequence[str], env: Mapping[str, str] | None) -> tuple[int, str, str]:
    from click.testing import CliRunner

    from pipeline.cli.commands import main

    if env and KILL_AT in env:
        raise ValueError(f"{KILL_AT} would kill the test process: run with in_process=False")
    if env and PAUSE_AT in env:
        raise ValueError(f"{PAUSE_AT} would hold the test process: run with in_process=False")
    res = CliRunner().invoke(main, list(args), env=dict(env) if env else None)
    stderr = res.stderr
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        # An exception the CLI did not map to an exit code: show it in the test's message.
        stderr += "".join(traceback.format_exception(res.exception))
    return res.exit_code, res.stdout, stderr


def output_of(args: Sequence[str]) -> Path | None:
    """The local output folder a ``run`` command line names, or None (S3, or not given)."""
    flags = _flags(args)
    out = flags.get("--output")
    if out is None and len(args) > 1 and args[0] == "run" and args[1].endswith(".toml"):
        try:
            out = tomllib.loads(Path(args[1]).read_text()).get("output")
        except (OSError, tomllib.TOMLDecodeError):
            return None
    if not isinstance(out, str) or "://" in out:
        return None
    if "{date}" in out:
        if "--date" not in flags:
            return None
        out = out.replace("{date}", flags["--date"])
    return Path(out)


def _flags(args: Sequence[str]) -> dict[str, str]:
    """``--name value`` and ``--name=value`` pairs of a command line (the last one wins)."""
    found: dict[str, str] = {}
    for i, a in enumerate(args):
        m = re.fullmatch(r"(--[a-z-]+)=(.*)", a)
        if m:
            found[m.group(1)] = m.group(2)
        elif a.startswith("--") and i + 1 < len(args):
            found[a] = args[i + 1]
    return found


def _stamp(out: Path | None) -> int | None:
    """The report's modification time (ns), or None when there is none."""
    if out is None:
        return None
    try:
        return report_path(out).stat().st_mtime_ns
    except OSError:
        return None


def job_args(inp: Path | str, out: Path | str, model: Path | str, *extra: str) -> list[str]:
    """``--input INP --output OUT --model MODEL EXTRA...`` for run, plan and friends."""
    return ["--input", str(inp), "--output", str(out), "--model", str(model), *extra]


def check_report(rep: Mapping[str, Any], where: str = "_report.json") -> None:
    """Fail unless ``rep`` passes ``pipeline.report.schema.validate_report``.

    Until that module exists this checks nothing; once it exists the check is strict: a report
    it refuses, or a module without ``validate_report``, fails the test.
    """
    try:
        schema = importlib.import_module("pipeline.report.schema")
    except ModuleNotFoundError as e:
        if e.name == "pipeline.report.schema":
            return
        raise
    validate = getattr(schema, "validate_report", None)
    assert callable(validate), "pipeline.report.schema has no validate_report(report)"
    try:
        problems = validate(rep)
    except Exception as e:  # any refusal, whatever its type, fails the test
        raise AssertionError(f"{where} does not match the report schema: {e}") from e
    # A validator may also return what is wrong instead of raising.
    assert problems is not False and not (isinstance(problems, (list, tuple)) and problems), (
        f"{where} does not match the report schema: {problems}"
    )


def control_of(out: Path) -> Path:
    """The control folder of output ``out`` (``pipeline.io.layout``), where its ``_report.json``,
    ``_report.html`` and ``_manifest.json`` are: beside the fixed part of its output template,
    ``<root's parent>/_score_catalog/<root's name>/<out below the root>``. The root is not known
    from ``out`` alone: this is the first folder from ``out`` up whose control folder holds
    one of those files, else ``out``'s own (an output without placeholders is its root)."""
    from pipeline.io import layout, storage

    for place in layout.candidates(storage.locate(str(out)))[:-1]:
        if any((Path(place.path) / name).is_file() for name in _CONTROL_FILES):
            return Path(place.path)
    return out.parent / "_score_catalog" / out.name


_CONTROL_FILES = ("_report.json", "_manifest.json", "_report.html")


def report_path(out: Path) -> Path:
    """Where the ``_report.json`` of output ``out`` is."""
    return control_of(out) / "_report.json"


def manifest_path(out: Path) -> Path:
    """Where the ``_manifest.json`` of output ``out`` is."""
    return control_of(out) / "_manifest.json"


def report(out: Path) -> dict[str, Any]:
    """The ``_report.json`` of output ``out``, checked against the report schema."""
    path = report_path(out)
    rep: dict[str, Any] = json.loads(path.read_text())
    check_report(rep, str(path))
    return rep


def data_files(root: Path) -> list[Path]:
    """Files a dataset reader sees: *.parquet with no _ or . path component."""
    if not root.exists():
        return []
    return sorted(
        p
        for p in root.rglob("*.parquet")
        if p.is_file()  # a folder may be named like a shard (a partition written as a folder)
        and not any(part.startswith(("_", ".")) for part in p.relative_to(root).parts)
    )


def read_tree(root: Path) -> dict[str, pa.Table]:
    """Every data file under ``root``, by relative path."""
    return {str(p.relative_to(root)): pq.read_table(p) for p in data_files(root)}


def temporaries(*roots: Path) -> list[Path]:
    """Staging files (``.tmp-`` in the name) left under ``roots``."""
    return [p for r in roots if r.exists() for p in r.rglob("*") if ".tmp-" in p.name]


def rejects_of(out: Path, root: Path | None = None) -> Path:
    """The default rejects folder of output ``out`` whose template's fixed part is ``root``
    (default: ``out``, an output without placeholders): ``<root's parent>/_rejects/<root's
    name>/<out below the root>``."""
    root = out if root is None else root
    return root.parent / "_rejects" / root.name / out.relative_to(root)


def reader_counts(root: Path) -> dict[str, int]:
    """The rows each dataset reader finds at ``root`` (a template's fixed part, or one output),
    read the way docs/output.md tells analysts to: DuckDB ``'**/*.parquet'`` with
    ``hive_partitioning``, Polars on the folder and on the glob, ``pyarrow.dataset`` with
    ``partitioning="hive"``, pandas and Dask. A reader that fails raises."""
    import dask.dataframe as dd
    import duckdb
    import pandas as pd
    import polars as pl
    import pyarrow.dataset as ds

    sql = f"select count(*) from read_parquet('{root}/**/*.parquet', hive_partitioning=true)"
    row = duckdb.connect().execute(sql).fetchone()
    assert row is not None
    return {
        "duckdb": int(row[0]),
        "polars root": pl.scan_parquet(root).select(pl.len()).collect().item(),
        "polars glob": pl.scan_parquet(f"{root}/**/*.parquet").select(pl.len()).collect().item(),
        "pyarrow.dataset": ds.dataset(root, partitioning="hive").count_rows(),
        "pandas": len(pd.read_parquet(root)),
        "dask": len(dd.read_parquet(str(root))),
    }
