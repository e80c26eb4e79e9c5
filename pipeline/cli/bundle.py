"""``score-catalog bundle``: commands about model bundles.

Registered by ``pipeline.cli`` (``main.add_command(bundle)``); each subcommand lives in its own
module and imports its heavy dependencies only when it runs.
"""

from __future__ import annotations

import click

from pipeline.cli.check import check
from pipeline.cli.registry import register

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@click.group(context_settings=CONTEXT)
def bundle() -> None:
    """Model bundles: check what one takes and gives; register one in an MLflow registry."""


bundle.add_command(check)
bundle.add_command(register)
