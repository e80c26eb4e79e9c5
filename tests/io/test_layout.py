"""pipeline.io.layout: where the control files, run index and rejects of an output live, finding
them, and moving what older versions kept elsewhere."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from pipeline.core import templates
from pipeline.io import layout, storage


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("data/scored/run_date=1", "data/scored/_score_catalog/run_date=1"),
        ("data/scored/x/", "data/scored/_score_catalog/x"),
        ("out", "_score_catalog/out"),
        ("/out", "/_score_catalog/out"),
        ("s3://b/scored/x", "s3://b/scored/_score_catalog/x"),
        ("s3://b/x", "s3://b/_score_catalog/x"),
        ("s3://b", None),
        ("s3://b/", None),
        ("/", None),
        ("data/..", None),
    ],
)
def test_beside(uri: str, expected: str | None) -> None:
    assert templates.beside(uri, templates.CONTROL_DIR) == expected


@pytest.mark.parametrize(
    ("template", "output", "control"),
    [
        # The template's fixed part is data/scored: everything else lives beside it.
        (
            "data/scored/run_date={date}",
            "data/scored/run_date=X",
            "data/_score_catalog/scored/run_date=X",
        ),
        (
            "s3://b/scored/{date}/{run_id}/",
            "s3://b/scored/d/r/",
            "s3://b/_score_catalog/scored/d/r",
        ),
        ("data/scored_{date}", "data/scored_X", "_score_catalog/data/scored_X"),
        # No placeholder: the output is its own root (the place is the one it always had).
        ("data/scored", "data/scored", "data/_score_catalog/scored"),
        ("s3://b/scored/", "s3://b/scored/", "s3://b/_score_catalog/scored"),
        # A root without a parent keeps its control files inside it, as before.
        ("s3://b", "s3://b", "s3://b"),
        ("s3://b/{date}", "s3://b/X", "s3://b/_score_catalog/X"),
        ("{date}/scored", "X/scored", "_score_catalog/X/scored"),
    ],
)
def test_control_folder_is_outside_the_template_root(
    template: str, output: str, control: str
) -> None:
    assert templates.control_uri(template, output) == control


def test_places_of_a_dated_output_on_disk_and_on_an_object_store(tmp_path: Path) -> None:
    where = layout.places(f"{tmp_path}/scored/d={{date}}", f"{tmp_path}/scored/d=1")
    assert where.control.uri == str(tmp_path / "_score_catalog" / "scored" / "d=1")
    assert where.index.uri == str(tmp_path / "_score_catalog" / "scored")
    old = storage.locate(str(tmp_path / "scored" / "_score_catalog" / "d=1"))
    assert where.old_controls == (old, where.output)
    new_rejects = str(tmp_path / "_rejects" / "scored" / "d=1")
    assert [(old.uri, new.uri) for old, new in where.rejects_moved] == [
        (str(tmp_path / "scored" / "_rejects" / "d=1"), new_rejects),  # the previous layout
        (str(tmp_path / "scored" / "d=1" / "_rejects"), new_rejects),  # the oldest
    ]
    remote = layout.places("memory://bucket/scored/{date}/", "memory://bucket/scored/d=1/")
    assert remote.control.uri == "memory://bucket/_score_catalog/scored/d=1"
    assert remote.index.uri == "memory://bucket/_score_catalog/scored"
    # Set rejects are the job's: nothing of them moves.
    assert layout.places("memory://b/s/{date}", "memory://b/s/1", rejects="x").rejects_moved == ()


def test_find_prefers_the_control_folder_and_reads_older_places(tmp_path: Path) -> None:
    out = tmp_path / "scored" / "d=1"
    loc = storage.locate(str(out))
    assert layout.find(loc, "_report.json") is None
    out.mkdir(parents=True)
    (out / "_report.json").write_text("{}")  # the oldest layout: inside the output
    assert layout.find(loc, "_report.json") == loc.child("_report.json")
    beside = tmp_path / "scored" / "_score_catalog" / "d=1"  # the previous layout
    beside.mkdir(parents=True)
    (beside / "_report.json").write_text("{}")
    assert layout.find(loc, "_report.json") == storage.locate(str(beside / "_report.json"))
    (beside / "_report.json").unlink()
    now = tmp_path / "_score_catalog" / "scored" / "d=1"  # this layout, template unknown
    now.mkdir(parents=True)
    (now / "_report.json").write_text("{}")
    assert layout.find(loc, "_report.json") == storage.locate(str(now / "_report.json"))
    where = layout.places(f"{tmp_path}/scored/d={{date}}", str(out))
    assert layout.find_in(where, "_report.json") == where.control.child("_report.json")


def test_ancestors_stop_at_the_bucket_and_the_filesystem_root() -> None:
    remote = storage.locate("memory://bucket/a/b")
    assert [a.uri for a in layout.ancestors(remote)] == ["memory://bucket/a", "memory://bucket"]
    local = storage.locate("/srv/a")
    assert [a.uri for a in layout.ancestors(local)] == ["/srv", "/"]


def _old_layout(tmp_path: Path) -> Path:
    """What the previous version left under data/scored for three dates (d=1 is migrated by
    this run; d=2 and d=3 belong to the same template and move too; x-other does not match)."""
    root = tmp_path / "scored"
    for d in ("d=1", "d=2", "d=3", "x-other"):
        (root / d).mkdir(parents=True)
        (root / d / "_SCORE_CATALOG").write_bytes(b"")
        control = root / "_score_catalog" / d
        control.mkdir(parents=True)
        (control / "_manifest.json").write_text(json.dumps({"d": d}))
        (control / "_report.json").write_text(json.dumps({"report": d}))
        (root / "_rejects" / d).mkdir(parents=True)
        (root / "_rejects" / d / "part-0.parquet").write_bytes(f"rejects {d}".encode())
    (root / "_runs" / "job").mkdir(parents=True)
    (root / "_runs" / "job" / "r1.json").write_text('{"run_id": "r1"}')
    (root / "_backfills" / "job").mkdir(parents=True)
    (root / "_backfills" / "job" / "a_b.json").write_text("{}")
    return root


def test_claim_moves_the_older_layout_out_of_the_template_root(tmp_path: Path) -> None:
    root = _old_layout(tmp_path)
    where = layout.places(f"{root}/d={{date}}", f"{root}/d=1")
    layout.claim(where, lambda: None, withdraw=lambda: None)
    area = tmp_path / "_score_catalog" / "scored"
    # This output: its report is withdrawn (it described the output before this run), its
    # manifest moves; the other dates keep theirs, moved.
    assert not (area / "d=1" / "_report.json").exists()
    assert json.loads((area / "d=1" / "_manifest.json").read_text()) == {"d": "d=1"}
    for d in ("d=2", "d=3"):
        assert json.loads((area / d / "_report.json").read_text()) == {"report": d}
        assert (tmp_path / "_rejects" / "scored" / d / "part-0.parquet").read_bytes() == (
            f"rejects {d}".encode()
        )
    assert (tmp_path / "_rejects" / "scored" / "d=1" / "part-0.parquet").exists()
    assert (area / "_runs" / "job" / "r1.json").exists()
    assert (area / "_backfills" / "job" / "a_b.json").exists()
    # Under the root: only the outputs, and what is not of this template.
    left = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    assert left == [
        "_rejects/x-other/part-0.parquet",
        "_score_catalog/x-other/_manifest.json",
        "_score_catalog/x-other/_report.json",
        "d=1/_SCORE_CATALOG",
        "d=2/_SCORE_CATALOG",
        "d=3/_SCORE_CATALOG",
        "x-other/_SCORE_CATALOG",
    ]


def test_a_move_cut_short_is_finished_by_the_next_run_and_the_new_copy_wins(
    tmp_path: Path,
) -> None:
    root = _old_layout(tmp_path)
    area = tmp_path / "_score_catalog" / "scored"
    # A crash after copying d=2's manifest, before deleting the original; and d=3's report
    # written since by this version (newer than the original, which must not replace it).
    (area / "d=2").mkdir(parents=True)
    (area / "d=2" / "_manifest.json").write_text(json.dumps({"d": "d=2"}))
    (area / "d=3").mkdir(parents=True)
    (area / "d=3" / "_report.json").write_text(json.dumps({"report": "newer"}))
    where = layout.places(f"{root}/d={{date}}", f"{root}/d=1")
    layout.claim(where, lambda: None, withdraw=lambda: None)
    assert json.loads((area / "d=2" / "_manifest.json").read_text()) == {"d": "d=2"}
    assert json.loads((area / "d=3" / "_report.json").read_text()) == {"report": "newer"}
    assert not (root / "_score_catalog" / "d=2").exists()
    assert not (root / "_score_catalog" / "d=3").exists()


def test_two_runs_moving_the_same_old_files_at_once_lose_nothing(tmp_path: Path) -> None:
    root = _old_layout(tmp_path)
    errors: list[BaseException] = []

    def claim(day: str) -> None:
        try:
            layout.claim(
                layout.places(f"{root}/d={{date}}", f"{root}/{day}"), lambda: None, lambda: None
            )
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=claim, args=(d,)) for d in ("d=2", "d=3")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    area = tmp_path / "_score_catalog" / "scored"
    # d=1's report is not withdrawn: neither run is d=1's.
    assert json.loads((area / "d=1" / "_report.json").read_text()) == {"report": "d=1"}
    assert json.loads((area / "d=1" / "_manifest.json").read_text()) == {"d": "d=1"}
    assert (area / "_runs" / "job" / "r1.json").read_text() == '{"run_id": "r1"}'


def test_rejects_the_oldest_layout_kept_inside_the_output_move_out(tmp_path: Path) -> None:
    """An output without placeholders: its default rejects did not move since the previous
    layout, but the oldest one kept them in ``<output>/_rejects``, where DuckDB's
    ``'**/*.parquet'`` read them as scores."""
    out = tmp_path / "latest"
    (out / "_rejects" / "sub").mkdir(parents=True)
    (out / "_rejects" / "sub" / "part-0.parquet").write_bytes(b"rejected rows")
    where = layout.places(str(out), str(out))
    layout.claim(where, lambda: None, withdraw=lambda: None)
    moved = tmp_path / "_rejects" / "latest" / "sub" / "part-0.parquet"
    assert moved.read_bytes() == b"rejected rows"
    assert not (out / "_rejects").exists()
    assert sorted(p.name for p in out.iterdir()) == ["_SCORE_CATALOG"]


@pytest.mark.parametrize(
    ("template", "names", "others"),
    [
        ("data/scored/run_date={date}", ["run_date=2026-11-28"], ["x", "run_date", "_runs"]),
        ("data/{{x}}/d={date}_{run_id}", ["d=2026-11-28_r1"], ["d=2026-11-28"]),
        ("s3://b/scored/{date}/", ["2026-11-28"], []),
    ],
)
def test_the_other_outputs_of_a_template_are_told_by_name(
    template: str, names: list[str], others: list[str]
) -> None:
    pattern = templates.single_segment_pattern(template, templates.fixed_part(template)[0])
    assert pattern is not None
    assert all(pattern.fullmatch(n) for n in names)
    assert not any(pattern.fullmatch(n) for n in others)
    # Outputs deeper below the root ({date}/part) are moved by their own runs only.
    assert templates.single_segment_pattern("data/s/{date}/part", "data/s") is None
    assert templates.single_segment_pattern("data/s", "data/s") is None


def test_claim_leaves_an_older_place_holding_another_output_s_control_files(
    tmp_path: Path,
) -> None:
    """Only what belongs to this output moves or goes: a folder in an older layout's place
    whose report names another output, or whose manifest another owner's, is left as it is
    (it used to be taken for this output's: its manifest moved and its report deleted)."""
    other = str(tmp_path / "elsewhere" / "run_date=1")
    where = layout.places(f"{tmp_path}/scored/d={{date}}", f"{tmp_path}/scored/d=1")
    old = Path(where.old_controls[0].path)  # scored/_score_catalog/d=1: the previous layout
    old.mkdir(parents=True)
    (old / "_report.json").write_text(json.dumps({"output": other}))
    owner = {"job": "nightly", "template": "t", "output": other}
    (old / "_manifest.json").write_text(json.dumps({"shards": {}, "owner": owner}))
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    layout.claim(where, lambda: None, lambda: None)
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before
    assert not Path(where.control.path).exists()
    # One that is this output's own moves as before.
    (old / "_report.json").write_text(json.dumps({"output": where.output.uri}))
    (old / "_manifest.json").write_text(json.dumps({"shards": {}}))
    layout.claim(where, lambda: None, lambda: None)
    assert not old.exists() and (Path(where.control.path) / "_manifest.json").is_file()


def test_a_template_one_level_too_high_moves_no_other_template_s_folders(tmp_path: Path) -> None:
    """Review 22, C3: ``data/{date}`` has the root ``data``, where the nightly
    ``data/scored/run_date={date}`` keeps its control area ``data/_score_catalog/scored`` and
    rejects ``data/_rejects/scored``. Their names fit a bare ``{date}`` loosely, but no manifest
    or report there describes ``data/scored`` as an output of ``data/{date}``: nothing moves
    (the run itself is refused before this: pipeline.io.nesting.check_root)."""
    data = tmp_path / "data"
    nightly = data / "_score_catalog" / "scored"
    (nightly / "run_date=2026-11-01").mkdir(parents=True)
    (nightly / "run_date=2026-11-01" / "_manifest.json").write_text(json.dumps({"d": 1}))
    (nightly / "_runs" / "nightly").mkdir(parents=True)
    (nightly / "_runs" / "nightly" / "r1.json").write_text('{"run_id": "r1"}')
    rejects = data / "_rejects" / "scored" / "run_date=2026-11-01"
    rejects.mkdir(parents=True)
    (rejects / "part-0.parquet").write_bytes(b"the nightly's rejects")
    before = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))

    where = layout.places(f"{data}/{{date}}", f"{data}/2026-11-03")
    layout.claim(where, lambda: None, withdraw=lambda: None)

    after = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    assert [p for p in after if p not in before] == [
        "data/2026-11-03",
        "data/2026-11-03/_SCORE_CATALOG",
    ]
    assert [p for p in before if p not in after] == []
