"""Grouping small shards into Dask tasks, and pinning one GPU per worker."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pipeline.driver.dispatch import MIN_TASKS_PER_SLOT, group_tasks
from pipeline.worker.loading import pin_device
from pipeline.worker.spec import ShardTask


def _task(i: int, rows: int) -> ShardTask:
    return ShardTask(
        rel_path=f"part-{i:05d}.parquet",
        input_uri=f"/in/part-{i:05d}.parquet",
        output_uri=f"/out/part-{i:05d}.parquet",
        rejects_uri=f"/out/_rejects/part-{i:05d}.parquet",
        num_rows=rows,
        meta_schema=b"",
    )


@given(
    sizes=st.lists(st.integers(min_value=0, max_value=5_000_000), max_size=200),
    target=st.integers(min_value=1, max_value=2_000_000),
    slots=st.integers(min_value=1, max_value=64),
)
def test_every_shard_once_in_order_and_groups_stay_under_the_limit(
    sizes: list[int], target: int, slots: int
) -> None:
    tasks = [_task(i, n) for i, n in enumerate(sizes)]
    groups = group_tasks(tasks, target, slots)
    assert [t for g in groups for t in g] == tasks
    assert all(g for g in groups)
    total = sum(sizes)
    limit = max(1, min(target, -(-total // (slots * MIN_TASKS_PER_SLOT))))
    for g in groups:
        # A group over the limit is a single big shard: it is streamed by row group anyway.
        assert len(g) == 1 or sum(t.num_rows for t in g) <= limit


def test_tiny_shards_are_grouped_and_big_ones_stand_alone() -> None:
    tasks = [_task(i, 100) for i in range(1000)] + [_task(1000, 5_000_000)]
    groups = group_tasks(tasks, 262_144, slots=2)
    assert len(groups[-1]) == 1 and groups[-1][0].num_rows == 5_000_000
    assert len(groups) < 20  # 1,000 tiny shards in a handful of tasks, not 1,000


def test_grouping_keeps_every_worker_busy() -> None:
    # 8 shards of 25k rows on 2 slots: one 200k-row group would idle a worker.
    groups = group_tasks([_task(i, 25_000) for i in range(8)], 262_144, slots=2)
    assert len(groups) == 8


def test_one_worker_per_gpu() -> None:
    assert pin_device("cuda", "0", 4) == "cuda:0"
    assert pin_device("cuda", 5, 4) == "cuda:1"
    assert pin_device("cuda", "tcp://10.0.0.1:1234", 4) == "cuda"  # not an index: leave it
    assert pin_device("cuda", "3", 1) == "cuda"  # one visible GPU (dask-cuda): it is ours
    assert pin_device("cuda:2", "0", 4) == "cuda:2"  # an explicit device wins
    assert pin_device("cpu", "1", 4) == "cpu"
