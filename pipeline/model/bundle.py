"""Model bundles: ``model.toml`` plus one weights file, loaded without unpickling arbitrary objects.

A bundle declares its inputs (:mod:`pipeline.model.inputs`: one tensor built from numeric columns or
a list column, or several named, typed tensors, with vocabularies for string columns) and its
outputs (output column name -> how it is derived from the model's output row). Loading checks
the declared inputs against the program's own signature where it has one (an exported program
records each input's dtype and shape) and runs the model on 1 and 2 rows before any data is
scored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import io
import logging
import operator
import re
import sys
import threading
import warnings
import weakref
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import torch

from pipeline.core.errors import ConfigError, ModelError
from pipeline.io import listing, storage
from pipeline.model import programcache
from pipeline.model.inputs import DTYPES, InputSpec, example_tensor, parse_inputs, parse_vocabulary

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

logger = logging.getLogger(__name__)

FORMATS = ("exported_program", "torchscript")
_TRANSFORM_RE = re.compile(r"^(softmax|sigmoid):(\d+)$|^(sigmoid|argmax|raw)$")
_BUNDLE_KEYS = {"name", "version", "format", "file", "inputs", "outputs", "description"}
EXPORT_HINT = (
    "export it with a dynamic batch dimension: "
    "ep = torch.export.export(model.eval(), (torch.zeros(2, N),), "
    "dynamic_shapes=({0: torch.export.Dim('batch', min=1)},)); torch.export.save(ep, 'model.pt2'); "
    'then set format = "exported_program" and file = "model.pt2" in model.toml'
)


@dataclass(frozen=True)
class OutputSpec:
    """One output column: its name and the transform of the model's output row."""

    name: str
    transform: str  # softmax, sigmoid, argmax or raw
    index: int | None = None

    def describe(self) -> str:
        return self.transform if self.index is None else f"{self.transform}:{self.index}"

    def arrow_type(self, width: int) -> pa.DataType:
        if self.transform == "argmax":
            return pa.int64()
        if self.transform == "raw" and width > 1:
            return pa.list_(pa.float32(), width)
        return pa.float32()


#: A model's inputs for a batch: one tensor per declared input, in declared order.
Inputs = tuple[torch.Tensor, ...]


def as_inputs(xs: Inputs | torch.Tensor) -> Inputs:
    """``xs`` as a tuple: a single-input model's tensor may be given alone."""
    return (xs,) if isinstance(xs, torch.Tensor) else tuple(xs)


def rows_of(xs: Inputs) -> int:
    """The number of rows in a batch of inputs."""
    return int(xs[0].shape[0]) if xs else 0


@dataclass(frozen=True)
class BundleSpec:
    """What ``model.toml`` declares."""

    uri: str
    name: str
    version: str
    format: str
    file: str
    inputs: tuple[InputSpec, ...]
    outputs: tuple[OutputSpec, ...]

    @property
    def input_columns(self) -> tuple[str, ...]:
        """Columns the model reads, in order, each once."""
        return tuple(dict.fromkeys(c for i in self.inputs for c in i.source_columns))

    @property
    def single(self) -> InputSpec | None:
        """The one input of a single-input bundle (None with several)."""
        return self.inputs[0] if len(self.inputs) == 1 else None

    # The single input's source, for code that handles one float32 tensor (benchmarks).
    @property
    def columns(self) -> tuple[str, ...] | None:
        return self.single.columns if self.single is not None else None

    @property
    def column(self) -> str | None:
        return self.single.column if self.single is not None else None

    @property
    def dim(self) -> int | None:
        return self.single.dim if self.single is not None else None

    def describe_inputs(self) -> str:
        return "; ".join(i.describe() for i in self.inputs)


def parse_bundle_toml(raw: bytes, uri: str) -> BundleSpec:
    """Validate ``model.toml``; every problem is reported at once."""
    where = f"{uri}/model.toml"
    try:
        doc = tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"model bundle {where} is not valid TOML: {e}") from e
    p = _header_problems(doc)
    inputs = parse_inputs(doc.get("inputs"), p)
    outputs = _parse_outputs(doc.get("outputs"), p)
    if p:
        raise ModelError(f"model bundle {where} is invalid:\n" + "\n".join(f"  - {x}" for x in p))
    return BundleSpec(
        uri=uri,
        name=doc["name"],
        version=doc["version"],
        format=doc["format"],
        file=doc["file"],
        inputs=inputs,
        outputs=tuple(outputs),
    )


def _header_problems(doc: Mapping[str, Any]) -> list[str]:
    """Problems with the bundle's top-level keys (name, version, format, file)."""
    p = [
        f"unknown key {key!r}; known keys: {', '.join(sorted(_BUNDLE_KEYS))}"
        for key in sorted(set(doc) - _BUNDLE_KEYS)
    ]
    for key in ("name", "version", "format", "file"):
        if not isinstance(doc.get(key), str) or not doc.get(key):
            p.append(f"{key} must be a non-empty string")
    f = doc.get("file")
    if isinstance(f, str) and (f.startswith("/") or ".." in f.split("/") or "://" in f):
        p.append(f"file = {f!r} must be a file name inside the bundle directory")
    fmt = doc.get("format")
    if fmt in ("pickle", "state_dict", "torch_save"):
        p.append(
            f"format = {fmt!r} is refused: pickles can run arbitrary code on load; {EXPORT_HINT}"
        )
    elif isinstance(fmt, str) and fmt not in FORMATS:
        p.append(f"format = {fmt!r} is not one of {', '.join(FORMATS)}")
    return p


def _parse_outputs(raw: Any, p: list[str]) -> list[OutputSpec]:
    """``[outputs]`` in declaration order; problems are appended to ``p``."""
    if not isinstance(raw, Mapping) or not raw:
        p.append('[outputs] table is required, e.g. score = "softmax:1"')
        return []
    outputs: list[OutputSpec] = []
    for name, how in raw.items():
        m = _TRANSFORM_RE.match(how) if isinstance(how, str) else None
        if m is None:
            p.append(
                f"outputs.{name} = {how!r} is not one of softmax:K, sigmoid, sigmoid:K, argmax, raw"
            )
        elif m.group(1):
            outputs.append(OutputSpec(name, m.group(1), int(m.group(2))))
        else:
            outputs.append(OutputSpec(name, m.group(3)))
    return outputs


@dataclass
class LoadedModel:
    """A bundle loaded on a device, checked by its dry runs."""

    spec: BundleSpec
    sha256: str
    module: Any
    device: torch.device
    widths: tuple[int, ...]  # per input: values per row (0: a (batch,) input)
    out_width: int  # values per output row
    # Position of each program parameter in the declared inputs: the program is called with
    # ``inputs[order[0]], inputs[order[1]], ...`` (its parameter names may order them).
    order: tuple[int, ...] = (0,)
    # The most rows one call may have: the batch dimension's upper bound an exported program
    # records (torch.export.Dim("batch", max=...)); None when it has none.
    max_batch: int | None = None

    @property
    def width(self) -> int:
        """Values per row of a single-input model (benchmarks, tests)."""
        return self.widths[0] if len(self.widths) == 1 else sum(max(1, w) for w in self.widths)

    def example(
        self, rows: int, *, random: bool = False, device: torch.device | str | None = None
    ) -> Inputs:
        """Inputs of ``rows`` rows on ``device`` (default: the model's): zeros, or random
        values each input can hold (see :func:`pipeline.model.inputs.example_tensor`)."""
        dev = self.device if device is None else device
        return tuple(
            example_tensor(i, w, rows, random=random, device=dev)
            for i, w in zip(self.spec.inputs, self.widths, strict=True)
        )


def resolve_device(requested: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; an unavailable device is a clear error."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(requested)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device {requested!r} is not available on this machine "
                "(torch.cuda.is_available() is False); use --device cpu or --device auto"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(
                f"device {requested!r} does not exist: this machine has "
                f"{torch.cuda.device_count()} CUDA device(s)"
            )
    return dev


def read_bundle(
    uri: str, options: Mapping[str, Any] | None = None
) -> tuple[BundleSpec, bytes, str]:
    """Read ``model.toml`` and the weights; returns (spec, weights bytes, SHA-256).

    The SHA-256 is taken over the bytes of ``model.toml`` followed by the weights file's bytes.
    """
    root = storage.locate(uri, options)
    toml_loc = root.child("model.toml")
    try:
        raw = storage.read_bytes(toml_loc)
    except (FileNotFoundError, NotADirectoryError) as e:
        if isinstance(e, NotADirectoryError) or storage.is_file(root):
            raise _file_not_bundle(uri, options) from None
        if not storage.exists(root):
            # A typo in the path, not a folder that lacks its model.toml: say which.
            raise ModelError(
                f"model bundle {uri} does not exist{listing.missing_hint(root)} (a bundle is a "
                "directory holding model.toml and one weights file)"
            ) from None
        raise ModelError(
            f"model bundle {uri} has no model.toml (a bundle is a directory holding model.toml "
            "and one weights file)"
        ) from None
    spec = parse_bundle_toml(raw, uri)
    w_loc = root.child(spec.file)
    try:
        weights = storage.read_bytes(w_loc)
    except FileNotFoundError:
        raise ModelError(f"model bundle {uri}: weights file {spec.file!r} does not exist") from None
    spec, vocab_bytes = _with_vocabularies(spec, root)
    sha = hashlib.sha256(raw + weights + vocab_bytes).hexdigest()
    return spec, weights, sha


def _with_vocabularies(spec: BundleSpec, root: storage.Location) -> tuple[BundleSpec, bytes]:
    """``spec`` with each vocabulary file's values read in, and those files' bytes (in input
    order) for the bundle's SHA-256: a changed vocabulary is a changed model."""
    if not any(i.vocabulary for i in spec.inputs):
        return spec, b""
    inputs, raw, problems = [], b"", []
    for inp in spec.inputs:
        if inp.vocabulary is None:
            inputs.append(inp)
            continue
        where = f"model bundle {spec.uri}: vocabulary {inp.vocabulary} of input {inp.name!r}"
        try:
            data = storage.read_bytes(root.child(inp.vocabulary))
        except FileNotFoundError:
            problems.append(f"{where} does not exist")
            continue
        values, bad = parse_vocabulary(data, inp, where)
        problems += bad
        raw += data
        inputs.append(dataclasses.replace(inp, vocab=values))
    if problems:
        raise ModelError("\n".join(problems))
    return dataclasses.replace(spec, inputs=tuple(inputs)), raw


def _file_not_bundle(uri: str, options: Mapping[str, Any] | None) -> ConfigError:
    """``--model`` names a file (the weights, model.toml) where the bundle folder is expected."""
    parent = uri.rstrip("/").rpartition("/")[0]
    hint = "give the folder holding model.toml and the weights file"
    if parent and storage.exists(storage.locate(parent, options).child("model.toml")):
        hint = f"give its folder, the bundle: --model {parent}"
    return ConfigError(f"model = {uri!r} is a file, not a model bundle folder; {hint}")


def _looks_like_pickle(weights: bytes) -> bool:
    try:
        with zipfile.ZipFile(io.BytesIO(weights)) as z:
            names = z.namelist()
    except zipfile.BadZipFile:
        # Legacy (pre-1.6) torch.save files are bare pickles: protocol 2+ starts with 0x80.
        return weights[:1] == b"\x80"
    has_pickle = any(n.endswith("/data.pkl") for n in names)
    is_script = any("/code/" in n for n in names)
    is_export = any(n.endswith(".json") and "models/" in n for n in names)
    return has_pickle and not is_script and not is_export


def _deserialize(spec: BundleSpec, weights: bytes, device: torch.device) -> Any:
    where = f"model bundle {spec.uri} ({spec.file}, format {spec.format})"
    if _looks_like_pickle(weights):
        raise ModelError(
            f"{where}: the weights file is a pickled object (torch.save of a module or "
            "state_dict), which is refused because unpickling can run arbitrary code; "
            + EXPORT_HINT
        )
    if spec.format == "exported_program" and not zipfile.is_zipfile(io.BytesIO(weights)):
        # torch.export.load would log its own traceback before failing on it.
        raise ModelError(
            f"{where}: cannot load the weights file: it is not a torch.export archive (not a "
            "zip file; truncated, or another format?)"
        )
    ep = None
    try:
        if spec.format == "exported_program":
            ep = torch.export.load(io.BytesIO(weights))
            module = ep.module()
        else:
            # Deprecated in torch 2.13 but still the only safe loader for older models; say so
            # once in the log rather than as a warning that -W error would turn into a failure.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                module = torch.jit.load(  # type: ignore[no-untyped-call]
                    io.BytesIO(weights), map_location="cpu"
                )
            logger.warning(
                "model bundle %s is TorchScript, which torch deprecates; re-export it with "
                "torch.export when you can",
                spec.uri,
            )
    except Exception as e:
        raise ModelError(f"{where}: cannot load the weights file: {e}") from e
    try:
        module = module.to(device)
    except Exception as e:  # exported modules may refuse .to() on older torch
        raise ModelError(f"{where}: cannot move the model to {device}: {e}") from e
    if hasattr(module, "eval") and spec.format != "exported_program":
        module.eval()
    if ep is not None:
        graph_call = _graph_call(ep, module)
        if graph_call is not None:
            _GRAPH_CALLS[module] = graph_call  # until the dry run finds it differs (_dry_run)
    return module


# An exported program's module, called the way ``ExportedProgram.module()`` does it, pays for a
# pytree flatten of its arguments, nested attribute lookups of every weight, a guard module and
# three hooks on each call: 43 us against 19 us for the eager module at batch 1 here. Calling
# the program's own graph with the module's weights as arguments does the same aten ops, in
# the same order, on the same tensors, in 14-19 us. Kept per module object, so a wrapper
# (precision's autocast, torch.compile) never takes the graph call of what it wraps by mistake.
_GRAPH_CALLS: weakref.WeakKeyDictionary[Any, programcache.GraphCall] = weakref.WeakKeyDictionary()


def _graph_call(ep: Any, module: Any) -> programcache.GraphCall | None:
    """``graph(*weights, *inputs)`` for a program whose signature is only weights (parameters,
    buffers, constant tensors) then tensor inputs, and tensor outputs (no mutation, no token,
    no custom object); None for any other, which keeps the module's own call."""
    from torch.export.graph_signature import InputKind, OutputKind, TensorArgument

    lifted = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
    specs = list(ep.graph_signature.input_specs)
    n_user = sum(s.kind == InputKind.USER_INPUT for s in specs)
    weights, user = specs[: len(specs) - n_user], specs[len(specs) - n_user :]
    if any(s.kind not in lifted for s in weights) or any(
        s.kind != InputKind.USER_INPUT or not isinstance(s.arg, TensorArgument) for s in user
    ):
        return None
    if any(o.kind != OutputKind.USER_OUTPUT for o in ep.graph_signature.output_specs):
        return None
    try:  # the module's own tensors (moved to the device with it), by their dotted names
        tensors = tuple(operator.attrgetter(s.target)(module) for s in weights)
    except AttributeError:
        return None
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    targets = tuple(str(s.target) for s in weights)
    parameters = tuple(s.kind == InputKind.PARAMETER for s in weights)
    return programcache.GraphCall(ep.graph_module, tensors, targets, parameters)


def callable_of(module: Any) -> Callable[..., Any]:
    """What calling ``module`` runs: its program's graph where :func:`_graph_call` gave one
    and the dry run confirmed it, else the module itself."""
    try:
        call: Callable[..., Any] = _GRAPH_CALLS.get(module, module)
    except TypeError:  # an object that cannot be weakly referenced has no graph call
        call = module
    return call


class NotOneTensor(TypeError):
    """The model returned something other than one tensor (or a 1-tuple of one)."""


def _what_it_returned(out: Any) -> str:
    if isinstance(out, (tuple, list)):
        kinds = ", ".join(sorted({type(o).__name__ for o in out})) or "nothing"
        what = f"a {type(out).__name__} of {len(out)} ({kinds})"
        return f"the model returned {what}, expected one tensor"
    if isinstance(out, dict):
        return f"the model returned a dict (keys {', '.join(map(str, out))}), expected one tensor"
    return f"the model returned {type(out).__name__}, expected one tensor"


def _forward(
    module: Any, xs: Inputs, order: tuple[int, ...], *, graph: bool = True
) -> torch.Tensor:
    call = callable_of(module) if graph else module
    out = call(*(xs[i] for i in order))
    if isinstance(out, (tuple, list)) and len(out) == 1:
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise NotOneTensor(_what_it_returned(out))
    if out.dim() == 1:
        out = out.unsqueeze(1)
    return out


def forward(model: LoadedModel, xs: Inputs | torch.Tensor) -> torch.Tensor:
    """The model's output for one batch of inputs (one tensor per declared input, in declared
    order; a single-input model also takes its tensor alone), as (batch, out_width)."""
    return _forward(model.module, as_inputs(xs), model.order)


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


def check_batch_size(model: LoadedModel, batch_size: int) -> None:
    """Refuse a batch size beyond what the model's program was exported for (ConfigError)."""
    if model.max_batch is not None and batch_size > model.max_batch:
        raise ConfigError(
            f"batch size {batch_size:,} is more than model bundle {model.spec.uri} takes: its "
            f"program was exported for batches of at most {model.max_batch:,} rows "
            f"(torch.export.Dim max). Set --batch-size {model.max_batch} or less, or re-export "
            "with a larger max."
        )


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


def _signature_problems(
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


def _dry_run(
    spec: BundleSpec, module: Any, widths: tuple[int, ...], device: torch.device
) -> tuple[int, tuple[int, ...]]:
    """Run the model on 1 and 2 rows of zeros; (values per output row, call order)."""
    where = f"model bundle {spec.uri} ({spec.describe_inputs()})"
    order = call_order(spec, module)
    problems = _signature_problems(spec, module, widths, order)
    if problems:
        raise ModelError(
            f"model bundle {spec.uri}: the declared inputs do not fit the model:\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\nFix [inputs] in model.toml (or re-export the model)."
        )
    outs: list[torch.Tensor] = []
    for rows in (1, 2):
        xs = tuple(
            example_tensor(i, w, rows, random=False, device=device)
            for i, w in zip(spec.inputs, widths, strict=True)
        )
        try:
            with torch.inference_mode():
                y = _forward(module, xs, order, graph=False)
        except NotOneTensor as e:
            raise ModelError(
                f"model bundle {spec.uri}: {e}. A bundle's model returns one (batch, n) tensor "
                "(its [outputs] are taken from its columns); re-export it returning that tensor"
            ) from e
        except Exception as e:
            text = str(e).splitlines()[0] if str(e) else type(e).__name__
            if rows == 2 and outs:
                raise ModelError(
                    f"{where}: the model accepts 1 row but not 2 ({text}); its batch dimension "
                    f"is static. Re-{EXPORT_HINT}"
                ) from e
            given = ", ".join(f"{tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}" for x in xs)
            raise ModelError(
                f"{where}: the model rejected input of {given} built from the declared inputs: "
                f"{text}. Check that the bundle's inputs match what the model was exported with."
            ) from e
        if y.shape[0] != rows:
            raise ModelError(
                f"{where}: a {rows}-row input gave an output of shape {tuple(y.shape)}; the "
                f"first dimension must be the batch. Re-{EXPORT_HINT}"
            )
        outs.append(y)
        _confirm_graph_call(module, xs, order, y)
    out_width = int(outs[0].shape[1])
    _check_outputs(spec, out_width)
    return out_width, order


def _confirm_graph_call(module: Any, xs: Inputs, order: tuple[int, ...], y: torch.Tensor) -> None:
    """Keep ``module``'s graph call only if it gives exactly the module's own output ``y``."""
    if callable_of(module) is module:
        return
    try:
        with torch.inference_mode():
            same = torch.equal(_forward(module, xs, order), y)
    except Exception as e:
        logger.debug("calling the program's graph directly failed (%s); using its module", e)
        same = False
    if not same:
        del _GRAPH_CALLS[module]


def _check_outputs(spec: BundleSpec, out_width: int) -> None:
    for o in spec.outputs:
        if o.transform == "softmax" and (out_width < 2 or (o.index or 0) >= out_width):
            raise ModelError(
                f"model bundle {spec.uri}: outputs.{o.name} = {o.describe()!r} needs at least "
                f"{max(2, (o.index or 0) + 1)} values per output row, but the model gives "
                f"{out_width}"
            )
        if o.transform == "sigmoid" and (
            (o.index is None and out_width != 1) or (o.index or 0) >= out_width
        ):
            raise ModelError(
                f"model bundle {spec.uri}: outputs.{o.name} = {o.describe()!r} does not fit a "
                f"model with {out_width} values per output row (use sigmoid:K to pick one)"
            )
        if o.transform == "argmax" and out_width < 2:
            raise ModelError(
                f"model bundle {spec.uri}: outputs.{o.name} = 'argmax' needs at least 2 values "
                f"per output row, but the model gives {out_width}"
            )


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


_CACHE: dict[tuple[str, str, str, tuple[int, ...]], LoadedModel] = {}
_CACHE_LOCK = threading.Lock()


def load_model(
    uri: str,
    device: str | torch.device = "cpu",
    *,
    widths: tuple[int | None, ...] | None = None,
    options: Mapping[str, Any] | None = None,
    expected_sha256: str | None = None,
) -> LoadedModel:
    """Load and dry-run a bundle, once per process for each (bundle, device, content).

    ``widths`` (values per row of each input) is needed only for a ``column`` input without
    ``dim``: it comes from the data. ``expected_sha256`` makes a worker refuse a bundle that
    changed after the run started.
    """
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    if expected_sha256 is not None and widths is not None and None not in widths:
        # A worker asking for the bundle the run planned with: reuse it without reading and
        # hashing the weights again for every shard.
        with _CACHE_LOCK:
            known = tuple(w for w in widths if w is not None)
            hit = _CACHE.get((uri, str(dev), expected_sha256, known))
        if hit is not None:
            return hit
    spec, weights, sha = read_bundle(uri, options)
    if expected_sha256 is not None and sha != expected_sha256:
        raise ModelError(
            f"model bundle {uri} changed while the run was going on (SHA-256 {sha[:12]} instead "
            f"of {expected_sha256[:12]}); rerun the job"
        )
    module, kept = None, False
    if any(i.fixed_width() is None for i in spec.inputs):
        # An open width: what the program records comes before what the data gives.
        module, kept = _module_of(spec, weights, sha, dev)
        w = input_widths(spec, widths, uri, program_widths(spec, module))
    else:
        w = input_widths(spec, widths, uri)
    key = (uri, str(dev), sha, w)
    with _CACHE_LOCK:
        cached = _CACHE.get(key)
        if cached is not None:
            return cached
        if module is None:
            module, kept = _module_of(spec, weights, sha, dev)
        out_width, order = _dry_run(spec, module, w, dev)
        if not kept:
            _keep(spec, sha, module, w, order)
        if getattr(module, "validate_inputs", None) is True:
            # An exported program checks every call's inputs against its signature (pytree
            # spec, dtypes, shape guards): about 30 us a call here, 40% of a small batch's
            # call. The signature check and the dry run above did that once, and every batch
            # is built from the same declared inputs and widths.
            module.validate_inputs = False
        loaded = LoadedModel(
            spec, sha, module, dev, w, out_width, order, max_batch=program_max_batch(module)
        )
        _CACHE[key] = loaded
        logger.info(
            "loaded model %s v%s (%s) on %s%s",
            spec.name,
            spec.version,
            sha[:12],
            dev,
            " from the program cache" if kept else "",
        )
        return loaded


def _module_of(
    spec: BundleSpec, weights: bytes, sha: str, device: torch.device
) -> tuple[Any, bool]:
    """The bundle's module on ``device``, and whether it came from the program cache
    (:mod:`pipeline.model.programcache`: a bundle loaded before, without torch.export's loader)."""
    if spec.format == "exported_program":
        kept = programcache.load(sha)
        if kept is not None:
            try:
                module = kept.module.to(device)
            except Exception as e:
                logger.debug("the cached program would not move to %s (%s)", device, e)
            else:
                _GRAPH_CALLS[module] = programcache.call_of(kept)
                return module, True
    return _deserialize(spec, weights, device), False


def _keep(
    spec: BundleSpec, sha: str, module: Any, widths: tuple[int, ...], order: tuple[int, ...]
) -> None:
    """Save a program whose graph the dry run confirmed to the program cache, with a probe:
    8 random rows (seeded, not touching the caller's random state) and the outputs they give."""
    call = _GRAPH_CALLS.get(module)
    if call is None:  # not a plain program, or its graph call differed from the module
        return
    out_spec = getattr(module, "_out_spec", None)
    if out_spec is None or not out_spec.is_leaf():
        return  # not one bare tensor out (a tuple, a dict): rebuilt, it would return another
    names = parameter_names(module)
    found = program_inputs(module)
    facts = programcache.ProgramFacts(
        parameter_names=None if names is None else tuple(names),
        inputs=None if found is None else tuple((str(d), shape) for d, shape in found),
        max_batch=program_max_batch(module),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        xs = tuple(
            example_tensor(i, w, 8, random=True, device="cpu")
            for i, w in zip(spec.inputs, widths, strict=True)
        )
    programcache.save(sha, call, facts, tuple(xs[i] for i in order))


def forget(uri: str) -> None:
    """Drop this process's cached loads of the bundle at ``uri`` (a folder that was removed)."""
    with _CACHE_LOCK:
        for key in [k for k in _CACHE if k[0] == uri]:
            del _CACHE[key]
