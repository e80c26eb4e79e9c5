"""Where a worker's time goes, per batch: ``python -m bench.profile_worker [--shard P --model M]``.

Scores one real shard in this process through the workers' own code
(:func:`pipeline.worker.shard.score_shard`), one torch thread as a worker of the 2-core plan has,
and times every stage of the batch loop with ``perf_counter`` around the functions that do it:

- decode: Parquet pages to Arrow record batches (``ShardBatches._pieces``);
- features + tensors: Arrow columns to the model's tensors, lossy-cast and null checks
  (``ShardBatches._make`` less nothing: it includes ``to_features`` and ``to_tensor``);
- model call: the module's forward alone (``engine.forward``);
- engine around the call: slicing, ``.float().cpu()``, the non-finite check (``engine.score``
  less the forward);
- output columns: softmax / argmax / raw to Arrow arrays (``engine.output_columns``);
- statistics: score sums, extremes and samples, latencies (``ShardStats.add_scores``,
  ``add_model_call``);
- id hashing: the duplicate-id count (``DuplicateIds.add`` and ``count``);
- write: Arrow to Parquet, zstd, and the commit (``ShardSink.write_output``, ``commit``);
- the rest of the loop: batch assembly, casts, schema checks, fences, progress.

With overlap off, the stages add up to the shard's wall time. With overlap on (read-ahead and
write-behind threads), the same shard is timed again, and the difference is what the threads
save or cost: on one core, threads only move work around unless pyarrow releases the GIL.

Timers cost about a microsecond per call (a few hundred calls per shard): noise here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

STAGES = (
    ("decode", "decode (Parquet -> Arrow)"),
    ("features", "features + tensors (Arrow -> torch)"),
    ("model", "model call (forward only)"),
    ("engine", "engine around the call (slice, .float().cpu(), finite check)"),
    ("outputs", "output columns (softmax/argmax -> Arrow)"),
    ("stats", "statistics (sums, extremes, samples, latencies)"),
    ("ids", "id hashing (duplicate-id count)"),
    ("write", "write (Parquet encode + zstd, commit)"),
)


class Timers:
    """Seconds spent per stage, summed over calls; nested stages are subtracted from outer."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.total[stage] += time.perf_counter() - t0
                self.calls[stage] += 1

        return timed

    def wrap_gen(self, stage: str, fn: Callable[..., Iterator[Any]]) -> Callable[..., Any]:
        """For a generator: the time inside each ``next`` is the stage's."""

        def timed(*a: Any, **k: Any) -> Iterator[Any]:
            it = fn(*a, **k)
            while True:
                t0 = time.perf_counter()
                try:
                    item = next(it)
                except StopIteration:
                    self.total[stage] += time.perf_counter() - t0
                    return
                self.total[stage] += time.perf_counter() - t0
                self.calls[stage] += 1
                yield item

        return timed


@contextlib.contextmanager
def instrumented(timers: Timers) -> Iterator[None]:
    """Wrap the stage functions where the worker's code looks them up; undone on exit."""
    from pipeline.model import engine
    from pipeline.worker import batching, stats
    from pipeline.worker import shard as scoring
    from pipeline.worker import sink as writing

    patches: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, new: Any) -> None:
        patches.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    patch(
        batching.ShardBatches, "_pieces", timers.wrap_gen("decode", batching.ShardBatches._pieces)
    )
    patch(batching.ShardBatches, "_make", timers.wrap("features", batching.ShardBatches._make))
    # engine.score's own time less the forward inside it: the forward is timed on its own.
    forward = timers.wrap("model", engine.forward)
    patch(engine, "forward", forward)
    patch(scoring, "score", timers.wrap("engine+model", engine.score))
    patch(scoring, "output_columns", timers.wrap("outputs", engine.output_columns))
    patch(stats.ShardStats, "add_scores", timers.wrap("stats", stats.ShardStats.add_scores))
    patch(stats.ShardStats, "add_model_call", timers.wrap("stats", stats.ShardStats.add_model_call))
    patch(stats.DuplicateIds, "add", timers.wrap("ids", stats.DuplicateIds.add))
    patch(stats.DuplicateIds, "count", timers.wrap("ids", stats.DuplicateIds.count))
    patch(writing.ShardSink, "write_output", timers.wrap("write", writing.ShardSink.write_output))
    patch(writing.ShardSink, "commit", timers.wrap("write", writing.ShardSink.commit))
    try:
        yield
    finally:
        for owner, name, old in reversed(patches):
            setattr(owner, name, old)


def _spec_and_task(
    shard: Path, model_dir: Path, batch: int, overlap: int, tmp: str, call_rows: int | None = None
) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from pipeline.model.bundle import read_bundle
    from pipeline.model.program import load_model
    from pipeline.worker.spec import ModelSpec, Scoring, ShardIO, ShardTask, Threads, WorkerSpec

    spec, _, sha = read_bundle(str(model_dir))
    widths = tuple(i.fixed_width() for i in spec.inputs)
    loaded = load_model(str(model_dir), "cpu", widths=widths, expected_sha256=sha)
    schema = pq.read_schema(shard)
    meta = pa.schema([schema.field("item_id")]).serialize().to_pybytes()
    rows = pq.ParquetFile(shard).metadata.num_rows
    wspec = WorkerSpec(
        model=ModelSpec(str(model_dir), sha, "cpu", widths=loaded.widths),
        threads=Threads(torch=1),
        scoring=Scoring(batch_size=batch, overlap_depth=overlap, call_rows=call_rows),
        io=ShardIO(id_column="item_id"),
    )
    torch.set_num_threads(1)

    def task(i: int) -> ShardTask:
        out = os.path.join(tmp, f"out-{i}.parquet")
        rej = os.path.join(tmp, f"rej-{i}.parquet")
        return ShardTask("shard.parquet", str(shard), out, rej, rows, meta)

    return wspec, task, rows


def _call_rows(model_dir: Path, batch: int) -> int | None:
    """Rows per model call as a run on this CPU chooses them (pipeline.driver.execution, one
    torch thread): None when one call per batch is as fast."""
    import torch

    from pipeline.model import tuning
    from pipeline.model.program import forward, load_model

    torch.set_num_threads(1)
    m = load_model(str(model_dir), "cpu")
    n = min(batch, tuning.CALL_SAMPLE_ROWS)
    chosen, _, _ = tuning.choose_call_rows(
        lambda xs: forward(m, xs), m.example(n, random=True), m.device, batch=n, budget_s=0.2
    )
    return chosen if chosen < n else None


def profile(shard: Path, model_dir: Path, batch: int, rounds: int) -> dict[str, Any]:
    """Per-stage seconds (medians over ``rounds``) of one shard, overlap off; and the shard's
    wall time with overlap on and off, alternating."""
    from pipeline.worker.shard import OVERLAP_DEPTH, score_shard

    result: dict[str, Any] = {"shard": str(shard), "batch_size": batch, "rounds": rounds}
    calls = _call_rows(model_dir, batch)
    result["call_rows"] = calls
    with tempfile.TemporaryDirectory(prefix="profile-worker-") as tmp:
        spec_off, task, rows = _spec_and_task(shard, model_dir, batch, 0, tmp, calls)
        spec_on, _, _ = _spec_and_task(shard, model_dir, batch, OVERLAP_DEPTH, tmp, calls)
        result["rows"] = rows
        score_shard(spec_off, task(0))  # warm: first calls, page cache
        per_round: list[dict[str, float]] = []
        walls: dict[str, list[float]] = {"off": [], "on": []}
        for r in range(rounds):
            timers = Timers()
            with instrumented(timers):
                t0 = time.perf_counter()
                res = score_shard(spec_off, task(r + 1))
                wall = time.perf_counter() - t0
            if res.status != "scored":
                raise RuntimeError(f"profile shard not scored: {res.message}")
            st = dict(timers.total)
            st["engine"] = st.pop("engine+model", 0.0) - st.get("model", 0.0)
            st["rest"] = wall - sum(st.get(k, 0.0) for k, _ in STAGES)
            st["wall"] = wall
            per_round.append(st)
            result["batches"] = timers.calls["engine+model"]  # one score() per batch
            # Plain walls (no timers), overlap off and on, alternating.
            for mode, spec in (("off", spec_off), ("on", spec_on)):
                t0 = time.perf_counter()
                score_shard(spec, task(100 + r))
                walls[mode].append(time.perf_counter() - t0)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    keys = [k for k, _ in STAGES] + ["rest", "wall"]
    result["stages_s"] = {k: med([p.get(k, 0.0) for p in per_round]) for k in keys}
    result["wall_overlap_off_s"] = med(walls["off"])
    result["wall_overlap_on_s"] = med(walls["on"])
    return result


def call_overhead(model_dir: Path, calls: int = 3000, rounds: int = 5) -> dict[str, float]:
    """Microseconds per call at batch 1, one torch thread, best of ``rounds`` (alternating):
    the eager demo MLP with the bundle's weights, the module ``ExportedProgram.module()``
    returns, and :func:`pipeline.model.program.forward` on the loaded bundle (what a run and
    ``score-catalog bench`` call); and ``score-catalog bench --batch-sizes 1``'s own ms per
    sample, from its table (its loop adds the copy to the device and the timing)."""
    import subprocess

    import torch

    from pipeline.cli.demo import DemoMLP
    from pipeline.model.bundle import read_bundle
    from pipeline.model.program import forward, load_model

    torch.set_num_threads(1)
    _, _, sha = read_bundle(str(model_dir))
    loaded = load_model(str(model_dir), "cpu", expected_sha256=sha)
    ep = torch.export.load(str(model_dir / "model.pt2"))
    w = ep.state_dict
    shape = (w["net.0.weight"].shape[0], w["net.2.weight"].shape[0])
    eager = DemoMLP(w["net.0.weight"].shape[1], shape, w["net.4.weight"].shape[0])
    eager.load_state_dict(w)
    eager.eval()
    plain = ep.module()
    x = torch.randn(1, loaded.width)
    ways: dict[str, Callable[[], Any]] = {
        "eager": lambda: eager(x),
        "exported_module": lambda: plain(x),
        "pipeline_forward": lambda: forward(loaded, x),
    }
    best = {k: float("inf") for k in ways}
    with torch.inference_mode():
        if not torch.equal(eager(x), forward(loaded, x)):
            raise RuntimeError("the eager MLP does not reproduce the bundle's output")
        for _ in range(rounds):
            for key, fn in ways.items():
                for _ in range(100):
                    fn()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                best[key] = min(best[key], (time.perf_counter() - t0) / calls * 1e6)
    cli = REPO / ".venv" / "bin" / "score-catalog"
    argv = [str(cli), "bench", "--model", str(model_dir), "--batch-sizes", "1", "--threads", "1"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=True).stdout
    row = [ln.split() for ln in out.splitlines() if ln.split()[:1] == ["1"]]
    best["score_catalog_bench"] = float(row[-1][-1]) * 1000.0  # ms/sample -> us per call
    return best


def _short(shard: str) -> str:
    """``w1/part-00000.parquet``: the workload's folder and the file, as the report names it."""
    p = Path(shard)
    return f"{p.parent.name}/{p.name}"


def markdown(res: dict[str, Any]) -> list[str]:
    """The report's section: a table of stages, ms per batch and share of the shard's wall."""
    st = res["stages_s"]
    n = max(1, res["batches"])
    wall = st["wall"]
    lines = [
        f"One shard, `{_short(res['shard'])}` ({res['rows']:,} rows, {res['batches']} "
        f"batches of {res['batch_size']:,}"
        + (f", model calls of {res['call_rows']:,} rows" if res.get("call_rows") else "")
        + ") "
        "scored in one process through `pipeline.worker.shard.score_shard`, one torch thread, "
        f"overlap off, each stage timed with `perf_counter` (median of {res['rounds']} rounds; "
        "`python -m bench.profile_worker`).",
        "",
        "| stage | ms per batch | share of the shard's wall |",
        "|---|---:|---:|",
    ]
    for key, label in (*STAGES, ("rest", "rest of the loop (assembly, casts, fences, progress)")):
        lines.append(f"| {label} | {st[key] / n * 1000:.3f} | {st[key] / wall * 100:.1f}% |")
    lines.append(f"| **shard wall** | {wall / n * 1000:.3f} | 100% |")
    not_model = 1 - st["model"] / wall
    lines += [
        "",
        f"- The model call is {st['model'] / wall * 100:.0f}% of the worker's time; "
        f"{not_model * 100:.0f}% is everything else ({res['rows'] / wall:,.0f} rows/s for the "
        f"shard against {res['rows'] / st['model']:,.0f} rows/s for its model calls alone).",
        f"- The same shard without timers: overlap off {res['wall_overlap_off_s']:.3f} s, "
        f"overlap on (read-ahead + write-behind, depth 2) {res['wall_overlap_on_s']:.3f} s "
        f"= {res['wall_overlap_off_s'] / res['wall_overlap_on_s']:.2f}x "
        "(alternating, medians).",
    ]
    calls = res.get("call_us")
    if calls:
        e = calls["eager"]
        lines += [
            "",
            "Per-call cost at batch 1 (one thread, best of 5 x 3,000 calls, alternating):",
            "",
            "| call | us per call | / eager |",
            "|---|---:|---:|",
            f"| eager `DemoMLP` with the bundle's weights | {e:.1f} | 1.00x |",
            f"| `ExportedProgram.module()` as torch returns it | {calls['exported_module']:.1f} "
            f"| {calls['exported_module'] / e:.2f}x |",
            f"| `pipeline.model.program.forward` (the program's graph, called directly) | "
            f"{calls['pipeline_forward']:.1f} | {calls['pipeline_forward'] / e:.2f}x |",
            f"| `score-catalog bench --batch-sizes 1` (ms/sample column) | "
            f"{calls['score_catalog_bench']:.1f} | {calls['score_catalog_bench'] / e:.2f}x |",
        ]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile_worker", description=__doc__)
    p.add_argument("--shard", type=Path, default=REPO / ".bench/data/w1/part-00000.parquet")
    p.add_argument("--model", type=Path, default=REPO / ".bench/models/w1-mlp")
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print the raw result as JSON")
    args = p.parse_args(argv)
    if not args.shard.exists():
        print(f"no shard at {args.shard}: run `make bench` once to build the data", file=sys.stderr)
        return 2
    res = profile(args.shard, args.model, args.batch_size, args.rounds)
    res["call_us"] = call_overhead(args.model)
    print(json.dumps(res, indent=1) if args.json else "\n".join(markdown(res)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
