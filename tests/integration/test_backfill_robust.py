"""Backfills that must not lose data or stop early: rejects kept per day, a bad day isolated.

Real Parquet archives (several row groups per shard), the real CLI for exit codes and output,
and the library entry point where only the summary matters.
"""

from __future__ import annotations

import datetime as dt
import importlib
import json
import math
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from pipeline.cli.demo import make_rows
from pipeline.core.config import ErrorPolicy, JobConfig
from pipeline.core.errors import ConfigError
from pipeline.driver.backfill import backfill
from tests.conftest import write_shards
from tests.integration.helpers import cli, data_files, rejects_of, report

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DAYS = ["2025-03-01", "2025-03-02", "2025-03-03"]
OK = "succeeded_with_errors"  # every day has rejected rows, within the job's budget
BAD_EVERY = 10  # one row in ten of each day's second shard has a NaN feature: rejected


def _shard_with_nans(path: Path, start: int, n: int, seed: int) -> int:
    """A shard whose f5 is NaN on every BAD_EVERY-th row, 4 row groups; returns the bad rows."""
    table = make_rows(start, n, seed)
    bad = pa.array([i % BAD_EVERY == 0 for i in range(n)])
    f5 = pc.if_else(bad, pa.scalar(math.nan, pa.float32()), table.column("f5"))
    table = table.set_column(table.schema.get_field_index("f5"), "f5", f5)
    pq.write_table(table, path, row_group_size=n // 4)
    return sum(bad.to_pylist())


@pytest.fixture
def archive(tmp_path: Path) -> dict[str, int]:
    """Three daily partitions: a clean shard and one with rejected rows; bad rows per day."""
    bad = {}
    for k, day in enumerate(DAYS):
        folder = tmp_path / "archive" / f"dt={day}"
        write_shards(folder, [900], row_group_rows=300, start=10_000 * k, seed=k)
        bad[day] = _shard_with_nans(folder / "part-00001.parquet", 10_000 * k + 900, 1200, k)
    return bad


def _job(tmp_path: Path, bundle: Path, rejects: str | None) -> Path:
    job = tmp_path / "nightly.toml"
    lines = [
        f'input = "{tmp_path}/archive/dt={{date}}"',
        f'output = "{tmp_path}/scored/dt={{date}}"',
        f'model = "{bundle}"',
        'scheduler = "sync"',
        "batch_size = 256",
        *([f'rejects = "{rejects}"'] if rejects is not None else []),
        "[errors]",
        "max_rejected_fraction = 0.5",
        "[monitoring]",
        "drift = false",
    ]
    job.write_text("\n".join(lines) + "\n")
    return job


def _summary(tmp_path: Path) -> dict[str, Any]:
    # In the control area beside the output template's fixed part (pipeline.io.layout).
    area = tmp_path / "_score_catalog" / "scored"
    path = area / "_backfills" / "nightly" / f"{DAYS[0]}_{DAYS[-1]}.json"
    summary: dict[str, Any] = json.loads(path.read_text())
    return summary


def _rejected_ids(folder: Path) -> list[int]:
    files = sorted(folder.rglob("*.parquet")) if folder.exists() else []
    return sorted(i for p in files for i in pq.read_table(p).column("item_id").to_pylist())


def _expected_rejects(day_index: int) -> list[int]:
    start = 10_000 * day_index + 900
    return [start + i for i in range(1200) if i % BAD_EVERY == 0]


def test_rejects_without_date_are_refused_before_any_day_runs(
    tmp_path: Path, bundle_dir: Path, archive: dict[str, int]
) -> None:
    job = _job(tmp_path, bundle_dir, rejects=f"{tmp_path}/rejects")
    r = cli("backfill", str(job), "--from", DAYS[0], "--to", DAYS[-1])
    assert r.returncode == 2, r.output
    assert f"rejects = '{tmp_path}/rejects' has no {{date}}" in r.stderr
    assert "leave rejects unset" in r.stderr
    assert not (tmp_path / "scored").exists() and not (tmp_path / "rejects").exists()

    # The same refusal from the library, with {run_id} alone too: it is not a day's location.
    for template in (f"{tmp_path}/rejects", f"{tmp_path}/rejects/{{run_id}}"):
        config = JobConfig(
            input=f"{tmp_path}/archive/dt={{date}}",
            output=f"{tmp_path}/scored/dt={{date}}",
            model=str(bundle_dir),
            rejects=template,
        )
        with pytest.raises(ConfigError, match="has no \\{date\\}"):
            backfill(config, dt.date(2025, 3, 1), dt.date(2025, 3, 3))
    assert not (tmp_path / "scored").exists()


@pytest.mark.parametrize("templated", [True, False], ids=["rejects-dt-date", "default-rejects"])
def test_every_days_rejected_rows_are_kept(
    tmp_path: Path, bundle_dir: Path, archive: dict[str, int], templated: bool
) -> None:
    rejects = f"{tmp_path}/rejects/dt={{date}}" if templated else None
    job = _job(tmp_path, bundle_dir, rejects)
    r = cli("backfill", str(job), "--from", DAYS[0], "--to", DAYS[-1])
    assert r.returncode == 0, r.output
    for k, day in enumerate(DAYS):
        out = tmp_path / "scored" / f"dt={day}"
        rep = report(out)  # checked against the report schema
        assert rep["status"] == OK
        assert rep["rows_rejected"] == archive[day]
        root = tmp_path / "scored"  # the default: beside the template's fixed part
        where = tmp_path / "rejects" / f"dt={day}" if templated else rejects_of(out, root)
        assert _rejected_ids(where) == _expected_rejects(k)  # day 2 did not replace day 1's
        scored = [
            i for p in data_files(out) for i in pq.read_table(p).column("item_id").to_pylist()
        ]
        assert len(scored) == 2100 - archive[day]
    assert {p["status"] for p in _summary(tmp_path)["partitions"]} == {OK}


def test_a_day_that_cannot_take_its_output_fails_alone(
    tmp_path: Path, bundle_dir: Path, archive: dict[str, int]
) -> None:
    # In the day's own folder: a file directly in the template's root is refused for every day
    # (readers of the root fail on it: pipeline.io.nesting.check_root).
    blocker = tmp_path / "scored" / f"dt={DAYS[1]}" / "_lock.json"
    blocker.parent.mkdir(parents=True)
    blocker.mkdir()
    (blocker / "not-a-lock").write_text("not a folder\n")
    job = _job(tmp_path, bundle_dir, rejects=None)
    r = cli("backfill", str(job), "--from", DAYS[0], "--to", DAYS[-1])
    assert r.returncode == 1, r.output  # the worst of the days'
    assert "Traceback" not in r.output

    s = _summary(tmp_path)
    parts = {p["date"]: p for p in s["partitions"]}
    assert s["status"] == "failed" and s["not_run"] == []
    assert [p["status"] for p in s["partitions"]] == [
        "succeeded_with_errors",
        "error",
        "succeeded_with_errors",
    ]
    assert str(blocker) in parts[DAYS[1]]["message"]
    assert parts[DAYS[1]]["exit_code"] == 1
    assert (blocker / "not-a-lock").read_text() == "not a folder\n"  # left as it was
    for day in (DAYS[0], DAYS[2]):  # the days on either side ran in full
        out = tmp_path / "scored" / f"dt={day}"
        assert (out / "_SUCCESS").exists() and report(out)["rows_out"] == 2100 - archive[day]
    assert DAYS[1] in r.stdout and "error" in r.stdout  # the summary table names the bad day


def test_an_unexpected_exception_is_recorded_and_later_days_run(
    tmp_path: Path, bundle_dir: Path, archive: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a PipelineError: a bug (here a TypeError raised by the scoring run) on day 2."""
    # The module of the ``pipeline.backfill`` function that the package exports.
    backfill_mod = importlib.import_module("pipeline.driver.backfill")
    real_run = backfill_mod.run

    def run_with_a_bug(cfg: JobConfig, **kw: Any) -> Any:
        if cfg.date == DAYS[1]:
            raise TypeError("unsupported operand type(s) for +: 'int' and 'NoneType'")
        return real_run(cfg, **kw)

    monkeypatch.setattr(backfill_mod, "run", run_with_a_bug)
    config = JobConfig(
        input=f"{tmp_path}/archive/dt={{date}}",
        output=f"{tmp_path}/scored/dt={{date}}",
        model=str(bundle_dir),
        name="nightly",
        scheduler="sync",
        batch_size=256,
        errors=ErrorPolicy(max_rejected_fraction=0.5),
    )
    seen: list[str] = []
    result = backfill(
        config,
        dt.date(2025, 3, 1),
        dt.date(2025, 3, 3),
        on_partition=lambda p: seen.append(p["date"]),
    )
    assert seen == DAYS  # day 3 ran after day 2's error
    assert result.exit_code == 1  # from day 2 alone: the other days are within the budget
    parts = result.data["partitions"]
    assert [p["status"] for p in parts] == [
        "succeeded_with_errors",
        "error",
        "succeeded_with_errors",
    ]
    assert parts[1]["message"].startswith("TypeError: unsupported operand")
    assert result.data["status"] == "failed"
    on_disk = {k: v for k, v in result.data.items() if k != "summary_uri"}
    assert _summary(tmp_path) == json.loads(json.dumps(on_disk))


def test_a_finished_day_whose_input_changed_is_run_again(
    tmp_path: Path, bundle_dir: Path, archive: dict[str, int]
) -> None:
    """A day is skipped only while its input lists the shards its manifest recorded: a shard
    deleted upstream since must not stay in an output that carries ``_SUCCESS``."""
    job = _job(tmp_path, bundle_dir, None)
    first = cli("backfill", str(job), "--from", DAYS[0], "--to", DAYS[-1])
    assert first.returncode == 0, first.output
    (tmp_path / "archive" / f"dt={DAYS[1]}" / "part-00001.parquet").unlink()
    again = cli("backfill", str(job), "--from", DAYS[0], "--to", DAYS[-1])
    assert again.returncode == 0, again.output
    statuses = {p["date"]: p["status"] for p in _summary(tmp_path)["partitions"]}
    assert statuses[DAYS[0]] == statuses[DAYS[2]] == "skipped"
    assert statuses[DAYS[1]] == "succeeded"
    out = tmp_path / "scored" / f"dt={DAYS[1]}"
    assert (out / "_SUCCESS").exists()
    assert [p.name for p in data_files(out)] == ["part-00000.parquet"]
    assert report(out)["rows_out"] == 900


def test_a_day_rewritten_in_place_with_its_size_and_mtime_kept_is_run_again(
    tmp_path: Path, bundle_dir: Path, archive: dict[str, int]
) -> None:
    """``cp -p`` or ``rsync -a`` of a corrected shard keeps size and mtime: the footer's
    statistics tell the new values apart, as they do for ``run``."""
    job = _job(tmp_path, bundle_dir, None)
    first = cli("backfill", str(job), "--from", DAYS[0], "--to", DAYS[-1])
    assert first.returncode == 0, first.output
    shard = tmp_path / "archive" / f"dt={DAYS[2]}" / "part-00000.parquet"
    before = shard.stat()
    table = pq.read_table(shard)
    i = table.schema.get_field_index("f0")
    table = table.set_column(i, "f0", pc.negate(table.column("f0")))  # same size when encoded
    pq.write_table(table, shard, row_group_size=300)
    assert shard.stat().st_size == before.st_size
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    again = cli("backfill", str(job), "--from", DAYS[0], "--to", DAYS[-1])
    assert again.returncode == 0, again.output
    statuses = {p["date"]: p["status"] for p in _summary(tmp_path)["partitions"]}
    assert statuses[DAYS[0]] == statuses[DAYS[1]] == "skipped"
    assert statuses[DAYS[2]] == OK  # run again: the rewritten shard is rescored
    rep = report(tmp_path / "scored" / f"dt={DAYS[2]}")
    assert {s["rel_path"]: s["status"] for s in rep["shards"]} == {
        "part-00000.parquet": "scored",
        "part-00001.parquet": "skipped",
    }
