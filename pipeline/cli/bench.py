"""``score-catalog bench``: time a model bundle at several batch sizes and print the table.

Registered by ``pipeline.cli`` (``main.add_command(bench)``). This module does not import
``pipeline.cli``, so that ``cli.py`` can import it at the top without a cycle, and it imports
torch only when the command runs, so that ``score-catalog --help`` stays fast.
"""

from __future__ import annotations

import math
import os
import sys
from typing import TYPE_CHECKING

import click

from pipeline.core.errors import EXIT_RUN_FAILED, InputError, PipelineError, SchemaError

if TYPE_CHECKING:
    import torch

    from pipeline.model.bundle import Inputs
    from pipeline.model.program import LoadedModel

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
DEFAULT_ROWS = 4096 * 4
EXIT_CODES_HELP = (
    "Exit codes: 0 the table was printed; 1 CUDA ran out of memory at a batch size (the sizes "
    "before it are shown) or a crash; 2 usage or configuration error (bad --batch-sizes, a "
    "device this machine lacks); 3 input or model error (bundle or --input shard)."
)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        return os.cpu_count() or 1


def _parse_batch_sizes(
    ctx: click.Context, param: click.Parameter, value: str | None
) -> list[int] | None:
    if value is None:
        return None
    sizes: list[int] = []
    for part in value.split(","):
        text = part.strip()
        try:
            size = int(text)
        except ValueError:
            raise click.BadParameter(
                f"{text!r} is not an integer; give comma-separated sizes, e.g. 1,32,256,4096"
            ) from None
        if size < 1:
            raise click.BadParameter(f"batch size {size} must be at least 1")
        sizes.append(size)
    return sizes


def _rows_from_input(
    input_uri: str, model_uri: str, device: str, rows: int
) -> tuple[LoadedModel, Inputs, str]:
    """(loaded model, ``rows`` valid input rows of the first shard, where they came from)."""
    import torch

    # Imported here, downward: --help must not pay for torch (tests/cli/test_commands.py).
    from pipeline.io.listing import list_shards
    from pipeline.io.parquet import read_footer
    from pipeline.model.bundle import read_bundle
    from pipeline.model.features import check_schema, data_widths
    from pipeline.model.program import load_model
    from pipeline.worker.batching import ShardBatches

    shard = list_shards(input_uri)[0].uri
    schema = read_footer(shard).schema
    spec, _, _ = read_bundle(model_uri)
    # An input model.toml leaves open takes its width from the data, as a run does.
    widths = data_widths(schema, spec)  # for inputs model.toml and the program leave open
    model = load_model(model_uri, device, widths=widths)
    # check_schema also checks an id column, which bench does not need: hand it a column that
    # is there (and not duplicated) so that only the feature columns are judged.
    names = schema.names
    id_col = next((n for n in names if names.count(n) == 1), spec.input_columns[0])
    problems = check_schema(
        schema, spec, widths=model.widths, id_column=id_col, passthrough=(), shard=shard
    )
    if problems:
        raise SchemaError("\n".join(problems))
    pieces: list[Inputs] = []
    have = 0
    dataset = ShardBatches(
        shard, spec, widths=model.widths, meta_columns=(), batch_size=min(rows, 65536)
    )
    for batch in dataset:
        # Invalid rows (null, NaN, inf) never reach the model in a run; leave them out here too.
        valid = torch.from_numpy(batch.features.valid)
        pieces.append(tuple(t[valid][: rows - have] for t in batch.tensors))
        have += int(pieces[-1][0].shape[0])
        if have >= rows:
            break
    if not have:
        raise InputError(f"shard {shard} has no valid rows to benchmark with")
    x = tuple(torch.cat(ts) for ts in zip(*pieces, strict=True))
    how = f"from {shard}"
    if have < rows:
        # Repeat the shard's rows so every batch size times the same amount of work.
        how += f" ({have:,} distinct rows repeated)"
        reps = math.ceil(rows / have)
        x = tuple(t.repeat(reps, *([1] * (t.dim() - 1)))[:rows] for t in x)
    return model, x, how


@click.command(context_settings=CONTEXT, epilog=EXIT_CODES_HELP)
@click.option(
    "--model",
    "model_uri",
    required=True,
    metavar="BUNDLE",
    help="Model bundle, or models:/NAME/VERSION or models:/NAME@ALIAS (MLflow registry).",
)
@click.option(
    "--device",
    default="auto",
    show_default=True,
    metavar="auto|cpu|cuda|cuda:N",
    help="Where the model runs.",
)
@click.option(
    "--batch-sizes",
    default="1,32,256,4096",
    show_default=True,
    callback=_parse_batch_sizes,
    metavar="N,N,...",
    help="Batch sizes to time, comma-separated.",
)
@click.option(
    "--rows",
    default=DEFAULT_ROWS,
    show_default=True,
    type=click.IntRange(min=1),
    help="Rows in one timed pass.",
)
@click.option(
    "--input",
    "input_uri",
    metavar="SHARD_OR_DIR",
    help="Take real rows from the first shard here instead of random normal rows.",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    help="torch threads (default: all cores; a run uses cores / workers).",
)
@click.option(
    "--repeats", default=3, show_default=True, type=click.IntRange(min=1), help="Timed passes."
)
def bench(
    model_uri: str,
    device: str,
    batch_sizes: list[int],
    rows: int,
    input_uri: str | None,
    threads: int | None,
    repeats: int,
) -> None:
    """Time the model of BUNDLE at each batch size: calls, ms per pass, samples/s, ms/sample.

    Each pass scores the same rows (random normal, or real ones with --input) split into
    batches; the best of --repeats passes is shown. Only the model call and the copy to the
    device are timed, not reading or writing Parquet.
    """
    import torch

    # Imported here, downward: --help must not pay for torch.
    from pipeline.model.program import forward, load_model
    from pipeline.model.registry import resolve_model
    from pipeline.model.tuning import BenchRow, bench_batch_sizes, format_table

    previous_threads = torch.get_num_threads()
    n_threads = threads or _cores()
    # Restored afterwards: the command may run inside a longer-lived process (tests, notebooks).
    torch.set_num_threads(n_threads)
    try:
        try:
            model_uri = resolve_model(model_uri).bundle
            if input_uri is not None:
                model, x, how = _rows_from_input(input_uri, model_uri, device, rows)
            else:
                model = load_model(model_uri, device)
                x = model.example(rows, random=True, device="cpu")
                floats = all(t.is_floating_point() for t in x)
                how = "random normal" if floats else "random values each input can hold"
        except PipelineError as e:
            _fail(e)
            return
        spec = model.spec
        click.echo(
            f"model {spec.name} v{spec.version} ({model.sha256[:12]}) on {model.device}, "
            f"torch threads {torch.get_num_threads()}, {rows:,} rows {how}"
        )

        def fn(t: Inputs) -> torch.Tensor:
            return forward(model, t)

        table: list[BenchRow] = []
        for size in batch_sizes:
            # One size at a time, so that a CUDA out-of-memory error at a large size still
            # shows the sizes that ran.
            try:
                table += bench_batch_sizes(fn, x, model.device, [size], repeats=repeats)
            except torch.cuda.OutOfMemoryError:
                if table:
                    click.echo(format_table(table))
                click.echo(
                    f"error: batch size {size} ran out of memory on {model.device}", err=True
                )
                sys.exit(EXIT_RUN_FAILED)
        click.echo(format_table(table))
    finally:
        torch.set_num_threads(previous_threads)


def _fail(e: PipelineError) -> None:
    # The same contract as cli.py's: the message to stderr, the error's own exit code.
    click.echo(f"error: {e}", err=True)
    sys.exit(e.exit_code)
