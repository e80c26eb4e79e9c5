"""``score-catalog bundle register``: put a bundle folder into an MLflow model registry.

Part of the ``bundle`` group (``pipeline.cli.bundle``), thin over
:func:`pipeline.model.registry.register`. MLflow is imported only when the command runs, so
``score-catalog --help`` needs no MLflow.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from pipeline.cli import logs
from pipeline.core.errors import PipelineError

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
EXIT_CODES_HELP = (
    "Exit codes: 0 registered; 1 the tracking server did not answer or refused the request; "
    "2 usage or configuration error (MLFLOW_TRACKING_URI unset, MLflow not installed, a name "
    "or alias the registry refuses); 3 the bundle does not load (nothing was registered)."
)


@click.command(context_settings=CONTEXT, epilog=EXIT_CODES_HELP)
@click.argument("path", type=click.Path(file_okay=False, path_type=Path))
@click.option("--name", required=True, help="Registered model name (created if new).")
@click.option("--alias", help="Point this alias (e.g. champion) at the new version.")
@click.option(
    "--experiment",
    default="score-catalog",
    show_default=True,
    help="MLflow experiment of the run that holds the bundle's files.",
)
def register(path: Path, name: str, alias: str | None, experiment: str) -> None:
    """Register the bundle folder PATH as a new version of model NAME in MLflow's registry.

    The bundle is loaded and dry-run first, as a run would. Its files are then logged as the
    artifacts (under bundle/) of a new run and registered as a model version tagged with the
    bundle's SHA-256, on the tracking server named by MLFLOW_TRACKING_URI. Score it with
    --model models:/NAME/VERSION or --model models:/NAME@ALIAS. Needs the mlflow extra:
    pip install 'score-catalog[mlflow]'.
    """
    # Imported here, downward: --help must not pay for torch (tests/cli/test_commands.py).
    from pipeline.model.registry import register as register_bundle

    logs.Console.setup("text", 0)
    try:
        version = register_bundle(str(path), name, alias=alias, experiment=experiment)
    except PipelineError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    also = f" (alias {version.alias})" if version.alias else ""
    click.echo(f"registered {version.pinned}{also} from {version.path}: run {version.run_id}")
