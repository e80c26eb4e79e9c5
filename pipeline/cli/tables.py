"""``score-catalog history | rollback | optimize | vacuum OUTPUT``: a table's versions and its
maintenance (``format = "delta"``, docs/delta.md; ``format = "iceberg"``, docs/iceberg.md).

Registered by ``pipeline.cli`` (``main.add_command``). Each command parses its options and calls
one function of :mod:`pipeline.driver.tables`; OUTPUT is the table's folder, one of its
partition folders, or a job file.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click

from pipeline.cli import logs
from pipeline.cli.accept import _options
from pipeline.core.errors import EXIT_RUN_FAILED, TABLE_EXIT_CODES_HELP, PipelineError, describe
from pipeline.core.jsontext import to_json

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
F = TypeVar("F", bound=Callable[..., Any])
OUTPUT_HELP = "OUTPUT: the table's folder, a partition folder in it, or a job file (JOB.toml)."


def _common(f: F) -> F:
    """OUTPUT and --storage-option, shared by every table command."""
    f = click.option(
        "--storage-option",
        "storage",
        multiple=True,
        callback=_options,
        metavar="KEY=VALUE",
        help="fsspec option for OUTPUT (repeatable); values never logged.",
    )(f)
    return click.argument("output", metavar="OUTPUT")(f)


def _fail(e: Exception, what: str) -> NoReturn:
    console = logs.Console.setup("text", -1)
    if isinstance(e, PipelineError):
        console.error(str(e), e.exit_code)
        sys.exit(e.exit_code)
    console.error(f"{what} failed: {describe(e)}", EXIT_RUN_FAILED)
    sys.exit(EXIT_RUN_FAILED)


@click.command("history", context_settings=CONTEXT, epilog=TABLE_EXIT_CODES_HELP)
@_common
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Newest N versions only.")
@click.option("--json", "as_json", is_flag=True, help="Print the versions as JSON.")
def history(output: str, storage: dict[str, Any], limit: int | None, as_json: bool) -> None:
    """List the versions of the Delta or Iceberg table at OUTPUT, newest first: run id, model,
    rows, status and time of each run's commit, and the restores, compactions and vacuums (an
    Iceberg table's version: a snapshot's sequence number).

    Pointed at a partition folder, only that partition's commits (and the table-wide
    operations) are listed. A rollback says which partitions it restored (a partition's
    rollback: status "restore", its partition); a version a rollback undid says "rolled back
    (version V)" (with --json: restored_to, rolled_back_by). OUTPUT: the table's folder, a
    partition folder in it, or a job file (JOB.toml).
    """
    # Imported here, downward: --help must not pay for pyarrow and deltalake.
    from pipeline.driver import tables

    logs.Console.setup("text", -1)
    try:
        target = tables.locate(output, storage)
        rows = tables.history(target, limit)
    except Exception as e:
        _fail(e, "reading the history")
    click.echo(to_json(rows) if as_json else tables.history_table(target, rows))


@click.command("rollback", context_settings=CONTEXT, epilog=TABLE_EXIT_CODES_HELP)
@_common
@click.option(
    "--to-version",
    "version",
    required=True,
    type=click.IntRange(min=0),
    metavar="N",
    help="The table version to restore (see `score-catalog history`).",
)
@click.option(
    "--partition",
    "partition",
    multiple=True,
    callback=_options,
    metavar="COLUMN=VALUE",
    help="Roll back only this partition (repeatable, one per partition column), e.g. "
    "run_date=2026-12-01: with a job file, the way to name a day. Default: the partition OUTPUT "
    "points at, else the whole table.",
)
@click.option(
    "--reason",
    default="",
    help="Why (kept in the table's log and the run index); required unless --dry-run.",
)
@click.option("--by", default=None, help="Who rolls back (default: user@host).")
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print what it would change, partition by partition; change nothing.",
)
def rollback(
    output: str,
    storage: dict[str, Any],
    version: int,
    partition: dict[str, Any],
    reason: str,
    by: str | None,
    dry_run: bool,
) -> None:
    """Roll the Delta or Iceberg table at OUTPUT, or one partition of it, back to version N.

    A partition (OUTPUT a partition folder, or --partition COLUMN=VALUE): only its files become
    version N's again, in one new version; every other partition stays as it is.

    The whole table (OUTPUT the table's folder, or a job file: a job file names its output
    template's table, not a day; add --partition to name one): every partition as at version
    N, in one new version (Delta RESTORE; for Iceberg one new snapshot), so partitions written
    since are removed. A Delta table's schema reverts; an Iceberg table's stays (a column gained
    since reads as null).

    Before it acts it prints each partition it changes, rows now -> after (partitions it
    leaves as they are are counted, not listed); --dry-run stops there. It takes the table
    lock (refused while a run on any partition is in progress) and records who, when, why,
    which partitions and which runs it undid in the commit (Delta's commit info, the Iceberg
    snapshot's summary) and the run index (one killed after its commit landed is recorded by
    the next rollback of the table: run it again, and it records it and finds nothing more to
    roll back). Run versions are not rolled back: a retry of an undone run is still refused.
    The next run of a partition it changed scores again the shards the table no longer holds,
    and its drift compares with what the partition holds now. OUTPUT: the table's folder, a
    partition folder in it, or a job file (JOB.toml).
    """
    from pipeline.driver import rollback as rb  # downward, as above
    from pipeline.driver import tables

    logs.Console.setup("text", -1)

    def announce(plan: rb.Plan) -> None:
        click.echo(rb.plan_text(plan, dry_run=dry_run))

    try:
        target = tables.locate(output, storage)
        done = rb.rollback(
            target,
            version,
            reason,
            by=by,
            partition=partition or None,
            dry_run=dry_run,
            announce=announce,
        )
    except Exception as e:
        _fail(e, "the rollback")
    if not dry_run:
        click.echo(rb.done_text(done))


@click.command("optimize", context_settings=CONTEXT, epilog=TABLE_EXIT_CODES_HELP)
@_common
@click.option(
    "--partition",
    "partition",
    multiple=True,
    callback=_options,
    metavar="COLUMN=VALUE",
    help="Only this partition (repeatable, one per partition column; default: the one OUTPUT "
    "points at, or all).",
)
@click.option(
    "--target-size",
    type=click.IntRange(min=1),
    default=None,
    metavar="BYTES",
    help="Size of the compacted files (default: delta-rs's, 100 MiB).",
)
def optimize(
    output: str, storage: dict[str, Any], partition: dict[str, Any], target_size: int | None
) -> None:
    """Compact the small files of the Delta or Iceberg table at OUTPUT into one OPTIMIZE version
    (for Iceberg one "replace" snapshot); readers see the same rows. Takes the table lock. The
    next run of a compacted partition scores it again (its shards' files are no longer in the
    table): compact partitions no run rewrites, such as past days. OUTPUT: the table's folder,
    a partition folder in it, or a job file (JOB.toml).
    """
    from pipeline.driver import tables  # downward, as above

    logs.Console.setup("text", -1)
    try:
        target = tables.locate(output, storage)
        done = tables.optimize(target, partition or None, target_size)
    except Exception as e:
        _fail(e, "optimize")
    click.echo(
        f"optimized {done['table']}"
        + (f" partition {done['partition']}" if done["partition"] else "")
        + f": {done.get('numFilesRemoved', 0)} file(s) compacted into "
        f"{done.get('numFilesAdded', 0)}"
    )


@click.command("vacuum", context_settings=CONTEXT, epilog=TABLE_EXIT_CODES_HELP)
@_common
@click.option(
    "--retention-hours",
    type=click.IntRange(min=0),
    default=None,
    metavar="H",
    help="Delete files removed longer ago than this (default and minimum: the table's "
    "retention, 30 days unless set: Delta's delta.deletedFileRetentionDuration, Iceberg's "
    "history.expire.max-snapshot-age-ms).",
)
@click.option("--dry-run", is_flag=True, help="List the files it would delete; delete none.")
@click.option(
    "--force",
    is_flag=True,
    help="Allow a --retention-hours shorter than the table's: a rollback to, time travel to "
    "or a reader still on a version older than it then fails.",
)
def vacuum(
    output: str,
    storage: dict[str, Any],
    retention_hours: int | None,
    dry_run: bool,
    force: bool,
) -> None:
    """Delete the data files that commits removed from the Delta or Iceberg table at OUTPUT
    longer ago than the retention (for Iceberg: expire the snapshots older than it and delete
    the files only they listed). Takes the table lock. A retention shorter than the table's is
    refused unless --force: a rollback, time travel or a reader still on an older version may
    need those files. Files no version lists (a run's uncommitted output) are never touched.
    OUTPUT: the table's folder, a partition folder in it, or a job file (JOB.toml).
    """
    from pipeline.driver import tables  # downward, as above

    logs.Console.setup("text", -1)
    try:
        target = tables.locate(output, storage)
        done = tables.vacuum(target, retention_hours, dry_run=dry_run, force=force)
    except Exception as e:
        _fail(e, "vacuum")
    verb = "would delete" if dry_run else "deleted"
    click.echo(f"vacuum of {done['table']}: {verb} {len(done['files'])} file(s)")
    for path in done["files"][:20]:
        click.echo(f"  {path}")
    if len(done["files"]) > 20:
        click.echo(f"  ... and {len(done['files']) - 20} more")
