"""Two versions of score-catalog side by side on W1: ``python -m bench.ab --base REV``.

``make bench-ab BASE=REV``. The base revision is unpacked with ``git archive`` under
``.bench/ab/<rev>`` and run from there (``PYTHONPATH``) with this checkout's virtual
environment, so both versions run on the same interpreter, packages, data and machine. Runs
alternate base, head, base, head, ... so that the machine's load hits both alike; the table
gives each side's median of the run report's own rows/s (run start to end) and of the whole
process (wall time from exec to exit), and the ratio head / base. The CPU model and flags go
with the figures: machines here differ (AVX2 only, or AVX512 with bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from bench import workloads
from bench.procs import report_file, run_measured
from bench.suites import clear_output

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / ".bench"


def _unpack(rev: str) -> tuple[str, Path]:
    """The base revision's tree under .bench/ab/<sha> (unpacked once)."""
    sha = subprocess.run(
        ["git", "rev-parse", "--short=12", rev],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    dest = ROOT / "ab" / sha
    if not (dest / "pipeline").is_dir():
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        with tempfile.TemporaryFile() as f:
            subprocess.run(["git", "archive", sha], cwd=REPO, check=True, stdout=f)
            f.seek(0)
            with tarfile.open(fileobj=f) as tar:
                tar.extractall(dest, filter="data")
    return sha, dest


def _run(
    tree: Path, data: Path, model: Path, out: Path, log: Path, extra: list[str]
) -> tuple[float, float]:
    """One ``score-catalog run`` of ``tree``'s code: (report rows/s, whole-process rows/s)."""
    clear_output(out)
    argv = [
        sys.executable, "-m", "pipeline.cli", "run", "--input", str(data), "--output", str(out),
        "--model", str(model), "--batch-size", "4096", "--scheduler", "local", *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree)}
    pr = run_measured(argv, log_path=log, cwd=tree, env=env, timeout_s=900)
    if pr.returncode != 0:
        raise RuntimeError(f"{tree}: exit {pr.returncode}\n{pr.log_tail()}")
    rep = json.loads(report_file(out).read_text())
    rows = int(rep["rows_processed"])
    return rows / float(rep["duration_s"]), rows / pr.wall_s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="git revision to compare HEAD's working tree with")
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("extra", nargs="*", help="more flags for both runs (after --)")
    args = p.parse_args(argv)
    sha, base_tree = _unpack(args.base)
    data = workloads.catalog(
        ROOT / "data" / f"ab-w1-{args.rows}-{args.shards}", rows=args.rows, shards=args.shards
    )
    model = workloads.w1_bundle(ROOT / "models" / "w1", REPO)
    sides = {f"base {sha}": base_tree, "head (working tree)": REPO}
    rates: dict[str, list[tuple[float, float]]] = {k: [] for k in sides}
    for rep in range(args.repeats):
        for name, tree in sides.items():
            key = name.split()[0]
            out = ROOT / "out" / "ab" / key / "scored"
            r = _run(
                tree, data, model, out, ROOT / "logs" / "ab" / f"{key}-{rep + 1}.log", args.extra
            )
            rates[name].append(r)
            print(
                f"round {rep + 1} {name}: run {r[0]:,.0f} rows/s, process {r[1]:,.0f} rows/s",
                flush=True,
            )
    cpu, flags = workloads.cpu_info()
    marks = ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)
    med = {
        k: (statistics.median(a for a, _ in v), statistics.median(b for _, b in v))
        for k, v in rates.items()
    }
    (base_name, head_name) = list(sides)
    print()
    print(
        f"W1 ({args.rows:,} rows, {args.shards} shards, the W1 MLP, batch 4096, local scheduler), "
        f"median of {args.repeats} alternating runs; {cpu} ({marks}), {os.cpu_count()} cores"
    )
    print()
    print("| version | run rows/s | process rows/s |")
    print("|---|---:|---:|")
    for k in sides:
        print(f"| {k} | {med[k][0]:,.0f} | {med[k][1]:,.0f} |")
    print(
        f"| head / base | {med[head_name][0] / med[base_name][0]:.3f}x | "
        f"{med[head_name][1] / med[base_name][1]:.3f}x |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
