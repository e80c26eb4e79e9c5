"""Measured choices of how the model runs, each cached per model and CPU and revalidated each
night against its neighbours: the batch size of ``batch_size = "auto"`` (measured through the
workers' own code, :func:`pipeline_step`) and the rows per model call; and the check that a
model scores each row on its own (:func:`row_dependence`), which calls of any size and
incremental nights rely on. Split from :mod:`pipeline.driver.execution`, which decides with
them (the size rule: modules <= 700 lines).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipeline.core.config import JobConfig
from pipeline.core.errors import ModelError
from pipeline.core.statuses import ShardStatus
from pipeline.driver.cluster import Plan
from pipeline.driver.workers import model_spec, worker_spec
from pipeline.io.listing import ShardRef
from pipeline.io.parquet import open_parquet
from pipeline.model import tuning
from pipeline.model.bundle import Inputs, rows_of
from pipeline.model.precision import (
    ExecutionOptions,
)
from pipeline.model.program import LoadedModel, forward
from pipeline.worker.shard import score_shard
from pipeline.worker.spec import ShardTask

logger = logging.getLogger(__name__)


#: Rows of the first shard copied for the ``batch_size = "auto"`` measurement (and for plan's
#: calibration); a pass scores as many of them as the largest size it compares.
AUTO_SAMPLE_ROWS = 16_384
#: What measuring the batch size may cost: on a first run (empty cache) :data:`AUTO_ROUNDS`
#: rounds of the default and its two neighbours within 0.3 s, or :data:`AUTO_JOB_SHARE` of the
#: job's estimated scoring time when that is more; each later run revalidates the cached size
#: with :data:`AUTO_CHECK_ROUNDS` round against its neighbours within 0.1 s or
#: :data:`AUTO_CHECK_SHARE` of the job. A measurement that does not fit is not made: a
#: 2048-wide MLP at 10k rows/s took 8-12 s to sweep, a third of a 200k-row job, and chose no
#: better. The first run used to sweep five sizes (1,024 to 16,384) in two or more rounds:
#: 0.35-0.45 s before the cluster starts, 9% of a 1M-row run's wall here (issue 31).
AUTO_BUDGET_S = 0.3
AUTO_JOB_SHARE = 0.05
AUTO_ROUNDS = 2
AUTO_CHECK_S = 0.1
AUTO_CHECK_SHARE = 0.02
AUTO_CHECK_ROUNDS = 1
DEFAULT_BATCH_SIZE = 4096
#: For tests only: measure whatever the budget (the value caps the rows per pass), so that
#: which sizes are compared does not depend on how busy the machine is (docs/development.md).
SWEEP_ROWS_ENV = "_SCORE_CATALOG_AUTO_SWEEP_ROWS"


def auto_cache_key(
    model: LoadedModel, precision: str, threads: int | None, engine: str = "torch"
) -> str:
    """The batch-size cache key of ``batch_size = "auto"``'s choice (``plan`` reads it too);
    another engine's best size is its own (torch's keys stay what they were)."""
    key = tuning.cache_key(model.sha256, model.device, precision, threads) + "|pipeline"
    return key if engine == "torch" else f"{key}|{engine}"


class _Trial(NamedTuple):
    """What one challenge of a cached (or default) size did: the size to use, the challenge
    (None when none was run: ``note`` says why), the rows per pass, the seconds spent, and the
    incumbent's seconds per row (what sizes the next night's measurement)."""

    chosen: int
    found: tuning.Challenge | None
    rows: int
    seconds: float
    note: str = ""
    per_row: float | None = None


def auto_batch_size(
    config: JobConfig,
    prepared: LoadedModel,
    sample_from: ShardRef | None,
    plan: Plan,
    job_rows: int,
    call_rows: int | None = None,
) -> tuple[int, dict[str, Any]]:
    """``batch_size = "auto"``: the size the whole pipeline scores fastest at, measured on real
    rows of the first shard through :func:`pipeline_step`, cached per model, device,
    precision, thread count and CPU. A first run times the default against its two neighbours
    (:func:`pipeline.model.tuning.challenge`), and moves only when a neighbour wins twice in a
    row by :data:`~pipeline.model.tuning.CHALLENGE_MARGIN`; every later run revalidates the
    cached size the same way, one round a night, the streak carried in the cache."""
    key = auto_cache_key(prepared, config.precision, plan.torch_threads, config.engine)
    # The choice is the CPU's as much as the model's (its caches, its instructions): an entry
    # measured on another CPU model or flags is measured again (tuning.cpu_identity).
    cache = tuning.BatchSizeCache(tuning.default_cache_path())
    limit = prepared.max_batch
    default = default_batch(prepared)
    ladder = sorted({b for b in tuning.PIPELINE_SIZES if limit is None or b <= limit} | {default})
    entry = cache.entry(key, allowed=ladder)
    head = {"cached": entry is not None, "key": key, "cpu": tuning.cpu_summary(cache.cpu)}
    if sample_from is None:
        chosen = int(entry["batch_size"]) if entry is not None else default
        logger.info("batch size auto: no readable rows to measure; using %d", chosen)
        return chosen, {**head, "batch_size": chosen}
    before = torch.get_num_threads()
    t0 = time.perf_counter()
    try:
        trial = _challenge_batch(
            config, prepared, sample_from, plan, job_rows, call_rows, ladder, entry
        )
    finally:
        torch.set_num_threads(before)  # measured as the workers will run (plan.torch_threads)
    trial = trial._replace(seconds=time.perf_counter() - t0)  # the sample's copy included
    if entry is not None:
        check = _revalidated(cache, key, entry, trial, "batch size auto")
        return trial.chosen, {**head, "batch_size": trial.chosen, "revalidation": check}
    _first_measured(cache, key, trial)
    table = trial.found.table(trial.rows) if trial.found is not None else []
    return trial.chosen, {
        **head,
        "batch_size": trial.chosen,
        "basis": "pipeline",
        "sweep_s": trial.seconds,
        "sweep": [dataclasses.asdict(r) for r in table],
        **({"note": trial.note} if trial.note else {}),
    }


def _first_measured(cache: tuning.BatchSizeCache, key: str, trial: _Trial) -> None:
    """Cache a first run's choice, with its sweep and the streak it leaves; one that could not
    be measured within its budget is cached with its pace (the next run decides from that
    whether to measure, at no cost); nothing when no other size fitted the sample (a first
    shard smaller than every other size: a later run over bigger shards must measure)."""
    if trial.per_row is None:
        logger.info("batch size auto: %s; using %d, not cached", trial.note, trial.chosen)
        return
    if trial.found is None:
        logger.info("batch size auto: %s; using %d", trial.note, trial.chosen)
    extra = {"per_row_s": trial.per_row, **(_streak(trial.found) if trial.found else {})}
    table = trial.found.table(trial.rows) if trial.found is not None else []
    try:
        cache.put(key, trial.chosen, table, extra)
    except OSError as e:  # a cache must never stop a run: it measures again next time
        logger.warning("batch size auto: cannot write %s (%s)", cache.path, e)


def _streak(found: tuning.Challenge) -> dict[str, Any]:
    return {"streak": dataclasses.asdict(found.streak) if found.streak else None}


def _budget(entry: Mapping[str, Any] | None, per_row: float, job_rows: int, plan: Plan) -> float:
    """What a first run's measurement (``entry`` None) or a later run's revalidation may cost
    at ``per_row`` seconds a row through one worker's pipeline."""
    floor, share = (
        (AUTO_BUDGET_S, AUTO_JOB_SHARE) if entry is None else (AUTO_CHECK_S, AUTO_CHECK_SHARE)
    )
    return max(floor, share * per_row * job_rows / (plan.workers or 1))


def _challenge_batch(
    config: JobConfig,
    prepared: LoadedModel,
    sample_from: ShardRef,
    plan: Plan,
    job_rows: int,
    call_rows: int | None,
    ladder: list[int],
    entry: Mapping[str, Any] | None,
) -> _Trial:
    """The incumbent (the cached size, else the default) against its neighbours on the
    ladder, in passes of the whole pipeline over the same rows (as many as the largest size
    compared): :data:`AUTO_ROUNDS` rounds on a first run, :data:`AUTO_CHECK_ROUNDS` on a later
    one, as many as fit the budget (:func:`_budget`) at the pace of the incumbent's first
    timed pass (the first round's own). A later run whose cached pace says that even one round
    would not fit does not read the sample at all."""
    incumbent = int(entry["batch_size"]) if entry is not None else default_batch(prepared)
    rounds = AUTO_ROUNDS if entry is None else AUTO_CHECK_ROUNDS
    fixed = os.environ.get(SWEEP_ROWS_ENV, "")
    near = tuning.neighbours(ladder, incumbent)
    want = min(max([*near, incumbent]), int(fixed) if fixed.isdigit() else AUTO_SAMPLE_ROWS)
    pace = entry.get("per_row_s") if entry is not None else None
    if isinstance(pace, float) and pace > 0 and not fixed.isdigit():
        cost = pace * want * (1 + rounds * (1 + len(near)))
        if cost > _budget(entry, pace, job_rows, plan):
            note = f"a round would take about {cost:.2f}s ({1 / pace:,.0f} rows/s cached)"
            return _Trial(incumbent, None, want, 0.0, note, pace)
    with pipeline_step(config, prepared, sample_from, plan, call_rows, max_rows=want) as ps:
        step, rows = ps
        near = [b for b in near if b <= rows]
        if not near:
            return _Trial(
                incumbent,
                None,
                rows,
                0.0,
                f"the sample ({rows:,} rows) fits no size but {incumbent:,}",
            )
        t0 = time.perf_counter()
        n = min(rows, max([incumbent, *near]))
        step(incumbent, min(n, incumbent))  # a cold pass: allocations, first writes and calls
        first = step(incumbent, n)
        budget = _budget(entry, first / n, job_rows, plan) - (time.perf_counter() - t0)
        fits = int((budget + first) // (first * (1 + len(near))))
        rounds = rounds if fixed.isdigit() else min(rounds, fits)
        if rounds < 1:
            note = f"a round would take more than {budget:.2f}s ({n / first:,.0f} rows/s)"
            return _Trial(incumbent, None, n, 0.0, note, first / n)
        ready = [first]  # the first round's incumbent pass, already timed

        def timed(b: int) -> float:
            return ready.pop() if ready and b == incumbent else step(b, n)

        streak = tuning.streak_of(entry) if entry is not None else None
        found = tuning.challenge(timed, incumbent, near, rounds=rounds, streak=streak)
        return _Trial(found.chosen, found, n, 0.0, per_row=first / n)


def _revalidated(
    cache: tuning.BatchSizeCache,
    key: str,
    entry: Mapping[str, Any],
    trial: _Trial,
    what: str,
) -> dict[str, Any]:
    """Keep a revalidation in the cache and say it in the log; the report's ``revalidation``:
    ``kept``, ``replaced`` or ``skipped`` (``note`` says why), the cached size and the one
    used, each neighbour's pass / the cached size's pass of the same round, the streak carried
    to the next run and the seconds spent."""
    cached = int(entry["batch_size"])
    found = trial.found
    out: dict[str, Any] = {"cached": cached, "chosen": trial.chosen, "seconds": trial.seconds}
    if found is None:
        logger.info("%s: cached %d kept, not revalidated: %s", what, cached, trial.note)
        return {"outcome": "skipped", **out, "note": trial.note}
    pairs: list[dict[str, Any]] = [
        {"size": b, "ratios": rs} for b, rs in sorted(found.ratios.items())
    ]
    logger.info(
        "%s: cached %d %s against %s in %.2fs (pass time / the cached size's: %s)",
        what,
        cached,
        "kept" if found.outcome == "kept" else f"replaced by {found.chosen}",
        " and ".join(f"{b:,}" for b in sorted(found.ratios)),
        trial.seconds,
        "; ".join(
            f"{b:,}: " + ", ".join(f"{q:.2f}" for q in rs) for b, rs in sorted(found.ratios.items())
        ),
    )
    try:
        pace = {"per_row_s": trial.per_row} if trial.per_row is not None else None
        cache.revalidated(key, entry, found, pace)
    except OSError as e:  # a cache that cannot be written costs a measurement, no more
        logger.warning("%s: cannot write %s (%s)", what, cache.path, e)
    streak = _streak(found)
    return {"outcome": found.outcome, **out, "pairs": pairs, **streak}


def default_batch(model: LoadedModel) -> int:
    """The default batch size, never past what the program was exported for
    (model.check_batch_size)."""
    limit = model.max_batch
    return DEFAULT_BATCH_SIZE if limit is None else min(DEFAULT_BATCH_SIZE, limit)


#: What measuring the rows per model call may cost on a cold cache: 0.2 s, or
#: :data:`AUTO_JOB_SHARE` of the job's estimated scoring time when that is more. The demo MLP
#: measures its five sizes four times in about 0.15 s here; a model whose two rounds do not fit
#: (a 64-1024-1024-8 MLP: 0.15 s per 4,096-row call) keeps one call per batch, and the
#: decision is cached all the same. A job of fewer than :data:`CALL_MIN_BATCHES` batches is
#: not worth measuring for.
CALL_BUDGET_S = 0.2
CALL_MIN_BATCHES = 8


def call_rows(
    config: JobConfig,
    prepared: LoadedModel,
    opts: ExecutionOptions,
    plan: Plan,
    batch: int,
    job_rows: int,
) -> tuple[int | None, dict[str, Any] | None, tuple[str, ...]]:
    """Rows per model call on this CPU (:func:`pipeline.model.tuning.choose_call_rows`), at
    most the ``min(batch, CALL_SAMPLE_ROWS)`` rows it is measured over (a batch of 8,192 whose
    4,096 rows ran best in one call is called in two: an 8,192-row call was never measured, and
    ran 1.3-2.9x slower per batch here), cached per model, precision, engine, torch threads and
    CPU like the batch size and revalidated in every later run (:func:`_recheck_calls`), with
    the report's ``call_rows`` and any warning for the report; (None, None, ()) where it is not
    measured: a CUDA device (big calls are what a GPU wants), ``--compile`` (every call size
    would be a graph to compile) or a job of fewer than CALL_MIN_BATCHES batches."""
    n = min(batch, tuning.CALL_SAMPLE_ROWS)
    small = job_rows < CALL_MIN_BATCHES * n or n <= min(tuning.CALL_SIZES)
    if prepared.device.type != "cpu" or opts.compile or small:
        return None, None, ()
    key = auto_cache_key(prepared, config.precision, plan.torch_threads, config.engine)
    key += f"|calls{n}"
    cache = tuning.BatchSizeCache(tuning.default_cache_path())
    found: dict[str, Any] = {"key": key, "cpu": tuning.cpu_summary(cache.cpu)}
    before = torch.get_num_threads()
    try:
        if plan.torch_threads:  # measured as the workers will run (plan.torch_threads)
            torch.set_num_threads(plan.torch_threads)
        # In every run, cached or not, before anything is split: 2 calls of 256 rows.
        check = prepared.example(CHECK_ROWS, random=True, device="cpu")
        gap = _slicing_gap(prepared, check, CHECK_ROWS // 4)
        if gap > SLICE_TOLERANCE:
            warning = (
                f"model bundle {config.model}: a row's output depends on the other rows in its "
                f"call (max difference {gap:.3g} between one call of {CHECK_ROWS} rows and "
                f"calls of {CHECK_ROWS // 4}), so its scores change with the batch size and "
                "with where a row sits in its shard; batches are not split. Export the model "
                "after model.eval() (BatchNorm, dropout) so that each row is scored on its own."
            )
            logger.warning("%s", warning)
            note = f"not split: outputs depend on the call's other rows ({gap:.3g})"
            return None, {**found, "cached": False, "note": note}, (warning,)
        sizes = [c for c in tuning.CALL_SIZES if c < n] + [n]
        entry = cache.entry(key, allowed=sizes)
        if entry is not None:
            trial = _recheck_calls(prepared, plan, entry, n, job_rows)
            again = _revalidated(cache, key, entry, trial, "rows per model call")
            return trial.chosen, {**found, "cached": True, "revalidation": again}, ()
        x = prepared.example(n, random=True, device="cpu")
        chosen, sweep, facts = _measure_call_rows(prepared, plan, x, job_rows)
    finally:
        torch.set_num_threads(before)
    logger.info(
        "rows per model call: %s (%s)",
        f"{chosen:,} of every {n:,}-row batch" if chosen < n else "one call per batch",
        facts.get("note") or f"measured in {facts['sweep_s']:.2f}s",
    )
    try:
        cache.put(key, chosen, sweep)
    except OSError as e:  # a read-only cache folder costs a new measurement next time, no more
        logger.warning("rows per model call: cannot write %s (%s)", cache.path, e)
    return (
        chosen,
        {
            **found,
            "cached": False,
            **{k: facts[k] for k in ("noise", "note") if k in facts},
            "sweep_s": facts["sweep_s"],
            "sweep": [dataclasses.asdict(r) for r in sweep],
        },
        (),
    )


def _measure_call_rows(
    prepared: LoadedModel, plan: Plan, x: Inputs, job_rows: int
) -> tuple[int, list[tuning.BenchRow], dict[str, Any]]:
    """The measurement behind :func:`_call_rows`, within its budget (CALL_BUDGET_S)."""
    n = rows_of(x)
    t0 = time.perf_counter()
    with torch.inference_mode():
        forward(prepared, x)  # first call at this shape: allocations, kernel choice
        t1 = time.perf_counter()
        forward(prepared, x)
    probe = time.perf_counter() - t1
    budget = max(CALL_BUDGET_S, AUTO_JOB_SHARE * probe / n * job_rows / (plan.workers or 1))
    sizes = 1 + sum(1 for c in tuning.CALL_SIZES if c < n)
    if 2 * sizes * probe > budget:
        note = f"not measured: one {n}-row call takes {probe:.3f}s"
        return n, [], {"note": note, "sweep_s": time.perf_counter() - t0}
    chosen, sweep, facts = tuning.choose_call_rows(
        lambda xs: forward(prepared, xs),
        x,
        prepared.device,
        batch=n,
        budget_s=budget - (time.perf_counter() - t0),
    )
    facts["sweep_s"] = time.perf_counter() - t0
    return chosen, sweep, facts


#: What revalidating a cached rows per call may cost: 0.05 s, or :data:`AUTO_CHECK_SHARE` of
#: the job's estimated model time when that is more; two rounds against its neighbours (the
#: demo MLP: about 0.03 s here, against 0.11-0.2 s to measure every size afresh).
CALL_CHECK_S = 0.05
CALL_CHECK_ROUNDS = 2


def _recheck_calls(
    prepared: LoadedModel, plan: Plan, entry: Mapping[str, Any], n: int, job_rows: int
) -> _Trial:
    """A cached rows per model call against its neighbours
    (:func:`pipeline.model.tuning.recheck_call_rows`): a choice made once, on a busy moment,
    is not kept for good (issue 31: a cached 2,048 ran slower night after night than the 1,024
    that every fresh measurement found). Skipped where the cached measurement says the passes
    would not fit :data:`CALL_CHECK_S` (or a share of the job), or has no pass times at all
    (one call per batch because a call was too slow to measure)."""
    cached = int(entry["batch_size"])
    rows = {r.get("batch"): r.get("ms") for r in entry.get("sweep") or [] if isinstance(r, dict)}
    ms = rows.get(cached)
    passes = 1 + CALL_CHECK_ROUNDS * 3  # warm-up calls, then rounds of 3 sizes
    if not isinstance(ms, (int, float)) or isinstance(ms, bool) or ms <= 0:
        return _Trial(cached, None, n, 0.0, "no pass times cached to size a revalidation")
    pass_s = ms / 1e3
    budget = max(CALL_CHECK_S, AUTO_CHECK_SHARE * pass_s / n * job_rows / (plan.workers or 1))
    if passes * pass_s > budget:
        note = f"{passes} passes of {pass_s:.3f}s would take more than {budget:.2f}s"
        return _Trial(cached, None, n, 0.0, note)
    x = prepared.example(n, random=True, device="cpu")
    found = tuning.recheck_call_rows(
        lambda xs: forward(prepared, xs),
        x,
        prepared.device,
        batch=n,
        cached=cached,
        rounds=CALL_CHECK_ROUNDS,
        streak=tuning.streak_of(entry),
    )
    return _Trial(found.chosen, found, n, found.seconds)


#: Rows of the check that a model scores each row on its own (one call, then four calls).
CHECK_ROWS = 256
#: The largest difference between a batch's outputs called whole and in slices that is still
#: rounding: on the bench's MLPs the two were the same bits; a model that normalises over its
#: batch differs by far more.
SLICE_TOLERANCE = 1e-5


def _slicing_gap(model: LoadedModel, x: Inputs, call_rows: int) -> float:
    """Max |difference| between ``x``'s outputs in one call and in calls of ``call_rows``."""
    n = rows_of(x)
    with torch.inference_mode():
        whole = forward(model, x).float()
        parts = [
            forward(model, tuple(t[i : i + call_rows] for t in x)) for i in range(0, n, call_rows)
        ]
        sliced = torch.cat(parts).float()
    if whole.shape != sliced.shape:
        return math.inf
    return float((whole - sliced).abs().nan_to_num(nan=0.0).max()) if n else 0.0


def row_dependence(model: LoadedModel) -> float | None:
    """The largest difference between the outputs of :data:`CHECK_ROWS` random rows in one
    call and in four, where it is more than rounding (:data:`SLICE_TOLERANCE`): a model whose
    output for a row depends on the other rows of its call (BatchNorm in training mode). None
    for a model that scores each row on its own."""
    rows = min(CHECK_ROWS, model.max_batch or CHECK_ROWS)
    gap = _slicing_gap(model, model.example(rows, random=True), max(1, rows // 4))
    return gap if gap > SLICE_TOLERANCE else None


@contextlib.contextmanager
def pipeline_step(
    config: JobConfig,
    model: LoadedModel,
    shard: ShardRef,
    plan: Plan,
    call_rows: int | None = None,
    *,
    max_rows: int = AUTO_SAMPLE_ROWS,
) -> Iterator[tuple[Callable[[int, int], float], int]]:
    """``step(batch, rows)``: score a local copy of the first ``rows`` (up to ``max_rows``)
    rows of ``shard`` through the workers' own code
    (:func:`pipeline.worker.shard.score_shard`: read, features, model, output columns, statistics,
    write, commit, with the run's precision, overlap and thread count) into a scratch folder,
    and return its seconds; and the sample's rows."""
    meta_cols = (config.id_column, *config.passthrough)
    columns = list(dict.fromkeys([*meta_cols, *model.spec.input_columns]))
    with open_parquet(shard.uri, config.storage) as pf:
        pieces, have = [], 0
        for rb in pf.iter_batches(batch_size=8192, columns=columns, use_threads=False):
            pieces.append(rb)
            have += rb.num_rows
            if have >= max_rows:
                break
    table = pa.Table.from_batches(pieces).slice(0, max_rows)
    with tempfile.TemporaryDirectory(prefix="score-catalog-auto-") as tmp:
        samples: dict[int, str] = {}

        def sample_of(rows: int) -> str:
            if rows not in samples:
                samples[rows] = os.path.join(tmp, f"sample-{rows}.parquet")
                pq.write_table(table.slice(0, rows), samples[rows], row_group_size=8192)
            return samples[rows]

        # The sample is a local file: no storage options (the model is this process's already).
        local: dict[str, object] = {}
        device = str(model.device)
        spec_model = model_spec(config, model.sha256, device, model.widths, storage_options=local)
        meta = pa.schema([table.schema.field(c) for c in meta_cols]).serialize().to_pybytes()

        def step(batch: int, rows: int) -> float:
            rows = min(rows, table.num_rows)
            task = ShardTask(
                "sample.parquet",
                sample_of(rows),
                os.path.join(tmp, f"out-{batch}.parquet"),
                os.path.join(tmp, f"rejects-{batch}.parquet"),
                rows,
                meta,
            )
            spec = worker_spec(
                config,
                spec_model,
                batch_size=batch,
                overlap=plan.overlap,
                torch_threads=plan.torch_threads,
                storage_options=local,
                call_rows=call_rows if call_rows is not None and call_rows < batch else None,
            )
            t0 = time.perf_counter()
            result = score_shard(spec, task)
            seconds = time.perf_counter() - t0
            if result.status != ShardStatus.SCORED:
                raise ModelError(
                    f"batch size auto: the sample could not be scored: {result.message}"
                )
            return seconds

        yield step, table.num_rows
