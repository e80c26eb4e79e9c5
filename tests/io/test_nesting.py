"""pipeline.io.nesting: an output that contains, lies inside, or is the template root of another
output of this tool is refused, and the check reads only what it must."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.core.config import JobConfig
from pipeline.core.errors import ConfigError
from pipeline.io import layout, nesting, storage


def _output(folder: Path, *, mark: str = "_SCORE_CATALOG") -> None:
    """An output of this tool: a data file and its mark (or an older version's manifest)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "part-00000.parquet").write_bytes(b"PAR1")
    (folder / mark).write_text("" if mark == "_SCORE_CATALOG" else "{}")


def _entry(index: Path, job: str, run_id: str, output: Path) -> None:
    d = index / "_runs" / job
    d.mkdir(parents=True, exist_ok=True)
    entry = {"run_id": run_id, "job": job, "output": str(output)}
    (d / f"{run_id}.json").write_text(json.dumps(entry))


@pytest.mark.parametrize("mark", ["_SCORE_CATALOG", "_manifest.json"])
def test_an_output_containing_another_is_refused(tmp_path: Path, mark: str) -> None:
    _output(tmp_path / "scored" / "run_date=2026-11-28", mark=mark)
    with pytest.raises(ConfigError) as e:
        nesting.check(storage.locate(str(tmp_path / "scored")))
    text = str(e.value)
    assert (
        f"output {tmp_path / 'scored'} contains {tmp_path / 'scored' / 'run_date=2026-11-28'}"
        in text
    )
    # The fix, for the usual slip (a forgotten {date}): the template it most likely meant.
    assert f"--output '{tmp_path / 'scored'}/run_date={{date}}'" in text


def test_an_older_control_folder_below_is_a_sign_of_outputs_below(tmp_path: Path) -> None:
    control = tmp_path / "scored" / "_score_catalog" / "d1"
    control.mkdir(parents=True)
    (control / "_report.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"contains .*d1"):
        nesting.check(storage.locate(str(tmp_path / "scored")))


@pytest.mark.parametrize("mark", ["_SCORE_CATALOG", "_manifest.json"])
def test_an_output_inside_another_is_refused(tmp_path: Path, mark: str) -> None:
    _output(tmp_path / "out", mark=mark)
    inner = tmp_path / "out" / "a" / "b"
    with pytest.raises(ConfigError) as e:
        nesting.check(storage.locate(str(inner)))
    assert f"output {inner} lies inside {tmp_path / 'out'}" in str(e.value)
    assert not inner.exists()


def test_the_root_of_another_job_s_template_is_refused_from_its_run_index(tmp_path: Path) -> None:
    """The nightly's dated outputs are gone (retention), its run index is not: the root it
    writes under is still its own."""
    root = tmp_path / "scored"
    root.mkdir()
    _entry(
        tmp_path / "_score_catalog" / "scored", "nightly", "20261128T021500Z-aaaaaa", root / "d1"
    )
    with pytest.raises(ConfigError) as e:
        nesting.check(storage.locate(str(root)))
    text = str(e.value)
    assert "fixed part of the template job 'nightly' writes under" in text
    assert str(root / "d1") in text and "_runs/nightly" in text


def test_an_older_run_index_inside_the_root_counts_too(tmp_path: Path) -> None:
    root = tmp_path / "scored"
    _entry(root, "nightly", "20261128T021500Z-aaaaaa", root / "d1")
    with pytest.raises(ConfigError, match="template job 'nightly'"):
        nesting.check(storage.locate(str(root)))


def test_outputs_side_by_side_and_an_output_s_own_files_pass(tmp_path: Path) -> None:
    _output(tmp_path / "scored" / "d1")
    _output(tmp_path / "scored" / "d2")
    nesting.check(storage.locate(str(tmp_path / "scored" / "d2")))  # its own mark: fine
    nesting.check(storage.locate(str(tmp_path / "scored" / "d3")))  # absent: fine
    nesting.check(storage.locate(str(tmp_path / "other")))
    # An output without placeholders is its own root: its own run index entries are fine.
    own = tmp_path / "latest"
    _output(own)
    (own / "_manifest.json").write_text("{}")  # the oldest layout kept it inside
    _entry(tmp_path / "_score_catalog" / "latest", "job", "20261129T000000Z-bbbbbb", own)
    _entry(own, "job", "20261128T000000Z-cccccc", own)  # the oldest layout's run index
    nesting.check(storage.locate(str(own)))


def test_the_newest_entry_of_each_job_decides(tmp_path: Path) -> None:
    root = tmp_path / "scored"
    index = tmp_path / "_score_catalog" / "scored"
    _entry(index, "job", "20261101T000000Z-aaaaaa", root / "d1")  # long ago, dated
    _entry(index, "job", "20261129T000000Z-bbbbbb", root)  # since then: the root itself
    nesting.check(storage.locate(str(root)))
    (index / "_runs" / "job" / "20261130T000000Z-cccccc.json").write_text("not json")
    nesting.check(storage.locate(str(root)))  # an unreadable entry blocks nothing


def test_on_an_object_store_the_check_lists_only_the_output(tmp_path: Path) -> None:
    """memory:// stands in for a bucket here (the CLI test on moto is in
    tests/integration/test_nesting.py): the refusal works without local paths."""
    fs = storage.locate("memory://nest-bucket").fs
    try:
        fs.pipe("/nest-bucket/scored/d1/_SCORE_CATALOG", b"")
        fs.pipe("/nest-bucket/scored/d1/part-0.parquet", b"PAR1")
        with pytest.raises(ConfigError, match="contains memory://nest-bucket/scored/d1"):
            nesting.check(storage.locate("memory://nest-bucket/scored"))
        with pytest.raises(ConfigError, match="lies inside memory://nest-bucket/scored/d1"):
            nesting.check(storage.locate("memory://nest-bucket/scored/d1/x"))
        nesting.check(storage.locate("memory://nest-bucket/scored/d2"))
        # An output without placeholders, named with a trailing slash, in its own run index.
        entry = {"run_id": "r", "job": "j", "output": "memory://nest-bucket/latest/"}
        fs.pipe("/nest-bucket/_score_catalog/latest/_runs/j/r.json", json.dumps(entry).encode())
        nesting.check(storage.locate("memory://nest-bucket/latest/"))
    finally:
        fs.rm("/nest-bucket", recursive=True)


# ---------------------------------------------------------------- places inside a dataset


def test_rejects_may_not_lie_inside_any_dataset(tmp_path: Path) -> None:
    root = storage.locate(str(tmp_path / "scored"))
    template = f"{tmp_path}/scored/run_date={{date}}"

    def check(rejects: Path) -> None:
        nesting.check_rejects(storage.locate(str(rejects)), root, template, explicit=True)

    with pytest.raises(ConfigError, match="the fixed part of the output template"):
        check(tmp_path / "scored" / "rejects")  # the job's own root, even before any run
    with pytest.raises(ConfigError, match="a control area of score-catalog"):
        check(tmp_path / "_score_catalog" / "scored" / "rejects")
    check(tmp_path / "_rejects" / "scored" / "run_date=1")  # its own default area: fine
    check(tmp_path / "_rejects" / "nightly" / "1")  # a `_rejects` folder of no dataset: fine
    (tmp_path / "_score_catalog" / "nightly").mkdir(parents=True)  # nightly is a root now
    with pytest.raises(ConfigError, match="a default rejects area of score-catalog"):
        check(tmp_path / "_rejects" / "nightly" / "1")
    _output(tmp_path / "other")
    with pytest.raises(ConfigError, match="an output of score-catalog"):
        check(tmp_path / "other" / "rej")
    _output(tmp_path / "wide" / "inner")
    with pytest.raises(ConfigError, match=r"contains .*wide/inner, an output"):
        check(tmp_path / "wide")


def test_an_output_inside_another_template_s_root_is_refused(tmp_path: Path) -> None:
    nightly_root = tmp_path / "scored"
    (tmp_path / "_score_catalog" / "scored").mkdir(parents=True)  # its control area
    out = nightly_root / "run_date=2026-11-02"
    with pytest.raises(ConfigError, match="--date 2026-11-02 instead of --output"):
        nesting.check(storage.locate(str(out)), storage.locate(str(out)))
    # Its own template's outputs are fine: the root's control area is the job's.
    nesting.check(storage.locate(str(out)), storage.locate(str(nightly_root)))
    with pytest.raises(ConfigError, match="a control area of score-catalog"):
        nesting.check(storage.locate(str(tmp_path / "_score_catalog" / "scored" / "x")))
    with pytest.raises(ConfigError, match="a default rejects area of score-catalog"):
        nesting.check(storage.locate(str(tmp_path / "_rejects" / "scored" / "x")))


# ---------------------------------------------------------------- ownership


def _places(tmp_path: Path, template: str = "scored/run_date={date}") -> layout.Places:
    full = f"{tmp_path}/{template}"
    return layout.places(full, full.replace("{date}", "2026-11-02"))


def _manifest(where: layout.Places, **doc: object) -> None:
    path = Path(where.control.path) / "_manifest.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema_version": 1, "shards": {}, **doc}))


def _owner(tmp_path: Path, job: str) -> dict[str, str]:
    out = tmp_path / "scored" / "run_date=2026-11-02"
    return {"job": job, "template": f"{tmp_path}/scored/run_date={{date}}", "output": str(out)}


def test_the_owner_s_runs_pass_and_other_jobs_are_refused(tmp_path: Path) -> None:
    where = _places(tmp_path)
    nesting.check_owner(where, _owner(tmp_path, "nightly"))  # nothing recorded yet
    _manifest(where, owner=_owner(tmp_path, "nightly"))
    nesting.check_owner(where, _owner(tmp_path, "nightly"))
    with pytest.raises(ConfigError, match=r"belongs to job 'nightly'.*this run is job 'promo'"):
        nesting.check_owner(where, _owner(tmp_path, "promo"))
    other_template = {**_owner(tmp_path, "nightly"), "template": "/elsewhere/{date}"}
    with pytest.raises(ConfigError, match="rerun it with --date 2026-11-02"):
        nesting.check_owner(where, other_template)
    # Written by a run with flags only: the fix names that, not a job file.
    _manifest(where, owner=_owner(tmp_path, "score-catalog"))
    with pytest.raises(ConfigError, match="run it with flags only, as it was written"):
        nesting.check_owner(where, _owner(tmp_path, "nightly"))


def test_a_manifest_without_owner_is_adopted_only_when_it_lists_this_output(
    tmp_path: Path,
) -> None:
    where = _places(tmp_path)
    mine = {"p.parquet": {"output": f"{where.output.uri}/p.parquet"}}
    _manifest(where, shards=mine)
    nesting.check_owner(where, _owner(tmp_path, "anyone"))  # an older version's: adopted
    theirs = {"p.parquet": {"output": f"{tmp_path}/scored/run_date=2026-11-01/p.parquet"}}
    _manifest(where, shards=theirs)
    with pytest.raises(ConfigError, match="written by an older version for another output"):
        nesting.check_owner(where, _owner(tmp_path, "anyone"))


def test_a_template_is_named_by_its_real_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.chdir(tmp_path)
    key = f"{tmp_path}/real/scored/run_date={{date}}"
    assert nesting.template_key("real/scored/run_date={date}") == key
    assert nesting.template_key(f"{tmp_path}/link/scored/run_date={{date}}/") == key
    assert nesting.template_key("{date}/x") == f"{tmp_path}/{{date}}/x"
    assert nesting.template_key("s3://b/scored/{date}") == "s3://b/scored/{date}"


def test_on_an_object_store_another_job_is_refused_too() -> None:
    fs = storage.locate("memory://own-bucket").fs
    try:
        where = layout.places("memory://own-bucket/s/{date}", "memory://own-bucket/s/d")
        owner = {"job": "a", "template": "memory://own-bucket/s/{date}", "output": "x"}
        fs.pipe(
            "/own-bucket/_score_catalog/s/d/_manifest.json",
            json.dumps({"schema_version": 1, "shards": {}, "owner": owner}).encode(),
        )
        nesting.check_owner(where, owner)
        with pytest.raises(ConfigError, match="belongs to job 'a'"):
            nesting.check_owner(where, {**owner, "job": "b"})
    finally:
        fs.rm("/own-bucket", recursive=True)


# ---------------------------------------------------------------- Delta tables (format = "delta")


def _table(root: Path, *partitions: str) -> None:
    """A Delta table's folder: its log, and a data file in each partition folder."""
    (root / "_delta_log").mkdir(parents=True)
    (root / "_delta_log" / "00000000000000000000.json").write_text("{}\n")
    for p in partitions:
        (root / p).mkdir()
        (root / p / "part-00000-x.parquet").write_bytes(b"PAR1")


def test_a_folder_output_inside_a_delta_table_is_refused(tmp_path: Path) -> None:
    _table(tmp_path / "scored", "run_date=2026-11-28")
    inner = tmp_path / "scored" / "run_date=2026-11-29"
    with pytest.raises(ConfigError) as e:
        nesting.check(storage.locate(str(inner)))
    assert f"lies inside {tmp_path / 'scored'}, a Delta table" in str(e.value)


def test_a_folder_output_containing_a_delta_table_is_refused(tmp_path: Path) -> None:
    _table(tmp_path / "out" / "scored", "run_date=2026-11-28")
    with pytest.raises(ConfigError) as e:
        nesting.check(storage.locate(str(tmp_path / "out")))
    assert f"contains {tmp_path / 'out' / 'scored'}, a Delta table" in str(e.value)


def test_a_partition_of_its_own_table_passes_and_of_another_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "scored"
    _table(root, "run_date=2026-11-28")
    part = storage.locate(str(root / "run_date=2026-11-29"))
    table = storage.locate(str(root))
    nesting.check(part, table, table)  # its own table's log is no sign of another output
    nesting.check(table, table, table)  # an unpartitioned table is its own output
    other = storage.locate(str(tmp_path / "elsewhere"))
    with pytest.raises(ConfigError, match="a Delta table"):
        nesting.check(part, other, other)


def test_a_folder_run_into_its_own_templates_table_is_told_to_set_the_format(
    tmp_path: Path,
) -> None:
    root = tmp_path / "scored"
    _table(root, "run_date=2026-11-28")
    with pytest.raises(ConfigError) as e:
        nesting.check(storage.locate(str(root / "run_date=2026-11-29")), storage.locate(str(root)))
    assert "this template's own root" in str(e.value) and "--format delta" in str(e.value)


# -------------------------------------------------------------- Iceberg tables (format = "iceberg")


def _iceberg(root: Path, *partitions: str) -> None:
    """An Iceberg table's folder as its files show it: ``metadata/`` holding a
    ``*.metadata.json`` (and a manifest), and a data file in each partition folder."""
    (root / "metadata").mkdir(parents=True)
    (root / "metadata" / "00001-5b7c.metadata.json").write_text("{}")
    (root / "metadata" / "snap-1-0-5b7c.avro").write_bytes(b"Obj")
    for p in partitions:
        (root / p).mkdir()
        (root / p / "part-00000-x.parquet").write_bytes(b"PAR1")


def test_a_folder_output_inside_an_iceberg_table_is_refused(tmp_path: Path) -> None:
    _iceberg(tmp_path / "scored", "run_date=2026-11-28")
    inner = tmp_path / "scored" / "run_date=2026-11-29"
    with pytest.raises(ConfigError) as e:
        nesting.check(storage.locate(str(inner)))
    sign = tmp_path / "scored" / "metadata" / "00001-5b7c.metadata.json"
    want = f"lies inside {tmp_path / 'scored'}, an Iceberg table ({sign} is there)"
    assert want in str(e.value)


@pytest.mark.parametrize("table_names", [(), ("_delta_log",)])
def test_a_folder_or_delta_output_containing_an_iceberg_table_is_refused(
    tmp_path: Path, table_names: tuple[str, ...]
) -> None:
    """One level above an Iceberg table: a folder output, or an unpartitioned Delta table whose
    root would hold it (its own log is no sign; the Iceberg table's metadata is)."""
    _iceberg(tmp_path / "out" / "scored", "run_date=2026-11-28")
    out = storage.locate(str(tmp_path / "out"))
    with pytest.raises(ConfigError) as e:
        if table_names:
            nesting.check(out, out, out, table_names)
        else:
            nesting.check(out)
    assert f"contains {tmp_path / 'out' / 'scored'}, an Iceberg table" in str(e.value)


def test_a_metadata_folder_without_a_table_file_is_no_table(tmp_path: Path) -> None:
    (tmp_path / "scored" / "metadata").mkdir(parents=True)
    (tmp_path / "scored" / "metadata" / "notes.json").write_text("{}")
    nesting.check(storage.locate(str(tmp_path / "scored" / "run_date=2026-11-29")))
    nesting.check(storage.locate(str(tmp_path)))


def test_a_partition_of_its_own_iceberg_table_passes_and_a_delta_run_into_it_is_told(
    tmp_path: Path,
) -> None:
    root = tmp_path / "scored"
    _iceberg(root, "run_date=2026-11-28")
    part = storage.locate(str(root / "run_date=2026-11-29"))
    table = storage.locate(str(root))
    nesting.check(part, table, table, ("metadata",))  # its own metadata: no other output
    nesting.check(table, table, table, ("metadata",))  # unpartitioned: the table itself
    with pytest.raises(ConfigError) as e:
        nesting.check(part, table, table, ("_delta_log",))  # a Delta run into it
    assert "an Iceberg table" in str(e.value) and "this template's own root" in str(e.value)
    assert 'format = "iceberg" (--format iceberg' in str(e.value)
    with pytest.raises(ConfigError, match="this template's own root"):
        nesting.check(part, table)  # a folder run into it
    _table(tmp_path / "delta")
    delta_part = storage.locate(str(tmp_path / "delta" / "run_date=2026-11-29"))
    delta = storage.locate(str(tmp_path / "delta"))
    with pytest.raises(ConfigError, match=r'a Delta table .* format = "delta"'):
        nesting.check(delta_part, delta, delta, ("metadata",))  # an Iceberg run into Delta


def test_rejects_inside_an_iceberg_table_are_refused(tmp_path: Path) -> None:
    _iceberg(tmp_path / "lake" / "scores")
    root = storage.real_path(storage.locate(str(tmp_path / "scored")))
    rejects = storage.locate(str(tmp_path / "lake" / "scores" / "rejects"))
    with pytest.raises(ConfigError, match=r"lies inside .*scores, an Iceberg table"):
        nesting.check_rejects(rejects, root, "x/run_date={date}", explicit=True)
    with pytest.raises(ConfigError, match=r"contains .*scores, an Iceberg table"):
        nesting.check_rejects(
            storage.locate(str(tmp_path / "lake")), root, "x/run_date={date}", explicit=True
        )


def test_a_table_pyiceberg_made_is_a_sign_of_a_table(tmp_path: Path) -> None:
    """The same, on a table pyiceberg wrote (its own file names), with no catalog read."""
    pytest.importorskip("pyiceberg")
    import pyarrow as pa
    from pyiceberg.catalog.sql import SqlCatalog

    cat = SqlCatalog("elsewhere", uri=f"sqlite:///{tmp_path / 'c.db'}")
    cat.create_namespace("ns")
    cat.create_table(
        "ns.t",
        schema=pa.schema([("item_id", pa.int64())]),
        location=(tmp_path / "lake" / "t").as_uri(),
    )
    with pytest.raises(ConfigError, match="an Iceberg table"):
        nesting.check(storage.locate(str(tmp_path / "lake" / "t" / "day=1")))
    with pytest.raises(ConfigError, match=r"contains .*t, an Iceberg table"):
        nesting.check(storage.locate(str(tmp_path / "lake")))


# ---------------------------------------------------------------- a template root's children


def _config(root: Path, rest: str = "run_date={date}", **keys: object) -> JobConfig:
    return JobConfig(input="in", output=f"{root}/{rest}", model="m", date="2026-11-02", **keys)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("rest", "names", "fmt"),
    [
        (
            "run_date={date}",
            ["run_date=2026-11-01", ".hidden", "_score_catalog", "_runs"],
            "parquet",
        ),
        ("{date}", ["2026-11-01", "2026-11-02", ".DS_Store"], "parquet"),
        ("{date}_{run_id}", ["2026-11-01_20261101T021500Z-3f9a1c"], "parquet"),
        ("run_date={date}", ["run_date=2026-11-01", "_delta_log"], "delta"),
    ],
)
def test_a_root_holding_only_its_template_s_outputs_passes(
    tmp_path: Path, rest: str, names: list[str], fmt: str
) -> None:
    root = tmp_path / "scored"
    for name in names:
        (root / name).mkdir(parents=True)
    # A table keeps its log in the root (the sink says which names: SinkPlaces.table_names).
    names_of_table = ("_delta_log",) if fmt == "delta" else ()
    nesting.check_root(_config(root, rest, format=fmt), storage.locate(str(root)), names_of_table)


@pytest.mark.parametrize(
    ("rest", "names", "files", "named"),
    [
        ("run_date={date}", ["2026-11-01"], [], "(2026-11-01)"),
        ("{date}", ["run_date=2026-11-01"], [], "(run_date=2026-11-01)"),
        ("{date}", ["2026-11"], [], "(2026-11)"),  # a date is YYYY-MM-DD
        ("run_date={date}", ["run_date=2026-11-01"], ["_SUCCESS"], "(_SUCCESS (a file))"),
        ("run_date={date}", [], ["run_date=2026-11-01"], "(run_date=2026-11-01 (a file))"),
        ("run_date={date}", ["_delta_log"], [], "(_delta_log)"),  # a Parquet folder's root
        ("run_date={date}", [f"x{i}" for i in range(7)], [], "(x0, x1, x2, x3, x4 and 2 more)"),
    ],
)
def test_a_root_holding_anything_else_is_refused(
    tmp_path: Path, rest: str, names: list[str], files: list[str], named: str
) -> None:
    root = tmp_path / "scored"
    root.mkdir()
    for name in names:
        (root / name).mkdir()
    for name in files:
        (root / name).write_text("")
    with pytest.raises(ConfigError) as e:
        nesting.check_root(_config(root, rest), storage.locate(str(root)))
    assert f"its fixed part {root} holds" in str(e.value)
    assert named in str(e.value)


def test_a_template_without_placeholders_has_no_root_check(tmp_path: Path) -> None:
    (tmp_path / "latest").mkdir()
    (tmp_path / "latest" / "README.txt").write_text("the output's own business")
    nesting.check_root(_config(tmp_path, "latest"), storage.locate(str(tmp_path / "latest")))
