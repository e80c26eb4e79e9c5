"""``_SUCCESS`` means exactly the current input, scored once by one model (issue #11).

Each test changes the input (or the output folder) the way upstream jobs and people do, reruns
the real CLI into the same output, and checks the contract: when ``_SUCCESS`` is there, what a
reader sees (every Parquet file without a ``_``/``.`` path component) is exactly the shards the
report lists as scored or skipped, with the report's row counts and this run's model SHA-256 in
every file's footer.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from pipeline.io.layout import MODEL_SHA_KEY, SETTINGS_KEY, WRITER, WRITER_KEY
from tests.conftest import demo_toml, write_shards
from tests.integration.helpers import (
    KILL_AT,
    CliResult,
    cli,
    control_of,
    data_files,
    job_args,
    manifest_path,
    report,
    report_path,
)

pytestmark = pytest.mark.integration

OUTPUT_COLUMNS = ["item_id", "category", "score", "label", "model_version"]


def _run(catalog: Path, out: Path, bundle: Path, *extra: str) -> CliResult:
    opts = ("--passthrough", "category", "--batch-size", "400", "--scheduler", "sync")
    return cli("run", *job_args(catalog, out, bundle, *opts, *extra), in_process=True)


def _rejects_of(out: Path) -> Path:
    return out.parent / "_rejects" / out.name


def _visible_matches_report(out: Path, rep: dict[str, Any]) -> list[str]:
    """How the visible output differs from the report (empty when it matches)."""
    problems = []
    in_output = {
        s["rel_path"]: s["rows_out"] for s in rep["shards"] if s["status"] in ("scored", "skipped")
    }
    files = {str(p.relative_to(out)): p for p in data_files(out)}
    if set(files) != set(in_output):
        problems.append(f"files {sorted(files)} != report shards {sorted(in_output)}")
    total = 0
    for rel, path in files.items():
        meta = pq.ParquetFile(path).metadata
        total += meta.num_rows
        kv = meta.metadata or {}
        if rel in in_output and meta.num_rows != in_output[rel]:
            problems.append(f"{rel}: {meta.num_rows} rows, report {in_output[rel]}")
        if kv.get(WRITER_KEY) != WRITER:
            problems.append(f"{rel}: no score-catalog writer mark in its footer")
        if kv.get(MODEL_SHA_KEY, b"").decode() != rep["model"]["sha256"]:
            problems.append(f"{rel}: model {kv.get(MODEL_SHA_KEY)!r} in its footer")
        if not kv.get(SETTINGS_KEY):
            problems.append(f"{rel}: no settings hash in its footer")
    if total != rep["rows_out"]:
        problems.append(f"{total} visible rows != rows_out {rep['rows_out']}")
    return problems


def _check_contract(out: Path, *, success: bool) -> dict[str, Any]:
    """The report, after checking that ``_SUCCESS`` is there exactly when expected and that it
    is only there when the visible data equals the report."""
    rep = report(out)
    assert (out / "_SUCCESS").exists() == success, rep["failure_reasons"]
    if success:
        assert _visible_matches_report(out, rep) == []
    return rep


def _ids(out: Path) -> list[int]:
    return [i for p in data_files(out) for i in pq.read_table(p).column("item_id").to_pylist()]


def _poison_one_row(path: Path, row: int) -> None:
    t = pq.read_table(path)
    vals = t.column("f2").to_pylist()
    vals[row] = None
    t = t.set_column(t.schema.get_field_index("f2"), "f2", pa.array(vals, pa.float32()))
    pq.write_table(t, path, row_group_size=1000)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------- inputs that change shape


def test_deleted_input_shard_takes_its_output_and_rejects_away(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    _poison_one_row(catalog / "part-00001.parquet", 7)  # so that the shard has rejects too
    out = tmp_path / "out"
    assert _run(catalog, out, bundle_dir).returncode == 0
    first = _check_contract(out, success=True)
    assert first["rows_out"] == 7299
    assert (_rejects_of(out) / "part-00001.parquet").exists()

    (catalog / "part-00001.parquet").unlink()
    r = _run(catalog, out, bundle_dir)
    assert r.returncode == 0, r.output
    rep = _check_contract(out, success=True)
    assert rep["rows_out"] == 5600 and len(_ids(out)) == 5600
    assert rep["shards_skipped"] == 2
    assert not (out / "part-00001.parquet").exists()
    assert not (_rejects_of(out) / "part-00001.parquet").exists()
    [removed] = rep["removed_outputs"]
    assert removed["output"] == str(out / "part-00001.parquet")
    assert removed["rejects"] == str(_rejects_of(out) / "part-00001.parquet")
    assert "no longer exists" in removed["reason"]
    manifest = manifest_path(out).read_text()
    assert "part-00001.parquet" not in manifest
    assert ds.dataset(out, format="parquet").count_rows() == rep["rows_out"]


def test_compacted_shards_are_not_duplicated(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    assert _run(catalog, out, bundle_dir).returncode == 0
    a, b = catalog / "part-00000.parquet", catalog / "part-00001.parquet"
    merged = pa.concat_tables([pq.read_table(a), pq.read_table(b)])
    pq.write_table(merged, catalog / "compacted-00000.parquet", row_group_size=1000)
    a.unlink()
    b.unlink()
    r = _run(catalog, out, bundle_dir)
    assert r.returncode == 0, r.output
    rep = _check_contract(out, success=True)
    ids = _ids(out)
    assert len(ids) == len(set(ids)) == 7300 == rep["rows_out"]
    assert {Path(x["output"]).name for x in rep["removed_outputs"]} == {a.name, b.name}


def test_truncated_shard_within_budget_loses_its_old_output(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    assert _run(catalog, out, bundle_dir).returncode == 0
    p = catalog / "part-00002.parquet"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    r = _run(catalog, out, bundle_dir, "--max-failed-shards", "1")
    assert r.returncode == 0, r.output
    rep = _check_contract(out, success=True)
    assert rep["status"] == "succeeded_with_errors" and rep["shards_failed"] == 1
    assert not (out / "part-00002.parquet").exists()
    assert rep["rows_out"] == 4200 == len(_ids(out))
    [removed] = rep["removed_outputs"]
    assert removed["output"] == str(out / "part-00002.parquet")
    assert "unreadable" in removed["reason"]


def test_schema_skipped_shard_leaves_no_rows_of_the_previous_model(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    v2 = tmp_path / "bundle-v2"
    shutil.copytree(bundle_dir, v2)
    (v2 / "model.toml").write_text(demo_toml(version="2"))
    out = tmp_path / "out"
    assert _run(catalog, out, v2).returncode == 0
    assert _check_contract(out, success=True)["model"]["version"] == "2"

    p = catalog / "part-00001.parquet"
    pq.write_table(pq.read_table(p).drop_columns(["f3"]), p, row_group_size=1000)
    r = _run(
        catalog, out, bundle_dir, "--on-schema-error", "skip_shard", "--max-failed-shards", "1"
    )
    assert r.returncode == 0, r.output
    rep = _check_contract(out, success=True)
    assert rep["model"]["version"] == "1" and rep["shards_failed"] == 1
    versions = set(ds.dataset(out, format="parquet").to_table().column("model_version").to_pylist())
    assert versions == {"1"}
    assert not (out / "part-00001.parquet").exists()
    [removed] = rep["removed_outputs"]
    assert "does not fit the model" in removed["reason"]


def test_rewrite_with_same_size_mtime_and_rows_is_detected_by_footer_statistics(
    tmp_path: Path, bundle_dir: Path
) -> None:
    catalog = tmp_path / "catalog"
    write_shards(catalog, [1500, 1200], row_group_rows=500)
    p = catalog / "part-00000.parquet"
    # Plain, uncompressed floats: changing a value keeps every byte count the same.
    pq.write_table(
        pq.read_table(p), p, row_group_size=500, compression="none", use_dictionary=False
    )
    out = tmp_path / "out"
    assert _run(catalog, out, bundle_dir).returncode == 0
    before = pq.read_table(out / "part-00000.parquet")

    stat = p.stat()
    t = pq.read_table(p)
    f0 = t.column("f0").to_pylist()
    f0[10] = 1000.0  # a new maximum in the first row group: its statistics change
    t = t.set_column(t.schema.get_field_index("f0"), "f0", pa.array(f0, pa.float32()))
    pq.write_table(t, p, row_group_size=500, compression="none", use_dictionary=False)
    os.utime(p, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert p.stat().st_size == stat.st_size and p.stat().st_mtime_ns == stat.st_mtime_ns
    assert pq.ParquetFile(p).metadata.num_rows == 1500

    r = _run(catalog, out, bundle_dir)
    assert r.returncode == 0, r.output
    rep = _check_contract(out, success=True)
    status = {s["rel_path"]: s["status"] for s in rep["shards"]}
    assert status == {"part-00000.parquet": "scored", "part-00001.parquet": "skipped"}
    after = pq.read_table(out / "part-00000.parquet")
    assert after.column("score")[10] != before.column("score")[10]
    assert after.column("score")[11] == before.column("score")[11]


# ---------------------------------------------------------------- an output folder not ours


def _foreign_folder(out: Path) -> dict[str, str]:
    out.mkdir(parents=True)
    (out / "notes.txt").write_text("the analytics team's folder\n")
    pq.write_table(pa.table({"x": list(range(50))}), out / "part-00000.parquet")
    pq.write_table(pa.table({"y": [1.5] * 20}), out / "old_other.parquet")
    return {p.name: _sha(p) for p in out.iterdir()}


def test_foreign_output_folder_is_refused_untouched(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "theirs"
    sums = _foreign_folder(out)
    r = _run(catalog, out, bundle_dir)
    assert r.returncode == 2, r.output
    for name in ("notes.txt", "part-00000.parquet", "old_other.parquet"):
        assert name in r.output
    assert "--on-foreign-output replace" in r.output
    assert {p.name: _sha(p) for p in out.iterdir()} == sums  # nothing added, nothing changed
    assert not _rejects_of(out).exists()


def test_replace_deletes_foreign_data_files_loudly_and_keeps_other_files(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "theirs"
    sums = _foreign_folder(out)
    r = _run(catalog, out, bundle_dir, "--on-foreign-output", "replace")
    assert r.returncode == 0, r.output
    rep = _check_contract(out, success=True)
    assert sorted(rep["foreign_removed"]) == [
        str(out / "old_other.parquet"),
        str(out / "part-00000.parquet"),
    ]
    assert rep["foreign_kept"] == [str(out / "notes.txt")]
    assert _sha(out / "notes.txt") == sums["notes.txt"]
    assert not (out / "old_other.parquet").exists()
    assert pq.read_table(out / "part-00000.parquet").column_names == OUTPUT_COLUMNS
    for name in ("old_other.parquet", "part-00000.parquet", "notes.txt"):
        assert any("WARNING" in line and name in line for line in r.output.splitlines()), r.output
    # Kept, but folder readers (pyarrow.dataset, pandas) trip over it: the report says so.
    assert [w for w in rep["warnings"] if "notes.txt" in w and "move it out" in w]
    # The folder is ours now: a plain rerun resumes instead of refusing.
    assert _run(catalog, out, bundle_dir).returncode == 0
    assert _check_contract(out, success=True)["shards_skipped"] == 3


def test_stray_file_in_our_output_fails_the_check_before_success(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    assert _run(catalog, out, bundle_dir).returncode == 0
    pq.write_table(pa.table({"item_id": [1, 2, 3]}), out / "stray.parquet")
    r = _run(catalog, out, bundle_dir)
    assert r.returncode == 1, r.output
    rep = _check_contract(out, success=False)
    assert rep["status"] == "failed"
    assert any("stray.parquet" in reason for reason in rep["failure_reasons"])
    assert (out / "stray.parquet").exists()  # someone else's file is never deleted unasked


@pytest.mark.parametrize("hidden", ["_archive/p.parquet", ".bak/p.parquet", "_old.parquet"])
def test_a_parquet_file_under_a_hidden_name_fails_the_check_duckdb_would_read_it(
    catalog: Path, bundle_dir: Path, tmp_path: Path, hidden: str
) -> None:
    import duckdb

    out = tmp_path / "out"
    assert _run(catalog, out, bundle_dir).returncode == 0
    stray = out / hidden
    stray.parent.mkdir(exist_ok=True)
    shutil.copy(catalog / "part-00000.parquet", stray)
    ((rows,),) = duckdb.sql(f"select count(*) from read_parquet('{out}/**/*.parquet')").fetchall()
    assert rows > 7300  # what a DuckDB reader would get
    r = _run(catalog, out, bundle_dir)
    assert r.returncode == 1, r.output
    rep = _check_contract(out, success=False)
    assert any(
        hidden in reason and "DuckDB's read_parquet('<output>/**/*.parquet') reads it" in reason
        for reason in rep["failure_reasons"]
    ), rep["failure_reasons"]
    assert stray.exists()  # not ours: named, never deleted unasked


def test_crash_before_the_first_manifest_save_is_still_ours(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    """Outputs carry the writer mark in their footers: a folder holding only those (the run
    died before its first manifest save) resumes instead of being refused as foreign."""
    out = tmp_path / "out"
    assert _run(catalog, out, bundle_dir).returncode == 0
    control = control_of(out)
    for path in (control / "_manifest.json", control / "_report.json", control / "_report.html"):
        path.unlink()
    for name in ("_SUCCESS", "_SCORE_CATALOG"):  # the output's own mark too
        (out / name).unlink()
    r = _run(catalog, out, bundle_dir)
    assert r.returncode == 0, r.output
    assert _check_contract(out, success=True)["shards_scored"] == 3


# ---------------------------------------------------------------- readers see only scores


def test_shards_whose_id_and_passthrough_types_differ_give_one_readable_dataset(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    """category dictionary-encoded in one shard, plain in the next, large_string in the last,
    and item_id int32 in one: Polars and Dask refuse a folder whose files disagree on a type,
    so the output has one type per column (decoded, promoted)."""
    import dask.dataframe as dd
    import polars as pl

    paths = sorted(catalog.glob("*.parquet"))
    for k, path in enumerate(paths):
        t = pq.read_table(path)
        cat = t.column("category").combine_chunks()
        cat = [cat.dictionary_encode(), cat, cat.cast(pa.large_string())][k]
        t = t.set_column(t.schema.get_field_index("category"), "category", cat)
        if k == 1:
            t = t.set_column(0, "item_id", pc.cast(t.column("item_id"), pa.int32()))
        pq.write_table(t, path, row_group_size=1000)
    out = tmp_path / "out"
    r = _run(catalog, out, bundle_dir)
    assert r.returncode == 0, r.output
    rep = _check_contract(out, success=True)
    types = {str(pq.read_schema(p).field("category").type) for p in out.glob("*.parquet")}
    ids = {str(pq.read_schema(p).field("item_id").type) for p in out.glob("*.parquet")}
    assert types == {"large_string"} and ids == {"int64"}
    assert pl.scan_parquet(out).collect().height == rep["rows_out"]
    assert len(dd.read_parquet(str(out)).compute()) == rep["rows_out"]


@pytest.mark.parametrize("templated", [True, False], ids=["date-template", "plain-output"])
def test_every_reader_sees_exactly_the_scores(
    catalog: Path, bundle_dir: Path, tmp_path: Path, templated: bool
) -> None:
    import dask.dataframe as dd
    import duckdb
    import pandas as pd
    import polars as pl

    _poison_one_row(catalog / "part-00000.parquet", 3)
    _poison_one_row(catalog / "part-00002.parquet", 5)
    if templated:
        # The usual nightly layout: the run index and the rejects land beside the template's
        # fixed part (tmp_path/scored), outside it.
        template = str(tmp_path / "scored" / "{date}")
        r = _run(catalog, Path(template), bundle_dir, "--date", "2026-11-29")
        out = tmp_path / "scored" / "2026-11-29"
        rej, index = (
            tmp_path / "_rejects" / "scored" / out.name,
            tmp_path / "_score_catalog" / "scored",
        )
    else:
        # No placeholder: the run index used to live inside the output (<output>/_runs).
        out = tmp_path / "scored" / "latest"
        r = _run(catalog, out, bundle_dir)
        rej, index = _rejects_of(out), control_of(out)
    assert r.returncode == 0, r.output
    rep = _check_contract(out, success=True)
    assert rep["rows_rejected"] == 2 and rep["rows_out"] == 7298
    assert rep["rejects"] == str(rej)
    assert len(list((index / "_runs").rglob("*.json"))) == 1
    assert len(list(rej.glob("*.parquet"))) == 2
    # Only data and empty markers in the output: Polars reads a folder only if every non-empty
    # file below it has the same extension.
    others = [p for p in out.rglob("*") if p.is_file() and p.suffix != ".parquet"]
    assert sorted(p.name for p in others) == ["_SCORE_CATALOG", "_SUCCESS"]
    assert all(p.stat().st_size == 0 for p in others)
    n = rep["rows_out"]

    def duck(pattern: str, **kw: str) -> tuple[int, list[str]]:
        args = "".join(f", {k}={v}" for k, v in kw.items())
        rel = duckdb.sql(f"select * from read_parquet('{out}/{pattern}'{args})")
        return len(rel.fetchall()), rel.columns

    assert duck("*.parquet") == (n, OUTPUT_COLUMNS)
    assert duck("**/*.parquet", hive_partitioning="true") == (n, OUTPUT_COLUMNS)
    for frame in (
        pl.scan_parquet(f"{out}/*.parquet").collect(),
        pl.scan_parquet(f"{out}/**/*.parquet").collect(),
        pl.scan_parquet(out).collect(),  # the folder, bare: Polars' documented way
        pl.scan_parquet(out, hidden_file_prefix=["_", "."]).collect(),
    ):
        assert frame.height == n and frame.columns == OUTPUT_COLUMNS
    table = ds.dataset(out, format="parquet").to_table()
    assert table.num_rows == n and table.column_names == OUTPUT_COLUMNS
    frame = pd.read_parquet(out)
    assert len(frame) == n and list(frame.columns) == OUTPUT_COLUMNS
    dframe = dd.read_parquet(str(out)).compute()
    assert len(dframe) == n and list(dframe.columns) == OUTPUT_COLUMNS
    # No rejected id is among the scores.
    rejected = {i for p in rej.glob("*.parquet") for i in pq.read_table(p)["item_id"].to_pylist()}
    assert rejected and not rejected & set(table.column("item_id").to_pylist())
    assert pc.sum(pc.is_null(table.column("score"))).as_py() == 0


# ---------------------------------------------------------------- the files around the output


def _to_old_layout(out: Path) -> None:
    """Put the control files where versions before the control folder kept them: inside the
    output (manifest, report, page and, for an output without placeholder, the run index)."""
    control = control_of(out)
    for name in ("_manifest.json", "_report.json", "_report.html"):
        (control / name).rename(out / name)
    (control / "_runs").rename(out / "_runs")
    (out / "_SCORE_CATALOG").unlink()


def test_an_output_in_the_old_layout_resumes_and_moves_its_files_out(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    assert _run(catalog, out, bundle_dir).returncode == 0
    first = report(out)
    _to_old_layout(out)
    shown = cli("report", str(out), "--json", in_process=True)  # read from the old place
    assert shown.returncode == 0, shown.output
    assert '"run_id": "' + first["run_id"] in shown.stdout

    r = _run(catalog, out, bundle_dir)
    assert r.returncode == 0, r.output
    rep = _check_contract(out, success=True)
    assert rep["shards_skipped"] == 3  # the old manifest was read: nothing rescored
    assert sorted(p.name for p in out.iterdir()) == [
        "_SCORE_CATALOG",
        "_SUCCESS",
        "part-00000.parquet",
        "part-00001.parquet",
        "part-00002.parquet",
    ]
    assert manifest_path(out).exists()
    # The old run index moved with it: both runs are there, the first one as the baseline.
    runs = sorted(p.stem for p in (control_of(out) / "_runs").rglob("*.json"))
    assert runs == sorted([first["run_id"], rep["run_id"]])
    # A new shard makes a new dataset: it is compared with the first run's (the second run
    # scored nothing, and a rescore of the same data would keep that data's verdict).
    write_shards(catalog / "new", [500], start=50_000)
    grown = _run(catalog, out, bundle_dir)
    assert grown.returncode == 0, grown.output
    assert report(out)["drift"]["baseline"]["run_id"] == first["run_id"]


def test_a_rerun_withdraws_the_previous_report_and_success_before_it_commits(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    """While a rerun changes the output, nothing there may say it describes the output: the
    previous ``_SUCCESS``, ``_report.json`` and ``_report.html`` go as soon as the lock is
    taken; the run index keeps the previous run's record."""
    out = tmp_path / "out"
    assert _run(catalog, out, bundle_dir).returncode == 0
    first = report(out)
    opts = ("--batch-size", "400", "--scheduler", "sync", "--force")
    killed = cli("run", *job_args(catalog, out, bundle_dir, *opts), env={KILL_AT: "batch-scored"})
    assert killed.returncode == -signal.SIGKILL, killed.output
    assert not (out / "_SUCCESS").exists()
    assert not report_path(out).exists() and not (control_of(out) / "_report.html").exists()
    entries = list((control_of(out) / "_runs").rglob("*.json"))
    assert [p.stem for p in entries] == [first["run_id"]]
    assert _run(catalog, out, bundle_dir).returncode == 0
    assert _check_contract(out, success=True)["run_id"] != first["run_id"]


# ---------------------------------------------------------------- outputs tied to their input


def test_an_output_copied_over_another_is_scored_again(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    """Rows, model and settings of part-00001's output match part-00002's line in the
    manifest; only the footer's input shard and fingerprint tell them apart."""
    out = tmp_path / "out"
    assert _run(catalog, out, bundle_dir).returncode == 0
    src, dst = out / "part-00001.parquet", out / "part-00002.parquet"
    shutil.copyfile(catalog / "part-00001.parquet", catalog / "part-00002.parquet")  # same rows
    assert _run(catalog, out, bundle_dir).returncode == 0  # part-00002 rescored from the copy
    shutil.copyfile(src, dst)  # by hand: same rows, model, settings and fingerprint as part-1
    meta = pq.ParquetFile(dst).metadata.metadata
    assert meta[b"score_catalog.input"] == b"part-00001.parquet"

    r = _run(catalog, out, bundle_dir)
    assert r.returncode == 0, r.output
    assert "scoring part-00002.parquet again" in r.output
    assert "scored from input shard part-00001.parquet" in r.output
    rep = _check_contract(out, success=True)
    status = {s["rel_path"]: s["status"] for s in rep["shards"]}
    assert status["part-00002.parquet"] == "scored"
    assert status["part-00000.parquet"] == status["part-00001.parquet"] == "skipped"
    assert pq.ParquetFile(dst).metadata.metadata[b"score_catalog.input"] == dst.name.encode()


# ---------------------------------------------------------------- rejects of one output only


def test_a_rejects_folder_of_another_output_is_refused_before_scoring(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    _poison_one_row(catalog / "part-00001.parquet", 7)
    shared = tmp_path / "rejects"
    a, b = tmp_path / "a", tmp_path / "b"
    assert _run(catalog, a, bundle_dir, "--rejects", str(shared)).returncode == 0
    theirs = shared / "part-00001.parquet"
    meta = pq.ParquetFile(theirs).metadata.metadata
    assert meta[b"score_catalog.output"] == str(a / "part-00001.parquet").encode()
    before = _sha(theirs)

    r = _run(catalog, b, bundle_dir, "--rejects", str(shared))
    assert r.returncode == 2, r.output
    assert str(theirs) in r.output and str(a) in r.output and "another output" in r.output
    assert not b.exists() and not control_of(b).exists()  # nothing scored, nothing written
    assert _sha(theirs) == before
    # The owner still runs into its own rejects, and keeps them.
    assert _run(catalog, a, bundle_dir, "--rejects", str(shared), "--force").returncode == 0
    assert pq.read_table(theirs).num_rows == 1


@pytest.mark.parametrize("under", [False, True], ids=["is-a-file", "under-a-file"])
def test_a_rejects_location_that_is_a_file_is_refused_before_scoring(
    catalog: Path, bundle_dir: Path, tmp_path: Path, under: bool
) -> None:
    blocker = tmp_path / "rejects"
    blocker.write_text("not a folder")
    rejects = blocker / "day" if under else blocker
    out = tmp_path / "out"
    r = _run(catalog, out, bundle_dir, "--rejects", str(rejects))
    assert r.returncode == 1, r.output
    assert "Traceback" not in r.output
    assert f"rejects {rejects} is a file or lies under one ({blocker})" in r.output
    assert not out.exists() and not control_of(out).exists()
    assert blocker.read_text() == "not a folder"


# ---------------------------------------------------------------- a shard that changes shape


def _split_into_folder(shard: Path) -> None:
    """Replace the file ``shard`` by a folder of the same name holding its rows in two files
    (an upstream job that starts writing that partition as a directory)."""
    t = pq.read_table(shard)
    shard.unlink()
    shard.mkdir()
    half = t.num_rows // 2
    pq.write_table(t.slice(0, half), shard / "a.parquet", row_group_size=400)
    pq.write_table(t.slice(half), shard / "b.parquet", row_group_size=400)


def _merge_folder(folder: Path) -> None:
    """The reverse: the folder's files become one file of the folder's name."""
    t = pa.concat_tables([pq.read_table(p) for p in sorted(folder.glob("*.parquet"))])
    shutil.rmtree(folder)
    pq.write_table(t, folder, row_group_size=400)


def test_an_input_shard_that_becomes_a_folder_and_back_is_rescored(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    _poison_one_row(catalog / "part-00002.parquet", 1)  # its rejects change shape too
    _poison_one_row(catalog / "part-00002.parquet", 1500)
    out = tmp_path / "out"
    assert _run(catalog, out, bundle_dir).returncode == 0
    shard = catalog / "part-00002.parquet"
    ids = sorted(pq.read_table(shard).column("item_id").to_pylist())

    _split_into_folder(shard)
    r = _run(catalog, out, bundle_dir)
    assert r.returncode == 0, r.output
    rep = _check_contract(out, success=True)
    assert (out / "part-00002.parquet").is_dir()
    assert {s["rel_path"] for s in rep["shards"] if s["status"] == "scored"} == {
        "part-00002.parquet/a.parquet",
        "part-00002.parquet/b.parquet",
    }
    [removed] = rep["removed_outputs"]
    assert removed["output"] == str(out / "part-00002.parquet")
    assert removed["rejects"] == str(_rejects_of(out) / "part-00002.parquet")
    assert "changed shape" in removed["reason"]
    assert sorted(_ids(out)) == sorted({*_ids_of(catalog)} - _rejected_ids(out))
    assert len(_ids(out)) + rep["rows_rejected"] == 7300
    assert sorted([*_rejected_ids(out), *[i for i in _ids(out) if i in set(ids)]]) == ids

    _merge_folder(shard)
    r = _run(catalog, out, bundle_dir)
    assert r.returncode == 0, r.output
    rep = _check_contract(out, success=True)
    assert (out / "part-00002.parquet").is_file()
    assert sorted(Path(x["output"]).name for x in rep["removed_outputs"]) == [
        "a.parquet",
        "b.parquet",
    ]
    assert len(_ids(out)) + rep["rows_rejected"] == 7300 and rep["rows_rejected"] == 2
    assert (_rejects_of(out) / "part-00002.parquet").is_file()


def test_a_foreign_file_where_a_shard_folder_must_go_is_named_and_kept(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    assert _run(catalog, out, bundle_dir).returncode == 0
    theirs = out / "extra.parquet"
    pq.write_table(pa.table({"x": [1, 2, 3]}), theirs)  # someone else's file, in our output
    before = _sha(theirs)
    write_shards(catalog / "extra.parquet", [300], start=10_000)  # a new partition folder
    r = _run(catalog, out, bundle_dir)
    assert r.returncode == 2, r.output
    assert str(theirs) in r.output and "manifest does not list it" in r.output
    assert _sha(theirs) == before
    assert not (out / "_SUCCESS").exists()
    assert not (out / "extra.parquet" / "part-00000.parquet").exists()


def _ids_of(catalog: Path) -> list[int]:
    return [
        i
        for p in sorted(catalog.rglob("*.parquet"))
        for i in pq.read_table(p)["item_id"].to_pylist()
    ]


def _rejected_ids(out: Path) -> set[int]:
    rej = _rejects_of(out)
    return {i for p in rej.rglob("*.parquet") for i in pq.read_table(p)["item_id"].to_pylist()}
