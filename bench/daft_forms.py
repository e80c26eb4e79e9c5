"""Daft's model forms side by side on W1, with the CLI beside them: ``python -m bench.daft_forms
[--rounds N] [--forms eager,torchscript,export] [--no-cli]``.

Each round runs Daft 0.7's native runner (``.venv-daft``, ``DO_NOT_TRACK=1``) once per form
(``bench.daft_runner.load_program``: the eager module rebuilt from the bundle's weights, its
TorchScript, the bundle's torch.export program) and the CLI (``--batch-size 4096``, the
program cache warmed by one untimed run first), alternating, each a whole process. Printed:
the CPU with its vector flags, each comparator's median wall, and pair by pair (same round)
each Daft form's wall against the CLI's and against the export form's. Uses the bench's W1
(``.bench/data/w1``, built by ``make bench`` or here).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

from bench import workloads
from bench.pairs import cpu_line
from bench.procs import run_measured
from bench.suites import BATCH, clear_output

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / ".bench"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.daft_forms", description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--forms", default="eager,torchscript,export")
    p.add_argument("--no-cli", action="store_true")
    ns = p.parse_args(argv)
    daft_python = REPO / ".venv-daft" / "bin" / "python"
    if not daft_python.exists():
        print("no .venv-daft: `make bench` builds it", file=sys.stderr)
        return 2
    sizes = workloads.Sizes.make(False, ns.rounds)
    w1 = workloads.catalog(ROOT / "data" / "w1", rows=sizes.w1_rows, shards=sizes.w1_shards)
    model = workloads.w1_bundle(ROOT / "models" / "w1-mlp", REPO)
    peer = workloads.peer_forms(model, ROOT / "models" / "w1-mlp-peer")
    spec = workloads.w1_features().to_json()
    shards = [str(s) for s in workloads.shard_files(w1)]
    out = ROOT / "out" / "daft-forms"
    cache = ROOT / "daft-forms-cache"
    shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, "DO_NOT_TRACK": "1", "XDG_CACHE_HOME": str(cache)}
    cli = [sys.executable, "-m", "pipeline.cli", "run", "--input", str(w1), "--output"]
    cli_tail = ["--model", str(model), "--batch-size", str(BATCH), "--scheduler", "local"]
    comps: dict[str, list[str]] = {}
    for form in ns.forms.split(","):
        args: dict[str, object] = {"kind": "daft", "shards": shards, "out_dir": str(out / form)}
        args |= {"bundle": str(model), "spec": spec, "batch": BATCH}
        args |= {"form": form, "peer": str(peer)}
        comps[f"daft-{form}"] = [str(daft_python), "-m", "bench.loops", json.dumps(args)]
    if not ns.no_cli:
        comps["cli"] = [*cli, str(out / "cli"), *cli_tail]
        run_measured(
            comps["cli"], log_path=ROOT / "logs" / "daft-forms-warm.log", cwd=REPO, env=env
        )
    print(f"# {cpu_line()}; W1 {sizes.w1_rows:,} rows, {ns.rounds} rounds", flush=True)
    walls: dict[str, list[float]] = {k: [] for k in comps}
    for rnd in range(ns.rounds):
        for key, argv_ in comps.items():
            target = out / key.removeprefix("daft-") if key != "cli" else out / "cli"
            clear_output(target)
            log = ROOT / "logs" / f"daft-forms-{key}-{rnd}.log"
            pr = run_measured(argv_, log_path=log, cwd=REPO, env=env, timeout_s=600)
            clear_output(target)
            if pr.returncode != 0:
                print(f"{key}: exit {pr.returncode}\n{pr.log_tail()}", file=sys.stderr)
                return 1
            walls[key].append(pr.wall_s)
            print(f"round {rnd + 1} {key}: wall {pr.wall_s:.2f} s", flush=True)
    for key, ws in walls.items():
        line = f"{key}: wall median {statistics.median(ws):.2f} s ({min(ws):.2f}-{max(ws):.2f})"
        for ref in ("cli", "daft-export"):
            if ref in walls and key != ref:
                r = [w / x for w, x in zip(ws, walls[ref], strict=True)]
                line += f"; wall / {ref} pair by pair: median {statistics.median(r):.3f}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
