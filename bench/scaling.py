"""Scaling-out figures for docs/scaling.md: 1 vs 2 workers, an external cluster, and tiny shards.

Runs the real CLI, alternating configurations so that machine noise hits each alike, and writes
the medians to BENCHMARKS_SCALING.md. Usage: ``make bench-scaling`` (about 4 minutes on 2 cores).

- W1s: 1,000,000 demo rows in 16 shards, demo MLP: embedded cluster with 1 worker (2 torch
  threads) vs 2 workers (1 thread each), and an external ``dask scheduler`` with two
  ``dask worker`` processes (``--scheduler tcp://``, started here on 127.0.0.1).
- Tiny shards: 1,000 shards of 200 rows: grouped into tasks (default ``task_rows``) vs one task
  per shard (``--task-rows 1``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.mdtable import Column, markdown_table
from bench.procs import report_file
from bench.suites import clear_output

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cli(*args: str) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    r = subprocess.run(
        [str(BIN / "score-catalog"), *args], capture_output=True, text=True, cwd=REPO
    )
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"score-catalog {' '.join(args)} failed:\n{r.stderr[-3000:]}")
    out = Path(args[args.index("--output") + 1])
    return wall, json.loads(report_file(out).read_text())


class Cluster:
    """A real scheduler and two single-threaded workers on loopback, stopped by PID."""

    def __init__(self, workers: int = 2) -> None:
        port = _free_port()
        self.address = f"tcp://127.0.0.1:{port}"
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "67108864", "PYTHONPATH": str(REPO)}
        self.procs = [
            subprocess.Popen(
                [
                    str(BIN / "dask"),
                    "scheduler",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--no-dashboard",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        ]
        for i in range(workers):
            self.procs.append(
                subprocess.Popen(
                    [
                        str(BIN / "dask"),
                        "worker",
                        self.address,
                        "--nthreads",
                        "1",
                        "--no-dashboard",
                        "--host",
                        "127.0.0.1",
                        "--name",
                        f"w{i}",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    env=env,
                    cwd=REPO,
                    start_new_session=True,
                )
            )
        from distributed import Client

        with Client(self.address, timeout="60s") as c:
            c.wait_for_workers(workers, timeout=120)

    def stop(self) -> None:
        for p in self.procs:
            os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--root", default="/tmp/score-catalog-bench-scaling")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "BENCHMARKS_SCALING.md"))
    a = ap.parse_args(argv)
    root = Path(a.root)
    sys.path.insert(0, str(REPO))
    from pipeline.cli.demo import write_catalog

    w1 = root / "w1"
    if not (w1 / ".done").exists():
        shutil.rmtree(w1, ignore_errors=True)
        write_catalog(w1, rows=1_000_000, shards=16, row_group_rows=8192, seed=0)
        (w1 / ".done").touch()
    tiny = root / "tiny"
    if not (tiny / ".done").exists():
        shutil.rmtree(tiny, ignore_errors=True)
        write_catalog(tiny, rows=200_000, shards=1000, row_group_rows=200, seed=1)
        (tiny / ".done").touch()
    model = str(REPO / "data/models/catalog-mlp")
    cluster = Cluster()
    configs = {
        "embedded, 1 worker x 2 torch threads": (w1, ["--workers", "1"]),
        "embedded, 2 workers x 1 torch thread": (w1, ["--workers", "2"]),
        "external tcp:// cluster, 2 workers x 1 thread": (w1, ["--scheduler", cluster.address]),
        "1,000 tiny shards, grouped (task_rows 262144)": (tiny, ["--workers", "2"]),
        "1,000 tiny shards, one task per shard (task_rows 1)": (
            tiny,
            ["--workers", "2", "--task-rows", "1"],
        ),
    }
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in configs}
    try:
        for rep in range(a.repeats):
            for name, (data, extra) in configs.items():
                out = root / "out" / f"{abs(hash(name))}-{rep}"
                clear_output(out)
                wall, report = _cli(
                    "run",
                    "--input",
                    str(data),
                    "--output",
                    str(out),
                    "--model",
                    model,
                    "--batch-size",
                    "4096",
                    "-q",
                    *extra,
                )
                rows = report["rows_processed"]
                samples[name].append((rows / wall, report["rows_per_s"]))
                print(f"[{rep}] {name}: {rows / wall:,.0f} rows/s wall", flush=True)
    finally:
        cluster.stop()
    base = statistics.median(s[0] for s in samples["embedded, 1 worker x 2 torch threads"])
    lines = [
        "# Scaling out: measured",
        "",
        f"`make bench-scaling` (bench/scaling.py) on {dt.date.today()}, {os.cpu_count()} cores, "
        f"{platform.processor() or platform.machine()}, median of {a.repeats} alternating runs. "
        "Rows/s is rows scored over the CLI's wall time (process start to exit, imports and "
        "Dask start-up included); 'in run' is the report's rows_per_s (from the run's start).",
        "",
    ]
    table = []
    for name, (data, _) in configs.items():
        wall_rate = statistics.median(s[0] for s in samples[name])
        table.append(
            {
                "name": name,
                "rows": "1,000,000" if data == w1 else "200,000",
                "wall": wall_rate,
                "run": statistics.median(s[1] for s in samples[name]),
                "ratio": f"{wall_rate / base:.2f}x" if data == w1 else "-",
            }
        )
    lines += markdown_table(
        table,
        [
            Column("configuration", "name"),
            Column("rows", "rows", right=True),
            Column("rows/s (wall)", "wall", lambda v: f"{v:,.0f}", right=True),
            Column("rows/s (in run)", "run", lambda v: f"{v:,.0f}", right=True),
            Column("vs 1 worker", "ratio", right=True),
        ],
    )
    g = statistics.median(s[0] for s in samples["1,000 tiny shards, grouped (task_rows 262144)"])
    u = statistics.median(
        s[0] for s in samples["1,000 tiny shards, one task per shard (task_rows 1)"]
    )
    lines += ["", f"Grouping tiny shards: {g / u:.2f}x the throughput of one task per shard.", ""]
    Path(a.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
