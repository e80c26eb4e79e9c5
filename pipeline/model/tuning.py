"""Model-speed measurement and batch-size choice, independent of the rest of the pipeline.

Everything here works on a plain callable ``fn(x) -> y`` (a model's forward, possibly wrapped in
autocast or ``torch.compile`` by the caller), a sample ``x`` (one tensor, or a tuple of tensors
with rows first for a model of several inputs: ``fn`` then takes the tuple) and a
``torch.device``, so any precision or compile wrapper can be measured the same way:

- :func:`bench_batch_sizes` times whole passes over a sample at each batch size (the textbook's
  table, printed by :func:`format_table`);
- :func:`auto_batch_size` doubles the batch size from 32 while throughput improves by at least 5%
  and memory stays within a budget;
- :class:`BatchSizeCache` remembers the choice per (model, device, precision) in a small JSON file
  so the sweep is paid once per machine, not once per run.

Timings on a shared machine are noisy: best-of-``repeats`` is reported because noise only ever
adds time, and the choice rule is written so that its answer is within 10% of the best
throughput that its own sweep measured whatever the noise was.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.model.programcache import cache_home

logger = logging.getLogger(__name__)

ModelFn = Callable[[Any], torch.Tensor]
#: A sample: one tensor, or one tensor per model input (rows first).
Sample = torch.Tensor | tuple[torch.Tensor, ...]
_Rows = tuple[torch.Tensor, ...]


def _as_rows(fn: ModelFn, x: Sample) -> tuple[ModelFn, _Rows]:
    """The sample as a tuple, and ``fn`` taking that tuple; each tensor made contiguous so that
    every batch slice is contiguous, as the loader's batches are."""
    if isinstance(x, torch.Tensor):
        return (lambda xs: fn(xs[0])), (x.contiguous(),)
    return fn, tuple(t.contiguous() for t in x)


def _n(xs: _Rows) -> int:
    return int(xs[0].shape[0])


def _slice(xs: _Rows, lo: int, hi: int) -> _Rows:
    return tuple(t[lo:hi] for t in xs)


DEFAULT_TIME_BUDGET_S = 1.5
# Without an explicit budget on CUDA, a batch may use at most this share of the device memory
# that was free when the sweep started. Half, not most: max_memory_allocated() does not count the
# caching allocator's fragmentation or cuBLAS/cuDNN workspaces, and other worker processes may
# share the GPU during the real run.
DEFAULT_CUDA_FREE_FRACTION = 0.5
# The CPU memory estimate: bytes per input byte of a row. See auto_batch_size's docstring.
CPU_BYTES_PER_INPUT_BYTE = 64


@dataclass
class BenchRow:
    """One batch size's timing: the best of several passes over the same sample."""

    batch: int  # rows per model call
    calls: int  # model calls in one pass (the last batch of a pass may be shorter)
    ms: float  # wall time of the best timed pass, in milliseconds
    samples_per_s: float  # rows in the pass / best pass time
    ms_per_sample: float  # best pass time / rows in the pass


def _sync(device: torch.device) -> None:
    # CUDA kernels run asynchronously: without this the clock would stop before the work does.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def _sample_for(x: _Rows, batch: int) -> _Rows:
    """``x``, with its rows repeated when it holds fewer than one full batch.

    A pass over fewer rows than ``batch`` would time a smaller batch than the one asked for.
    """
    n = _n(x)
    if n >= batch:
        return x
    reps = math.ceil(batch / n)
    return tuple(t.repeat(reps, *([1] * (t.dim() - 1)))[:batch] for t in x)


def _check_sample(x: _Rows) -> None:
    if not x or x[0].dim() < 1 or x[0].shape[0] < 1:
        shape = tuple(x[0].shape) if x else ()
        raise ValueError(f"the sample must hold at least one row; got shape {shape}")
    if any(t.shape[0] != x[0].shape[0] for t in x):
        raise ValueError(f"the sample's tensors differ in rows: {[tuple(t.shape) for t in x]}")
    if any(t.device.type != "cpu" for t in x):
        raise ValueError(
            f"the sample must be on the CPU (batches are moved to the device while timing, as in "
            f"a real run); it is on {x[0].device}"
        )


def _one_pass(fn: ModelFn, data: _Rows, device: torch.device, batch: int) -> float:
    """Seconds for one pass over ``data`` in batches of ``batch``, device work included."""
    _sync(device)  # do not charge earlier queued work to this pass
    t0 = time.perf_counter()
    with torch.inference_mode():
        for lo in range(0, _n(data), batch):
            fn(tuple(t[lo : lo + batch].to(device, non_blocking=True) for t in data))
    _sync(device)
    return time.perf_counter() - t0


def _bench_one(
    fn: ModelFn,
    x: _Rows,
    device: torch.device,
    batch: int,
    *,
    repeats: int,
    warmup: int,
    time_budget_s: float,
) -> BenchRow:
    data = _sample_for(x, batch)
    if device.type == "cuda":
        # The real run pins its batches (DataLoader pin_memory=True), which is what makes the
        # non_blocking copy asynchronous; time the same copy path.
        data = tuple(t.pin_memory() for t in data)
    rows = _n(data)
    calls = math.ceil(rows / batch)
    start = time.perf_counter()

    def over_budget() -> bool:
        return time.perf_counter() - start >= time_budget_s

    # The first warmup pass always runs: first calls at a new shape pay for allocator growth,
    # kernel selection or a recompile, which is not what is being measured.
    for i in range(warmup):
        if i > 0 and over_budget():
            break
        _one_pass(fn, data, device, batch)
    best = math.inf
    timed = 0
    for i in range(repeats):
        if i > 0 and over_budget():
            break
        best = min(best, _one_pass(fn, data, device, batch))
        timed += 1
    best = max(best, 1e-9)  # a clock tick of 0 would divide by zero below
    row = BenchRow(
        batch=batch,
        calls=calls,
        ms=best * 1e3,
        samples_per_s=rows / best,
        ms_per_sample=best * 1e3 / rows,
    )
    logger.debug(
        "batch %d: %d rows in %d calls, best %.3f ms of %d timed passes (%.0f rows/s)",
        batch,
        rows,
        calls,
        row.ms,
        timed,
        row.samples_per_s,
    )
    return row


def bench_batch_sizes(
    fn: ModelFn,
    x: Sample,
    device: torch.device,
    batch_sizes: Sequence[int],
    *,
    repeats: int = 3,
    warmup: int = 2,
    time_budget_s: float = DEFAULT_TIME_BUDGET_S,
) -> list[BenchRow]:
    """Time ``fn`` over the rows of ``x`` at each batch size; one :class:`BenchRow` per size.

    ``x`` holds rows on the CPU (float32 for a model bundle). For each batch size, ``x`` is split
    into consecutive batches, each moved to ``device`` with ``non_blocking=True`` (from pinned
    memory on CUDA) and passed to ``fn`` under ``torch.inference_mode()``; CUDA is synchronised
    before the clock is read. A pass is every batch of the sample; ``warmup`` untimed passes come
    first, then the best of ``repeats`` timed passes is kept.

    Work is bounded two ways: when ``x`` has fewer rows than a batch size its rows are repeated
    to make one full batch; and once ``time_budget_s`` has been spent on a batch size no further
    pass is started (the first warmup pass and the first timed pass always run, so each row
    rests on at least one real measurement).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    bad = [b for b in batch_sizes if isinstance(b, bool) or not isinstance(b, int) or b < 1]
    if bad:
        raise ValueError(f"batch sizes must be integers >= 1; got {bad}")
    fn, rows = _as_rows(fn, x)
    _check_sample(rows)
    return [
        _bench_one(fn, rows, device, b, repeats=repeats, warmup=warmup, time_budget_s=time_budget_s)
        for b in batch_sizes
    ]


def format_table(rows: Sequence[BenchRow]) -> str:
    """The sweep as an aligned text table: ``batch  calls  ms  samples/s  ms/sample``."""
    header = ("batch", "calls", "ms", "samples/s", "ms/sample")
    cells = [
        (
            f"{r.batch:,}",
            f"{r.calls:,}",
            f"{r.ms:,.2f}",
            f"{r.samples_per_s:,.0f}",
            f"{r.ms_per_sample:.5f}",
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in [header, *cells]) for i in range(len(header))]
    # Right-aligned, so that the digits of each column line up.
    return "\n".join(
        "  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True))
        for line in [header, *cells]
    )


def _cuda_peak_bytes(fn: ModelFn, x: _Rows, device: torch.device, batch: int) -> int | None:
    """Peak bytes allocated on ``device`` during one call at ``batch`` rows; None on OOM.

    The peak includes everything this process holds there (weights, other tensors), which is
    what has to fit.
    """
    data = _slice(_sample_for(x, batch), 0, batch)
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        with torch.inference_mode():
            fn(tuple(t.to(device) for t in data))
        _sync(device)
    except Exception as e:
        if not _is_oom(e):
            raise
        torch.cuda.empty_cache()  # give the failed attempt's cached blocks back
        return None
    return int(torch.cuda.max_memory_allocated(device))


class _Probe:
    """Whether a batch size fits the memory budget, and its timing (None: out of memory)."""

    def __init__(
        self,
        fn: ModelFn,
        x: _Rows,
        device: torch.device,
        budget: int | None,
        timing: tuple[int, int, float],  # repeats, warmup, time budget per size
    ) -> None:
        self.fn, self.x, self.device, self.budget, self.timing = fn, x, device, budget, timing
        self.row_bytes = sum(t[0].numel() * t.element_size() for t in x)

    def fits(self, batch: int) -> bool:
        budget, device = self.budget, self.device
        if budget is None:
            return True
        if device.type == "cuda":
            peak = _cuda_peak_bytes(self.fn, self.x, device, batch)
            ok = peak is not None and peak <= budget
            logger.debug("batch %d: peak %s bytes on %s (budget %d)", batch, peak, device, budget)
            return ok
        return batch * self.row_bytes * CPU_BYTES_PER_INPUT_BYTE <= budget

    def measure(self, batch: int) -> BenchRow | None:
        repeats, warmup, time_budget_s = self.timing
        try:
            (row,) = bench_batch_sizes(
                self.fn,
                self.x,
                self.device,
                [batch],
                repeats=repeats,
                warmup=warmup,
                time_budget_s=time_budget_s,
            )
        except Exception as e:
            # Memory use varies a little from call to call; an OOM while timing also means
            # "does not fit", anything else is a real error.
            if self.device.type != "cuda" or not _is_oom(e):
                raise
            torch.cuda.empty_cache()
            return None
        return row


# The tuning knobs are keyword-only with defaults, mirroring bench_batch_sizes; the long body is
# mostly the docstring that states the memory rules.
def auto_batch_size(  # noqa: PLR0913
    fn: ModelFn,
    x: Sample,
    device: torch.device,
    *,
    start: int = 32,
    max_batch: int = 65536,
    min_gain: float = 0.05,
    memory_budget_bytes: int | None = None,
    repeats: int = 3,
    warmup: int = 1,
    time_budget_s: float = DEFAULT_TIME_BUDGET_S,
) -> tuple[int, list[BenchRow]]:
    """Choose a batch size by the textbook's recipe; returns (chosen size, the sweep).

    Start at ``start`` and double while throughput improves by at least ``min_gain`` over the
    best so far, the size stays at most ``max_batch``, and the batch fits the memory budget. The
    chosen size is the last one that improved. The sweep holds every size that was measured,
    including the one that did not improve enough; that one is less than ``1 + min_gain`` times
    faster than the choice, so with the default 5% the choice is within 5% of the sweep's best.

    Memory, checked before a size is timed (a size that does not fit is neither timed nor put in
    the sweep):

    - CUDA: one call at the size, after ``torch.cuda.reset_peak_memory_stats``; its
      ``torch.cuda.max_memory_allocated`` (weights and every other tensor of this process
      included) must not exceed ``memory_budget_bytes``. Without a budget, the limit is what was
      allocated when the sweep began plus half of the device memory free then. An out-of-memory
      error counts as not fitting.
    - CPU: no check unless ``memory_budget_bytes`` is given. Then a batch is estimated to need
      ``batch * row_bytes * 64`` bytes, where ``row_bytes`` is one input row's size. It is a
      deliberately simple bound: measuring activations (``torch.profiler``) costs more than the
      sweep, and process RSS barely moves because the allocator reuses freed memory. It
      over-estimates MLPs whose layers are up to about 16 times their input width (the demo's
      16-256-128-2 needs about 25 bytes per input byte) and under-estimates wider ones, which
      should pass a budget scaled to match.

    If ``start`` does not fit, it is halved until a size fits, and that size alone is measured
    and chosen; if no size fits, :class:`ValueError` is raised.
    """
    if start < 1 or max_batch < start:
        raise ValueError(f"need 1 <= start <= max_batch; got start={start}, max_batch={max_batch}")
    if min_gain < 0:
        raise ValueError(f"min_gain must be >= 0, got {min_gain}")
    fn, rows = _as_rows(fn, x)
    _check_sample(rows)

    budget = memory_budget_bytes
    if device.type == "cuda" and budget is None:
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(torch.cuda.memory_allocated(device) + DEFAULT_CUDA_FREE_FRACTION * free)
    probe = _Probe(fn, rows, device, budget, (repeats, warmup, time_budget_s))
    fits, measure = probe.fits, probe.measure

    first = start
    while not fits(first):
        if first == 1:
            raise ValueError(
                f"even a batch of 1 row does not fit the memory budget of {budget:,} bytes "
                f"on {device}"
            )
        first //= 2
    row = measure(first)
    if row is None:
        raise ValueError(f"a batch of {first} rows ran out of memory on {device}")
    sweep = [row]
    best = row
    reason = f"the start size {start} does not fit the memory budget" if first < start else ""
    batch = first * 2
    while not reason:
        if batch > max_batch:
            reason = f"the next size {batch} is over max_batch {max_batch}"
        elif not fits(batch):
            reason = f"batch {batch} does not fit the memory budget"
        elif (row := measure(batch)) is None:
            reason = f"batch {batch} ran out of memory"
        else:
            sweep.append(row)
            if row.samples_per_s >= best.samples_per_s * (1 + min_gain):
                best = row
                batch *= 2
            else:
                gain = row.samples_per_s / best.samples_per_s - 1
                reason = f"batch {batch} gained {gain:+.1%} over {best.batch} (< {min_gain:.0%})"
    logger.info(
        "batch size %d on %s: %.0f rows/s; stopped because %s",
        best.batch,
        device,
        best.samples_per_s,
        reason,
    )
    return best.batch, sweep


def cache_key(
    model_sha256: str, device: str | torch.device, precision: str, threads: int | None = None
) -> str:
    """The :class:`BatchSizeCache` key of a model on a device at a precision (and thread count:
    the best batch on 1 torch thread is not the best on 2)."""
    key = f"{model_sha256}|{device}|{precision}"
    return key if threads is None else f"{key}|{threads}"


def default_cache_path() -> Path:
    """``batch_sizes.json`` in :func:`pipeline.model.programcache.cache_home`
    (``$XDG_CACHE_HOME/score-catalog``, else ``~/.cache/score-catalog``)."""
    return cache_home() / "batch_sizes.json"


class BatchSizeCache:
    """Chosen batch sizes in a small JSON file: key -> ``{batch_size, measured_at, sweep}``.

    Keys come from :func:`cache_key`. Writes replace the whole file atomically (a temporary file
    in the same directory, then ``os.replace``), so a reader never sees half a file; two
    processes writing at once may lose one entry, which only costs a new sweep. A file that is
    unreadable or not what this class writes is ignored with a warning: a cache must never stop
    a run.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def _load(self) -> dict[str, Any]:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except OSError as e:
            logger.warning("ignoring batch-size cache %s: cannot read it (%s)", self.path, e)
            return {}
        try:
            doc = json.loads(text)
        except ValueError as e:
            logger.warning("ignoring batch-size cache %s: not valid JSON (%s)", self.path, e)
            return {}
        if not isinstance(doc, dict):
            logger.warning(
                "ignoring batch-size cache %s: expected a JSON object, found %s",
                self.path,
                type(doc).__name__,
            )
            return {}
        return doc

    def get(self, key: str) -> int | None:
        """The cached batch size for ``key``, or None (missing, or an unusable entry)."""
        entry = self._load().get(key)
        if entry is None:
            return None
        size = entry.get("batch_size") if isinstance(entry, dict) else None
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            logger.warning(
                "ignoring batch-size cache entry %r in %s: batch_size %r is not an integer >= 1",
                key,
                self.path,
                size,
            )
            return None
        return size

    def put(self, key: str, batch_size: int, sweep: Sequence[BenchRow]) -> None:
        """Record ``batch_size`` (and the sweep it came from) for ``key``, atomically."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        doc = self._load()
        doc[key] = {
            "batch_size": batch_size,
            "measured_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "sweep": [asdict(r) for r in sweep],
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Hidden and in the same directory: os.replace is atomic only within one filesystem.
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.tmp-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=2, sort_keys=True)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise


# --------------------------------------------------------------------------------------------
# Choosing by the pipeline's own rate


#: Batch sizes an end-to-end sweep tries (those up to the sample's row count).
PIPELINE_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)
#: The noise assumed when only one pass per size fitted the budget.
DEFAULT_NOISE = 0.05


def choose_by_rate(
    step: Callable[[int], float],
    sizes: Sequence[int],
    *,
    rows: int,
    default: int,
    budget_s: float,
    max_rounds: int = 4,
) -> tuple[int, list[BenchRow], dict[str, Any]]:
    """Choose a batch size by what ``step`` measures: ``step(b)`` runs one pass over the same
    ``rows`` rows in batches of ``b`` (the whole pipeline: decode, model, output columns,
    write) and returns its seconds.

    Sizes are measured round-robin (all of them once, then again while ``budget_s`` lasts, up
    to ``max_rounds``), so that the machine's load hits every size alike. Each size counts by
    its fastest pass: a first pass at a new batch shape pays one-time costs (kernel selection,
    first allocations) and a busy machine only ever adds time, so the minimum is the size's own
    cost. The noise is the largest spread (max - min over min) any size showed between its
    passes, at least 2% (:data:`DEFAULT_NOISE` after a single round). The fastest size wins,
    except that ``default`` is kept whenever it is within the noise of the best: a difference
    the sweep cannot tell from noise is no reason to move off a size known to work. So the
    choice is never slower than the best by more than the noise measured. Returns (chosen, one
    row per size with its fastest pass, facts: rounds, noise, seconds spent).
    """
    # Sizes above the sample's rows would time the same single call; the default always runs.
    sizes = sorted({b for b in sizes if 1 <= b <= max(rows, 1)} | {default})
    times: dict[int, list[float]] = {b: [] for b in sizes}
    t0 = time.perf_counter()
    rounds = 0
    while rounds < max_rounds and (rounds == 0 or time.perf_counter() - t0 < budget_s):
        for b in sizes:
            times[b].append(max(step(b), 1e-9))
        rounds += 1
    medians = {b: min(ts) for b, ts in times.items()}  # the fastest pass (see above)
    spreads = [(max(ts) - min(ts)) / medians[b] for b, ts in times.items() if len(ts) > 1]
    noise = max([0.02, *spreads]) if spreads else DEFAULT_NOISE
    best = min(medians, key=lambda b: medians[b])
    chosen = default if medians[default] <= medians[best] * (1 + noise) else best
    table = [
        BenchRow(
            batch=b,
            calls=math.ceil(rows / b),
            ms=medians[b] * 1e3,
            samples_per_s=rows / medians[b],
            ms_per_sample=medians[b] * 1e3 / max(rows, 1),
        )
        for b in sizes
    ]
    facts = {"rounds": rounds, "noise": noise, "sweep_s": time.perf_counter() - t0}
    logger.info(
        "batch size %d by the pipeline's rate: %.0f rows/s (best %d at %.0f rows/s, noise "
        "%.1f%%, %d rounds in %.2fs)",
        chosen,
        rows / medians[chosen],
        best,
        rows / medians[best],
        noise * 100,
        rounds,
        facts["sweep_s"],
    )
    return chosen, table, facts
