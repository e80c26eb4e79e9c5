"""pipeline.worker.sink: one shard's output and rejects, staged, fenced and committed in order."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.core.errors import LockError
from pipeline.io import storage
from pipeline.worker.sink import ShardSink, StagedParquetWriter

META = pa.schema([pa.field("item_id", pa.int64())])
OUT = META.append(pa.field("score", pa.float64()))


def _rows(ids: list[int]) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays(
        [pa.array(ids, pa.int64()), pa.array([i / 10 for i in ids])], schema=OUT
    )


def _rejects(sink: ShardSink, ids: list[int]) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays(
        [pa.array(ids, pa.int64()), pa.array(["nan"] * len(ids))], schema=sink.rejects_schema
    )


def _sink(tmp_path: Path, fence: object = None, depth: int = 0) -> ShardSink:
    out = storage.locate(str(tmp_path / "out" / "part-0.parquet"))
    rej = storage.locate(str(tmp_path / "rejects" / "part-0.parquet"))
    return ShardSink(out, rej, META, OUT, depth=depth, fence=fence)  # type: ignore[arg-type]


@pytest.mark.parametrize("depth", [0, 2])
def test_the_fence_runs_before_each_publish_rejects_first_then_output(
    tmp_path: Path, depth: int
) -> None:
    seen: list[tuple[bool, bool]] = []

    def fence() -> None:  # what is visible at each fence: (rejects, output)
        seen.append(
            (
                (tmp_path / "rejects" / "part-0.parquet").exists(),
                (tmp_path / "out" / "part-0.parquet").exists(),
            )
        )

    with _sink(tmp_path, fence, depth) as sink:
        sink.write_output(_rows([1, 2]))
        sink.write_rejects(_rejects(sink, [3]))
        sink.commit()
    assert seen == [(False, False), (True, False)]  # the output is published last
    assert pq.read_table(tmp_path / "rejects" / "part-0.parquet").num_rows == 1


def test_a_fence_that_refuses_publishes_nothing(tmp_path: Path) -> None:
    def lost() -> None:
        raise LockError("another run holds the lock now")

    with pytest.raises(LockError), _sink(tmp_path, lost) as sink:
        sink.write_output(_rows([1]))
        sink.write_rejects(_rejects(sink, [2]))
        sink.commit()
    visible = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert visible == []  # no final name, and no staged file left behind


def test_a_committed_file_knows_its_size_and_footer(tmp_path: Path) -> None:
    with _sink(tmp_path) as sink:
        sink.write_output(_rows(list(range(10))))
        sink.commit()
    path = tmp_path / "out" / "part-0.parquet"
    assert sink.output.size == path.stat().st_size
    assert sink.output.metadata is not None
    assert sink.output.metadata.num_rows == pq.ParquetFile(path).metadata.num_rows == 10


def test_small_batches_are_buffered_into_fewer_row_groups(tmp_path: Path) -> None:
    loc = storage.locate(str(tmp_path / "x.parquet"))
    w = StagedParquetWriter(loc, OUT, row_group_rows=4)
    batches = [list(range(lo, min(lo + 3, 10))) for lo in range(0, 10, 3)]  # 3, 3, 3, 1 rows
    for ids in batches:
        w.write(_rows(ids))
    assert not (tmp_path / "x.parquet").exists()  # staged until commit
    w.commit()
    meta = pq.ParquetFile(tmp_path / "x.parquet").metadata
    groups = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    assert sum(groups) == w.rows == 10
    assert max(groups) <= 4 and len(groups) < len(batches)
    ids = pq.read_table(tmp_path / "x.parquet").column("item_id").to_pylist()
    assert ids == list(range(10))


@pytest.mark.parametrize("watch", [True, False])
def test_a_writer_asked_to_watch_nan_names_the_float_columns_that_hold_one(
    tmp_path: Path, watch: bool
) -> None:
    schema = OUT.append(pa.field("calibrated", pa.float32()))
    w = StagedParquetWriter(storage.locate(str(tmp_path / "a.parquet")), schema, watch_nan=watch)
    for scores in ([0.1, 0.2], [float("nan"), 0.3]):  # the NaN comes in the second batch
        w.write(
            pa.RecordBatch.from_arrays(
                [
                    pa.array([1, 2], pa.int64()),
                    pa.array(scores),
                    pa.array([0.5, 0.5], pa.float32()),
                ],
                schema=schema,
            )
        )
    w.commit()
    # Parquet's footer leaves the NaN out of the max: only the writer can tell
    assert w.metadata is not None
    assert w.metadata.row_group(0).column(1).statistics.max == 0.3
    assert w.nan_columns == ({"score"} if watch else set())
