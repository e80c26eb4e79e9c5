"""``score-catalog plan``: what a run would do, from footers and a calibration; scores nothing.

Reads every footer, checks each schema against the model, reads the output's manifest to say which
shards a resume would skip, and times the model on real rows at the configured batch size to
estimate how long the scoring would take. Nothing is written and no lock is taken.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from pipeline import oov, registry, storage
from pipeline.cluster import thread_plan
from pipeline.config import JobConfig
from pipeline.manifest import Manifest, expectation, fingerprint_hash
from pipeline.model import forward, read_bundle, resolve_device, rows_of
from pipeline.precision import ExecutionOptions, prepare
from pipeline.preparation import (
    SAMPLE_ROWS,
    Inspection,
    check_job_columns,
    inspect_shards,
    list_input,
    meta_fields,
    run_settings,
    sample_rows,
)
from pipeline.reading import ShardInfo
from pipeline.reconcile import Expected, file_problems
from pipeline.storage import Location, ShardRef
from pipeline.tuning import BatchSizeCache, bench_batch_sizes, cache_key, default_cache_path

CALIBRATION_S = 2.0  # time spent timing the model, at most (plus one warm-up pass)
DEFAULT_AUTO_BATCH = 4096  # what `plan` assumes for batch_size = "auto" before it is cached


def plan_job(config: JobConfig) -> dict[str, Any]:
    """Plan ``config`` without scoring: shards, rows, schema problems, resume skips, estimate."""
    t0 = time.perf_counter()
    source = registry.resolve_model(config.model)
    config = dataclasses.replace(config, model=source.bundle)
    opts = config.storage
    out_root = storage.locate(config.output_uri("plan"), opts)
    shards = list_input(config)
    # What a run would refuse before writing (a missing bucket, an output under a file).
    storage.check_write_target(out_root, "output", create_bucket=config.create_output_bucket)
    device = resolve_device(config.device)
    spec, _, sha = read_bundle(config.model, opts)
    found = inspect_shards(config, shards, spec, sha, device, opts)
    _, failed, problems, _, model = found
    check_job_columns(config, found.infos)  # as the run would: a typo, exit 2
    meta_fields(config, found.infos, failed)  # and a column no one type can hold, exit 3
    # What the run would warn about: in the plan's output (its table or JSON), once.
    warnings = oov.check(model)
    settings = run_settings(config, spec, model_version=source.model_version)
    entries = _shard_entries(config, shards, found, out_root, expect_done=(sha, settings.hash))
    to_score = [e for e in entries if e["action"] == "score"]
    rows_to_score = sum(e["rows"] or 0 for e in to_score)
    plan = thread_plan(config, len(to_score), device.type)
    sample_from = next(
        (s for s in shards if s.rel_path not in failed and s.rel_path not in problems), None
    )
    calibration = _calibrate(config, model, sample_from, plan.torch_threads)
    workers = plan.workers
    estimate = None
    if calibration["rows_per_s"] and workers:
        estimate = rows_to_score / (calibration["rows_per_s"] * workers)
    bad = [e for e in entries if e["action"] == "fail"]
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
        "estimated_scoring_s": estimate,
        "problems": [f"{e['input']}: {e['problem']}" for e in entries if e.get("problem")],
        "warnings": warnings,
        "shards": entries,
        "plan_s": time.perf_counter() - t0,
    }


def _shard_entries(
    config: JobConfig,
    shards: list[ShardRef],
    found: Inspection,
    out_root: Location,
    expect_done: tuple[str, str],  # model SHA-256 and settings hash a done shard must match
) -> list[dict[str, Any]]:
    """One plan entry per shard: rows, row groups, bytes and what a run would do with it."""
    infos, failed, problems = found.infos, found.failed, found.schema_problems
    manifest = Manifest.load(out_root)
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
            done = not config.force and _done(manifest, s, info, out_root, expect_done, config)
            entry["action"] = "skip (done)" if done else "score"
        entries.append(entry)
    return entries


def _done(
    manifest: Manifest,
    s: ShardRef,
    info: ShardInfo,
    out_root: Location,
    expect_done: tuple[str, str],
    config: JobConfig,
) -> bool:
    """Whether a run would skip ``s``: as ``ScoringRun._skip_if_done`` judges it, from the
    manifest entry and the output file's footer."""
    expect = expectation(s, info, *expect_done)
    if not manifest.matches(s.rel_path, expect):
        return False
    rows = manifest.shards[s.rel_path]["rows_scored"]
    want = Expected(rows, *expect_done, s.rel_path, fingerprint_hash(expect["fingerprint"]))
    return not file_problems(out_root.child(s.rel_path), want, config.storage)


def _calibrate(
    config: JobConfig, model: Any, sample_from: Any, threads: int | None
) -> dict[str, Any]:
    """Model-only rows/s per worker at the configured batch size, on real rows."""
    batch = config.batch_size
    note = None
    if batch == "auto":
        key = cache_key(model.sha256, model.device, config.precision, threads)
        cached = BatchSizeCache(default_cache_path()).get(key)
        batch = cached or DEFAULT_AUTO_BATCH
        if not cached:
            note = f"batch_size auto not measured yet; assumed {DEFAULT_AUTO_BATCH}"
    assert isinstance(batch, int)
    prepared, _ = prepare(
        model, ExecutionOptions(config.precision, config.compile, config.strict_fp32)
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
            time_budget_s=CALIBRATION_S,
        )
    finally:
        torch.set_num_threads(before)
    return {
        "batch_size": batch,
        "rows": rows_of(x),
        "torch_threads": threads,
        "rows_per_s": row.samples_per_s,
        "ms_per_batch": row.ms * batch / max(1, rows_of(x)),
        "note": note,
    }


def plan_table(plan: dict[str, Any], *, max_shards: int = 40) -> str:
    """The plan for the terminal."""
    est = plan["estimated_scoring_s"]
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
        f"  model     {cal['rows_per_s']:,.0f} rows/s per worker at batch {cal['batch_size']} "
        f"({cal['torch_threads']} torch threads)" + (f"; {cal['note']}" if cal["note"] else ""),
        f"  overlap   read-ahead and write-behind threads {'on' if plan['overlap'] else 'off'}",
        "  estimate  "
        + (
            f"{est:.1f}s of scoring with {plan['threads']['workers']} worker(s) (model time "
            "only: start-up, reading and writing add to it)"
            if est is not None
            else "unknown (an external cluster's size is not known in advance)"
        ),
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
