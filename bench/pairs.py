"""CLI variants side by side, alternating: ``python -m bench.pairs --input DIR --model BUNDLE
--variant NAME='ARGS' --variant NAME@REV:MODE='ARGS' [--rounds N] [--cache cold|warm|prime]
[--seed-calls ROWS]``.

A variant named ``NAME@REV`` runs the code of git revision ``REV`` (unpacked under
``.bench/ab`` as ``make bench-ab`` does, on this checkout's interpreter and packages); a plain
``NAME`` runs this checkout's. A ``:MODE`` suffix gives that variant its own cache mode.

Each round runs every variant once, in order (A B A B ...), as a whole ``score-catalog run``
process with ``--scheduler local``. ``--cache cold`` gives each run an empty ``XDG_CACHE_HOME``
(a fresh container each night: program cache, batch-size and call-size caches all empty);
``prime`` gives each variant a cache folder of its own, filled by one untimed first run and
kept (nights 2+ on one machine); ``warm`` shares one folder between all variants and never
empties it. Printed: the CPU with its vector flags, the load average, each variant's median
wall and planning time (run start to the first shard's start), what the run chose (batch size,
rows per model call, whether cached or measured and the sweep's seconds), and each variant's
wall against the first variant's, pair by pair (median and range). ``--json`` writes the raw
samples.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

import psutil

from bench.ab import _unpack
from bench.procs import report_file, run_measured
from bench.suites import clear_output
from bench.workloads import cpu_info

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / ".bench" / "pairs"


def cpu_line() -> str:
    """The CPU's model name and its AVX-512/AMX flags (what a figure here depends on)."""
    model, flags = cpu_info()
    wide = sorted(f for f in flags if f.startswith(("avx512", "amx")) or f == "avx2")
    return f"{model}, {psutil.cpu_count()} cores: {' '.join(wide)}" + (
        "" if any(f.startswith("amx") for f in flags) else " (no AMX)"
    )


def _one(
    name: str, args: list[str], ns: argparse.Namespace, rnd: int, cache: Path
) -> dict[str, Any]:
    out = ROOT / "out" / name.replace("@", "-at-").replace(":", "-")
    clear_output(out)
    tree = REPO
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    if "@" in name:  # another revision's code, on this interpreter
        _, tree = _unpack(name.partition("@")[2].partition(":")[0])
        env["PYTHONPATH"] = str(tree)
    argv = [sys.executable, "-m", "pipeline.cli", "run", "--input", ns.input]
    argv += ["--output", str(out), "--model", ns.model, "--scheduler", "local", *args]
    log = ROOT / "logs" / f"{name.replace('@', '-at-').replace(':', '-')}-{rnd}.log"
    pr = run_measured(argv, log_path=log, cwd=tree, env=env, timeout_s=600)
    if pr.returncode != 0:
        raise RuntimeError(f"{name} round {rnd}: exit {pr.returncode}\n{pr.log_tail()}")
    rep = json.loads(report_file(out).read_text())
    clear_output(out)
    shards = [s for s in rep.get("shards", []) if s.get("started_s") is not None]
    ex = rep.get("execution") or {}
    auto, calls = ex.get("batch_size_auto") or {}, ex.get("call_rows") or {}
    return {
        "wall_s": pr.wall_s,
        "duration_s": float(rep["duration_s"]),
        "planning_s": min(float(s["started_s"]) for s in shards) if shards else None,
        "scoring_s": (
            max(float(s["finished_s"]) for s in shards) - min(float(s["started_s"]) for s in shards)
            if shards
            else None
        ),
        "batch_size": rep.get("batch_size"),
        "auto": _facts(auto, "batch_size"),
        "call_rows": _facts(calls, "rows"),
        "load": os.getloadavg()[0],
    }


def _facts(section: dict[str, Any], size: str) -> dict[str, Any]:
    """What a run's ``batch_size_auto`` or ``call_rows`` section says, in brief."""
    got = {k: section[k] for k in (size, "cached", "sweep_s") if k in section}
    check = section.get("revalidation")
    if check:
        got["revalidation"] = f"{check['outcome']} {check['cached']}->{check['chosen']}"
        got["revalidation_s"] = check["seconds"]
    return got


def _mode(ns: argparse.Namespace, name: str) -> str:
    """A variant's cache mode: its own ``:MODE`` suffix, else ``--cache``."""
    return name.rpartition(":")[2] if ":" in name else str(ns.cache)


def _cache_for(ns: argparse.Namespace, name: str, rnd: int) -> Path:
    mode = _mode(ns, name)
    if mode == "warm":
        return ROOT / "cache-shared"
    path = ROOT / "cache" / name.replace("@", "-at-").replace(":", "-")
    if mode == "cold" or rnd == 0:
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    return path


def _seed_calls(cache: Path, rows: int) -> None:
    """Set every cached rows per model call in ``cache`` to ``rows`` (a choice made once on a
    busy moment, as issue 31 saw), keeping the rest of each entry."""
    path = cache / "score-catalog" / "batch_sizes.json"
    doc = json.loads(path.read_text())
    for key, entry in doc.items():
        if "|calls" in key:
            entry["batch_size"] = rows
    path.write_text(json.dumps(doc, indent=2))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pairs", description=__doc__)
    p.add_argument("--input", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--variant", action="append", required=True, help="NAME='CLI ARGS'")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--cache",
        choices=("cold", "warm", "prime"),
        default="cold",
        help="cache mode of every variant without a :MODE suffix of its own (NAME:prime=...)",
    )
    p.add_argument(
        "--seed-calls",
        type=int,
        help="after priming, set the cached rows per model call of primed variants to this",
    )
    p.add_argument("--json", help="write the raw samples here")
    ns = p.parse_args(argv)
    ns.input, ns.model = str(Path(ns.input).resolve()), str(Path(ns.model).resolve())
    variants = [(v.partition("=")[0], shlex.split(v.partition("=")[2])) for v in ns.variant]
    print(f"# {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; {cpu_line()}")
    print(f"# {ns.rounds} rounds, cache {ns.cache}; {' | '.join(ns.variant)}", flush=True)
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in variants}
    for name, args in variants:
        if _mode(ns, name) == "prime":
            cache = _cache_for(ns, name, 0)
            _one(name, args, ns, -1, cache)
            if ns.seed_calls:
                _seed_calls(cache, ns.seed_calls)
    for rnd in range(ns.rounds):
        for name, args in variants:
            s = _one(name, args, ns, rnd, _cache_for(ns, name, rnd + 1))
            samples[name].append(s)
            print(
                f"round {rnd + 1} {name}: wall {s['wall_s']:.2f} s, planning "
                f"{s['planning_s'] or 0:.2f} s, batch {s['batch_size']}, auto {s['auto']}, "
                f"calls {s['call_rows']}, load {s['load']:.1f}",
                flush=True,
            )
    base = variants[0][0]
    for name, _ in variants:
        walls = [s["wall_s"] for s in samples[name]]
        plan = [s["planning_s"] or 0.0 for s in samples[name]]
        line = f"{name}: wall median {statistics.median(walls):.2f} s "
        line += f"({min(walls):.2f}-{max(walls):.2f}), planning {statistics.median(plan):.2f} s"
        if name != base:
            # rate ratio = base wall / this wall, pair by pair (same round)
            r = [
                b["wall_s"] / s["wall_s"] for b, s in zip(samples[base], samples[name], strict=True)
            ]
            line += (
                f"; rate vs {base} pair by pair: median {statistics.median(r):.3f}x "
                f"({min(r):.3f}-{max(r):.3f})"
            )
        print(line)
    if ns.json:
        Path(ns.json).write_text(json.dumps({"cpu": cpu_line(), "samples": samples}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
