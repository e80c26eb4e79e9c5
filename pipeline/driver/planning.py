"""``score-catalog plan``: what a run would do, from footers and a calibration; scores nothing.

Reads every footer, checks each schema against the model, reads the output's manifest to say which
shards a resume would skip, and times the model on real rows at the configured batch size to
estimate how long the scoring would take. Nothing is written and no lock is taken.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Any

import torch

from pipeline.core import storage_options
from pipeline.core.config import JobConfig
from pipeline.driver import incremental
from pipeline.driver.autotune import auto_cache_key, pipeline_step
from pipeline.driver.cluster import Plan, thread_plan
from pipeline.driver.dispatch import group_tasks
from pipeline.driver.execution import SAMPLE_ROWS, sample_rows
from pipeline.driver.inspect import (
    Inspection,
    Settings,
    check_job_columns,
    inspect_shards,
    list_input,
    meta_fields,
    run_identity,
)
from pipeline.io import layout, nesting, ownership, storage
from pipeline.io.listing import ShardRef
from pipeline.io.manifest import Manifest, expectation, fingerprint_hash
from pipeline.io.parquet import ShardInfo
from pipeline.model import oov, programcache, registry
from pipeline.model.bundle import read_bundle, rows_of
from pipeline.model.precision import ExecutionOptions, prepare
from pipeline.model.program import forward, resolve_device
from pipeline.model.tuning import BatchSizeCache, bench_batch_sizes, default_cache_path
from pipeline.sinks import sink_for
from pipeline.sinks.base import Begun, Expected

# Time spent timing, roughly: half of it the model alone, then the worker's whole path (each of
# its passes sized to a quarter of it, after one cold pass).
CALIBRATION_S = 2.0
DEFAULT_AUTO_BATCH = 4096  # what `plan` assumes for batch_size = "auto" before it is cached


def plan_job(config: JobConfig) -> dict[str, Any]:
    """Plan ``config`` without scoring: shards, rows, schema problems, resume skips, estimate."""
    t0 = time.perf_counter()
    source = registry.resolve_model(config.model)
    config = dataclasses.replace(config, model=source.bundle)
    opts = config.storage
    where = layout.for_run(config, "plan")
    out_root = where.output
    shards = list_input(config)
    # What a run would refuse before writing (a missing bucket, an output under a file, an
    # output that contains or lies inside another, or belongs to another job; rejects inside
    # a dataset).
    ownership.check_write_target(out_root, "output", create_bucket=config.create_output_bucket)
    sink = sink_for(config, where, "plan")
    rejects = storage.locate(config.rejects_uri("plan"), opts)
    nesting.check_run(config, where, rejects, table_names=sink.places.table_names)
    device = resolve_device(config.device)
    spec, _, sha = read_bundle(config.model, opts)
    found = inspect_shards(config, shards, spec, sha, device, opts)
    _, failed, problems, _, model = found
    check_job_columns(config, found.infos)  # as the run would: a typo, exit 2
    meta_fields(config, found.infos, failed)  # and a column no one type can hold, exit 3
    # What the run would warn about: in the plan's output (its table or JSON), once.
    warnings = oov.check(model)
    settings, scorer = run_identity(
        config, spec, sha, str(device), source.model_version, sink.keeps_fingerprints()
    )
    entries = _shard_entries(config, shards, found, where, expect_done=(sha, settings.hash))
    to_score = [e for e in entries if e["action"] == "score"]
    rows_to_score = sum(e["rows"] or 0 for e in to_score)
    plan = thread_plan(config, len(to_score), device.type)
    sample_from = next(
        (
            s
            for s in shards
            if s.rel_path not in failed
            and s.rel_path not in problems
            and found.infos[s.rel_path].num_rows
        ),
        None,
    )
    startup_s = time.perf_counter() - t0  # what the run also does before its first shard
    calibration = _calibrate(config, model, sample_from, plan)
    estimate = _estimate(config, plan, calibration, [e["rows"] or 0 for e in to_score])
    if estimate is not None:
        estimate["startup_s"] = startup_s
    bad = [e for e in entries if e["action"] == "fail"]
    night = None
    if config.incremental and scorer is not None:
        night = _incremental(config, scorer, model, where, sink, entries, found, calibration)
    return {
        "job": config.name,
        "input": storage.locate(config.input_uri(), opts).uri,
        "output": out_root.uri,
        "model": {
            "uri": source.uri,
            "name": spec.name,
            "version": spec.version,
            "sha256": sha,
            "registry": source.report(),
        },
        "device": str(device),
        "threads": plan.public(),
        "overlap": plan.overlap,
        "shards_total": len(entries),
        "shards_to_score": len(to_score),
        "shards_skipped": sum(e["action"].startswith("skip") for e in entries),
        "shards_failing": len(bad),
        "rows_total": sum(e["rows"] or 0 for e in entries),
        "rows_to_score": rows_to_score,
        "calibration": calibration,
        "estimated_scoring_s": None if estimate is None else estimate["scoring_s"],
        "estimate": estimate,
        "incremental": night,
        "problems": [f"{e['input']}: {e['problem']}" for e in entries if e.get("problem")],
        "warnings": warnings,
        "shards": entries,
        "plan_s": time.perf_counter() - t0,
    }


def _incremental(
    config: JobConfig,
    scorer: Settings,
    model: Any,
    where: layout.Places,
    sink: Any,
    entries: list[dict[str, Any]],
    found: Inspection,
    calibration: dict[str, Any],
) -> dict[str, Any]:
    """What an incremental run would send through the model and carry
    (:func:`pipeline.driver.incremental.preview`)."""
    night = incremental.Night(config, scorer, model, where.output, where.control, sink)
    to_score = [(e["rel_path"], e["input"]) for e in entries if e["action"] == "score"]
    readable = [e["input"] for e in entries if e["action"] != "fail"]
    assert found.widths is not None
    return incremental.preview(
        night, to_score, readable, found.widths, int(calibration["batch_size"])
    )


def _shard_entries(
    config: JobConfig,
    shards: list[ShardRef],
    found: Inspection,
    where: layout.Places,
    expect_done: tuple[str, str],  # model SHA-256 and settings hash a done shard must match
) -> list[dict[str, Any]]:
    """One plan entry per shard: rows, row groups, bytes and what a run would do with it."""
    infos, failed, problems = found.infos, found.failed, found.schema_problems
    manifest = Manifest.load(where.control, where.old_controls)
    # What the output holds now, as a run's lock phase would find it (no lock taken).
    begun = sink_for(config, where, "plan").state(manifest)
    entries: list[dict[str, Any]] = []
    for s in shards:
        info = infos.get(s.rel_path)
        entry: dict[str, Any] = {
            "rel_path": s.rel_path,
            "input": s.uri,
            "rows": info.num_rows if info else None,
            "row_groups": info.num_row_groups if info else None,
            "bytes": s.size,
        }
        if s.rel_path in failed:
            entry.update(action="fail", problem=failed[s.rel_path].message)
        elif s.rel_path in problems:
            action = "fail" if config.errors.on_schema_error == "fail" else "skip (schema)"
            entry.update(action=action, problem="; ".join(problems[s.rel_path]))
        else:
            assert info is not None
            done = not config.force and _done(manifest, s, info, begun, expect_done)
            entry["action"] = "skip (done)" if done else "score"
        entries.append(entry)
    return entries


def _done(
    manifest: Manifest,
    s: ShardRef,
    info: ShardInfo,
    begun: Begun,
    expect_done: tuple[str, str],
) -> bool:
    """Whether a run would skip ``s``: as the lock phase judges it (pipeline.driver.lock), from
    the manifest entry and what the sink says of the shard's file."""
    expect = expectation(s, info, *expect_done)
    if not manifest.matches(s.rel_path, expect):
        return False
    entry = manifest.shards[s.rel_path]
    want = Expected(
        entry["rows_scored"], *expect_done, s.rel_path, fingerprint_hash(expect["fingerprint"])
    )
    return not begun.done(s.rel_path, entry, want)


def _calibrate(config: JobConfig, model: Any, sample_from: Any, plan: Plan) -> dict[str, Any]:
    """How fast one worker scores, on real rows at the configured batch size: the model alone
    (``rows_per_s``), and the whole per-shard path a worker runs (``pipeline``)."""
    batch = config.batch_size
    note = None
    threads = plan.torch_threads
    if batch == "auto":
        # The key the run's own choice is cached under (it was read under another, and missed).
        key = auto_cache_key(model, config.precision, threads, config.engine)
        cached = BatchSizeCache(default_cache_path()).get(key)
        batch = cached or DEFAULT_AUTO_BATCH
        if not cached:
            note = f"batch_size auto not measured yet; assumed {DEFAULT_AUTO_BATCH}"
    assert isinstance(batch, int)
    if model.device.type == "cpu" and threads:
        # Timed with no more torch threads than there are free cores: on a busy machine the
        # extra OpenMP threads only spin, which made a 2-thread timing here 2-5x slower than
        # the run's workers scored (OMP_WAIT_POLICY=PASSIVE brought it back).
        threads = max(1, min(threads, int(_free_cores(plan.cores))))
        plan = dataclasses.replace(plan, torch_threads=threads)
    prepared, _ = prepare(
        model, ExecutionOptions(config.precision, config.compile, config.strict_fp32, config.engine)
    )
    x = sample_rows(config, model, sample_from) if sample_from is not None else None
    if x is None or not rows_of(x):
        x = model.example(min(SAMPLE_ROWS, batch), random=True, device="cpu")
        note = (note + "; " if note else "") + "no readable rows: timed on random rows"
    x = tuple(t[:batch] for t in x)
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        (row,) = bench_batch_sizes(
            lambda t: forward(prepared, t),
            x,
            model.device,
            [batch],
            repeats=3,
            warmup=1,
            time_budget_s=CALIBRATION_S / 2,
        )
        pipeline = _time_pipeline(config, model, sample_from, plan, batch)
    finally:
        torch.set_num_threads(before)
    return {
        "batch_size": batch,
        "device": str(model.device.type),
        "rows": rows_of(x),
        "torch_threads": threads,
        "rows_per_s": row.samples_per_s,
        "ms_per_batch": row.ms * batch / max(1, rows_of(x)),
        "pipeline": pipeline,
        "note": note,
    }


#: The ``plan`` estimate used to time the model alone (``forward`` on in-memory tensors): the
#: demo job's 200,000 rows came out at 0.03 s of "scoring" for a run whose shards took 0.96 s
#: from the first start to the last commit, and W1 at 4.5 s for 15.4 s (a shared 2-core
#: machine), because reading, turning Arrow columns into tensors, the output columns,
#: statistics and writing cost more than the model, and the workers shared the cores with other
#: work. So the estimate times what a worker runs for each shard instead, and counts the cores
#: the load average leaves free.
PIPELINE_PASSES = 3  # timed passes of the whole path (their median is used)


def _time_pipeline(
    config: JobConfig, model: Any, sample_from: ShardRef | None, plan: Plan, batch: int
) -> dict[str, Any] | None:
    """What one worker slot takes through its whole per-shard path
    (:func:`pipeline.worker.shard.score_shard`: read, features, model, output columns, statistics,
    write, commit; the run's batch size, precision, threads and overlap), timed on the first
    rows of ``sample_from`` (up to 16,384) copied to local disk: seconds per row, the median
    of :data:`PIPELINE_PASSES` passes, each pass's per-shard costs included (the first shard's
    size stands for the others', which is what makes a job of tiny shards come out slow); and
    the warm-up a fresh worker pays once (loading the model from the program cache, and the
    first pass's extra time). None without a readable, non-empty shard."""
    if sample_from is None:
        return None
    t0 = time.perf_counter()
    with pipeline_step(config, model, sample_from, plan) as (step, rows):
        probe = min(rows, batch)
        first = step(batch, probe)  # a cold pass: its allocations, first writes and calls
        # At least two batches (one batch on a busy machine measured mostly noise), at most a
        # quarter of the budget per pass at the probe's pace.
        fits = int(CALIBRATION_S / 4 / max(first / probe, 1e-9))
        big = min(rows, max(2 * probe, fits))
        per_row_s = statistics.median(step(batch, big) for _ in range(PIPELINE_PASSES)) / big
    warm_up = max(0.0, first - per_row_s * probe) + _load_seconds(model)
    return {
        "shard": sample_from.rel_path,
        "rows": big,
        "per_row_s": per_row_s,
        "rows_per_s": 1 / per_row_s if per_row_s > 0 else None,
        "warm_up_s": warm_up,
        "seconds": time.perf_counter() - t0,
    }


def _load_seconds(model: Any) -> float:
    """How long a worker takes to load this bundle's program, as the run's workers do: from
    the program cache (which the run's own load fills first); 0 where it is not cached."""
    t0 = time.perf_counter()
    try:
        cached = programcache.load(model.sha256)
    except Exception:  # a cache that cannot be read: the workers load the bundle some other way
        return 0.0
    return time.perf_counter() - t0 if cached is not None else 0.0


def _estimate(
    config: JobConfig, plan: Plan, calibration: dict[str, Any], shard_rows: list[int]
) -> dict[str, Any] | None:
    """The scoring time of the shards to score (from the first shard's start to the last
    one's commit), from the per-shard cost :func:`_time_pipeline` measured: the shards grouped
    into tasks as the run groups them, each task on the first worker slot free, in order. None
    where the number of workers is not known (an external cluster)."""
    cost = calibration.get("pipeline")
    slots = (plan.workers or 0) * (plan.threads_per_worker or 1)
    if not slots:
        return None
    if cost is None:  # no readable rows: the model alone, which is all that could be timed
        rate = calibration["rows_per_s"] or 0.0
        cost = {"per_row_s": 1 / rate if rate else 0.0, "warm_up_s": 0.0}
    items = [_Rows(n) for n in shard_rows]
    groups = (
        [[i] for i in items]
        if plan.scheduler == "sync"
        else (group_tasks(items, config.task_rows, slots))
    )
    # Each slot runs at the measured pace only with a core of its own; on a machine busy with
    # other work the slots share what is left (see _free_cores), and slow down together.
    free_cores = _free_cores(plan.cores) if str(calibration.get("device", "cpu")) == "cpu" else None
    share = 1.0 if free_cores is None else min(1.0, free_cores / slots)
    # When each worker slot is next free: after its warm-up, then after each task it takes.
    free = [cost["warm_up_s"] / share] * min(slots, len(groups))
    for group in groups:
        k = free.index(min(free))
        free[k] += cost["per_row_s"] * sum(i.num_rows for i in group) / share
    excludes = [
        *(
            [f"starting {plan.workers} Dask worker process(es), beyond the model load"]
            if plan.scheduler == "local"
            else []
        ),
        "the run's finish (report, drift, HTML page)",
    ]
    remote = [u for u in (config.input, config.output) if not storage_options.is_local_uri(u)]
    if remote:
        excludes.append("transfers to and from object storage (the sample was timed on local disk)")
    return {
        "scoring_s": max(free, default=0.0),
        "slots": slots,
        "tasks": len(groups),
        "free_cores": free_cores,
        "cores": plan.cores,
        "excludes": excludes,
    }


def _free_cores(cores: int) -> float:
    """The cores not busy with other work: ``cores`` less the 1-minute load average (this
    process, busy timing the model, counted out), at least one.

    Measured here (a 2-core machine shared with other test runs, load average 5-8): with the
    estimate assuming a core per worker, the demo job's shards took 4x and W1's 2x longer than
    estimated, since its 2 workers got about one core between them."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # not available on this platform
        return float(cores)
    return max(1.0, min(float(cores), cores - max(0.0, load - 1.0)))


@dataclasses.dataclass(frozen=True)
class _Rows:
    """A shard to score, as :func:`pipeline.driver.dispatch.group_tasks` sees it."""

    num_rows: int


def _estimate_lines(plan: dict[str, Any]) -> list[str]:
    """The estimate for the terminal: the scoring time, what it rests on, what it leaves out."""
    est, cal = plan.get("estimate"), plan["calibration"]
    if est is None:
        return ["  estimate  unknown (an external cluster's size is not known in advance)"]
    pipe = cal.get("pipeline")
    basis = (
        f"{pipe['rows_per_s']:,.0f} rows/s per worker slot reading, scoring and writing "
        f"{pipe['rows']:,} rows of {pipe['shard']} here, after a warm-up of "
        f"{pipe['warm_up_s']:.2f}s"
        if pipe and pipe.get("rows_per_s")
        else "the model alone: no readable rows to time the rest on"
    )
    busy = ""
    if est.get("free_cores") is not None and est["free_cores"] < min(est["slots"], est["cores"]):
        busy = (
            f" (the machine is busy: about {est['free_cores']:.1f} of its {est['cores']} cores "
            "are free, by the load average, and the workers share them)"
        )
    return [
        f"  estimate  {est['scoring_s']:.1f}s of scoring, from the first shard's start to the "
        f"last one's commit: {plan['rows_to_score']:,} rows in {est['tasks']} task(s) on "
        f"{est['slots']} worker slot(s){busy} at {basis}",
        f"            a whole run: about {est['startup_s'] + est['scoring_s']:.1f}s, with "
        f"{est['startup_s']:.1f}s before its first shard (listing, footers, the model: what "
        "this plan did before timing)",
        "            not included: " + "; ".join(est["excludes"]),
    ]


def plan_table(plan: dict[str, Any], *, max_shards: int = 40) -> str:
    """The plan for the terminal."""
    cal = plan["calibration"]
    lines = [
        f"score-catalog plan {plan['job']}",
        f"  input     {plan['input']}",
        f"  output    {plan['output']}",
        f"  model     {plan['model']['name']} v{plan['model']['version']} "
        f"({plan['model']['sha256'][:12]}) on {plan['device']}",
        f"  shards    {plan['shards_total']} total: {plan['shards_to_score']} to score, "
        f"{plan['shards_skipped']} skipped, {plan['shards_failing']} would fail",
        f"  rows      {plan['rows_total']:,} in footers, {plan['rows_to_score']:,} to score",
        f"  model     {cal['rows_per_s']:,.0f} rows/s per worker at batch {cal['batch_size']}, "
        f"the model alone ({cal['torch_threads']} torch threads)"
        + (f"; {cal['note']}" if cal["note"] else ""),
        f"  overlap   read-ahead and write-behind threads {'on' if plan['overlap'] else 'off'}",
        *_estimate_lines(plan),
        *_incremental_lines(plan),
        "",
        f"  {'shard':<40} {'rows':>12} {'row groups':>10}  action",
    ]
    for e in plan["shards"][:max_shards]:
        rows = "-" if e["rows"] is None else f"{e['rows']:,}"
        rgs = "-" if e["row_groups"] is None else str(e["row_groups"])
        lines.append(f"  {e['rel_path']:<40} {rows:>12} {rgs:>10}  {e['action']}")
    if len(plan["shards"]) > max_shards:
        lines.append(f"  ... {len(plan['shards']) - max_shards} more shards (--json lists all)")
    for p in plan["problems"]:
        lines.append(f"  PROBLEM {p}")
    for w in plan.get("warnings") or []:
        lines.append(f"  WARNING {w}")
    return "\n".join(lines)


def _incremental_lines(plan: dict[str, Any]) -> list[str]:
    """What an incremental run would send through the model, or why it would score all."""
    inc = plan.get("incremental")
    if not inc:
        return []
    base = inc.get("baseline")
    if base is None:
        return [f"  changed   every row would be scored: {inc['full_reason']}"]
    night = base.get("date") or base.get("output")
    return [
        f"  changed   {inc['rows_scored']:,} rows would go through the model "
        f"({inc['rows_new']:,} new, {inc['rows_changed']:,} changed), "
        f"{inc['rows_carried']:,} carried from run {base['run_id']} ({night})"
    ]
