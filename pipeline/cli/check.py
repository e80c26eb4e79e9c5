"""``score-catalog bundle check``: what a bundle takes and gives, and a dry run on a few rows.

Part of the ``bundle`` group (``pipeline.cli.bundle``), thin over
:func:`pipeline.worker.bundlecheck.check_bundle`.
"""

from __future__ import annotations

import sys

import click

from pipeline.cli import logs
from pipeline.core.errors import EXIT_RUN_FAILED, EXIT_USAGE, PipelineError

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
EXIT_CODES_HELP = (
    "Exit codes: 0 the bundle loads and scored the rows (rows a run would reject are listed); "
    "1 storage could not be read (or the program file written); 2 usage or configuration "
    "error; 3 the bundle does not load, or the --input shard does not fit its inputs."
)


@click.command(context_settings=CONTEXT, epilog=EXIT_CODES_HELP)
@click.argument("path")
@click.option(
    "--input",
    "input_uri",
    help="Score the first rows of this input's first shard (a folder, glob or file) instead "
    "of random rows, through the same reading path as a run.",
)
@click.option("--rows", default=8, show_default=True, type=click.IntRange(min=1, max=100_000))
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:N or auto.")
@click.option(
    "--write-program-file",
    is_flag=True,
    help="Once the check passes, write the bundle's program file into PATH (a local folder), as "
    "save_bundle does: a machine with an empty program cache then loads it without "
    "torch.export's loader.",
)
def check(
    path: str, input_uri: str | None, rows: int, device: str, write_program_file: bool
) -> None:
    """Load the bundle PATH as a run would and print its inputs, outputs and a dry run.

    Shows each input (its columns, dtype, shape, vocabulary and null policy), the order in
    which they are passed to the program, each output column with its type, and the outputs
    on a few rows: random values each input can hold, or with --input real rows, where rows a
    run would reject are listed with their reasons.
    """
    # Imported here, downward: --help must not pay for torch (tests/cli/test_commands.py).
    from pipeline.worker.bundlecheck import check_bundle, check_text

    logs.Console.setup("text", 0)
    try:
        result = check_bundle(path, input_uri=input_uri, rows=rows, device=device)
    except PipelineError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    click.echo(check_text(result))
    if write_program_file:
        _write_program_file(path)


def _write_program_file(path: str) -> None:
    """``--write-program-file``: the program file of the local bundle ``path``, loaded on the
    CPU (the run's reference device), or a note that its program gets none."""
    from pathlib import Path

    from pipeline.model.program import load_model, write_program_file

    folder = Path(path.removeprefix("file://"))
    if "://" in path.removeprefix("file://") or not folder.is_dir():
        click.echo(
            f"error: --write-program-file writes into a local bundle folder; {path} is not one "
            "(write it where the bundle is saved, then copy the folder)",
            err=True,
        )
        sys.exit(EXIT_USAGE)
    try:
        written = write_program_file(load_model(str(folder), "cpu"), folder)
    except (PipelineError, OSError) as e:
        click.echo(f"error: could not write the program file: {e}", err=True)
        sys.exit(e.exit_code if isinstance(e, PipelineError) else EXIT_RUN_FAILED)
    click.echo(
        f"wrote {written}"
        if written is not None
        else "no program file: this bundle's program is not a plain graph of aten operations "
        "returning one tensor; it loads through torch.export on a machine that has not loaded "
        "it before"
    )
