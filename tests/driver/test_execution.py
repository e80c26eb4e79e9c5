"""pipeline.driver.execution: how the batch size and the rows per model call are measured on a
first run, revalidated on later ones, and what the report and the cache say about it.

Real parts throughout: a real exported bundle, real shards, the workers' own scoring code in the
batch-size passes, a real cache file. The decision rule itself (pairs, margins, streaks) is
tested with scripted timings in tests/model/test_tuning.py; here what is checked is what is
measured, what is kept, and what is skipped, which timings cannot flip.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.core.config import JobConfig
from pipeline.driver import autotune, execution
from pipeline.driver.cluster import Plan
from pipeline.io.listing import ShardRef, list_shards
from pipeline.model import tuning
from pipeline.model.precision import ExecutionOptions
from pipeline.model.program import LoadedModel, load_model
from tests.conftest import write_shards

PLAN = Plan("local", 2, 1, 1, 2, overlap=False)
FP32 = ExecutionOptions("fp32", False, False, "torch")
ROW = tuning.BenchRow(batch=256, calls=16, ms=1.0, samples_per_s=4e6, ms_per_sample=2e-4)


@pytest.fixture(autouse=True)
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    before = torch.get_num_threads()
    yield tmp_path / "cache" / "score-catalog" / "batch_sizes.json"
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model(bundle_dir: Path) -> LoadedModel:
    return load_model(str(bundle_dir), "cpu")


@pytest.fixture
def shard(tmp_path: Path) -> ShardRef:
    """One shard of 10,000 rows: room for 8,192-row passes."""
    write_shards(tmp_path / "in", [10_000], row_group_rows=5_000)
    (ref,) = list_shards(str(tmp_path / "in"), {})
    return ref


def _config(tmp_path: Path, bundle: Path, batch: int | str) -> JobConfig:
    return JobConfig(
        input=str(tmp_path / "in"),
        output=str(tmp_path / "out"),
        model=str(bundle),
        batch_size=batch,  # type: ignore[arg-type]
        id_column="item_id",
    )


def _night(
    tmp_path: Path,
    bundle: Path,
    model: LoadedModel,
    shard: ShardRef | None,
    batch: int | str,
    job_rows: int = 10**7,
) -> execution.Execution:
    config = _config(tmp_path, bundle, batch)
    return execution.prepare_execution(config, model, FP32, shard, PLAN, job_rows=job_rows)


def _calls_key(model: LoadedModel, n: int = 4096) -> str:
    return autotune.auto_cache_key(model, "fp32", PLAN.torch_threads) + f"|calls{n}"


def _doc(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


# ----------------------------------------------------------------------- rows per model call


def test_a_batch_over_the_measured_rows_is_called_in_slices_of_at_most_those(
    tmp_path: Path, bundle_dir: Path, model: LoadedModel, cache_home: Path
) -> None:
    # 4,096 rows ran best in one call: a batch of 8,192 is called in two calls of 4,096 (or
    # what the revalidation moves to), never in one 8,192-row call nobody measured.
    row = tuning.BenchRow(batch=4096, calls=1, ms=1.0, samples_per_s=4e6, ms_per_sample=2e-4)
    tuning.BatchSizeCache(cache_home).put(_calls_key(model), 4096, [row])
    ex = _night(tmp_path, bundle_dir, model, None, 8192)
    assert ex.batch_size == 8192
    assert ex.call_rows is not None and ex.call_rows <= 4096
    assert ex.report["call_rows"]["rows"] == ex.call_rows


def test_a_cached_call_size_beaten_by_a_neighbour_is_replaced(
    tmp_path: Path, bundle_dir: Path, model: LoadedModel, cache_home: Path
) -> None:
    # The test bundle's 16-32-16-2 MLP costs little more than its per-call overhead, so calls
    # of 256 take about twice as long per batch as calls of 512 (measured 1.6-2.3x here): the
    # cached 256 loses pair after pair and is replaced within a few nights, never downwards.
    tuning.BatchSizeCache(cache_home).put(_calls_key(model), 256, [ROW])
    seen = []
    for _ in range(4):
        ex = _night(tmp_path, bundle_dir, model, None, 4096)
        check = ex.report["call_rows"]["revalidation"]
        seen.append(check)
        assert ex.report["call_rows"]["cached"] is True
        assert check["cached"] == 256 and check["outcome"] in ("kept", "replaced")
        assert [p["size"] for p in check["pairs"]] == [512]  # 256 has one neighbour
        if check["outcome"] == "replaced":
            break
    assert seen[-1]["outcome"] == "replaced", seen
    assert seen[-1]["chosen"] == 512 and ex.call_rows == 512
    entry = _doc(cache_home)[_calls_key(model)]
    assert entry["batch_size"] == 512 and entry["replaced"] == 256
    assert entry["checks"] == len(seen) and entry["sweep"][0]["batch"] == 256  # measured once


def test_a_call_size_cached_without_pass_times_is_kept_unchecked(
    tmp_path: Path, bundle_dir: Path, model: LoadedModel, cache_home: Path
) -> None:
    # As cached when one call was too slow to measure (a wide model): nothing to size a
    # revalidation by, so none is made, and the cache is left as it was.
    tuning.BatchSizeCache(cache_home).put(_calls_key(model), 4096, [])
    before = cache_home.read_text()
    ex = _night(tmp_path, bundle_dir, model, None, 4096)
    check = ex.report["call_rows"]["revalidation"]
    assert check["outcome"] == "skipped" and "no pass times" in check["note"]
    assert (check["cached"], check["chosen"], ex.call_rows) == (4096, 4096, None)
    assert cache_home.read_text() == before


def test_a_call_size_revalidation_over_its_budget_is_skipped(
    tmp_path: Path, bundle_dir: Path, model: LoadedModel, cache_home: Path
) -> None:
    slow = tuning.BenchRow(batch=1024, calls=4, ms=500.0, samples_per_s=8e3, ms_per_sample=0.1)
    tuning.BatchSizeCache(cache_home).put(_calls_key(model), 1024, [slow])
    # 100,000 rows at that pace is 6 s of model time: 2% of it is 0.12 s, against 3.5 s.
    ex = _night(tmp_path, bundle_dir, model, None, 4096, job_rows=100_000)
    check = ex.report["call_rows"]["revalidation"]
    assert check["outcome"] == "skipped" and "would take more than" in check["note"]
    assert check["seconds"] == 0 and ex.call_rows == 1024


# ------------------------------------------------------------------------ batch size auto


@pytest.fixture
def whole_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    """Measure whatever the budget (autotune.SWEEP_ROWS_ENV): which sizes are compared must not
    depend on how busy the machine is."""
    monkeypatch.setenv(autotune.SWEEP_ROWS_ENV, str(autotune.AUTO_SAMPLE_ROWS))


@pytest.mark.usefixtures("whole_sample")
def test_a_first_night_times_the_default_against_its_neighbours_only(
    tmp_path: Path, bundle_dir: Path, model: LoadedModel, shard: ShardRef, cache_home: Path
) -> None:
    ex = _night(tmp_path, bundle_dir, model, shard, "auto")
    auto = ex.report["batch_size_auto"]
    assert auto["cached"] is False and auto["basis"] == "pipeline"
    assert [r["batch"] for r in auto["sweep"]] == [2048, 4096, 8192]  # not 1,024 or 16,384
    assert all(r["calls"] == -(-8192 // r["batch"]) for r in auto["sweep"])  # same rows each
    assert ex.batch_size in (2048, 4096, 8192) and ex.batch_size == auto["batch_size"]
    entry = _doc(cache_home)[autotune.auto_cache_key(model, "fp32", PLAN.torch_threads)]
    assert entry["batch_size"] == ex.batch_size and entry["per_row_s"] > 0
    assert "streak" in entry


@pytest.mark.usefixtures("whole_sample")
def test_a_cached_batch_size_is_revalidated_against_its_neighbours_each_night(
    tmp_path: Path, bundle_dir: Path, model: LoadedModel, shard: ShardRef, cache_home: Path
) -> None:
    key = autotune.auto_cache_key(model, "fp32", PLAN.torch_threads)
    tuning.BatchSizeCache(cache_home).put(key, 2048, [], {"per_row_s": 1e-6})
    ex = _night(tmp_path, bundle_dir, model, shard, "auto")
    auto = ex.report["batch_size_auto"]
    check = auto["revalidation"]
    assert auto["cached"] is True and "sweep" not in auto
    assert check["cached"] == 2048 and check["outcome"] in ("kept", "replaced")
    assert [p["size"] for p in check["pairs"]] == [1024, 4096]
    assert all(len(p["ratios"]) == autotune.AUTO_CHECK_ROUNDS for p in check["pairs"])
    assert check["seconds"] > 0 and ex.batch_size == check["chosen"]
    entry = _doc(cache_home)[key]
    assert entry["checks"] == 1 and entry["batch_size"] == ex.batch_size


def test_a_cached_pace_too_slow_for_the_budget_skips_without_reading_the_sample(
    tmp_path: Path, bundle_dir: Path, model: LoadedModel, shard: ShardRef, cache_home: Path
) -> None:
    # 10 ms a row: even one round of three 8,192-row passes is minutes; the shard is never
    # opened (it is deleted first, so reading it would fail the run).
    key = autotune.auto_cache_key(model, "fp32", PLAN.torch_threads)
    tuning.BatchSizeCache(cache_home).put(key, 4096, [], {"per_row_s": 1e-2})
    Path(shard.uri.removeprefix("file://")).unlink()
    ex = _night(tmp_path, bundle_dir, model, shard, "auto", job_rows=100_000)
    check = ex.report["batch_size_auto"]["revalidation"]
    assert check["outcome"] == "skipped" and "a round would take about" in check["note"]
    assert ex.batch_size == 4096


def test_a_first_shard_smaller_than_every_neighbour_is_not_cached(
    tmp_path: Path, bundle_dir: Path, model: LoadedModel, cache_home: Path
) -> None:
    write_shards(tmp_path / "in", [500])
    (small,) = list_shards(str(tmp_path / "in"), {})
    ex = _night(tmp_path, bundle_dir, model, small, "auto")
    auto = ex.report["batch_size_auto"]
    assert ex.batch_size == 4096 and auto["sweep"] == [] and "fits no size" in auto["note"]
    key = autotune.auto_cache_key(model, "fp32", PLAN.torch_threads)
    assert key not in _doc(cache_home)  # (the rows per call are cached: they were measured)
