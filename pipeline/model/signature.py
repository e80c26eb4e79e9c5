"""What a loaded program says of itself, against what its bundle declares: parameter names
(they may order the inputs), input dtypes and shapes and the batch bound an exported program
records, and the width of each input (``model.toml``, the program, or the data). Problems are
said per input, naming the key to set in ``model.toml``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from pipeline.core.errors import ModelError
from pipeline.model import programcache
from pipeline.model.bundle import EXPORT_HINT, BundleSpec
from pipeline.model.inputs import DTYPES


def parameter_names(module: Any) -> list[str] | None:
    """The names of the program's inputs, in call order: an exported program's keep the
    original ``forward``'s, TorchScript's are in its schema. None when they cannot be read."""
    facts = programcache.facts_of(module)
    if facts is not None:
        return None if facts.parameter_names is None else list(facts.parameter_names)
    schema = getattr(getattr(module, "forward", None), "schema", None)
    if schema is not None:  # TorchScript
        return [a.name for a in schema.arguments[1:]]
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError, AttributeError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in params if p.kind in kinds]
    return names if len(names) == len(params) else None


def program_inputs(module: Any) -> list[tuple[torch.dtype, tuple[int | None, ...]]] | None:
    """An exported program's inputs as it was exported: (dtype, shape with None for a dynamic
    size) each, in call order. None for programs that do not record them (TorchScript)."""
    facts = programcache.facts_of(module)
    if facts is not None:
        if facts.inputs is None:
            return None
        return [(getattr(torch, d.removeprefix("torch.")), shape) for d, shape in facts.inputs]
    if not isinstance(module, torch.fx.GraphModule):
        return None
    found: list[tuple[torch.dtype, tuple[int | None, ...]]] = []
    for node in module.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return None
        found.append((val.dtype, tuple(d if isinstance(d, int) else None for d in val.shape)))
    return found


def program_max_batch(module: Any) -> int | None:
    """The largest batch an exported program was exported for (the upper bound its range
    constraints give the batch dimension of its inputs), or None for no bound.

    Calls skip the program's own input checks (see :func:`load_model`), and a program may be
    specialised for the range it was exported with: past the bound, it may compute something
    else without a word. So the run refuses batch sizes beyond it instead.
    """
    facts = programcache.facts_of(module)
    if facts is not None:
        return facts.max_batch
    ranges = getattr(module, "range_constraints", None)
    if not isinstance(module, torch.fx.GraphModule) or not ranges:
        return None
    bound: int | None = None
    for node in module.graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" else None
        if not isinstance(val, torch.Tensor) or not val.shape:
            continue
        rows = val.shape[0]
        expr = getattr(getattr(rows, "node", None), "expr", None)
        vr = ranges.get(expr) if expr is not None else None
        upper: Any = getattr(vr, "upper", None)
        # torch's int_oo (no bound) is a sympy object that int() refuses in its own way.
        finite = isinstance(upper, int) or getattr(upper, "is_Integer", False) is True
        top = int(upper) if finite and upper is not None else None
        if top is not None and top < 2**62:
            bound = top if bound is None else min(bound, top)
    return bound


def call_order(spec: BundleSpec, module: Any) -> tuple[int, ...]:
    """How the declared inputs map to the program's parameters: by name when the program's
    parameter names are exactly the input names, in declared order when no input is named
    like a parameter. Anything in between is refused (:class:`ModelError`): an input named
    like a parameter it would not feed (``seller`` declared first, ``forward(brand,
    seller)``) is a silent swap waiting to happen."""
    n = len(spec.inputs)
    if n == 1:
        return (0,)
    names = parameter_names(module)
    declared = [i.name for i in spec.inputs]
    if names is None:
        return tuple(range(n))
    if sorted(names) == sorted(declared):
        return tuple(declared.index(name) for name in names)
    misplaced = [
        (name, pos, names.index(name))
        for pos, name in enumerate(declared)
        if name in names and names.index(name) != pos
    ]
    if misplaced:
        name, pos, at = misplaced[0]
        raise ModelError(
            f"model bundle {spec.uri}: input {name!r} is declared {_nth(pos)}, but the "
            f"program's parameter {name!r} is its {_nth(at)} (forward({', '.join(names)})); "
            f"the inputs ({', '.join(declared)}) are passed in declared order unless they are "
            "named exactly as the parameters. Name every input as the parameter it feeds, or "
            "declare them in the program's order."
        )
    return tuple(range(n))


def _nth(i: int) -> str:
    return {0: "first", 1: "second", 2: "third"}.get(i, f"number {i + 1}")


def signature_problems(
    spec: BundleSpec, module: Any, widths: tuple[int, ...], order: tuple[int, ...]
) -> list[str]:
    """How the declared inputs differ from what the exported program records (dtype, rank,
    the sizes after the batch dimension), one line per input."""
    found = program_inputs(module)
    if found is None or len(spec.inputs) == 0:
        return []
    if len(found) != len(spec.inputs):
        names = parameter_names(module)
        return [
            f"the program takes {len(found)} input(s)"
            + (f" ({', '.join(names)})" if names else "")
            + f" but model.toml declares {len(spec.inputs)} "
            f"({', '.join(i.name for i in spec.inputs)})"
        ]
    static = [shape[0] for _, shape in found if shape and shape[0] is not None]
    if static:
        return [
            f"the program was exported with a static batch size of {static[0]} rows, so it "
            f"cannot score batches of any other size. Re-{EXPORT_HINT}"
        ]
    problems = []
    for pos, (dtype, shape) in zip(order, found, strict=True):
        inp, width = spec.inputs[pos], widths[pos]
        want = (None,) if width == 0 else (None, width)
        dims_ok = len(shape) == len(want) and all(
            s is None or w is None or s == w for s, w in zip(shape[1:], want[1:], strict=True)
        )
        if dtype != DTYPES[inp.dtype] or not dims_ok:
            took = (
                "("
                + ", ".join(["batch", *(str(d) for d in shape[1:])])
                + ("," if len(shape) == 1 else "")
                + ")"
            )
            problems.append(
                f"{inp.describe()} gives {inp.dtype} {inp.shape_text(width)}, but the program's "
                f"input {pos + 1} takes {str(dtype).removeprefix('torch.')} {took}"
            )
    return problems


def program_widths(spec: BundleSpec, module: Any) -> tuple[int | None, ...]:
    """Per input, the values per row an exported program records for it (0 for a (batch,)
    input, n for a static (batch, n)); None where it records none (TorchScript, a dynamic
    size). Lets a bundle whose ``column`` inputs have no ``dim`` load without data."""
    found = program_inputs(module)
    if found is None or len(found) != len(spec.inputs):
        return tuple(None for _ in spec.inputs)
    widths: list[int | None] = [None] * len(spec.inputs)
    for pos, (_, shape) in zip(call_order(spec, module), found, strict=True):
        if len(shape) == 1:
            widths[pos] = 0
        elif len(shape) == 2:
            widths[pos] = shape[1]
    return tuple(widths)


def input_widths(
    spec: BundleSpec,
    widths: tuple[int | None, ...] | None,
    uri: str,
    recorded: tuple[int | None, ...] | None = None,
) -> tuple[int, ...]:
    """Each input's values per row: from ``model.toml``; where it leaves one open, from what
    the exported program records (``recorded``: :func:`program_widths`); else from ``widths``
    (what the data gives: pipeline.driver.inspect; None where it says nothing). The program wins
    over the data: a shard whose lists are another size is then a schema problem of that
    shard (named, and skippable), not of the bundle. A declared width the data contradicts is
    a ModelError."""
    if widths is not None and len(widths) != len(spec.inputs):
        raise ModelError(
            f"model bundle {uri}: {len(widths)} input widths given for {len(spec.inputs)} inputs"
        )
    out = []
    for k, inp in enumerate(spec.inputs):
        fixed = inp.fixed_width()
        given = widths[k] if widths is not None else None
        rec = recorded[k] if recorded is not None else None
        if fixed is not None and given is not None and given != fixed:
            raise ModelError(
                f"model bundle {uri}: {inp.describe()} declares {fixed} features per row "
                f"but the data has {given}"
            )
        w = fixed if fixed is not None else rec if rec is not None else given
        if w is None:
            what = "inputs.column" if inp.legacy else inp.describe()
            key = "inputs.dim" if inp.legacy else f"inputs.{inp.name}.dim"
            raise ModelError(
                f"model bundle {uri}: {what} needs {key}, or data to take it from (run and "
                "plan read it from the shards' footers; bundle check and bench take --input)"
            )
        out.append(w)
    return tuple(out)
