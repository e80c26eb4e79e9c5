"""What a bundle takes and gives, and a dry run on a few rows: ``score-catalog bundle check``.

:func:`check_bundle` loads a bundle as a run would (the same validation, signature check and dry
run), then scores a few rows: random values each input can hold, or the first rows of a real
shard through the same reading path as a run (schema check, vocabularies, null policies), so
that rows a run would reject are shown with their reasons. :func:`check_text` words the result
for the terminal.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pipeline.core.errors import InputError, SchemaError
from pipeline.io.listing import list_shards
from pipeline.io.parquet import read_footer
from pipeline.model import oov
from pipeline.model.bundle import read_bundle
from pipeline.model.engine import output_columns, score
from pipeline.model.features import check_schema, data_widths
from pipeline.model.inputs import InputSpec
from pipeline.model.program import LoadedModel, load_model
from pipeline.model.signature import parameter_names
from pipeline.worker.batching import ShardBatches


@dataclass
class BundleCheck:
    """A loaded bundle and what it gave on the sample rows."""

    model: LoadedModel
    source: str  # where the rows came from
    rows: int
    outputs: dict[str, list[Any]]  # per output column, the first rows' values
    rejected: list[tuple[int, str]] = field(default_factory=list)  # (row, reason)
    # What a run would warn about (pipeline.model.oov: an oov id that is a real value's).
    warnings: list[str] = field(default_factory=list)


def check_bundle(
    uri: str,
    *,
    input_uri: str | None = None,
    rows: int = 8,
    device: str = "cpu",
    options: Mapping[str, Any] | None = None,
) -> BundleCheck:
    """Load ``uri`` and score ``rows`` rows (random, or the first rows of ``input_uri``'s
    first shard, which must fit the model's inputs)."""
    if input_uri is None:
        model = load_model(uri, device, options=options)
        oov.check_declared_ranges(model)  # ids a run may feed must not crash the model
        warnings = oov.check(model)
        xs = model.example(rows, random=True)
        scored = score(model, xs)
        result = _result(model, f"{rows} random rows", rows, scored, [])
    else:
        result = _from_input(uri, input_uri, rows, device, options)
        warnings = oov.check(result.model)
    result.warnings = warnings
    return result


def _from_input(
    uri: str, input_uri: str, rows: int, device: str, options: Mapping[str, Any] | None
) -> BundleCheck:
    shard = list_shards(input_uri, options)[0].uri
    schema = read_footer(shard, options).schema
    spec, _, _ = read_bundle(uri, options)
    widths = data_widths(schema, spec)  # for inputs model.toml and the program leave open
    model = load_model(uri, device, widths=widths, options=options)
    names = schema.names
    # No id column here: hand check_schema one that is there, so only the inputs are judged.
    id_col = next((n for n in names if names.count(n) == 1), "")
    problems = check_schema(
        schema, model.spec, widths=model.widths, id_column=id_col, passthrough=(), shard=shard
    )
    if problems:
        raise SchemaError("\n".join(problems))
    data = ShardBatches(
        shard,
        model.spec,
        widths=model.widths,
        meta_columns=(),
        batch_size=rows,
        storage_options=options,
    )
    for batch in data:
        valid = batch.features.valid
        idx = np.flatnonzero(~valid)
        rejected = list(zip(idx.tolist(), batch.features.reasons or [], strict=True))
        xs = tuple(t[torch.from_numpy(valid)] for t in batch.tensors)
        scored = score(model, xs)
        return _result(
            model, f"the first {batch.num_rows} rows of {shard}", batch.num_rows, scored, rejected
        )
    raise InputError(f"shard {shard} has no rows")


def _result(
    model: LoadedModel, source: str, rows: int, scored: Any, rejected: list[tuple[int, str]]
) -> BundleCheck:
    cols = output_columns(scored.outputs, model.spec.outputs)
    outputs = {o.name: c.to_pylist() for o, c in zip(model.spec.outputs, cols, strict=True)}
    valid_idx = [i for i in range(rows) if i not in {r for r, _ in rejected}]
    for j, msg in scored.errors.items():
        rejected.append((valid_idx[j], msg))
    return BundleCheck(model, source, rows, outputs, sorted(rejected))


def _input_line(inp: InputSpec, width: int) -> str:
    src = ", ".join(inp.columns) if inp.columns is not None else inp.column or ""
    parts = [f"{inp.name:<12} {src:<28} {inp.dtype} {inp.shape_text(width)}"]
    if inp.vocabulary:
        oov = "reject" if inp.oov is None else f"-> {inp.oov}"
        if inp.oov is not None:  # whose id it is: a reserved entry's, its own, or a real value's
            own = inp.oov >= len(inp.vocab)
            oov += " (its own id)" if own else f" ({inp.vocab[inp.oov]!r})"
        parts.append(f"vocabulary {inp.vocabulary} ({len(inp.vocab):,} values), unseen {oov}")
    if inp.num_embeddings is not None:
        parts.append(f"ids 0..{inp.num_embeddings - 1}")
    parts.append("null: reject" if inp.fill is None else f"null -> {inp.fill!r}")
    return "    " + "; ".join(parts)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v[:4]) + (", ...]" if len(v) > 4 else "]")
    return repr(v)


def check_text(result: BundleCheck, *, max_rows: int = 8) -> str:
    """The check for the terminal: the bundle, its inputs and outputs, the dry run."""
    m = result.model
    spec = m.spec
    names = parameter_names(m.module)
    called = [spec.inputs[i].name for i in m.order]
    by_name = names == called and len(called) > 1 and m.order != tuple(range(len(called)))
    how = "by name" if names == called and len(called) > 1 else "in declared order"
    params = ", ".join(names) if names else f"{len(called)} inputs"
    lines = [
        f"bundle {spec.uri}",
        f"  model     {spec.name} v{spec.version} ({m.sha256[:12]}), {spec.format} {spec.file}, "
        f"on {m.device}",
        f"  inputs    forward({params}) <- {', '.join(called)} ({how}"
        + (", not as declared" if by_name else "")
        + ")",
        *(_input_line(i, w) for i, w in zip(spec.inputs, m.widths, strict=True)),
        f"  outputs   {m.out_width} value(s) per row from the model",
    ]
    for o in spec.outputs:
        lines.append(f"    {o.name:<12} {o.describe():<12} {o.arrow_type(m.out_width)}")
    scored = result.rows - len(result.rejected)
    lines.append(f"  dry run   {result.source}: {scored} scored, {len(result.rejected)} rejected")
    shown = [n for n in result.outputs]
    lines.append("    " + "  ".join(f"{n:>14}" for n in shown))
    for k in range(min(max_rows, scored)):
        lines.append("    " + "  ".join(f"{_fmt(result.outputs[n][k]):>14}" for n in shown))
    for row, reason in result.rejected[:max_rows]:
        lines.append(f"    row {row}: rejected: {reason}")
    for warning in result.warnings:
        lines.append(f"  WARNING   {warning}")
    return "\n".join(lines)
