"""Incremental nights through the real CLI, in the three output formats (docs/incremental.md).

Four nights of one job over a date-partitioned input, each a real ``score-catalog run``
process: night 1 scores every row; night 2 reads night 1's rows re-cut into other shards in
another order, with 1% of the rows' features changed, 2% of their pass-through changed, some
ids deleted and some new, and sends exactly the changed and new rows through the model while
its output equals a full rescore row for row; night 3 (the same input again) scores nothing;
night 4, with another model, scores every row. A full rescore of each night (the same job
without ``--incremental``, into another output) is the reference.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.cli.demo import export_bundle, make_rows
from tests.conftest import demo_toml, make_model
from tests.integration.helpers import KILL_AT, cli, read_tree, report
from tests.integration.servers import DaskCluster

pytestmark = pytest.mark.integration

ROWS = 6000
FEATURE_CHANGED = 60  # 1%
PASSTHROUGH_CHANGED = 120  # 2%
DELETED = 45
NEW = 55
DAYS = ("2026-12-01", "2026-12-02", "2026-12-03", "2026-12-04")


def _write_day(root: Path, day: str, table: pa.Table, shards: int, seed: int) -> None:
    """``table``'s rows shuffled and cut into ``shards`` files of several row groups."""
    order = np.random.default_rng(seed).permutation(table.num_rows)
    table = table.take(pa.array(order))
    folder = root / "in" / day
    folder.mkdir(parents=True)
    cuts = np.linspace(0, table.num_rows, shards + 1).astype(int)
    for i in range(shards):
        part = table.slice(cuts[i], cuts[i + 1] - cuts[i])
        pq.write_table(part, folder / f"cut{seed}-{i:02d}.parquet", row_group_size=700)


@dataclass(frozen=True)
class Nights:
    root: Path
    fmt: str
    bundle: Path
    other_bundle: Path
    night2: pd.DataFrame  # night 2's input, as written
    feature_changed: frozenset[int]
    new_ids: frozenset[int]

    def args(
        self, day: str, *extra: str, output: str = "out", model: Path | None = None
    ) -> list[str]:
        return [
            "run",
            "--input",
            str(self.root / "in" / "{date}"),
            "--output",
            str(self.root / output / "run_date={date}"),
            "--model",
            str(model or self.bundle),
            "--passthrough",
            "category",
            "--format",
            self.fmt,
            "--date",
            day,
            "--scheduler",
            "sync",
            "-q",
            *extra,
        ]

    def run(self, day: str, *extra: str, drift: bool = False, **kw: Any) -> dict[str, Any]:
        r = cli(*self.args(day, *extra, **kw))
        # Another model's scores drift from the last night's: exit 4, still written.
        assert r.returncode in ((0, 4) if drift else (0,)), r.stderr
        out = self.root / kw.get("output", "out") / f"run_date={day}"
        return report(out)

    def rows(self, day: str, output: str = "out") -> pd.DataFrame:
        """What a reader of the night's output sees, sorted by id."""
        if self.fmt == "delta":
            from pipeline.sinks.delta.client import TableRef
            from pipeline.sinks.delta.read import read

            ref = TableRef.of(str(self.root / output), {})
            table = read(ref, partition={"run_date": day})
        elif self.fmt == "iceberg":
            # Through the catalog and identifier the night's report names, filtered by day.
            from pyiceberg.catalog.sql import SqlCatalog
            from pyiceberg.expressions import EqualTo

            section = report(self.root / output / f"run_date={day}")["output_format"]
            found = SqlCatalog("score_catalog", uri=section["catalog"])
            scan = found.load_table(section["identifier"]).scan(EqualTo("run_date", day))
            table = scan.to_arrow()
        else:
            parts = read_tree(self.root / output / f"run_date={day}")
            table = pa.concat_tables(parts.values())
        return table.to_pandas().sort_values("item_id").reset_index(drop=True)


def _nights(root: Path, fmt: str) -> Nights:
    bundle, other = root / "bundle", root / "other_bundle"
    export_bundle(make_model(), bundle, demo_toml(), n_in=16)
    export_bundle(make_model(seed=7), other, demo_toml(version="2"), n_in=16)
    first = make_rows(0, ROWS, 0)
    _write_day(root, DAYS[0], first, shards=3, seed=1)
    rng = np.random.default_rng(42)
    df = first.to_pandas()
    picked = rng.choice(ROWS, FEATURE_CHANGED + PASSTHROUGH_CHANGED + DELETED, replace=False)
    feat, passed, gone = np.split(picked, [FEATURE_CHANGED, FEATURE_CHANGED + PASSTHROUGH_CHANGED])
    df.loc[feat, "f3"] = df.loc[feat, "f3"] + np.float32(0.5)
    df.loc[passed, "category"] = df.loc[passed, "category"] + "-renamed"
    df = df.drop(index=gone)
    new = make_rows(1_000_000, NEW, 9).to_pandas()
    night2 = pd.concat([df, new], ignore_index=True)
    table2 = pa.Table.from_pandas(night2, schema=first.schema, preserve_index=False)
    _write_day(root, DAYS[1], table2, shards=4, seed=2)  # other cuts, another order
    _write_day(root, DAYS[2], table2, shards=5, seed=3)  # night 3: the same rows again
    _write_day(root, DAYS[3], table2, shards=5, seed=4)  # night 4: another model
    return Nights(
        root,
        fmt,
        bundle,
        other,
        night2.sort_values("item_id").reset_index(drop=True),
        frozenset(int(i) for i in first.column("item_id").to_numpy()[feat]),
        frozenset(int(i) for i in new["item_id"]),
    )


@pytest.fixture(scope="module", params=["parquet", "delta", "iceberg"])
def nights(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Nights]:
    yield _nights(tmp_path_factory.mktemp(f"incremental-{request.param}"), request.param)


def _assert_equal_to_full(got: pd.DataFrame, full: pd.DataFrame, inputs: pd.DataFrame) -> None:
    """Row for row: the ids once each, scores within 1e-5, labels equal, pass-through as
    tonight's input."""
    assert got["item_id"].is_unique
    assert got["item_id"].tolist() == full["item_id"].tolist() == inputs["item_id"].tolist()
    assert np.abs(got["score"].to_numpy() - full["score"].to_numpy()).max() <= 1e-5
    assert (got["label"].to_numpy() == full["label"].to_numpy()).all()
    assert got["category"].tolist() == inputs["category"].tolist()


def test_four_nights_score_what_changed_and_equal_a_full_rescore(nights: Nights) -> None:
    n = nights
    first = n.run(DAYS[0], "--incremental")
    inc = first["incremental"]
    assert inc["rows_scored"] == ROWS and inc["rows_carried"] == 0
    assert inc["baseline"] is None and "no earlier night" in inc["full_reason"]

    # Night 2: re-cut, reordered, 1% features and 2% pass-through changed, deletes, new ids;
    # a real Dask cluster (two worker processes share the memory-mapped index).
    second = n.run(DAYS[1], "--incremental", "--scheduler", "local", "--workers", "2")
    inc = second["incremental"]
    assert inc["baseline"]["run_id"] == first["run_id"]
    assert inc["baseline"]["date"] == DAYS[0] and inc["full_reason"] is None
    assert inc["rows_new"] == NEW
    assert inc["rows_changed"] == FEATURE_CHANGED
    assert inc["rows_scored"] == FEATURE_CHANGED + NEW  # exactly the changed and new rows
    assert inc["rows_carried"] == ROWS - DELETED - FEATURE_CHANGED
    assert inc["rows_removed"] == DELETED
    assert sum(s["incremental"]["rows_scored"] for s in second["shards"]) == inc["rows_scored"]
    n.run(DAYS[1], output="full")
    got, full = n.rows(DAYS[1]), n.rows(DAYS[1], "full")
    _assert_equal_to_full(got, full, n.night2)
    assert got["model_input_hash"].notna().all()

    # Night 3: the same rows, cut again: nothing goes through the model.
    third = n.run(DAYS[2], "--incremental")
    assert third["incremental"]["rows_scored"] == 0
    assert third["incremental"]["rows_carried"] == ROWS - DELETED + NEW
    assert third["incremental"]["baseline"]["run_id"] == second["run_id"]
    _assert_equal_to_full(n.rows(DAYS[2]), full, n.night2)

    # Night 4: another model: every row through it, and the report says why.
    fourth = n.run(DAYS[3], "--incremental", model=n.other_bundle, drift=True)
    inc = fourth["incremental"]
    assert inc["rows_scored"] == ROWS - DELETED + NEW and inc["rows_carried"] == 0
    assert "another scorer" in inc["full_reason"] and "model_sha256" in inc["full_reason"]
    n.run(DAYS[3], output="full", model=n.other_bundle, drift=True)
    _assert_equal_to_full(n.rows(DAYS[3]), n.rows(DAYS[3], "full"), n.night2)


def test_plan_says_what_would_go_through_the_model(nights: Nights) -> None:
    n = nights
    if not (n.root / "out" / f"run_date={DAYS[0]}").exists():
        n.run(DAYS[0], "--incremental")
    args = n.args(DAYS[1], "--incremental")
    args[0] = "plan"
    args = [a for a in args if a != "-q"]
    r = cli(*args, "--json")
    assert r.returncode == 0, r.stderr
    import json

    plan = json.loads(r.stdout)
    inc = plan["incremental"]
    if plan["shards_to_score"]:
        assert inc["rows_scored"] == FEATURE_CHANGED + NEW
        assert inc["rows_new"] == NEW and inc["rows_changed"] == FEATURE_CHANGED
        assert inc["rows_removed"] == DELETED
    text = cli(*[a for a in args if a != "--json"])
    assert "would go through the model" in text.stdout or "every row" in text.stdout


@pytest.mark.parametrize("point", ["output-committed:2", "judged:1"])
def test_a_sigkilled_incremental_night_resumes_to_a_full_rescore(
    nights: Nights, point: str
) -> None:
    """Killed mid-night (once a shard's file is committed, or once every shard is done and the
    run is about to commit), night 2 resumes: what the dead run left done is kept, the rest is
    scored against the same baseline, and the output equals a full rescore."""
    n = nights
    day = DAYS[1]
    out = f"killed-{n.fmt}-{point.split(':')[0]}"
    _first_night(n, DAYS[0], out)  # the baseline: night 1 of this output's own history
    killed = cli(*n.args(day, "--incremental", output=out), env={KILL_AT: point})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = n.run(day, "--incremental", output=out)
    inc = resumed["incremental"]
    assert inc["baseline"] is not None and inc["baseline"]["date"] == DAYS[0]
    kept = [s for s in resumed["shards"] if s["status"] == "skipped"]
    # What the dead run left done is kept, unread (how many shards that is depends on when
    # its manifest was last saved; after the score phase, every shard).
    assert inc["rows_kept"] == sum(s["rows_out"] for s in kept)
    if point.startswith("judged"):
        assert len(kept) == len(resumed["shards"]) and inc["rows_scored"] == 0
    assert inc["rows_scored"] + inc["rows_carried"] + inc["rows_kept"] == ROWS - DELETED + NEW
    if not (n.root / "full" / f"run_date={day}").exists():
        n.run(day, output="full")
    _assert_equal_to_full(n.rows(day, out), n.rows(day, "full"), n.night2)


def test_an_incremental_night_on_a_dask_cluster_elsewhere(
    nights: Nights, dask_cluster: DaskCluster
) -> None:
    """Workers of a cluster started apart (a scheduler and two workers) copy the index from
    the output's control area, build the id table in their copy when rows moved (night 2 is
    re-cut), and mark nothing: the driver reads the input's ids to count the removed ones.
    The counts and the output are those of a night on this machine."""
    n = nights
    out = f"remote-{n.fmt}"
    _first_night(n, DAYS[0], out)
    second = n.run(DAYS[1], "--incremental", "--scheduler", dask_cluster.address, output=out)
    inc = second["incremental"]
    assert (inc["rows_new"], inc["rows_changed"]) == (NEW, FEATURE_CHANGED)
    assert inc["rows_scored"] == FEATURE_CHANGED + NEW and inc["rows_removed"] == DELETED
    if not (n.root / "full" / f"run_date={DAYS[1]}").exists():
        n.run(DAYS[1], output="full")
    _assert_equal_to_full(n.rows(DAYS[1], out), n.rows(DAYS[1], "full"), n.night2)
    assert not list(n.root.rglob("_baseline/*/*"))  # the uploaded index is gone


def _first_night(n: Nights, day: str, output: str) -> None:
    """Night ``day`` scored into ``output`` (the run index of that output's root has it)."""
    r = cli(*n.args(day, "--incremental", output=output))
    assert r.returncode == 0, r.stderr


def test_a_compacted_baseline_is_still_carried_from(tmp_path: Path) -> None:
    """OPTIMIZE rewrites a day's files into one: the compacted file keeps the scorer of the
    files it was made of, so the next night still carries from it."""
    n = _nights(tmp_path, "delta")
    n.run(DAYS[0], "--incremental")
    r = cli("optimize", str(n.root / "out" / f"run_date={DAYS[0]}"))
    assert r.returncode == 0, r.stderr
    second = n.run(DAYS[1], "--incremental")
    inc = second["incremental"]
    assert inc["baseline"]["files"] == 1 and inc["baseline"]["files_skipped"] == 0
    assert inc["rows_scored"] == FEATURE_CHANGED + NEW


def test_a_day_a_rollback_restored_is_carried_from(tmp_path: Path) -> None:
    """Day 1 scored, day 2 scored twice (the second by another model), day 2 rolled back to
    its first version: the restored day is the next night's baseline, carried from like the
    run that wrote it (issue 31 review: the rollback's record had no scorer, and the night
    scored every row, saying its baseline "was not incremental")."""
    n = _nights(tmp_path, "delta")
    n.run(DAYS[0], "--incremental")
    n.run(DAYS[1], "--incremental")
    n.run(DAYS[1], "--model", str(n.other_bundle), drift=True)
    undo = cli(
        "rollback",
        str(n.root / "out" / f"run_date={DAYS[1]}"),
        "--to-version",
        "2",
        "--reason",
        "model 2 was bad",
    )
    assert undo.returncode == 0, undo.stderr
    third = n.run(DAYS[2], "--incremental")
    inc = third["incremental"]
    assert inc["full_reason"] is None, inc
    assert inc["rows_scored"] == 0 and inc["rows_carried"] == len(n.night2), inc
    assert inc["baseline"]["output"].endswith(f"run_date={DAYS[1]}"), inc["baseline"]
    full = cli(*n.args(DAYS[2], output="full"))
    assert full.returncode == 0, full.stderr
    _assert_equal_to_full(n.rows(DAYS[2]), n.rows(DAYS[2], output="full"), n.night2)


def test_a_night_in_its_baseline_files_order_needs_no_id_table(tmp_path: Path) -> None:
    """Shards that keep their names and their rows' order (features changed in place, rows
    deleted, new items numbered on inserted and appended) are matched near each row's place:
    the id table is never built, and the counts and output are a full rescore's. The same
    night with a new id inside the baseline's range (an id that cannot be known new without
    the table) builds it once, and carries the same rows."""
    bundle = tmp_path / "bundle"
    export_bundle(make_model(), bundle, demo_toml(), n_in=16)
    first = make_rows(0, 3000, 0)
    night1 = tmp_path / "in" / DAYS[0]
    night1.mkdir(parents=True)
    for i in range(3):
        part = first.slice(1000 * i, 1000)
        pq.write_table(part, night1 / f"part-{i}.parquet", row_group_size=300)
    df = first.to_pandas()
    df.loc[5:34, "f3"] = df.loc[5:34, "f3"] + np.float32(0.5)  # 30 changed in place
    new = make_rows(3000, 12, 9).to_pandas()  # ids 3000..3011: beyond night 1's
    shard1 = pd.concat([new.iloc[:5], df.iloc[1000:1400], df.iloc[1410:2000]])  # 10 deleted
    shard2 = pd.concat([df.iloc[2000:3000], new.iloc[5:]])
    night2 = [df.iloc[:1000], shard1, shard2]

    def write(day: str, parts: list[pd.DataFrame]) -> pd.DataFrame:
        folder = tmp_path / "in" / day
        folder.mkdir(parents=True)
        for i, part in enumerate(parts):
            table = pa.Table.from_pandas(part, schema=first.schema, preserve_index=False)
            pq.write_table(table, folder / f"part-{i}.parquet", row_group_size=300)
        return pd.concat(parts).sort_values("item_id").reset_index(drop=True)

    def night(day: str, *extra: str, output: str = "out") -> tuple[dict[str, Any], str]:
        args = [
            "run", "--input", str(tmp_path / "in" / "{date}"),
            "--output", str(tmp_path / output / "run_date={date}"),
            "--model", str(bundle), "--passthrough", "category", "--date", day,
            "--scheduler", "sync", *extra,
        ]  # fmt: skip
        r = cli(*args)
        assert r.returncode == 0, r.stderr
        return report(tmp_path / output / f"run_date={day}"), r.stderr

    def rows(day: str, output: str) -> pd.DataFrame:
        parts = read_tree(tmp_path / output / f"run_date={day}")
        frame = pa.concat_tables(parts.values()).to_pandas()
        return frame.sort_values("item_id").reset_index(drop=True)

    night(DAYS[0], "--incremental")
    inputs = write(DAYS[1], night2)
    second, log = night(DAYS[1], "--incremental")
    inc = second["incremental"]
    assert (inc["rows_changed"], inc["rows_new"], inc["rows_removed"]) == (30, 12, 10)
    assert inc["rows_scored"] == 42 and inc["rows_carried"] == 3000 - 10 - 30
    assert "id table built" not in log
    night(DAYS[1], output="full")
    _assert_equal_to_full(rows(DAYS[1], "out"), rows(DAYS[1], "full"), inputs)

    gap = make_rows(1500, 1, 3).to_pandas()  # id 1500: inside the range, and deleted above
    gap["item_id"] = 1405
    inputs = write(DAYS[2], [night2[0], pd.concat([night2[1], gap]), night2[2]])
    third, log = night(DAYS[2], "--incremental")
    inc = third["incremental"]
    assert inc["rows_new"] == 1 and inc["rows_changed"] == 0 and inc["rows_scored"] == 1
    assert log.count("id table built") == 1
    night(DAYS[2], output="full")
    _assert_equal_to_full(rows(DAYS[2], "out"), rows(DAYS[2], "full"), inputs)
