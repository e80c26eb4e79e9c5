"""Bundles saved from Python: :func:`save_bundle` exports a ``torch.nn.Module`` and writes a
bundle the tool loads, or refuses.

It writes what a user would otherwise write by hand (``model.toml``, the exported program with
a dynamic batch dimension, one file per vocabulary) into a temporary folder next to the target,
loads that folder back exactly as a run would (:func:`pipeline.model.program.load_model`: the same
validation, the same dry run) and compares the loaded program's output with the eager module's
on the example. Only a bundle that passes is moved into place; anything else is a
:class:`~pipeline.core.errors.ModelError` and leaves nothing behind.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from pipeline.core.errors import ModelError
from pipeline.model import oov
from pipeline.model.bundle import BundleSpec, Inputs, as_inputs, parse_bundle_toml, read_bundle
from pipeline.model.inputs import DTYPES, NAMED_KEYS
from pipeline.model.program import LoadedModel, forget, forward, load_model, write_program_file
from pipeline.model.signature import call_order

logger = logging.getLogger(__name__)

#: Parity between the saved program and the eager module on the example (max |difference|).
DEFAULT_TOLERANCE = 1e-5


def _toml_value(v: Any) -> str:
    """A TOML value for the few types model.toml holds. JSON's string escapes are TOML's (and
    ``json.dumps`` writes no ``\\/``), so a JSON string is a valid TOML basic string."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise ModelError(f"save_bundle: cannot write {v!r} ({type(v).__name__}) into model.toml")


def _key(name: str) -> str:
    """A TOML key: bare when it can be, quoted otherwise."""
    bare = name and all(c.isalnum() or c in "-_" for c in name) and name.isascii()
    return name if bare else json.dumps(name, ensure_ascii=False)


def _vocabulary_files(
    inputs: Mapping[str, Mapping[str, Any]],
) -> tuple[dict[str, dict[str, Any]], dict[str, bytes]]:
    """The input tables with each vocabulary given as values (a list of strings) or as a file
    path replaced by a file name in the bundle, and those files' bytes."""
    tables: dict[str, dict[str, Any]] = {}
    files: dict[str, bytes] = {}
    for name, table in inputs.items():
        if not isinstance(table, Mapping):
            raise ModelError(
                f"save_bundle: inputs[{name!r}] must be a mapping of {', '.join(NAMED_KEYS)}"
            )
        t = dict(table)
        vocab = t.get("vocabulary")
        if isinstance(vocab, Path) or (isinstance(vocab, str) and Path(vocab).is_file()):
            src = Path(vocab)
            t["vocabulary"] = src.name
            files[src.name] = src.read_bytes()
        elif isinstance(vocab, Sequence) and not isinstance(vocab, str):
            wrong = [(i, v) for i, v in enumerate(vocab) if not isinstance(v, str)]
            if wrong:
                i, v = wrong[0]
                raise ModelError(
                    f"save_bundle: inputs[{name!r}] vocabulary values must be strings; value "
                    f"{i} is {v!r} ({type(v).__name__})"
                )
            values = list(vocab)
            bad = [v for v in values if "\n" in v or "\r" in v]
            if bad:
                raise ModelError(
                    f"save_bundle: inputs[{name!r}] vocabulary value {bad[0]!r} holds a line break"
                )
            file = f"vocabulary-{name}.txt"
            t["vocabulary"] = file
            files[file] = "".join(f"{v}\n" for v in values).encode()
        elif vocab is not None:
            raise ModelError(
                f"save_bundle: inputs[{name!r}] vocabulary must be a list of values or the path "
                f"of an existing file, not {vocab!r}"
            )
        tables[name] = t
    return tables, files


def bundle_toml(
    *,
    name: str,
    version: str,
    inputs: Mapping[str, Mapping[str, Any]],
    outputs: Mapping[str, str],
    description: str | None = None,
    file: str = "model.pt2",
) -> str:
    """``model.toml`` for an exported program with named inputs (declared order kept)."""
    lines = [
        "# Written by pipeline.save_bundle.",
        f"name = {_toml_value(name)}",
        f"version = {_toml_value(version)}",
        'format = "exported_program"',
        f"file = {_toml_value(file)}",
    ]
    if description:
        lines.append(f"description = {_toml_value(description)}")
    for input_name, table in inputs.items():
        lines += ["", f"[inputs.{_key(input_name)}]"]
        lines += [f"{_key(k)} = {_toml_value(v)}" for k, v in table.items()]
    lines += ["", "[outputs]"]
    lines += [f"{_key(k)} = {_toml_value(v)}" for k, v in outputs.items()]
    return "\n".join(lines) + "\n"


def _example(
    example: Inputs | torch.Tensor | Mapping[str, torch.Tensor], names: list[str]
) -> Inputs:
    """The example as one CPU tensor per input in declared order, with at least 2 rows (an
    export from 1 row would fix the batch size at 1)."""
    if isinstance(example, Mapping):
        missing = [n for n in names if n not in example]
        extra = sorted(set(example) - set(names))
        if missing or extra:
            raise ModelError(
                f"save_bundle: example names {sorted(example)}, inputs are {names}"
                + (f" (missing {missing})" if missing else "")
                + (f" (unknown {extra})" if extra else "")
            )
        xs = tuple(example[n] for n in names)
    else:
        xs = as_inputs(example)
    if len(xs) != len(names):
        raise ModelError(
            f"save_bundle: the example holds {len(xs)} tensor(s) for {len(names)} input(s) "
            f"({', '.join(names)})"
        )
    rows = {int(t.shape[0]) if t.dim() else -1 for t in xs}
    if len(rows) != 1 or min(rows) < 1:
        raise ModelError(
            "save_bundle: every example tensor needs the same number of rows (>= 1) in its "
            f"first dimension; got shapes {[tuple(t.shape) for t in xs]}"
        )
    # Cloned: torch.export.save keeps the example in the file, and a view (x[:64]) would take
    # its whole storage along (1.4 MB for the demo's 64-row slice of 20,000 rows).
    xs = tuple(t.detach().cpu().clone() for t in xs)
    if rows == {1}:
        xs = tuple(torch.cat([t, t]) for t in xs)
    return xs


def save_bundle(  # noqa: PLR0913 - keyword-only, each one a part of model.toml
    module: torch.nn.Module,
    path: str | Path,
    *,
    inputs: Mapping[str, Mapping[str, Any]],
    outputs: Mapping[str, str],
    example: Inputs | torch.Tensor | Mapping[str, torch.Tensor],
    name: str,
    version: str,
    description: str | None = None,
    overwrite: bool = False,
    tolerance: float = DEFAULT_TOLERANCE,
) -> BundleSpec:
    """Export ``module`` as a bundle at ``path`` (a local folder) and prove that it loads.

    ``inputs`` are the ``[inputs.<name>]`` tables of ``model.toml`` in the order the module
    takes them (or named as its ``forward`` parameters), e.g. ``{"numeric": {"columns": ["price",
    "rating"]}, "brand": {"column": "brand", "vocabulary": ["acme", "zenith"], "oov": 0}}``; a
    vocabulary is a list of values (written as ``vocabulary-<input>.txt``, value i on line i) or
    the path of an existing file. ``outputs`` are the ``[outputs]`` table (``{"score":
    "sigmoid"}``). ``example`` is one batch of real or typical inputs: a tensor per input, in
    order or by name. The module is exported with a dynamic batch dimension, the bundle is
    loaded back as a run loads it, and its output on ``example`` must equal the eager module's
    within ``tolerance``. Returns the bundle's spec; raises :class:`ModelError` (and writes
    nothing at ``path``) when any of that fails. An existing non-empty ``path`` is refused
    unless ``overwrite``.
    """
    target = Path(path)
    if target.exists() and (not target.is_dir() or any(target.iterdir())) and not overwrite:
        raise ModelError(f"save_bundle: {target} exists and is not empty (pass overwrite=True)")
    tables, files = _vocabulary_files(inputs)

    def toml_for(tables: dict[str, dict[str, Any]]) -> str:
        return bundle_toml(
            name=name, version=version, inputs=tables, outputs=outputs, description=description
        )

    spec = parse_bundle_toml(toml_for(tables).encode(), str(target))  # every problem, first
    xs = _example(example, [i.name for i in spec.inputs])
    _check_example_dtypes(spec, xs)
    tables = _with_list_dims(spec, tables, xs)
    toml_text = toml_for(tables)
    spec = parse_bundle_toml(toml_text.encode(), str(target))
    module = module.eval()
    program_args = tuple(xs[i] for i in call_order(spec, module))
    with torch.inference_mode():
        eager = _eager(module, program_args)
    ep = _export(module, program_args)
    target.parent.mkdir(parents=True, exist_ok=True)
    # A hidden sibling (mkdir, not mkdtemp: the bundle keeps the umask's permissions).
    staging = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        torch.export.save(ep, staging / "model.pt2")
        (staging / "model.toml").write_text(toml_text, encoding="utf-8")
        for file, data in files.items():
            (staging / file).write_bytes(data)
        loaded, warnings = _verify(staging, target, xs, eager, tolerance)
        # The program cache's entry, kept with the bundle: a machine that has never loaded it
        # (a fresh container each night) skips torch.export's loader too (docs/model-bundles.md).
        write_program_file(loaded, staging)
        if target.exists():
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        forget(str(staging))  # the staging folder is gone: its cached load is no use
    for warning in warnings:
        # Saved (the bundle loads and scores), but a run would score some rows wrongly.
        logger.warning("save_bundle: %s", warning)
    return read_bundle(str(target))[0]


def _export(module: torch.nn.Module, program_args: tuple[torch.Tensor, ...]) -> Any:
    """``module`` exported with a dynamic batch dimension (:class:`ModelError` if it cannot)."""
    batch = torch.export.Dim("batch", min=1)
    try:
        return torch.export.export(
            module, program_args, dynamic_shapes=tuple({0: batch} for _ in program_args)
        )
    except Exception as e:
        raise ModelError(
            f"save_bundle: torch.export could not export the module with a dynamic batch "
            f"dimension: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from e


def _with_list_dims(
    spec: BundleSpec, tables: dict[str, dict[str, Any]], xs: Inputs
) -> dict[str, dict[str, Any]]:
    """``tables`` with each list column's width, from the example, written down: then a shard
    whose lists are another size is that shard's schema problem (named, skippable), whatever
    the format, and the bundle loads without data."""
    out = dict(tables)
    for inp, x in zip(spec.inputs, xs, strict=True):
        if inp.column is not None and inp.fixed_width() is None and x.dim() == 2:
            out[inp.name] = {**out[inp.name], "dim": int(x.shape[1])}
    return out


def _verify(
    staging: Path, target: Path, xs: Inputs, eager: torch.Tensor, tolerance: float
) -> tuple[LoadedModel, list[str]]:
    """Load the staged bundle as a run does and hold it to the eager module's output; the
    loaded bundle, and the warnings a run would give (:func:`pipeline.model.oov.check`), naming
    the target."""
    widths = tuple(0 if t.dim() == 1 else int(t[0].numel()) for t in xs)
    try:
        loaded = load_model(str(staging), "cpu", widths=widths)
        with torch.inference_mode():
            got = forward(loaded, xs).float()
    except ModelError as e:  # name the bundle being saved, not its staging folder
        raise ModelError(str(e).replace(str(staging), str(target))) from e
    try:
        oov.check_declared_ranges(loaded)  # ids the bundle declares valid must not crash it
        warnings = oov.check(loaded)  # and unseen values must not borrow a real value's id
    except ModelError as e:
        raise ModelError(str(e).replace(str(staging), str(target))) from e
    if got.shape != eager.shape:
        raise ModelError(
            f"save_bundle: the saved program gives shape {tuple(got.shape)}, the module "
            f"{tuple(eager.shape)}"
        )
    diff = _max_difference(got, eager)
    if not diff <= tolerance:
        raise ModelError(
            f"save_bundle: the saved program differs from the module by up to {diff:.3g} "
            f"on the example (tolerance {tolerance:g}"
            + ("; inf: NaN or inf on one side only" if math.isinf(diff) else "")
            + "); nothing was saved"
        )
    return loaded, [w.replace(str(staging), str(target)) for w in warnings]


def _max_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want|, where NaN on both sides (a model that gives NaN for some rows)
    and the same infinity agree, and NaN or inf on one side only is an infinite difference."""
    if not got.numel():
        return 0.0
    agree = (got == want) | (got.isnan() & want.isnan())
    delta = torch.where(agree, torch.zeros_like(got), (got - want).abs())
    return float(torch.nan_to_num(delta, nan=math.inf, posinf=math.inf).max())


def _check_example_dtypes(spec: BundleSpec, xs: Inputs) -> None:
    """Each example tensor in its input's dtype: the program is exported for the dtypes it is
    shown, and a run feeds the declared ones."""
    bad = [
        f"{inp.name!r} is {str(x.dtype).removeprefix('torch.')}, declared {inp.dtype}"
        for inp, x in zip(spec.inputs, xs, strict=True)
        if x.dtype != DTYPES[inp.dtype]
    ]
    if bad:
        raise ModelError(
            "save_bundle: give the example in the declared dtypes (a run feeds those): "
            + "; ".join(bad)
        )


def _eager(module: torch.nn.Module, args: Inputs) -> torch.Tensor:
    try:
        out = module(*args)
    except Exception as e:
        raise ModelError(
            f"save_bundle: the module raised on the example: {type(e).__name__}: {e}"
        ) from e
    if isinstance(out, (tuple, list)) and len(out) == 1:
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise ModelError(
            f"save_bundle: the module returned {type(out).__name__}; a bundle's model returns "
            "one tensor (batch, values)"
        )
    return (out.unsqueeze(1) if out.dim() == 1 else out).float()
