"""The pure scoring loop: feature tensors in, output columns out. No I/O here.

A batch the model raises on is bisected until the offending rows are isolated: those rows are
rejected with the exception's message and the rest are scored. A CUDA out-of-memory error splits
the batch and retries the halves. A row whose output is NaN or infinite is rejected too: a NaN
score written as a score (and a NaN logit's argmax written as a label) is worse than no score.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch

from pipeline.model.bundle import Inputs, OutputSpec, as_inputs, rows_of
from pipeline.model.program import LoadedModel, forward


@dataclass
class Scored:
    """The model's outputs for the rows it could score."""

    outputs: torch.Tensor  # (rows_ok, out_width) float32 on the CPU
    ok: np.ndarray  # (rows,) bool over the input rows
    # row index -> why the model gave no score: it raised, or its output is not finite
    errors: dict[int, str] = field(default_factory=dict)
    oom_splits: int = 0
    seconds: float = 0.0
    raised: int = 0  # rows the model raised on (the rest of ``errors``: outputs not finite)


#: A batch of at most this many rows that fails on every row is rejected row by row even from
#: a model that has not scored a row yet: bisecting it costs at most 31 calls, and a tiny
#: shard's rows can all be bad.
SMALL_BATCH = 16


class ModelFailedEverywhere(Exception):
    """The model raised on every row of a multi-row batch: a broken model, not bad rows."""


def _message(e: BaseException) -> str:
    """One line for a reject reason. TorchScript wraps the original error in a traceback whose
    last line ("builtins.ValueError: ...") is the part that names the problem."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    if isinstance(e, torch.jit.Error):
        return lines[-1]
    return f"{type(e).__name__}: {lines[0]}"


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def score(
    model: LoadedModel,
    x: Inputs | torch.Tensor,
    *,
    proven: bool = False,
    call_rows: int | None = None,
) -> Scored:
    """Run the model on ``x`` (one tensor per input) under ``inference_mode``; outputs come back
    on the CPU.

    A model that raises on every row of a batch of more than :data:`SMALL_BATCH` rows is taken
    for broken (:class:`ModelFailedEverywhere`), unless ``proven``: it already scored rows of
    this data, so the batch's rows are bad rows (a shard's short last batch can be all bad),
    rejected one by one.

    The host-to-device copy is ``non_blocking`` (the loader pins memory on CUDA) and outputs come
    back once per batch. ``call_rows``: the model is called on consecutive slices of at most this
    many rows (the driver measures what runs fastest on this CPU:
    :func:`pipeline.model.tuning.choose_call_rows`); a slice that raises is bisected alone.
    """
    t0 = time.perf_counter()
    x = as_inputs(x)
    n = rows_of(x)
    ok = np.ones(n, dtype=bool)
    errors: dict[int, str] = {}
    pieces: list[torch.Tensor] = []
    oom = 0

    def run(lo: int, hi: int) -> None:
        nonlocal oom
        try:
            with torch.inference_mode():
                xd = tuple(t[lo:hi].to(model.device, non_blocking=True) for t in x)
                pieces.append(forward(model, xd).float().cpu())
            return
        except Exception as e:
            if _is_oom(e) and hi - lo > 1:
                oom += 1
                if model.device.type == "cuda":
                    torch.cuda.empty_cache()
            elif hi - lo == 1:
                ok[lo] = False
                errors[lo] = f"model error: {_message(e)}"
                return
        mid = (lo + hi) // 2
        run(lo, mid)
        run(mid, hi)

    step = max(1, n if call_rows is None else call_rows)
    for lo in range(0, n, step):
        run(lo, min(n, lo + step))
    if n > SMALL_BATCH and not ok.any() and not proven:
        first = errors[min(errors)]
        raise ModelFailedEverywhere(f"the model failed on every row of a {n}-row batch ({first})")
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    out = torch.cat(pieces) if pieces else torch.empty(0, model.out_width)
    # After the every-row check on purpose: a batch whose outputs are all NaN is rows rejected
    # (named, counted against max_rejected_fraction), not a broken model (docs/failure-handling.md).
    raised = len(errors)
    out = _reject_non_finite(out, model.spec.outputs, ok, errors)
    return Scored(out, ok, errors, oom, time.perf_counter() - t0, raised)


def no_rows(model: LoadedModel) -> Scored:
    """What :func:`score` returns for a call without rows, without calling the model (an
    incremental batch whose rows were all carried)."""
    return Scored(torch.empty(0, model.out_width), np.ones(0, dtype=bool))


def _column_finite(
    outputs: torch.Tensor, spec: OutputSpec, row_finite: torch.Tensor
) -> torch.Tensor:
    """Per row: whether the raw values ``spec``'s column is derived from are all finite.

    A sigmoid reads one value; softmax, argmax and raw read the whole row (one NaN logit makes
    every softmax probability NaN and the argmax arbitrary).
    """
    if spec.transform == "sigmoid":
        return torch.isfinite(outputs[:, spec.index or 0])
    return row_finite


def _reject_non_finite(
    out: torch.Tensor, specs: tuple[OutputSpec, ...], ok: np.ndarray, errors: dict[int, str]
) -> torch.Tensor:
    """Drop the rows of ``out`` that would give a declared column a non-finite value.

    ``out`` holds the rows where ``ok`` is True; a dropped row turns False there and gets the
    reason ``model output is not finite (<first such column>)`` in ``errors``. One vectorised
    check per batch; the per-column work runs only on the rows that failed it.
    """
    # NaN and infinities propagate through a sum, so a finite sum means every value is: 2.5 us
    # per 4096x2 batch here, against 21 us for isfinite(out).all() (three kernel dispatches).
    if out.numel() == 0 or math.isfinite(float(out.sum())):
        return out
    finite = torch.isfinite(out)
    if bool(finite.all()):  # the sum of finite values overflowed
        return out
    bad_rows = torch.nonzero(~finite.all(dim=1)).flatten()
    sub, sub_finite = out[bad_rows], finite[bad_rows].all(dim=1)
    first = torch.full((len(bad_rows),), -1, dtype=torch.long)
    for k, spec in enumerate(specs):
        hit = (~_column_finite(sub, spec, sub_finite)) & (first < 0)
        first[hit] = k
    # A non-finite value that no declared column reads (an unused logit) harms no written value.
    rejected = first >= 0
    drop = bad_rows[rejected]
    if not len(drop):
        return out
    ok_idx = np.flatnonzero(ok)
    for row, k in zip(drop.tolist(), first[rejected].tolist(), strict=True):
        i = int(ok_idx[row])
        ok[i] = False
        errors[i] = f"model output is not finite ({specs[k].name})"
    keep = torch.ones(out.shape[0], dtype=torch.bool)
    keep[drop] = False
    return out[keep]


def output_columns(outputs: torch.Tensor, specs: tuple[OutputSpec, ...]) -> list[pa.Array]:
    """Derive each declared output column from the model's output rows."""
    cols: list[pa.Array] = []
    probs: torch.Tensor | None = None
    width = outputs.shape[1] if outputs.dim() == 2 else 1
    for o in specs:
        if o.transform == "softmax":
            if probs is None:
                # Over each row as it comes, though a short last dimension makes torch's CPU
                # kernel slow (4096 x 2: 162 us): softmax over the transposed outputs took
                # 22 us but rounds a row differently by where it sits in the batch and how the
                # threads split it, and a resumed run must score every row as a clean one does.
                probs = torch.softmax(outputs, dim=1)
            cols.append(pa.array(probs[:, o.index or 0].numpy()))
        elif o.transform == "sigmoid":
            cols.append(pa.array(torch.sigmoid(outputs[:, o.index or 0]).numpy()))
        elif o.transform == "argmax":
            cols.append(pa.array(outputs.argmax(dim=1).to(torch.int64).numpy()))
        elif width == 1:  # raw, one value per row
            cols.append(pa.array(outputs[:, 0].contiguous().numpy()))
        else:
            flat = pa.array(outputs.contiguous().reshape(-1).numpy())
            cols.append(pa.FixedSizeListArray.from_arrays(flat, width))
    return cols
