"""Entry point of ``make bench``: ``python -m bench.run [--quick] [--repeats N] [--only W1,..]``.

Builds (or reuses) the workloads under ``.bench/``, runs every suite, prints the report and
writes it to BENCHMARKS.md at the repository root (raw samples go to ``.bench/results.json``).
Exits 1 when any comparator failed or left a process behind, after writing the report.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

from bench import delta, incremental, report, suites, workloads
from bench.procs import run_measured

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / ".bench"
SUITE_KEYS = ("W1", "W1X10", "W2", "W3", "TINY", "DELTA", "INCREMENTAL", "PROFILE")


def _log(msg: str) -> None:
    # Progress goes to stderr so that stdout carries only the report.
    print(msg, file=sys.stderr, flush=True)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
    p.add_argument("--quick", action="store_true", help="a tenth of the rows, one round")
    p.add_argument("--repeats", type=int, help="rounds per comparator (default 3; quick: 1)")
    p.add_argument(
        "--only",
        help=f"comma-separated subset of {','.join(SUITE_KEYS)} (marks the report PARTIAL)",
    )
    p.add_argument("--output", default="BENCHMARKS.md", help="report path, relative to the repo")
    p.add_argument(
        "--budget-min",
        type=float,
        default=15.0,
        help="time budget in minutes: the optional batch-65,536 runs are skipped when they "
        "would not fit (default 15)",
    )
    args = p.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.only:
        args.only = [s.strip().upper() for s in args.only.split(",") if s.strip()]
        unknown = sorted(set(args.only) - set(SUITE_KEYS))
        if unknown:
            p.error(f"unknown suite(s) {unknown}; choose from {', '.join(SUITE_KEYS)}")
    return args


def _command(argv: list[str]) -> str:
    if not argv:
        return "make bench"
    return f"make bench BENCH_ARGS={shlex.quote(' '.join(argv))}"


def _warm_up(runner: suites.Runner, data: workloads.Data) -> None:
    """One untimed CLI run, so that the first measured run does not pay for a cold page cache
    of torch's and dask's files."""
    out = runner.out_dir("warmup", "cli")
    suites.clear_output(out)  # a leftover output would make the run a no-op
    argv = runner.cli_argv(data.tiny, out, data.w1_model, suites.BATCH)
    log_path = ROOT / "logs" / "warmup.log"
    pr = run_measured(argv, log_path=log_path, cwd=REPO, timeout_s=suites.RUN_TIMEOUT_S)
    suites.clear_output(out)
    _log(f"warm-up CLI run: exit {pr.returncode}, {pr.wall_s:.1f} s")
    if pr.returncode != 0 or pr.timed_out or pr.wall_s > 60:
        runner.warnings.append(
            f"the untimed warm-up CLI run (1,000 rows) failed or hung (exit {pr.returncode}, "
            f"{pr.wall_s:.0f} s); see .bench/logs/warmup.log"
        )
        _log(pr.log_tail())
    if pr.leaked_pids:
        runner.leaks.append(f"warm-up: {len(pr.leaked_pids)} process(es) outlived the run")


def _maybe_big_batch(
    runner: suites.Runner,
    data: workloads.Data,
    sizes: workloads.Sizes,
    w1: suites.WorkloadResult,
    budget_s: float,
    t0: float,
) -> None:
    """Batch 65,536 on W1 "if time allows": only when its projected cost fits the budget."""
    cost = suites.w1_big_batch_cost(w1, sizes.repeats)
    elapsed = time.perf_counter() - t0
    # 10% slack for report writing and for runs slower than their batch-4096 siblings.
    if cost is not None and elapsed + 1.1 * cost <= budget_s:
        suites.w1_big_batch(runner, data, sizes, w1)
        return
    why = (
        "batch 4096 did not run"
        if cost is None
        else (
            f"about {cost:.0f} s more after {elapsed:.0f} s would pass the "
            f"{budget_s / 60:g}-minute budget (`--budget-min`)"
        )
    )
    w1.notes.append(f"Batch {suites.BIG_BATCH:,} through the CLI and the library: skipped: {why}.")
    _log(f"batch {suites.BIG_BATCH:,} skipped: {why}")


def _profile(data: workloads.Data) -> dict[str, object] | None:
    """The per-batch profile of one W1 shard (bench.profile_worker), in a fresh process."""
    import subprocess

    shard = sorted(data.w1.glob("*.parquet"))[0]
    argv = [sys.executable, "-m", "bench.profile_worker", "--json", "--shard", str(shard)]
    argv += ["--model", str(data.w1_model)]
    _log("[PROFILE] one W1 shard, stage by stage ...")
    try:
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        _log("[PROFILE] timed out")
        return None
    if done.returncode != 0:
        _log(f"[PROFILE] failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
        return None
    result: dict[str, object] = json.loads(done.stdout)
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit code."""
    raw = sys.argv[1:] if argv is None else argv
    args = _parse(raw)
    t0 = time.perf_counter()
    sizes = workloads.Sizes.make(args.quick, args.repeats)
    cores = report.available_cores()
    selected = args.only or list(SUITE_KEYS)
    _log(f"score-catalog bench: {'QUICK ' if sizes.quick else ''}{sizes.repeats} round(s)")

    _log("generating (or reusing) data under .bench/data ...")
    big = "W1X10" in selected or "INCREMENTAL" in selected
    data = workloads.build(ROOT, REPO, sizes, big=big)
    data_s = time.perf_counter() - t0
    _log(f"data ready in {data_s:.1f} s")

    # The caches under XDG_CACHE_HOME (the CLI's program cache, chosen batch sizes) start empty
    # in every bench and are the bench's own: the warm-up run fills the W1 bundle's entry, W2's
    # first CLI run fills its own, and the cold comparators empty theirs before every run.
    cache_home = ROOT / "cache"
    shutil.rmtree(cache_home, ignore_errors=True)
    cache_home.mkdir(parents=True)
    os.environ["XDG_CACHE_HOME"] = str(cache_home)
    runner = suites.Runner(REPO, ROOT, _log)
    precision = suites.precision_flag_available(runner.cli)
    _log(f"--precision available: {precision}")
    _warm_up(runner, data)

    results: dict[str, suites.WorkloadResult] = {}
    if "W1" in selected:
        results["W1"] = suites.w1(runner, data, sizes, cores)
    if "W1X10" in selected:
        results["W1X10"] = suites.w1x10(runner, data, sizes, cores)
    if "W2" in selected:
        results["W2"] = suites.w2(runner, data, sizes, cores, precision)
    if "W3" in selected:
        results["W3"] = suites.w3(runner, data, sizes)
    if "TINY" in selected:
        results["TINY"] = suites.tiny(runner, data, sizes)
    if "DELTA" in selected:
        results["DELTA"] = delta.delta_suite(runner, data, sizes)
    if "INCREMENTAL" in selected:
        results["INCREMENTAL"] = incremental.incremental_suite(runner, data, sizes)
    profile = _profile(data) if "PROFILE" in selected else None
    if "W1" in results:
        _maybe_big_batch(runner, data, sizes, results["W1"], args.budget_min * 60, t0)

    # The raw samples first: a report that fails to render must not lose a long run's figures.
    (ROOT / "results.json").write_text(json.dumps(report.as_json(results), indent=1))
    text = report.render(
        facts=report.machine_facts(REPO),
        sizes=sizes,
        command=_command(raw),
        results=results,
        skipped=[k for k in SUITE_KEYS if k not in selected],
        cores=cores,
        total_s=time.perf_counter() - t0,
        data_s=data_s,
        leaks=runner.leaks,
        warnings=runner.warnings,
        precision=precision,
        budget_s=args.budget_min * 60,
        profile=profile if "PROFILE" in selected else False,
    )
    print(text)
    (REPO / args.output).write_text(text)
    _log(f"wrote {args.output} in {(time.perf_counter() - t0) / 60:.1f} min")
    failed = any(wl.failures for wl in results.values()) or bool(runner.leaks)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
