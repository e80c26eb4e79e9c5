"""The ``score-catalog`` command: options -> JobConfig -> one library call -> exit code.

Each command parses its options, builds the config (:func:`pipeline.core.jobfile.build_config`),
calls one library function and maps :class:`PipelineError` to its exit code. The job options are
made from :data:`pipeline.core.config.SETTINGS`, so their names, choices and defaults are the
dataclasses'.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

from pipeline.cli import logs, progress, tables
from pipeline.cli.accept import accept_drift
from pipeline.cli.bench import bench
from pipeline.cli.bundle import bundle
from pipeline.cli.options import (
    Pair,
    as_dict,
    backfill_job_options,
    job_options,
    output_options,
    plan_job_options,
    progress_option,
)
from pipeline.core import config as cfg
from pipeline.core import hugepages, jobfile, runcontext
from pipeline.core.errors import (
    BACKFILL_EXIT_CODES_HELP,
    DEMO_EXIT_CODES_HELP,
    EXIT_CODES_HELP,
    EXIT_INPUT,
    EXIT_RUN_FAILED,
    EXIT_SIGTERM,
    PLAN_EXIT_CODES_HELP,
    REPORT_EXIT_CODES_HELP,
    ConfigError,
    PipelineError,
    UsageError,
    describe,
)
from pipeline.core.faults import checkpoint
from pipeline.core.interrupt import EXIT_CODES, Aborted, StopRequest, handle_signals, settled
from pipeline.core.jsontext import to_json
from pipeline.core.signals import (
    EarlyStop,
    check_early_stop,
    raise_early_signals,
    route_early_signals,
)
from pipeline.core.storage_options import unknown_options

F = TypeVar("F", bound=Callable[..., Any])

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
# The context object of the real command line (entrypoint), never of CliRunner: see _exit.
FAST_EXIT = "fast-exit"

#: The commands that take over a signal recorded while starting (pipeline.core.signals): a run
#: asked to stop before it takes its output raises EarlyStop at a safe point, and once it has
#: taken it, it stops as interrupted.
STOP_HANDLING = frozenset({"run", "backfill"})


@click.group(context_settings=CONTEXT, epilog=EXIT_CODES_HELP)
@click.version_option(package_name="score-catalog")
def main() -> None:
    """Score Parquet shards with a PyTorch model bundle, in batches, scheduled by Dask.

    Run `score-catalog run JOB.toml` for a job file (see jobs/), or give --input, --output and
    --model. `score-catalog demo` builds the demo catalog and model.
    """
    # Before any command imports torch: torch reads it at its first allocation.
    hugepages.ask_before_torch()
    ctx = click.get_current_context()
    if ctx.invoked_subcommand not in STOP_HANDLING:
        # No stop handling of its own to take a recorded signal over (pipeline.core.signals).
        raise_early_signals()


# --------------------------------------------------------------------------------------------
# Options made from the config's settings


def _console(opts: dict[str, Any]) -> logs.Console:
    """Take the output options out of ``opts`` and set up logging for them."""
    quiet, verbose = opts.pop("quiet"), opts.pop("verbose")
    log_file = opts.pop("log_file")
    if log_file is not None:
        try:  # here, where it can be named: logging's own set-up hides the cause
            with open(log_file, "a", encoding="utf-8"):
                pass
        except OSError as e:  # no such folder, no permission: before anything is done
            raise click.BadParameter(
                f"cannot append to {log_file} ({e.strerror or type(e).__name__}); give a file "
                "in a folder that exists and that this user can write to",
                param_hint="'--log-file'",
            ) from e
    console = logs.Console.setup(opts.pop("log_format"), -1 if quiet else verbose, log_file)
    console.progress_every = float(opts.pop("progress_interval", 0.0))
    return console


def _fail(e: PipelineError, console: logs.Console) -> NoReturn:
    console.error(str(e), e.exit_code)
    _exit(e.exit_code)


def _crash(e: Exception, console: logs.Console) -> NoReturn:
    """Any other error: one line naming it (its traceback only with -vv), exit 1."""
    if console.verbosity >= 2:
        logging.getLogger(__name__).debug("traceback of the error", exc_info=e)
    console.error(f"run failed: {describe(e)}", EXIT_RUN_FAILED)
    _exit(EXIT_RUN_FAILED)


def _aborted(e: Aborted, console: logs.Console) -> NoReturn:
    """A second signal stopped the run at once: the signal's exit code, no report."""
    code = EXIT_CODES.get(signal.Signals(e.signum), EXIT_SIGTERM)
    console.error(f"run {e}: stopped at once; no report was written", code)
    _exit(code)


class _StartupGC:
    """Python's cyclic garbage collector paused while a command starts up, then frozen.

    Importing torch, Dask and torch.export's loader creates some 470,000 objects that live
    as long as the process, and the collector traverses them again and again while they are
    being created: pausing it made the imports and the model load 0.5 s faster here (a
    quarter of them). :meth:`started` (the run is about to score) moves every object made so
    far out of the collector's reach with ``gc.freeze()``, so later collections, in forked
    Dask workers too, skip them, and turns collection back on for what the run allocates.
    """

    def __init__(self) -> None:
        self._paused = gc.isenabled()
        gc.disable()

    def __enter__(self) -> _StartupGC:
        return self

    def started(self) -> None:
        if self._paused:
            self._paused = False
            gc.freeze()
            gc.enable()

    def __exit__(self, *_: object) -> None:
        self.started()


def _exit(code: int) -> NoReturn:
    """Exit with ``code``. From the real command line, skip interpreter teardown.

    Everything the run wrote is closed and fsynced by now. Tearing down torch, dynamo and Dask
    modules took 1.35 s after the last atexit handler, 15% of a 2M-row nightly run here.
    """
    ctx = click.get_current_context(silent=True)
    if ctx is not None and ctx.find_root().obj == FAST_EXIT:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    sys.exit(code)


def _job_config(job: Path | None, opts: dict[str, Any]) -> cfg.JobConfig:
    """The job's configuration; when it cannot be built (exit 2), the metrics still say so."""
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.perf_counter()
    overrides = cfg.from_flags(opts)
    try:
        return jobfile.build_config(job, overrides=overrides)
    except PipelineError as e:
        _failed_metrics(jobfile.metrics_destination(job, overrides=overrides), started, t0, e)
        raise


def _failed_metrics(
    dest: jobfile.MetricsDestination | None, started: datetime.datetime, t0: float, e: BaseException
) -> None:
    """Status ``failed`` to the metrics file and Pushgateway of a job that never started (a
    configuration or usage error): the documented alert on ``status="failed"`` must fire for
    a bad deploy too, not only the staleness alert a day later."""
    if dest is None:
        return
    # Downward, and not pipeline.driver.finish: a usage error should not import torch.
    # Imported here, downward: --help must not pay for the report layer.
    from pipeline.report import metrics

    error = str(e) if isinstance(e, PipelineError) else f"{type(e).__name__}: {e}"
    summary = metrics.failure_summary(dest.name, started, time.perf_counter() - t0, error)
    metrics.publish(dest.metrics_file, dest.pushgateway, summary)


# --------------------------------------------------------------------------------------------
# Commands


@main.command(context_settings=CONTEXT, epilog=EXIT_CODES_HELP)
@click.argument("job", required=False, type=click.Path(dir_okay=False, path_type=Path))
@job_options
@output_options
@progress_option
def run(job: Path | None, **opts: Any) -> None:
    """Score the input shards of JOB (a TOML job file) or of --input/--output/--model.

    Settings come from the job file, then SCORE_CATALOG_* environment variables, then these
    flags (later wins). Finished shards recorded in the output's _manifest.json are skipped, so
    rerunning a failed night resumes it. The summary goes to stdout, log lines to stderr,
    _report.json and _report.html (with the manifest) to the output's control folder, beside
    the output template's fixed part (data/scored/run_date=X: data/_score_catalog/scored/
    run_date=X/), and, on success, _SUCCESS into the output. On a terminal a
    progress bar shows rows, shards, rows/s and ETA; elsewhere (cron) a progress line says the
    same every --progress-interval seconds.
    """
    # Paused until the run starts scoring (on_start), or until the command fails before.
    with _StartupGC() as startup:
        # Imported here, downward: --help must not pay for torch.
        from pipeline.driver.run import run as run_job
        from pipeline.report.text import problem_line, summary_table

        checkpoint("imported")  # the crash tests' place for a signal during the imports
        check_early_stop()  # a safe point: a signal while torch and Dask were imported stops here
        console = _console(opts)
        console.summarize_errors = True
        run_id = runcontext.new_run_id()
        runcontext.bind_run_id(
            run_id
        )  # every line of this command carries it, the earliest included
        try:
            config = _job_config(job, opts)
            # SIGTERM/SIGINT: stop scheduling, let shards in flight commit, report (exit 143/130).
            stop = StopRequest(config.grace_period_s)
            checkpoint("startup")  # the crash tests' place for a signal before the run routes them
            with handle_signals(stop), console.progress() as progress:
                checkpoint("routed")  # the crash tests' place for a signal once the run routes them

                def on_start(rows: int, shards: int) -> None:
                    startup.started()
                    progress.on_start(rows, shards)

                report = run_job(
                    config,
                    on_shard=progress.on_shard,
                    on_start=on_start,
                    on_rows=progress.on_rows,
                    stop=stop,
                    run_id=run_id,
                )
        except PipelineError as e:
            _fail(e, console)
        except Aborted as e:
            _aborted(e, console)
        except Exception as e:
            _crash(e, console)
    with settled(report.status):  # a signal now changes nothing: the report is written
        checkpoint("run-ended")  # the crash tests' place for a signal once the run has ended
        console.summary(
            {**report.data, "exit_code": report.exit_code},
            summary_table(report),
            problem_line(report.data, report.control),
        )
        _exit(report.exit_code)


@main.command(context_settings=CONTEXT, epilog=DEMO_EXIT_CODES_HELP)
@click.option(
    "--catalog",
    "catalog_dir",
    default="data/catalog",
    show_default=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Where to write the catalog.",
)
@click.option(
    "--model-dir",
    default="data/models/catalog-ranker",
    show_default=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Where to write the demo model's bundle.",
)
@click.option("--rows", default=200_000, show_default=True, type=click.IntRange(min=0))
@click.option("--shards", default=8, show_default=True, type=click.IntRange(min=1))
@click.option("--row-group-rows", default=8_192, show_default=True, type=click.IntRange(min=1))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--skip-model", is_flag=True, help="Only write the catalog.")
@click.option(
    "--train-model", is_flag=True, help="Retrain and re-export the bundle even if one exists."
)
def demo(
    catalog_dir: Path,
    model_dir: Path,
    rows: int,
    shards: int,
    row_group_rows: int,
    seed: int,
    skip_model: bool,
    train_model: bool,
) -> None:
    """Write the deterministic demo catalog and, if missing, train and export the demo model."""
    # Imported here, downward: --help must not pay for torch (tests/cli/test_commands.py).
    from pipeline.cli import demo as demo_mod

    logs.Console.setup("text", 0)
    paths = demo_mod.write_catalog(
        catalog_dir, rows=rows, shards=shards, row_group_rows=row_group_rows, seed=seed
    )
    click.echo(f"wrote {rows:,} rows in {len(paths)} shards to {catalog_dir}")
    if skip_model:
        return
    if train_model or not (model_dir / "model.toml").exists():
        acc = demo_mod.train_demo_model(model_dir, seed=seed)
        click.echo(f"trained demo model: held-out accuracy {acc:.3f}; bundle in {model_dir}")
    else:
        click.echo(f"model bundle {model_dir} exists (use --train-model to retrain)")


@main.command(context_settings=CONTEXT, epilog=PLAN_EXIT_CODES_HELP)
@click.argument("job", required=False, type=click.Path(dir_okay=False, path_type=Path))
@plan_job_options
@output_options
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(job: Path | None, as_json: bool, **opts: Any) -> None:
    """Show what `run` would do, scoring nothing and writing nothing.

    Reads every shard's footer (shards and rows), checks each schema against the model, reads
    the output's _manifest.json to say which shards a resume would skip, and times the model on
    real rows at the configured batch size to estimate the scoring time. Exits 3 when a shard
    would fail (unreadable, or its columns do not fit the model), naming it.
    """
    # Imported here, downward: --help must not pay for torch (tests/cli/test_commands.py).
    from pipeline.driver.planning import plan_job, plan_table

    console = _console(opts)
    try:
        result = plan_job(jobfile.build_config(job, overrides=cfg.from_flags(opts)))
    except PipelineError as e:
        _fail(e, console)
    click.echo(to_json(result) if as_json else plan_table(result))
    _exit(EXIT_INPUT if result["shards_failing"] else 0)


@main.command(context_settings=CONTEXT, epilog=REPORT_EXIT_CODES_HELP)
@click.argument("run_uri", metavar="RUN_URI")
@click.option(
    "--vs",
    "other",
    metavar="OTHER_RUN_URI",
    help="Compare with this run: counts, throughput, score quantiles, drift.",
)
@click.option(
    "--storage-option",
    "storage",
    multiple=True,
    type=Pair("KEY=VALUE", entry=None),
    callback=as_dict,
    metavar="KEY=VALUE",
    help="fsspec option for both URIs (repeatable); values never logged.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report (or both) as JSON.")
def report(run_uri: str, other: str | None, storage: dict[str, Any] | None, as_json: bool) -> None:
    """Print the summary of a finished run, or two runs side by side with --vs.

    RUN_URI is a run's output root (its _report.json is found in its control folder, beside
    the output template's fixed part) or the report file; any fsspec URI works (s3://...).
    """
    # Imported here, downward: --help must not pay for numpy and fsspec (the report needs no
    # torch either: tests/cli/test_commands.py).
    from pipeline.report.text import (
        diff_table,
        find_report,
        load_report,
        rolled_back_line,
        summary_table,
    )

    console = logs.Console.setup("text", -1)
    try:
        bad = unknown_options([run_uri, *([other] if other else [])], storage or {})
        if bad:
            raise ConfigError(bad)
        found = find_report(run_uri, storage or {})
        previous = load_report(other, storage or {}) if other else None
    except PipelineError as e:
        _fail(e, console)
    current = found.data
    if as_json:
        click.echo(to_json(current if previous is None else [current, previous]))
    elif previous is None:
        undone = _rolled_back(current, storage or {})
        if undone is not None:
            click.echo(rolled_back_line(undone))
        click.echo(summary_table(found))  # names the page where it is (found.control)
    else:
        click.echo(diff_table(current, previous))


def _rolled_back(data: dict[str, Any], storage: dict[str, Any]) -> dict[str, Any] | None:
    """The rollback that undoes the run ``data`` reports, as the table's history says it now
    (pipeline.driver.tables.run_rolled_back: the same as ``history``); where the table cannot
    be read from here (another catalog, storage down), as the run index recorded it."""
    from pipeline.driver.tables import run_rolled_back  # downward, as report's other imports
    from pipeline.report.text import rolled_back_by

    try:
        return run_rolled_back(data, storage)
    except Exception as e:  # a hint on top of the report: never the reason it cannot be shown
        logging.getLogger(__name__).debug(
            "could not read the table of run %s: %s", data.get("run_id"), e
        )
        return rolled_back_by(data, storage)


@main.command(context_settings=CONTEXT, epilog=BACKFILL_EXIT_CODES_HELP)
@click.argument("job", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--from",
    "start",
    required=True,
    metavar="YYYY-MM-DD",
    type=click.DateTime(["%Y-%m-%d"]),
    help="First partition date.",
)
@click.option(
    "--to",
    "end",
    required=True,
    metavar="YYYY-MM-DD",
    type=click.DateTime(["%Y-%m-%d"]),
    help="Last partition date, included.",
)
@backfill_job_options
@output_options
def backfill(job: Path, start: Any, end: Any, **opts: Any) -> None:
    """Rescore a date-partitioned archive: one resumable run per day from --from to --to.

    JOB's input and output must contain {date} (e.g. data/archive/dt={date}). Each day gets its
    own output, manifest and report; days whose output already has _SUCCESS from the current
    model bundle, over the same input shards, are skipped (--force rescores them) and missing
    input folders are listed as missing. A summary of every day goes to
    _backfills/<job>/<from>_<to>.json in the control area beside the output template's fixed
    part (output data/scored/dt={date}: data/_score_catalog/scored/_backfills/).
    """
    with _StartupGC():  # the imports only: each day's run allocates its own
        # Imported here, downward: --help must not pay for torch.
        from pipeline.driver.backfill import backfill as run_backfill
        from pipeline.driver.backfill import problem_line, summary_table

    checkpoint("imported")  # the crash tests' place for a signal during the imports
    check_early_stop()  # a safe point: a signal while torch and Dask were imported stops here
    console = _console(opts)
    console.summarize_errors = True
    force = bool(opts.pop("force"))
    try:
        config = _job_config(job, opts)
        # SIGTERM/SIGINT: the day in progress stops as a run does; the days left are not run.
        stop = StopRequest(config.grace_period_s)
        with handle_signals(stop):
            checkpoint("routed")  # the crash tests' place for a signal once the backfill has them
            result = run_backfill(
                config,
                start.date(),
                end.date(),
                force=force,
                on_partition=progress.log_partition,
                on_shard=progress.log_shard,
                stop=stop,
            )
    except PipelineError as e:
        _fail(e, console)
    except Aborted as e:
        _aborted(e, console)
    with settled(str(result.data["status"])):
        console.summary(
            {**result.data, "exit_code": result.exit_code},
            summary_table(result),
            problem_line(result),
        )
        _exit(result.exit_code)


main.add_command(bench)
main.add_command(bundle)
main.add_command(accept_drift)
for _command in (tables.history, tables.rollback, tables.optimize, tables.vacuum):
    main.add_command(_command)


def _flag_value(args: list[str], flag: str) -> str | None:
    """The value of ``flag`` (``--flag V`` or ``--flag=V``, the last one) in raw arguments."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a[len(flag) + 1 :]
    return value


def _usage_error_metrics(args: list[str], e: click.exceptions.UsageError) -> None:
    """A command line Click refused (a bad flag value, a misspelt flag) of ``run`` or
    ``backfill``: the failed status to the metrics the job file, environment and flags name,
    read from the raw arguments since Click parsed none of them."""
    job = next((a for a in args if a.endswith(".toml") and not a.startswith("-")), None)
    overrides = {
        key: value
        for key, flag in (("metrics_file", "--metrics-file"), ("pushgateway", "--pushgateway"))
        if (value := _flag_value(args, flag)) is not None
    }
    try:
        dest = jobfile.metrics_destination(job, overrides=overrides)
        now = datetime.datetime.now(datetime.timezone.utc)
        _failed_metrics(dest, now, time.perf_counter(), UsageError(e.format_message()))
    except Exception as err:  # the usage error is what the user must see
        logging.getLogger(__name__).debug("no metrics for the usage error: %s", err)


def entrypoint() -> None:
    """The command line, once :mod:`pipeline.cli.launch` (the console script) has routed signals.

    Whatever stops the command outside its own error handling still ends in one line, in the
    log format asked for: a usage error Click found (exit 2), SIGINT or SIGTERM while the
    command is still starting up, before its run routes them, or a run stopped before it took
    its output (130 / 143: nothing was written), or an error no command mapped (exit 1).
    """
    argv = sys.argv[1:]
    console = logs.Console("json" if logs.wants_json(argv) else "text", 0, logs.Terminal())
    console.summarize_errors = bool(argv) and argv[0] in ("run", "backfill")
    fmt = console.fmt
    # Until a run routes them to its StopRequest (handle_signals); after it, see _settled.
    route_early_signals()
    try:
        code = main(obj=FAST_EXIT, standalone_mode=False, prog_name="score-catalog")
    except click.exceptions.UsageError as e:
        if fmt == "json":
            console.error(e.format_message(), e.exit_code)
        else:
            e.show()
        if argv and argv[0] in ("run", "backfill"):
            _usage_error_metrics(argv[1:], e)
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        logs.emit_error("aborted", EXIT_RUN_FAILED, fmt)
        sys.exit(EXIT_RUN_FAILED)
    except KeyboardInterrupt:  # raised by a library itself, not by a handler of ours
        logs.stopped_while_starting(EarlyStop(signal.SIGINT), argv)
    except EarlyStop as e:
        logs.stopped_while_starting(e, argv)
    except Exception as e:  # pragma: no cover  (commands map their errors themselves)
        logs.emit_error(f"unexpected error: {type(e).__name__}: {e}", EXIT_RUN_FAILED, fmt)
        logging.debug("traceback", exc_info=True)
        sys.exit(EXIT_RUN_FAILED)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":  # pragma: no cover  (python -m pipeline starts as the script does)
    entrypoint()
