"""Model-speed measurement and batch-size choice, independent of the rest of the pipeline.

Everything here works on a plain callable ``fn(x) -> y`` (a model's forward, possibly wrapped in
autocast or ``torch.compile`` by the caller), a sample ``x`` (one tensor, or a tuple of tensors
with rows first for a model of several inputs: ``fn`` then takes the tuple) and a
``torch.device``, so any precision or compile wrapper can be measured the same way:

- :func:`bench_batch_sizes` times whole passes over a sample at each batch size (the usual
  batch / calls / ms / rows per second table, printed by :func:`format_table`);
- :func:`challenge` times a size against its neighbours, pass for pass, and says whether a
  neighbour wins often enough to replace it (``batch_size = "auto"`` and the rows per model
  call, on a first run and to revalidate a cached choice: ``pipeline.driver.autotune``);
- :class:`BatchSizeCache` remembers the choice per (model, device, precision) in a small JSON file
  so the sweep is paid once per machine, not once per run, with the CPU it was measured on
  (:func:`cpu_identity`): a choice measured on another CPU model or flags is measured again.

Timings on a shared machine are noisy: best-of-``repeats`` is reported because noise only ever
adds time, and a choice moves off a size only when another wins against it twice in a row by
a margin, each time in a pair of passes run back to back.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.model.tuningcache import (
    CPUINFO as CPUINFO,
)
from pipeline.model.tuningcache import (
    BatchSizeCache as BatchSizeCache,
)
from pipeline.model.tuningcache import (
    BenchRow as BenchRow,
)
from pipeline.model.tuningcache import (
    Streak as Streak,
)
from pipeline.model.tuningcache import (
    cache_key as cache_key,
)
from pipeline.model.tuningcache import (
    cpu_identity as cpu_identity,
)
from pipeline.model.tuningcache import (
    cpu_summary as cpu_summary,
)
from pipeline.model.tuningcache import (
    default_cache_path as default_cache_path,
)
from pipeline.model.tuningcache import (
    streak_of as streak_of,
)

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


# --------------------------------------------------------------------------------------------
# Challenging a size with its neighbours


#: Batch sizes ``batch_size = "auto"`` moves between, one step at a time (those up to the
#: sample's rows and the program's largest batch).
PIPELINE_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)
#: A neighbour replaces a size only when it beats it by this margin in :data:`CHALLENGE_WINS`
#: pairs in a row, each pair the two sizes' passes over the same rows one after the other. The
#: pairs may come from one run or from several (the streak is kept in the cache between runs).
#: A pair shares its moment's load, which a fastest-pass rule does not: on the shared 2-core
#: machine here the batch-size sweep's "noise" (largest spread between one size's passes) ran
#: from 21% to 39% within minutes, and it switched to 8,192 in some runs and not in others.
CHALLENGE_MARGIN = 0.05
CHALLENGE_WINS = 2


def neighbours(ladder: Sequence[int], size: int) -> list[int]:
    """The sizes of ``ladder`` just below and just above ``size`` (one or none at an end)."""
    below = [s for s in ladder if s < size]
    above = [s for s in ladder if s > size]
    return ([max(below)] if below else []) + ([min(above)] if above else [])


@dataclass(frozen=True)
class Challenge:
    """What :func:`challenge` found: the size to use, whether it is the incumbent
    (``kept``) or a neighbour (``replaced``), every pass's seconds by size, each neighbour's
    pass / the incumbent's pass of the same round, and the streak to keep for the next run."""

    chosen: int
    outcome: str  # "kept" or "replaced"
    passes: dict[int, list[float]]
    ratios: dict[int, list[float]]
    streak: Streak | None
    seconds: float

    def table(self, rows: int) -> list[BenchRow]:
        """One :class:`BenchRow` per size: its fastest pass over ``rows`` rows."""
        return _table({b: min(ts) for b, ts in sorted(self.passes.items()) if ts}, rows)


def challenge(
    step: Callable[[int], float],
    incumbent: int,
    challengers: Sequence[int],
    *,
    rounds: int,
    streak: Streak | None = None,
    margin: float = CHALLENGE_MARGIN,
    wins: int = CHALLENGE_WINS,
) -> Challenge:
    """Time ``rounds`` rounds of one pass per size (``step(size)`` returns a pass's seconds
    over the same rows at ``size``), the incumbent and its ``challengers`` alternating in
    order (forward, then backward), and pair each challenger's pass with the incumbent's of
    the same round. A pair is a win when the challenger took at most ``1 - margin`` of the
    incumbent's time; a loss ends a streak. ``streak`` (from an earlier run, against the same
    incumbent) counts toward the challenger it names. A challenger with ``wins`` wins in a row
    replaces the incumbent (of two, the lower median ratio); else the incumbent is kept and
    the longest running streak is returned, to be continued by the next run."""
    t0 = time.perf_counter()
    sizes = [incumbent, *challengers]
    passes: dict[int, list[float]] = {b: [] for b in sizes}
    ratios: dict[int, list[float]] = {c: [] for c in challengers}
    for r in range(max(rounds, 1)):
        got = {b: max(step(b), 1e-9) for b in (sizes if r % 2 == 0 else sizes[::-1])}
        for b in sizes:
            passes[b].append(got[b])
        for c in challengers:
            ratios[c].append(got[c] / got[incumbent])
    run = {c: streak.wins if streak is not None and streak.size == c else 0 for c in challengers}
    for c in challengers:
        for q in ratios[c]:
            run[c] = run[c] + 1 if q <= 1 - margin else 0
    seconds = time.perf_counter() - t0
    by_gain = sorted(challengers, key=lambda c: (-run[c], statistics.median(ratios[c])))
    if by_gain and run[by_gain[0]] >= wins:
        return Challenge(by_gain[0], "replaced", passes, ratios, None, seconds)
    going = Streak(by_gain[0], run[by_gain[0]]) if by_gain and run[by_gain[0]] else None
    return Challenge(incumbent, "kept", passes, ratios, going, seconds)


def _table(seconds: Mapping[int, float], rows: int) -> list[BenchRow]:
    """One :class:`BenchRow` per size: a pass over ``rows`` rows in ``seconds[size]``."""
    return [
        BenchRow(
            batch=b,
            calls=math.ceil(rows / b),
            ms=t * 1e3,
            samples_per_s=rows / t,
            ms_per_sample=t * 1e3 / max(rows, 1),
        )
        for b, t in seconds.items()
    ]


# --------------------------------------------------------------------------------------------
# Rows per model call


#: Sizes a CPU run tries for its model calls below the batch (the pipeline still reads, checks
#: and writes whole batches): on a 2-core AMD EPYC without AMX the demo 16-256-128-2 MLP ran
#: 1.35x faster in calls of 2,048 rows than in one call of 4,096, and 1.54x in calls of 1,024
#: (one thread, 5 alternating pairs): at 4,096 rows its 256-wide activations (4 MiB) no longer
#: fit the core's cache. A row's output depends on its own row only, so the scores are the same
#: bits (checked on the bench's two MLPs at 37, 1,000 and 4,096 rows).
CALL_SIZES = (256, 512, 1024, 2048)
#: The rows the call sizes are measured over: a batch up to this size, split each way.
CALL_SAMPLE_ROWS = 4096


def choose_call_rows(
    fn: ModelFn,
    x: Sample,
    device: torch.device,
    *,
    batch: int,
    budget_s: float,
    max_rounds: int = 4,
) -> tuple[int, list[BenchRow], dict[str, Any]]:
    """The rows per model call that score a batch of ``batch`` rows fastest: one batch of
    ``min(batch, CALL_SAMPLE_ROWS)`` rows of ``x`` (repeated when ``x`` is shorter) called whole,
    and split into calls of each of :data:`CALL_SIZES` below it, round-robin (at least two
    rounds, more while ``budget_s`` lasts, up to ``max_rounds``).

    The whole batch is kept unless the fastest size wins twice over: its *second* fastest pass
    beats the whole batch's fastest by 2%. A run measures this while its Dask workers start
    beside it, so one pass in a round can take three times as long (a spread of 229% in a W1
    run on 2 cores): a rule that counts the largest spread as noise, as the batch-size sweep
    does, would never split; one that trusts a single fast pass would split on luck. Returns
    (rows per call, one row per size with its fastest pass, facts: rounds, noise (the largest
    gap between a size's two fastest passes), seconds spent)."""
    fn, rows = _as_rows(fn, x)
    _check_sample(rows)
    n = min(batch, CALL_SAMPLE_ROWS)
    data = _slice(_sample_for(rows, n), 0, n)
    sizes = [c for c in CALL_SIZES if c < n] + [n]
    t0 = time.perf_counter()
    for c in sizes:  # first calls at a new shape pay allocations and kernel choice
        _one_pass(fn, data, device, c)
    times: dict[int, list[float]] = {c: [] for c in sizes}
    rounds = 0
    while rounds < max_rounds and (rounds < 2 or time.perf_counter() - t0 < budget_s):
        for c in sizes:
            times[c].append(max(_one_pass(fn, data, device, c), 1e-9))
        rounds += 1
    fastest = {c: sorted(ts)[:2] for c, ts in times.items()}
    best = min(sizes, key=lambda c: fastest[c][0])
    chosen = best if fastest[best][1] * 1.02 < fastest[n][0] else n
    noise = max((b - a) / a for a, b in fastest.values())
    table = _table({c: ts[0] for c, ts in fastest.items()}, n)
    facts = {"rounds": rounds, "noise": noise, "sweep_s": time.perf_counter() - t0}
    logger.debug(
        "fastest rows per model call %d: %.0f rows/s (one call per batch of %d: %.0f rows/s; "
        "%d rounds in %.2fs)",
        chosen,
        n / fastest[chosen][0],
        n,
        n / fastest[n][0],
        rounds,
        facts["sweep_s"],
    )
    return chosen, table, facts


def recheck_call_rows(
    fn: ModelFn,
    x: Sample,
    device: torch.device,
    *,
    batch: int,
    cached: int,
    rounds: int = 2,
    streak: Streak | None = None,
) -> Challenge:
    """Revalidate a cached rows per model call: ``cached`` against its neighbours among the
    sizes :func:`choose_call_rows` measures for ``batch`` (:func:`neighbours`), in passes over
    the same batch (rows of ``x``, repeated when short) as that measurement, ``rounds`` rounds
    of :func:`challenge`. A first call at each size's shape comes first, untimed (allocations,
    kernel choice)."""
    fn, rows = _as_rows(fn, x)
    _check_sample(rows)
    n = min(batch, CALL_SAMPLE_ROWS)
    data = _slice(_sample_for(rows, n), 0, n)
    near = neighbours([c for c in CALL_SIZES if c < n] + [n], cached)
    with torch.inference_mode():
        for c in [cached, *near]:
            fn(tuple(t[:c].to(device) for t in data))
    _sync(device)
    return challenge(
        lambda c: _one_pass(fn, data, device, c), cached, near, rounds=rounds, streak=streak
    )
