"""Model execution options: precision (fp32, bf16, fp16, int8), TF32 on CUDA, torch.compile,
the engine (torch, or ONNX Runtime: :mod:`pipeline.model.onnxengine`), and the parity check of
every run that is not torch fp32 against it on a fixed sample of rows.

Each option returns a new :class:`~pipeline.model.program.LoadedModel` whose ``module`` runs the
model that way, so the scoring loop does not change with the option.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
import warnings
from typing import Any

import numpy as np
import torch

from pipeline.core.config import PRECISIONS
from pipeline.core.errors import ConfigError, ModelError
from pipeline.model.bundle import Inputs, as_inputs
from pipeline.model.engine import output_columns
from pipeline.model.onnxengine import prepare_onnx
from pipeline.model.program import LoadedModel, callable_of, forward

logger = logging.getLogger(__name__)

# Default max |difference| from fp32 per output column (probabilities, raw values), and the
# largest share of argmax labels that may differ. Overridden by parity_tolerance.
DEFAULT_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2, "fp16": 1e-2, "int8": 1e-1}
PARITY_ROWS = 2048


def cpu_has_native_bf16() -> bool:
    """True where the CPU has bf16 instructions (AVX512-BF16 or AMX); elsewhere bf16 is emulated
    and much slower than fp32 (11x measured on an AVX2-only EPYC)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


class _Autocast(torch.nn.Module):
    def __init__(self, inner: Any, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.inner = inner
        self.device_type = device_type
        self.dtype = dtype

    def forward(self, *xs: torch.Tensor) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return callable_of(self.inner)(*xs)


_LINEAR = torch.ops.aten.linear.default


class _DynamicInt8(torch.nn.Module):
    """Dynamic int8 quantisation of the Linear layers of an exported program.

    ``torch.ao.quantization.quantize_dynamic`` looks for ``nn.Linear`` modules, which an
    exported graph no longer has (it calls ``aten.linear``), so this runs the graph with an FX
    interpreter that sends each ``aten.linear`` on a constant weight to the quantized kernel,
    with per-channel int8 weights packed once.
    """

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__()
        self.gm = gm
        self.packed: dict[int, Any] = {}
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.target is not _LINEAR:
                continue
            w_node = node.args[1]
            b_node = node.args[2] if len(node.args) > 2 else None
            if getattr(w_node, "op", None) != "get_attr":
                continue
            w = _fetch(gm, w_node.target)
            b = None
            if b_node is not None and getattr(b_node, "op", None) == "get_attr":
                b = _fetch(gm, b_node.target)
            wf = w.detach().float()
            scales = (wf.abs().amax(dim=1).clamp(min=1e-8) / 127.0).double()
            zeros = torch.zeros(wf.shape[0], dtype=torch.long)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # quantized tensors are deprecated in 2.13
                qw = torch.quantize_per_channel(wf, scales, zeros, 0, torch.qint8)
                packed = torch.ops.quantized.linear_prepack(
                    qw, None if b is None else b.detach().float()
                )
            self.packed[w.data_ptr()] = packed
        if not self.packed:
            raise ConfigError("precision int8 found no Linear layer to quantise in this model")

    def forward(self, *xs: torch.Tensor) -> Any:
        packed = self.packed

        class Run(torch.fx.Interpreter):
            def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
                if target is _LINEAR and isinstance(args[1], torch.Tensor):
                    p = packed.get(args[1].data_ptr())
                    if p is not None:
                        return torch.ops.quantized.linear_dynamic(args[0], p, True)
                return super().call_function(target, args, kwargs)

        return Run(self.gm).run(*xs)


def _fetch(root: Any, target: str) -> Any:
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


@dataclasses.dataclass(frozen=True)
class ExecutionOptions:
    precision: str = "fp32"
    compile: bool = False
    strict_fp32: bool = False
    engine: str = "torch"  # or "onnx": ONNX Runtime on the CPU (pipeline.model.onnxengine)


# The models this process prepared, by content: the bundle's SHA-256, the device, the input
# widths and the options (not id(model): a freed model's id can be reused by another model).
# A worker of an existing cluster outlives its runs: only the last few are kept.
_PREPARED: collections.OrderedDict[
    tuple[str, str, tuple[int, ...], ExecutionOptions], tuple[LoadedModel, float | None]
] = collections.OrderedDict()
_KEEP_PREPARED = 4
_LOCK = threading.Lock()


def prepare(
    model: LoadedModel, opts: ExecutionOptions, *, warm_rows: int = 2
) -> tuple[LoadedModel, float | None]:
    """The model set up to run with ``opts`` (once per process), and the compile seconds.

    With ``compile``, the model is compiled for ``warm_rows`` rows right away (pass the batch
    size, so the first real batch does not pay for it).
    """
    key = (model.sha256, str(model.device), model.widths, opts)
    with _LOCK:
        hit = _PREPARED.get(key)
        if hit is not None:
            _PREPARED.move_to_end(key)
            return hit
        if opts.engine == "onnx":
            if opts.precision != "fp32" or opts.compile:
                raise ConfigError(
                    "engine 'onnx' runs fp32 without compile only: use one or the other"
                )
            prepared: tuple[LoadedModel, float | None] = (prepare_onnx(model), None)
        else:
            prepared = _prepare(model, opts, warm_rows)
        _PREPARED[key] = prepared
        while len(_PREPARED) > _KEEP_PREPARED:
            _PREPARED.popitem(last=False)
        return prepared


def _prepare(
    model: LoadedModel, opts: ExecutionOptions, warm_rows: int
) -> tuple[LoadedModel, float | None]:
    dev = model.device
    if opts.precision not in PRECISIONS:
        raise ConfigError(f"precision {opts.precision!r} is not one of {', '.join(PRECISIONS)}")
    if dev.type == "cuda":
        # TF32 keeps fp32 range with a 10-bit mantissa on Ampere and later: several times the
        # matmul speed for a small error; --strict-fp32 turns it off.
        torch.backends.cuda.matmul.allow_tf32 = not opts.strict_fp32
        torch.backends.cudnn.allow_tf32 = not opts.strict_fp32
    module: Any = model.module
    if opts.precision == "bf16":
        if dev.type == "cpu" and not cpu_has_native_bf16():
            logger.warning(
                "this CPU has no bf16 instructions (no AVX512-BF16 or AMX): bf16 runs emulated "
                "and is usually much slower than fp32 here"
            )
        module = _Autocast(module, dev.type, torch.bfloat16)
    elif opts.precision == "fp16":
        if dev.type != "cuda":
            raise ConfigError("precision fp16 needs a CUDA device; on the CPU use bf16 or int8")
        module = _Autocast(module, dev.type, torch.float16)
    elif opts.precision == "int8":
        if dev.type != "cpu":
            raise ConfigError("precision int8 runs on the CPU only; on CUDA use fp16 or bf16")
        if not isinstance(module, torch.fx.GraphModule):
            raise ConfigError(
                "precision int8 needs an exported_program bundle (TorchScript graphs cannot be "
                "rewritten); re-export the model with torch.export"
            )
        module = _DynamicInt8(module)
    compile_s = None
    if opts.compile:
        t0 = time.perf_counter()
        # Static shapes: every full batch has the same size, and a static graph ran 1.8x faster
        # than a dynamic one here (20 vs 36-41 ms per 4096 rows). A shard's shorter last batch
        # gets a graph of its own (dynamo falls back to eager past its recompile limit).
        module = torch.compile(module, dynamic=False)
        with torch.inference_mode():
            forward(dataclasses.replace(model, module=module), model.example(max(1, warm_rows)))
        compile_s = time.perf_counter() - t0
        logger.info("torch.compile took %.1fs", compile_s)
    return dataclasses.replace(model, module=module), compile_s


def parity(
    reference: LoadedModel, candidate: LoadedModel, x: Inputs | torch.Tensor
) -> dict[str, dict[str, float]]:
    """Per output column: max and mean |candidate - fp32| on ``x`` (labels: share that differ)."""
    x = as_inputs(x)
    with torch.inference_mode():
        ref = forward(reference, tuple(t.to(reference.device) for t in x)).float().cpu()
        got = forward(candidate, tuple(t.to(candidate.device) for t in x)).float().cpu()
    specs = reference.spec.outputs
    out: dict[str, dict[str, float]] = {}
    for spec, a, b in zip(
        specs, output_columns(ref, specs), output_columns(got, specs), strict=True
    ):
        if spec.transform == "argmax":
            differ = np.asarray(a) != np.asarray(b)
            out[spec.name] = {"mismatch_fraction": float(differ.mean()) if len(differ) else 0.0}
            continue
        av = np.asarray(a.flatten() if hasattr(a, "flatten") else a, dtype=np.float64)
        bv = np.asarray(b.flatten() if hasattr(b, "flatten") else b, dtype=np.float64)
        # Rows whose outputs are not finite are rejects, not scores (engine.py): compare the
        # values both sides score, and count the values only one side leaves non-finite (a
        # NaN would otherwise pass every "diff > tolerance" test).
        fa, fb = np.isfinite(av), np.isfinite(bv)
        both = fa & fb
        diff = np.abs(av[both] - bv[both])
        out[spec.name] = {
            "max_abs_diff": float(diff.max()) if len(diff) else 0.0,
            "mean_abs_diff": float(diff.mean()) if len(diff) else 0.0,
            "non_finite_mismatch": int(np.count_nonzero(fa != fb)),
        }
    return out


def check_parity(
    report: dict[str, dict[str, float]],
    precision: str,
    tolerance: float,
    where: str,
    *,
    engine: str = "torch",
) -> None:
    """Raise :class:`ModelError` naming the column if a difference exceeds ``tolerance``.

    Value columns compare their max |difference|; label (argmax) columns the share of labels
    that differ.
    """
    bad = []
    for col, d in report.items():
        worst = d.get("max_abs_diff", d.get("mismatch_fraction", 0.0))
        if worst > tolerance:
            what = "max |diff|" if "max_abs_diff" in d else "labels differing"
            bad.append(f"{col}: {what} {worst:.3g}")
        if d.get("non_finite_mismatch"):
            bad.append(
                f"{col}: {int(d['non_finite_mismatch'])} value(s) finite on one side and NaN "
                "or infinite on the other"
            )
    if bad and engine != "torch":
        raise ModelError(
            f"{where}: engine {engine!r} differs from torch (fp32, the reference) beyond the "
            f"tolerance {tolerance:g} on the parity sample ({', '.join(bad)}); nothing was "
            "scored. Use engine 'torch' (the default), or set a wider parity_tolerance if that "
            "is acceptable."
        )
    if bad:
        raise ModelError(
            f"{where}: precision {precision} differs from fp32 beyond the tolerance {tolerance:g} "
            f"on the parity sample ({', '.join(bad)}); nothing was scored. Set a wider "
            "parity_tolerance if that is acceptable, or use another precision."
        )
