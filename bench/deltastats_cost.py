"""Per-file cost of the Delta stats a worker computes (``deltastats.delta_facts``): one realistic
scored file, 65,536 rows x 20 columns (ids, bool, timestamps with and without zone, float64 and
float32, short and 57-character strings, date, decimal, integers), in 1 and in 8 row groups.

``python -m bench.deltastats_cost [--against OLD.py]`` prints the median and minimum per call over
rounds of 200 calls; with ``--against`` (another copy of the module, e.g. ``git show
main:pipeline/sinks/delta/stats.py > /tmp/old.py``) the rounds alternate between the two in
one process, so that a busy machine slows both alike. The work is the footer's: no row data.
"""

from __future__ import annotations

import argparse
import datetime as dt
import decimal
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.sinks.delta import stats as deltastats

ROWS = 65_536
CALLS = 200


def scored_file(n: int = ROWS, seed: int = 0) -> pa.Table:
    """A scored output file as the workers write it: id, pass-through columns, scores."""
    rng = np.random.default_rng(seed)
    base = np.datetime64("2026-01-01T00:00:00", "us")
    stamps = [base + rng.integers(0, 10**12, n).astype("timedelta64[us]") for _ in range(2)]
    days = np.datetime64("2026-01-01") + rng.integers(0, 400, n).astype("timedelta64[D]")
    cents = rng.integers(-(10**8), 10**8, n)
    cols = {
        "item_id": pa.array(np.arange(n, dtype=np.int64)),
        "flag": pa.array(rng.random(n) < 0.5),
        "seen_at": pa.array(stamps[0], pa.timestamp("us", "UTC")),
        "local_at": pa.array(stamps[1], pa.timestamp("us")),
        "price": pa.array(rng.normal(size=n)),
        "weight": pa.array(rng.normal(size=n)),
        "title": pa.array(
            [f"item title number {i:08d} with a longer description tail" for i in range(n)]
        ),
        "brand": pa.array([f"brand-{i % 97}" for i in range(n)]),
        "day": pa.array(days.astype("datetime64[D]")),
        "amount": pa.array(
            [decimal.Decimal(int(c)).scaleb(-2) for c in cents], pa.decimal128(12, 2)
        ),
        "qty": pa.array(rng.integers(0, 1000, n)),
        "rank": pa.array(rng.integers(0, 10**6, n)),
        "category": pa.array([f"cat-{i % 13}" for i in range(n)]),
        "region": pa.array([f"r{i % 7}" for i in range(n)]),
        "ratio": pa.array(rng.random(n).astype(np.float32)),
        "score": pa.array(rng.random(n).astype(np.float32)),
        "p_other": pa.array(rng.random(n).astype(np.float32)),
        "label": pa.array(rng.integers(0, 2, n)),
        "segment": pa.array(rng.integers(0, 50, n).astype(np.int32)),
        "model_version": pa.array(["3"] * n),
    }
    return pa.table(cols)


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("deltastats_against", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _per_call_ms(module: ModuleType, metadata: pq.FileMetaData) -> float:
    t0 = time.perf_counter()
    for _ in range(CALLS):
        module.delta_facts(metadata, frozenset())
    return (time.perf_counter() - t0) / CALLS * 1e3


def measure(modules: dict[str, ModuleType], row_groups: int, rounds: int) -> str:
    table = scored_file()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "scored.parquet"
        pq.write_table(table, path, row_group_size=ROWS // row_groups, compression="zstd")
        metadata = pq.read_metadata(path)
    times: dict[str, list[float]] = {name: [] for name in modules}
    for module in modules.values():
        _per_call_ms(module, metadata)  # warm
    for r in range(rounds):
        order = list(modules.items())
        for name, module in order if r % 2 == 0 else reversed(order):
            times[name].append(_per_call_ms(module, metadata))
    return f"{metadata.num_row_groups} row group(s): " + "; ".join(
        f"{name} median {statistics.median(v):.3f} ms, min {min(v):.3f} ms"
        for name, v in times.items()
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", type=Path, help="another deltastats.py to compare with")
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args(argv)
    modules: dict[str, ModuleType] = {}
    if args.against:
        modules["against"] = _load(args.against)
    modules["this"] = deltastats
    print(f"delta_facts per file, {ROWS:,} rows x 20 columns, {dt.date.today()}:")
    for row_groups in (1, 8):
        print(" ", measure(modules, row_groups, args.rounds))


if __name__ == "__main__":
    main()
