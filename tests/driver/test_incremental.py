"""Tests for pipeline.driver.incremental: which baseline a night carries from, and every reason
it scores every row instead (through ``pipeline.run``, in this process, on real files)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

import pipeline
from pipeline.cli.demo import export_bundle, make_rows
from pipeline.core.config import JobConfig
from pipeline.worker.baseline import forget_open
from tests.conftest import demo_toml, make_model

DAY1, DAY2 = "2026-12-01", "2026-12-02"


def _write(root: Path, day: str, table: pa.Table, parts: int = 2) -> None:
    folder = root / "in" / day
    folder.mkdir(parents=True, exist_ok=True)
    cuts = np.linspace(0, table.num_rows, parts + 1).astype(int)
    for i in range(parts):
        part = table.slice(cuts[i], cuts[i + 1] - cuts[i])
        pq.write_table(part, folder / f"p{i}.parquet", row_group_size=300)


def _config(root: Path, bundle: Path, day: str, **kw: Any) -> JobConfig:
    base: dict[str, Any] = {
        "input": str(root / "in" / "{date}"),
        "output": str(root / "out" / "run_date={date}"),
        "model": str(bundle),
        "scheduler": "sync",
        "incremental": True,
        "date": day,
    }
    return JobConfig(**{**base, **kw})


def _scores(root: Path, day: str) -> pa.Table:
    files = sorted((root / "out" / f"run_date={day}").glob("*.parquet"))
    return pa.concat_tables([pq.read_table(f) for f in files]).sort_by("item_id")


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    b = tmp_path / "bundle"
    export_bundle(make_model(), b, demo_toml(), n_in=16)
    return b


@pytest.fixture(autouse=True)
def _fresh_index() -> Any:
    yield
    forget_open()


def test_null_ids_and_rejected_rows_are_scored_again_and_the_rest_carried(
    tmp_path: Path, bundle: Path
) -> None:
    """A null id is never carried; a row rejected last night (a NaN feature) is not in the
    baseline, so it is examined again (and rejected again); everything else is carried."""
    t = make_rows(0, 2000, 0)
    ids = t.column("item_id").to_numpy().astype(object)
    ids[[3, 700]] = None
    f5 = t.column("f5").to_numpy().copy()
    f5[[10, 1500]] = np.nan
    t = t.set_column(0, "item_id", pa.array(ids.tolist(), pa.int64()))
    t = t.set_column(t.schema.get_field_index("f5"), "f5", pa.array(f5))
    _write(tmp_path, DAY1, t)
    _write(tmp_path, DAY2, t, parts=3)
    first = pipeline.run(_config(tmp_path, bundle, DAY1))
    assert first.status == "succeeded_with_errors"  # two rows rejected, within the budget
    second = pipeline.run(_config(tmp_path, bundle, DAY2))
    inc = second["incremental"]
    assert inc["rows_scored"] == 2 and inc["rows_new"] == 2  # the null ids
    assert inc["rows_carried"] == 2000 - 2 - 2
    assert second["rows_rejected"] == 2 and second["rows_out"] == 1998
    assert inc["rows_removed"] == 0


def test_a_night_after_one_that_was_not_incremental_scores_every_row(
    tmp_path: Path, bundle: Path
) -> None:
    t = make_rows(0, 900, 0)
    _write(tmp_path, DAY1, t)
    _write(tmp_path, DAY2, t)
    pipeline.run(_config(tmp_path, bundle, DAY1, incremental=False))
    second = pipeline.run(_config(tmp_path, bundle, DAY2))
    inc = second["incremental"]
    assert inc["rows_scored"] == 900 and inc["baseline"] is None
    assert "was not incremental" in inc["full_reason"]
    # ... and the one after it carries from it.
    third = pipeline.run(_config(tmp_path, bundle, "2026-12-03", input=str(tmp_path / "in" / DAY2)))
    assert third["incremental"]["rows_carried"] == 900


def test_force_scores_every_row(tmp_path: Path, bundle: Path) -> None:
    t = make_rows(0, 600, 0)
    _write(tmp_path, DAY1, t)
    _write(tmp_path, DAY2, t)
    pipeline.run(_config(tmp_path, bundle, DAY1))
    forced = pipeline.run(_config(tmp_path, bundle, DAY2, force=True))
    assert forced["incremental"]["rows_scored"] == 600
    assert "--force" in forced["incremental"]["full_reason"]


def test_another_precision_is_another_scorer(tmp_path: Path, bundle: Path) -> None:
    t = make_rows(0, 600, 0)
    _write(tmp_path, DAY1, t)
    _write(tmp_path, DAY2, t)
    pipeline.run(_config(tmp_path, bundle, DAY1))
    other = pipeline.run(_config(tmp_path, bundle, DAY2, precision="bf16", parity_tolerance=1.0))
    reason = other["incremental"]["full_reason"]
    assert "another scorer" in reason and "precision 'fp32' -> 'bf16'" in reason


def test_a_baseline_file_that_cannot_be_read_makes_every_row_scored_and_names_it(
    tmp_path: Path, bundle: Path
) -> None:
    t = make_rows(0, 800, 0)
    _write(tmp_path, DAY1, t)
    _write(tmp_path, DAY2, t)
    pipeline.run(_config(tmp_path, bundle, DAY1))
    broken = tmp_path / "out" / f"run_date={DAY1}" / "p1.parquet"
    broken.write_bytes(broken.read_bytes()[:100])  # truncated: a lost or damaged object
    second = pipeline.run(_config(tmp_path, bundle, DAY2))
    inc = second["incremental"]
    assert inc["rows_scored"] == 800 and inc["baseline"] is None
    assert "p1.parquet cannot be read" in inc["full_reason"]


class _Centered(torch.nn.Module):
    """Each row's output depends on the other rows of its call (the batch's mean)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(dim=0, keepdim=True))[:, :2]


def test_a_model_whose_rows_depend_on_each_other_carries_nothing(tmp_path: Path) -> None:
    b = tmp_path / "centered"
    export_bundle(_Centered().eval(), b, demo_toml(outputs='score = "raw"\n'), n_in=16)
    t = make_rows(0, 500, 0)
    _write(tmp_path, DAY1, t)
    _write(tmp_path, DAY2, t)
    pipeline.run(_config(tmp_path, b, DAY1))
    second = pipeline.run(_config(tmp_path, b, DAY2))
    inc = second["incremental"]
    assert inc["rows_carried"] == 0
    assert "depends on the other rows of its call" in inc["full_reason"]


@pytest.mark.parametrize("widen", ["int32->int64", "string->large_string"])
def test_ids_match_by_value_whatever_their_arrow_type(
    tmp_path: Path, bundle: Path, widen: str
) -> None:
    """An id column widened upstream between nights still matches."""
    t = make_rows(0, 700, 0)
    if widen.startswith("string"):
        strings = pc.cast(t.column("item_id"), pa.string())
        sku = pc.binary_join_element_wise("SKU-", strings, "")
        first = t.set_column(0, "item_id", sku)
        second = t.set_column(0, "item_id", sku.cast(pa.large_string()))
    else:
        first = t.set_column(0, "item_id", t.column("item_id").cast(pa.int32()))
        second = t
    _write(tmp_path, DAY1, first)
    _write(tmp_path, DAY2, second, parts=3)
    pipeline.run(_config(tmp_path, bundle, DAY1))
    night = pipeline.run(_config(tmp_path, bundle, DAY2))
    assert night["incremental"]["rows_carried"] == 700


def test_the_run_index_records_the_scorer_and_the_summary_says_what_changed(
    tmp_path: Path, bundle: Path
) -> None:
    from pipeline.report.text import summary_table

    t = make_rows(0, 1000, 0)
    _write(tmp_path, DAY1, t)
    changed = t.set_column(
        t.schema.get_field_index("f2"),
        "f2",
        pa.array(np.where(np.arange(1000) < 10, 9.0, t.column("f2").to_numpy()).astype(np.float32)),
    )
    _write(tmp_path, DAY2, changed)
    first = pipeline.run(_config(tmp_path, bundle, DAY1))
    entry = json.loads(
        (
            tmp_path
            / "_score_catalog"
            / "out"
            / "_runs"
            / "score-catalog"
            / f"{first['run_id']}.json"
        ).read_text()
    )
    assert entry["scorer"]["values"]["precision"] == "fp32" and len(entry["scorer"]["hash"]) == 16
    second = pipeline.run(_config(tmp_path, bundle, DAY2))
    text = summary_table(second)
    assert f"990 carried from run {first['run_id']} ({DAY1})" in text
    assert "10 through the model (0 new, 10 changed)" in text
    scores = _scores(tmp_path, DAY2)
    footer = pq.ParquetFile(next((tmp_path / "out" / f"run_date={DAY2}").glob("*.parquet")))
    assert footer.metadata.metadata[b"score_catalog.scorer"] == entry["scorer"]["hash"].encode()
    assert scores.column("model_input_hash").null_count == 0
