"""A bundle's program, loaded: deserialized without unpickling arbitrary objects, its signature
checked against the declared inputs (an exported program records each input's dtype and
shape), run on 1 and 2 rows before any data is scored, and kept once per process
(:func:`load_model`). :func:`forward` is how everything calls it.
"""

from __future__ import annotations

import io
import logging
import operator
import threading
import warnings
import weakref
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.core.errors import ConfigError, ModelError
from pipeline.model import programcache, sidecar
from pipeline.model.bundle import EXPORT_HINT, BundleSpec, Inputs, as_inputs, read_bundle
from pipeline.model.columns import example_tensor
from pipeline.model.signature import (
    call_order,
    input_widths,
    parameter_names,
    program_inputs,
    program_max_batch,
    program_widths,
    signature_problems,
)

logger = logging.getLogger(__name__)


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
        values each input can hold (see :func:`pipeline.model.columns.example_tensor`)."""
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


def check_batch_size(model: LoadedModel, batch_size: int) -> None:
    """Refuse a batch size beyond what the model's program was exported for (ConfigError)."""
    if model.max_batch is not None and batch_size > model.max_batch:
        raise ConfigError(
            f"batch size {batch_size:,} is more than model bundle {model.spec.uri} takes: its "
            f"program was exported for batches of at most {model.max_batch:,} rows "
            f"(torch.export.Dim max). Set --batch-size {model.max_batch} or less, or re-export "
            "with a larger max."
        )


def _dry_run(
    spec: BundleSpec, module: Any, widths: tuple[int, ...], device: torch.device
) -> tuple[int, tuple[int, ...]]:
    """Run the model on 1 and 2 rows of zeros; (values per output row, call order)."""
    where = f"model bundle {spec.uri} ({spec.describe_inputs()})"
    order = call_order(spec, module)
    problems = signature_problems(spec, module, widths, order)
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
    module, kept = None, ""
    if any(i.fixed_width() is None for i in spec.inputs):
        # An open width: what the program records comes before what the data gives.
        module, kept = _module_of(spec, weights, sha, dev, options)
        w = input_widths(spec, widths, uri, program_widths(spec, module))
    else:
        w = input_widths(spec, widths, uri)
    key = (uri, str(dev), sha, w)
    with _CACHE_LOCK:
        cached = _CACHE.get(key)
        if cached is not None:
            return cached
        if module is None:
            module, kept = _module_of(spec, weights, sha, dev, options)
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
            f" from {kept}" if kept else "",
        )
        return loaded


def _module_of(
    spec: BundleSpec,
    weights: bytes,
    sha: str,
    device: torch.device,
    options: Mapping[str, Any] | None = None,
) -> tuple[Any, str]:
    """The bundle's module on ``device``, and where it came from without torch.export's loader
    (``"the program cache"``: :mod:`pipeline.model.programcache`, a bundle loaded on this
    machine before; ``"its program file"``: :mod:`pipeline.model.sidecar`, written next to the
    bundle by save_bundle), or ``""`` when torch.export loaded it."""
    if spec.format == "exported_program":
        for source, kept in (
            ("the program cache", lambda: programcache.load(sha)),
            ("its program file", lambda: sidecar.load(spec, sha, options, weights)),
        ):
            found = kept()
            if found is None:
                continue
            try:
                module = found.module.to(device)
            except Exception as e:
                logger.debug("the program from %s would not move to %s (%s)", source, device, e)
                continue
            _GRAPH_CALLS[module] = programcache.call_of(found)
            return module, source
    return _deserialize(spec, weights, device), ""


def _entry_parts(
    spec: BundleSpec, module: Any, widths: tuple[int, ...], order: tuple[int, ...]
) -> tuple[programcache.GraphCall, programcache.ProgramFacts, tuple[torch.Tensor, ...]] | None:
    """What a program cache entry or a program file keeps of a program whose graph the dry run
    confirmed: its graph call, its facts and a probe (8 random rows, seeded, not touching the
    caller's random state, in call order); None for a program neither keeps."""
    call = _GRAPH_CALLS.get(module)
    if call is None:  # not a plain program, or its graph call differed from the module
        return None
    facts = programcache.facts_of(module)
    if facts is None:
        out_spec = getattr(module, "_out_spec", None)
        if out_spec is None or not out_spec.is_leaf():
            return None  # not one bare tensor out (a tuple, a dict): rebuilt, it would differ
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
    return call, facts, tuple(xs[i] for i in order)


def _keep(
    spec: BundleSpec, sha: str, module: Any, widths: tuple[int, ...], order: tuple[int, ...]
) -> None:
    """Save a program whose graph the dry run confirmed to the program cache."""
    parts = _entry_parts(spec, module, widths, order)
    if parts is not None:
        programcache.save(sha, *parts)


def write_program_file(model: LoadedModel, folder: Path) -> Path | None:
    """Write ``model``'s program file (:mod:`pipeline.model.sidecar`) into its local bundle
    ``folder``, from which it was loaded; None when its program is not one the file describes
    (it then loads through torch.export on a machine that has not loaded it before)."""
    parts = _entry_parts(model.spec, model.module, model.widths, model.order)
    if parts is None:
        logger.info("no program file for %s: its program is not a plain graph", folder)
        return None
    return sidecar.write(folder, model.spec, model.sha256, *parts)


def forget(uri: str) -> None:
    """Drop this process's cached loads of the bundle at ``uri`` (a folder that was removed)."""
    with _CACHE_LOCK:
        for key in [k for k in _CACHE if k[0] == uri]:
            del _CACHE[key]
