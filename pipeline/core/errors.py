"""One exception hierarchy for the whole pipeline.

Every error carries what went wrong, where (URI, shard, row group, column) and what to do about
it, and an ``exit_code`` that the CLI returns unchanged. The codes are part of the public
contract (cron mails them, dashboards alert on them), so they are defined here and nowhere else.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger("pipeline")

EXIT_OK = 0
EXIT_RUN_FAILED = 1
EXIT_USAGE = 2
EXIT_INPUT = 3
EXIT_DRIFT = 4
EXIT_SIGTERM = 143  # the shell's 128 + signal number (pipeline.core.interrupt.EXIT_CODES)
EXIT_SIGINT = 130

# Each command's --help ends with its own exit codes (run's is the full table of the README).
EXIT_CODES_HELP = (
    "Exit codes: 0 success (status succeeded or succeeded_with_errors within the error budget); "
    "1 run failed (shards failed or rows rejected beyond the error budget, the lock held by "
    "another run or lost, or any other error during the run); "
    "2 usage or configuration error; "
    "3 input, schema or model error found before any row was scored; "
    "4 scored and committed, but the score distribution drifted from the previous successful "
    "run beyond [monitoring] thresholds (status succeeded_with_warnings, whatever the rejects); "
    "a rerun over the same data says so again until `score-catalog accept-drift OUTPUT` "
    "accepts it; "
    "143 or 130 stopped by SIGTERM or SIGINT (status interrupted; committed shards are kept and "
    "a rerun resumes)."
)


PLAN_EXIT_CODES_HELP = (
    "Exit codes: 0 every shard would be scored; 2 usage or configuration error; 3 a shard would "
    "fail (unreadable, or its columns do not fit the model), or an input or model error."
)
ACCEPT_EXIT_CODES_HELP = (
    "Exit codes: 0 the acceptance was recorded in the run index; 1 the storage could not be "
    "read or written; 2 usage error, no drift verdict at OUTPUT, or no drift alert to accept."
)
REPORT_EXIT_CODES_HELP = (
    "Exit codes: 0 the summary was printed (whatever the run's status); 1 the storage could not "
    "be read; 2 usage error, or no run report at RUN_URI."
)
DEMO_EXIT_CODES_HELP = (
    "Exit codes: 0 the catalog (and bundle) were written; 1 any error while writing them; "
    "2 usage error."
)
TABLE_EXIT_CODES_HELP = (
    "Exit codes: 0 done (history printed; the table rolled back, compacted or vacuumed); 1 the "
    "table is locked (a run on one of its partitions, or another maintenance command), or the "
    "storage could not be read or written; 2 usage error, or no Delta or Iceberg table at OUTPUT."
)
BACKFILL_EXIT_CODES_HELP = (
    "Exit codes: the worst of the days': 143 or 130 a day was stopped by SIGTERM or SIGINT (the "
    "days after it are not run); 1 a day failed, or had no input (missing) without "
    "--allow-missing-partitions; 4 a day's scores drifted; 0 every day succeeded, was skipped "
    "(already done) or was missing with --allow-missing-partitions. 2 usage or configuration "
    "error, 3 model error or no day in the range has input, before any day runs."
)


class PipelineError(Exception):
    """Base class: every error the pipeline raises on purpose."""

    exit_code = EXIT_RUN_FAILED


class ConfigError(PipelineError):
    """The job file, environment or flags are wrong. Carries every problem found at once."""

    exit_code = EXIT_USAGE

    def __init__(self, problems: list[str] | str, source: str | None = None) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        where = f" in {source}" if source else ""
        if len(self.problems) == 1:
            msg = f"invalid configuration{where}: {self.problems[0]}"
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            msg = f"invalid configuration{where} ({len(self.problems)} problems):\n{lines}"
        super().__init__(msg)


class UsageError(PipelineError):
    """A command was pointed at something it cannot use (a run with no report, a file where a
    folder is expected); the message says what to give instead. Exit 2, like a bad flag."""

    exit_code = EXIT_USAGE


class InputError(PipelineError):
    """The input cannot be scored as configured (no shards, bad schema); found before scoring."""

    exit_code = EXIT_INPUT


class MissingInputError(InputError):
    """The input (a folder, a file, or the folder a glob starts from) does not exist; ``uri``
    is the location that was looked for."""

    def __init__(self, message: str, *, uri: str) -> None:
        self.uri = uri
        super().__init__(message)


class SchemaError(InputError):
    """A readable shard's columns do not match what the model needs."""


class ModelError(PipelineError):
    """The model bundle cannot be loaded or does not fit its declared input/output spec."""

    exit_code = EXIT_INPUT


class StorageError(PipelineError):
    """Reading or writing storage failed (permissions, missing bucket, network, a full or
    read-only disk). ``uri`` names the location when it is known: a run's report lists it with
    the failure kind ``storage``."""

    def __init__(self, message: str, *, uri: str | None = None) -> None:
        super().__init__(message)
        self.uri = uri


class RegistryError(StorageError):
    """The model registry (an MLflow tracking server) could not be reached or refused a request;
    a rerun once it answers goes on. An unknown model, version or alias is a :class:`ModelError`."""


class ClusterError(PipelineError):
    """The Dask cluster could not be started or reached (a scheduler address nothing answers)."""


class LockError(PipelineError):
    """Another run holds the lock on this output."""


class ShardError(PipelineError):
    """One shard failed while being scored; the run goes on within the error budget.

    ``kind`` is one of ``unreadable``, ``schema``, ``invalid_rows``, ``model``, ``error``.
    """

    def __init__(self, message: str, *, shard: str, kind: str) -> None:
        self.shard = shard
        self.kind = kind
        super().__init__(message)


# --------------------------------------------------------------------------- Delta tables
# (pipeline.sinks.delta.table)


class TableError(PipelineError):
    """A Delta table could not take an operation; ``uri`` names the table. Exit 1, like any
    failure during a run."""

    def __init__(self, message: str, *, uri: str) -> None:
        super().__init__(message)
        self.uri = uri


class TableSchemaError(InputError):
    """The run's output does not fit the Delta table it writes to (a column's type changed, a
    column dropped or, without schema evolution, added; other partition columns). Found before
    anything is committed; exit 3 like the other schema errors."""

    def __init__(self, message: str, *, uri: str) -> None:
        super().__init__(message)
        self.uri = uri


class NotATableError(UsageError):
    """A command that reads a table (history, rollback, vacuum, optimize) was pointed at a
    location without one this tool can open (Delta, or Iceberg in its own catalog). Exit 2."""

    def __init__(self, message: str, *, uri: str) -> None:
        super().__init__(message)
        self.uri = uri


class CommitConflict(TableError):
    """Another writer committed to the table since this run read it, in a way this commit
    cannot be applied over (the same app id, or a file this commit removes is gone). Nothing
    was committed; the run's files stay for a rerun."""


class CommitRefused(TableError):
    """A file the run would commit is not what its worker reported (missing, another size,
    another schema or row count, a bad path). Nothing was committed."""


class AlreadyCommitted(TableError):
    """The table already holds this app id's commit at ``run_version`` or later (a retried or
    resumed run): nothing was committed again. ``committed_version`` is the app's latest run
    version in the table; ``table_version`` the table version that recorded it, when known."""

    def __init__(
        self,
        message: str,
        *,
        uri: str,
        app_id: str,
        run_version: int,
        committed_version: int,
        table_version: int | None,
    ) -> None:
        super().__init__(message, uri=uri)
        self.app_id = app_id
        self.run_version = run_version
        self.committed_version = committed_version
        self.table_version = table_version


def describe(e: BaseException) -> str:
    """One line naming what went wrong and where: our errors say it; others get their type
    (``NotADirectoryError: [Errno 20] Not a directory: '/data/out/x.parquet'``)."""
    if isinstance(e, PipelineError):
        return str(e)
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def log_cleanup_error(step: Callable[[], object], what: str) -> None:
    """Run a clean-up ``step``; its error is logged (``error while WHAT: ...``), never raised: it
    would hide the error that ended the run."""
    try:
        step()
    except Exception as e:
        logger.warning("error while %s: %s", what, describe(e))


# -- a commit that landed before the run failed --------------------------------------------

_LANDED = "_score_catalog_landed"


def mark_landed(e: BaseException, version: int | None, table: str) -> None:
    """Say on ``e`` that the run's table commit had landed as ``version`` of ``table`` when it
    was raised (the store died before the run recorded the commit): readers see the run's
    scores, and the run's error says so (:func:`landed_of`). The exception keeps its type: a
    storage failure is still one."""
    if getattr(e, _LANDED, None) is None:
        setattr(e, _LANDED, (version, table))


def landed_of(e: BaseException | None) -> tuple[int | None, str] | None:
    """(version, table) :func:`mark_landed` put on ``e`` or on an error it was raised from."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        found = getattr(e, _LANDED, None)
        if found is not None:
            return (found[0], str(found[1]))
        e = e.__cause__ or e.__context__
    return None
