"""``score-catalog accept-drift OUTPUT --reason TEXT``: accept a dataset's drift alert.

Registered by ``pipeline.cli`` (``main.add_command(accept_drift)``). The acceptance goes into the
run index (``pipeline.report.verdict.accept``); the next run over the same dataset ends
``succeeded``.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from pipeline.cli import logs
from pipeline.core.errors import ACCEPT_EXIT_CODES_HELP, EXIT_RUN_FAILED, PipelineError, describe

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def _options(_ctx: click.Context, _param: click.Parameter, value: Any) -> dict[str, Any]:
    """``KEY=VALUE`` pairs -> a dict (fsspec options)."""
    found: dict[str, Any] = {}
    for item in value or ():
        key, sep, text = str(item).partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE")
        found[key] = text
    return found


@click.command("accept-drift", context_settings=CONTEXT, epilog=ACCEPT_EXIT_CODES_HELP)
@click.argument("output", metavar="OUTPUT")
@click.option("--reason", required=True, help="Why the drift is accepted (kept in the run index).")
@click.option("--by", default=None, help="Who accepts it (default: user@host).")
@click.option(
    "--storage-option",
    "storage",
    multiple=True,
    callback=_options,
    metavar="KEY=VALUE",
    help="fsspec option for OUTPUT (repeatable); values never logged.",
)
def accept_drift(output: str, reason: str, by: str | None, storage: dict[str, Any]) -> None:
    """Accept the drift alert of the dataset in OUTPUT (a run's output folder).

    A run whose scores drifted ends succeeded_with_warnings (exit 4), and so does every rerun
    that leaves the same data in OUTPUT. Once the drift is understood, this records who
    accepted it, when and why in the job's run index; the next run over the same data ends
    succeeded (exit 0) and its report says the drift was accepted. Data that changes again is
    judged again.
    """
    # Imported here, downward: --help must not pay for torch (tests/cli/test_commands.py).
    from pipeline.report.verdict import accept

    console = logs.Console.setup("text", -1)
    try:
        entry = accept(output, reason, by=by, options=storage)
    except PipelineError as e:
        console.error(str(e), e.exit_code)
        sys.exit(e.exit_code)
    except Exception as e:  # storage: one line naming it, not a traceback
        console.error(f"could not record the acceptance: {describe(e)}", EXIT_RUN_FAILED)
        sys.exit(EXIT_RUN_FAILED)
    click.echo(
        f"drift of dataset {entry['dataset']} in {entry['output']} (judged by run "
        f"{entry['judged_by']} against run {entry['baseline']}) accepted by {entry['by']} at "
        f"{entry['at']}: {entry['reason']}\n  recorded in {entry['uri']}\n"
        "  the next run over the same data ends succeeded (exit 0) and reports the acceptance"
    )
