"""pipeline.layout: where the control files of an output live, and finding them."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline import layout, storage


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
    assert layout.beside(uri, layout.CONTROL_DIR) == expected


def test_control_root_on_disk_and_on_an_object_store(tmp_path: Path) -> None:
    out = storage.locate(str(tmp_path / "scored" / "d=1"))
    control = layout.control_root(out)
    assert control.path == control.uri == str(tmp_path / "scored" / "_score_catalog" / "d=1")
    assert layout.candidates(out) == [control, out]

    remote = storage.locate("memory://bucket/scored/d=1/")
    control = layout.control_root(remote)
    assert control.uri == "memory://bucket/scored/_score_catalog/d=1"
    assert control.path.rstrip("/").endswith("bucket/scored/_score_catalog/d=1")
    root = storage.locate("memory://bucket")
    assert layout.control_root(root) == root and layout.candidates(root) == [root]


def test_find_prefers_the_control_folder_and_reads_the_old_place(tmp_path: Path) -> None:
    out = tmp_path / "scored" / "d=1"
    loc = storage.locate(str(out))
    assert layout.find(loc, "_report.json") is None
    out.mkdir(parents=True)
    (out / "_report.json").write_text("{}")  # an older version's layout
    assert layout.find(loc, "_report.json") == loc.child("_report.json")
    control = tmp_path / "scored" / "_score_catalog" / "d=1"
    control.mkdir(parents=True)
    (control / "_report.json").write_text("{}")
    assert layout.find(loc, "_report.json") == layout.control_root(loc).child("_report.json")
