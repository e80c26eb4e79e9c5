"""INCREMENTAL: nights with 0%, 1%, 10% and 100% of the rows changed, against a full rescore.

For each workload (W1, W1 x 10, W2 at 600,000 rows) one night is scored with ``--incremental``
(untimed: the baseline), then, alternating round by round, a plain run over night 2's input
(``full``, no ``--incremental``, the rescore every night pays today) and an incremental night 2
over each changed copy of the input. A changed row has its first feature moved by 1.0: a change
the model sees, so the row goes through the model. Two more nights of the 1%-changed input:
``inc-1pct-moved``, its shards under each other's names (each shard's rows out of their
baseline file's place: looked up through the id table, which the night builds), and
``inc-1pct-catalog``, 0.5% of each shard's items deleted and as many new ones appended,
numbered on (what a catalog's night looks like). Every run is a whole ``score-catalog run``
process (``--scheduler local``), wall time from its start to its exit; peak memory is the
proportional set size (PSS) of its process tree, sampled every 50 ms, so that the index the
workers map from one file is counted once, as the machine holds it (RSS would count it once per
worker).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq

from bench.procs import run_measured, tree_pids
from bench.stats import Sample, Summary, summarize
from bench.suites import BATCH, RUN_TIMEOUT_S, Comparator, Runner, WorkloadResult
from bench.workloads import ROW_GROUP_ROWS, Data, Sizes, embeddings, shard_files

FRACTIONS = (0.0, 0.01, 0.10, 1.0)
NIGHT1, NIGHT2 = "2026-01-01", "2026-01-02"
W2_ROWS = 600_000  # the W2 night: 600,000 rows
#: The issue's targets on this CPU: wall of an incremental night / wall of a full rescore.
TARGETS = {("W2", 0.01): 0.25, ("W1X10", 0.01): 0.5}
HUNDRED_TARGET = 1.05  # 100% changed: the fingerprint is not a tax
MEMORY_TARGET = 1.5  # W1 x 10, 1% changed: peak memory against a plain run's
#: The 1%-changed night with its shards under each other's names (rows out of their place).
MOVED = "inc-1pct-moved"
#: The 1%-changed night with 0.5% of the items deleted and 0.5% new ones numbered on.
CATALOG = "inc-1pct-catalog"


def _key(fraction: float) -> str:
    return f"inc-{round(fraction * 100):g}pct"


def _write(table: pa.Table, path: Path) -> None:
    """A night's shard written as the workload's shards are (row groups, no dictionary, zstd)."""
    pq.write_table(
        table, path, row_group_size=ROW_GROUP_ROWS, use_dictionary=False, compression="zstd"
    )


def _changed_copy(src: Path, dest: Path, fraction: float, column: str) -> Path:
    """``src``'s shards with ``fraction`` of each shard's rows' ``column`` moved by 1.0 (the
    first value of a list column), cached by a stamp."""
    source = (src / "_bench.json").read_text() if (src / "_bench.json").exists() else ""
    stamp = {"src": str(src), "source": source, "fraction": fraction, "column": column}
    stamp["rg"] = ROW_GROUP_ROWS
    mark = dest / "_bench.json"
    if mark.exists() and json.loads(mark.read_text()) == stamp:
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for k, path in enumerate(shard_files(src)):
        table = pq.read_table(path)
        n = table.num_rows
        rng = np.random.default_rng([7, k])
        picked = rng.choice(n, round(n * fraction), replace=False) if fraction < 1 else None
        col = table.column(column).combine_chunks()
        if pa.types.is_fixed_size_list(col.type):
            width = col.type.list_size
            values = col.flatten().to_numpy().reshape(n, width).copy()
            rows = picked if picked is not None else slice(None)
            values[rows, 0] += np.float32(1.0)
            new = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), width)
        else:
            values = col.to_numpy().copy()
            values[picked if picked is not None else slice(None)] += values.dtype.type(1.0)
            new = pa.array(values)
        table = table.set_column(table.schema.get_field_index(column), column, new)
        _write(table, dest / path.name)
    mark.write_text(json.dumps(stamp))
    return dest


def _moved_copy(src: Path, dest: Path) -> Path:
    """``src``'s shards under each other's names (shard k's rows in the file named k + 1): every
    shard is first compared with another shard's baseline file, so its rows are looked up in
    the id table (built once, by the first worker that needs it). Hard links, not copies."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    files = shard_files(src)
    for k, path in enumerate(files):
        os.link(path, dest / files[(k + 1) % len(files)].name)
    return dest


def _catalog_copy(src: Path, dest: Path, id_column: str) -> Path:
    """A catalog's night: ``src`` (1% of the rows' features changed) with 0.5% of each shard's
    rows deleted and as many new items appended, numbered on from the largest id. Cached by a
    stamp."""
    stamp = {"src": str(src), "source": (src / "_bench.json").read_text(), "rg": ROW_GROUP_ROWS}
    mark = dest / "_bench.json"
    if mark.exists() and json.loads(mark.read_text()) == stamp:
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    files = shard_files(src)
    top = max(int(pq.read_table(p, columns=[id_column]).column(0).to_numpy().max()) for p in files)
    for k, path in enumerate(files):
        table = pq.read_table(path)
        n = table.num_rows
        rng = np.random.default_rng([11, k])
        gone = rng.choice(n, max(1, n // 200), replace=False)
        keep = np.ones(n, dtype=bool)
        keep[gone] = False
        added = table.take(pa.array(rng.choice(n, gone.size, replace=False)))
        ids = pa.array(np.arange(top + 1, top + 1 + gone.size), added.schema.field(id_column).type)
        top += gone.size
        added = added.set_column(added.schema.get_field_index(id_column), id_column, ids)
        table = pa.concat_tables([table.filter(pa.array(keep)), added])
        _write(table, dest / path.name)
    mark.write_text(json.dumps(stamp))
    return dest


def tree_pss_bytes(root: int) -> int:
    """Proportional set size of ``root`` and its descendants: a page shared by n processes
    counts 1/n in each, so a file they all map counts once. Read from
    ``/proc/<pid>/smaps_rollup`` (one line per process), not ``smaps``: psutil's
    ``memory_full_info`` walks every mapping, and sampling every 50 ms took 29% of a core
    while processes mapped the index, which the nights under test then lacked."""
    total = 0
    for pid in tree_pids(root):
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            try:
                total += int(psutil.Process(pid).memory_full_info().pss)
            except psutil.Error:
                continue
    return total


@dataclass
class _Night:
    """One workload's nights: where their inputs are, and how a run of each is launched."""

    key: str
    title: str
    model: Path
    night1: Path
    inputs: dict[str, Path]  # comparator key -> night 2's input
    root: Path  # the job's outputs (incremental) and the full rescore's, below it
    rows: int

    def out(self, which: str) -> Path:
        return self.root / which / "run_date={date}"

    def done(self, which: str, day: str) -> Path:
        return self.root / which / f"run_date={day}"

    def control(self, which: str, day: str) -> Path:
        return self.root / "_score_catalog" / which / f"run_date={day}"


def _argv(runner: Runner, night: _Night, key: str, day: str) -> list[str]:
    which = "full" if key == "full" else "inc"
    extra = ("--date", day, "-q") if key == "full" else ("--date", day, "--incremental", "-q")
    src = night.night1 if day == NIGHT1 else night.inputs[key]
    return runner.cli_argv(src, night.out(which), night.model, BATCH, extra=extra)


def _clear(night: _Night, which: str, day: str) -> None:
    """A night's output and its control folder: the next run of it starts from nothing (the
    run index stays: the baseline is night 1 whatever ran since)."""
    for path in (night.done(which, day), night.control(which, day)):
        shutil.rmtree(path, ignore_errors=True)


def _report(night: _Night, which: str, day: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((night.control(which, day) / "_report.json").read_text())
    return data


def _run(runner: Runner, wl: WorkloadResult, night: _Night, key: str, rep: int) -> Sample | None:
    which = "full" if key == "full" else "inc"
    _clear(night, which, NIGHT2)
    log = runner.root / "logs" / wl.key / f"{key}-rep{rep + 1}.log"
    argv = _argv(runner, night, key, NIGHT2)
    pr = run_measured(
        argv, log_path=log, cwd=runner.repo, timeout_s=RUN_TIMEOUT_S, memory=tree_pss_bytes
    )
    try:
        if pr.timed_out or pr.returncode not in (0, 4):  # 4: the scores drifted (100%)
            raise RuntimeError(f"exit {pr.returncode}; log {log}\n{pr.log_tail()}")
        rep_data = _report(night, which, NIGHT2)
        inc = rep_data.get("incremental") or {}
        if key != "full" and inc.get("baseline") is None:
            raise RuntimeError(f"no baseline: {inc.get('full_reason')}")
        sample = Sample(
            rows=int(rep_data["rows_out"]),
            wall_s=pr.wall_s,
            timed_s=float(rep_data["duration_s"]),
            peak_rss_bytes=pr.peak_rss_bytes,
            extra={"incremental": inc, "exit": pr.returncode},
        )
    except Exception as e:
        wl.failures.setdefault(key, []).append(f"rep {rep + 1}: {e}")
        runner.log(f"  {key}: FAILED ({e})")
        return None
    finally:
        _clear(night, which, NIGHT2)
    scored = inc.get("rows_scored")
    runner.log(
        f"  {key}: wall {sample.wall_s:.2f} s, peak PSS {sample.peak_rss_bytes / 2**20:,.0f} MiB"
        + (f", {scored:,} rows through the model" if scored is not None else "")
    )
    return sample


def _night(
    runner: Runner, key: str, title: str, model: Path, night1: Path, column: str, rows: int
) -> _Night:
    data = runner.root / "data" / "incremental" / key.lower()
    inputs = {"full": night1}
    for f in FRACTIONS:
        inputs[_key(f)] = night1 if f == 0 else _changed_copy(night1, data / _key(f), f, column)
    inputs["full"] = inputs[_key(0.01)]  # the full rescore of the night the targets are for
    inputs[MOVED] = _moved_copy(inputs[_key(0.01)], data / MOVED)
    inputs[CATALOG] = _catalog_copy(inputs[_key(0.01)], data / CATALOG, "item_id")
    root = runner.root / "out" / "incremental" / key.lower()
    shutil.rmtree(root, ignore_errors=True)
    return _Night(key, title, model, night1, inputs, root, rows)


def _baseline(runner: Runner, wl: WorkloadResult, night: _Night) -> bool:
    """Night 1, untimed: the baseline every night 2 carries from."""
    log = runner.root / "logs" / wl.key / "night1.log"
    pr = run_measured(
        _argv(runner, night, _key(0), NIGHT1),
        log_path=log,
        cwd=runner.repo,
        timeout_s=RUN_TIMEOUT_S,
    )
    if pr.returncode != 0:
        wl.failures.setdefault("night1", []).append(f"exit {pr.returncode}; log {log}")
        return False
    runner.log(f"  night 1 (the baseline): {pr.wall_s:.2f} s")
    return True


def incremental_suite(
    runner: Runner, data: Data, sizes: Sizes, *, workloads: tuple[str, ...] = ("W1", "W1X10", "W2")
) -> WorkloadResult:
    """Every workload's full rescore and incremental nights, alternating round by round."""
    from pipeline.cli.demo import FEATURES

    nights = []
    if "W1" in workloads:
        nights.append(
            _night(runner, "W1", "W1", data.w1_model, data.w1, FEATURES[0], sizes.w1_rows)
        )
    if "W1X10" in workloads and data.w1x10 is not None:
        nights.append(
            _night(
                runner, "W1X10", "W1 x 10", data.w1_model, data.w1x10, FEATURES[0], sizes.w1x10_rows
            )
        )
    if "W2" in workloads:
        w2 = embeddings(
            runner.root / "data" / "w2-600k", rows=W2_ROWS // (10 if sizes.quick else 1), shards=8
        )
        nights.append(
            _night(
                runner,
                "W2",
                "W2 (600,000 rows)",
                data.w2_model,
                w2,
                "embedding",
                W2_ROWS // (10 if sizes.quick else 1),
            )
        )
    keys = ["full", *(_key(f) for f in FRACTIONS), MOVED, CATALOG]
    wl = WorkloadResult(
        "INCREMENTAL",
        "INCREMENTAL: nights that score only what changed",
        [
            "Night 1 of each workload scored with `--incremental` (untimed: the baseline); then, "
            "alternating, a full rescore of night 2 (`full`: the same job without "
            "`--incremental`, over the 1%-changed input) and incremental nights 2 with 0%, 1%, "
            "10% and 100% of the rows' first feature moved by 1.0. Whole `score-catalog run` "
            "processes (`--scheduler local`, batch 4,096), wall from start to exit; peak memory "
            "is the PSS of the process tree (the shared index counted once).",
        ],
        [
            Comparator(
                f"{n.key}:{k}", f"{n.title} {k}", "Dask LocalCluster", BATCH, [], "cli", n.rows
            )
            for n in nights
            for k in keys
        ],
    )
    t0 = time.perf_counter()
    for n in nights:
        runner.log(f"[INCREMENTAL] {n.title}")
        if not _baseline(runner, wl, n):
            continue
        for rep in range(sizes.repeats):
            runner.log(f"[INCREMENTAL] {n.title} round {rep + 1}/{sizes.repeats}")
            for k in keys:
                sample = _run(runner, wl, n, k, rep)
                if sample is not None:
                    wl.samples.setdefault(f"{n.key}:{k}", []).append(sample)
        shutil.rmtree(n.root, ignore_errors=True)
    wl.seconds = time.perf_counter() - t0
    return wl


# -- the report ---------------------------------------------------------------------------------


def _median(wl: WorkloadResult, key: str, value: Callable[[Sample], float]) -> Summary | None:
    return summarize(wl.samples.get(key, []), value)


def _ratio(a: Summary | None, b: Summary | None) -> float | None:
    return None if a is None or b is None or not b.median else a.median / b.median


def incremental_section(wl: WorkloadResult) -> tuple[list[str], list[str]]:
    """The INCREMENTAL section of BENCHMARKS.md and its summary lines."""
    lines = [f"## {wl.title}", "", *wl.description, ""]
    lines += [
        "| workload | night | rows through the model | wall s (median) | range | vs full | "
        "peak PSS MiB | vs full |",
        "|---|---|---|---|---|---|---|---|",
    ]
    summary: list[str] = []
    workloads = sorted(
        {c.key.split(":")[0] for c in wl.comparators}, key=["W1", "W1X10", "W2"].index
    )
    for name in workloads:
        full_wall = _median(wl, f"{name}:full", lambda s: s.wall_s)
        full_mem = _median(wl, f"{name}:full", lambda s: float(s.peak_rss_bytes))
        for comp in (c for c in wl.comparators if c.key.startswith(f"{name}:")):
            k = comp.key.split(":")[1]
            wall = _median(wl, comp.key, lambda s: s.wall_s)
            mem = _median(wl, comp.key, lambda s: float(s.peak_rss_bytes))
            samples = wl.samples.get(comp.key, [])
            scored = (
                (samples[0].extra.get("incremental") or {}).get("rows_scored") if samples else None
            )
            r, m = _ratio(wall, full_wall), _ratio(mem, full_mem)
            through = "all" if k == "full" else "—" if scored is None else f"{scored:,}"
            lines.append(
                f"| {name} | {k} | {through} | "
                f"{'—' if wall is None else f'{wall.median:.2f}'} | "
                f"{'—' if wall is None else f'{wall.lo:.2f}–{wall.hi:.2f}'} | "
                f"{'—' if r is None or k == 'full' else f'{r:.2f}x'} | "
                f"{'—' if mem is None else f'{mem.median / 2**20:,.0f}'} | "
                f"{'—' if m is None or k == 'full' else f'{m:.2f}x'} |"
            )
            target = TARGETS.get((name, {"inc-1pct": 0.01}.get(k, -1.0)))
            if target is not None and r is not None:
                ok = "met" if r <= target else "MISSED"
                summary.append(
                    f"{name} incremental night, 1% of rows changed: **{r:.2f}x** the full "
                    f"rescore's wall (target <= {target}x: {ok}); {scored:,} rows through the model"
                )
            if k == "inc-100pct" and r is not None:
                ok = "met" if r <= HUNDRED_TARGET else "MISSED"
                summary.append(
                    f"{name} incremental night, 100% changed: {r:.2f}x the full rescore's wall "
                    f"(target <= {HUNDRED_TARGET}x: {ok})"
                )
            if name == "W1X10" and k == "inc-1pct" and m is not None:
                ok = "met" if m <= MEMORY_TARGET else "MISSED"
                summary.append(
                    f"W1X10 incremental night, 1% changed: peak memory (PSS, process tree) "
                    f"{m:.2f}x the full rescore's (target <= {MEMORY_TARGET}x: {ok})"
                )
    for key, fails in wl.failures.items():
        lines.append(f"- {key} failed: {'; '.join(fails)}")
    lines += ["", *(f"- {s}" for s in summary), ""]
    return lines, summary


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.incremental [--quick] [--repeats N] [W1|W1X10|W2 ...]``: this suite
    alone (``make bench`` runs it with the others), its section printed."""
    import argparse
    import os
    import sys

    from bench import workloads
    from bench.run import REPO, ROOT

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("workloads", nargs="*", default=["W1", "W1X10", "W2"])
    args = parser.parse_args(argv)
    sizes = workloads.Sizes.make(args.quick, args.repeats)
    data = workloads.build(ROOT, REPO, sizes, big="W1X10" in args.workloads)
    os.environ.setdefault("XDG_CACHE_HOME", str(ROOT / "cache"))
    runner = Runner(REPO, ROOT, lambda m: print(m, file=sys.stderr, flush=True))
    wl = incremental_suite(runner, data, sizes, workloads=tuple(args.workloads))
    lines, _ = incremental_section(wl)
    print("\n".join(lines))
    return 1 if wl.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
