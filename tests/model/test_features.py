"""Shard footers, unreadable shards, and the schema check against the model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.cli.demo import FEATURES, make_rows
from pipeline.core.errors import ShardError
from pipeline.io.parquet import ShardInfo, open_parquet, read_footer
from pipeline.model.bundle import BundleSpec, parse_bundle_toml
from pipeline.model.features import check_schema, data_widths
from tests.conftest import demo_toml, write_shards

SHARD = "s3://bucket/catalog/part-00007.parquet"


def _columns_spec(columns: tuple[str, ...] = FEATURES) -> BundleSpec:
    return parse_bundle_toml(demo_toml(columns).encode(), "bundle-under-test")


def _list_spec(dim: int = 16) -> BundleSpec:
    toml = (
        'name = "emb"\nversion = "1"\nformat = "exported_program"\nfile = "model.pt2"\n'
        f'[inputs]\ncolumn = "embedding"\ndim = {dim}\n[outputs]\nscore = "softmax:1"\n'
    )
    return parse_bundle_toml(toml.encode(), "bundle-under-test")


def _demo_schema(**replace: pa.DataType) -> pa.Schema:
    """The demo catalog's schema with some column types replaced."""
    schema = make_rows(0, 1, 0).schema
    for name, t in replace.items():
        schema = schema.set(schema.get_field_index(name), pa.field(name, t))
    return schema


def _check(
    schema: pa.Schema,
    spec: BundleSpec | None = None,
    *,
    passthrough: tuple[str, ...] = ("category",),
    width: int = 16,
) -> list[str]:
    return check_schema(
        schema,
        spec or _columns_spec(),
        widths=(width,),
        id_column="item_id",
        passthrough=passthrough,
        shard=SHARD,
    )


# --- footers ------------------------------------------------------------------------------


def test_read_footer_of_a_multi_row_group_file(tmp_path: Path) -> None:
    (path,) = write_shards(tmp_path / "in", [2500], row_group_rows=1000)
    info = read_footer(str(path))
    assert isinstance(info, ShardInfo)
    assert info.num_rows == 2500
    assert info.num_row_groups == 3
    expected = make_rows(0, 1, 0).schema
    assert info.schema.names == expected.names
    assert info.schema.types == expected.types
    with open_parquet(str(path)) as pf:
        assert [pf.metadata.row_group(i).num_rows for i in range(3)] == [1000, 1000, 500]


def test_read_footer_of_a_file_with_empty_row_groups(tmp_path: Path) -> None:
    table = make_rows(0, 30, 0)
    path = tmp_path / "e.parquet"
    with pq.ParquetWriter(path, table.schema) as w:
        w.write_table(table.slice(0, 10))
        w.write_table(table.slice(0, 0))
        w.write_table(table.slice(10, 20))
    info = read_footer(str(path))
    assert (info.num_rows, info.num_row_groups) == (30, 3)


def _unreadable_files(tmp_path: Path) -> dict[str, Path]:
    (real,) = write_shards(tmp_path / "real", [3000], row_group_rows=1000)
    data = real.read_bytes()
    files = {
        "zero-byte": tmp_path / "empty.parquet",
        "truncated": tmp_path / "truncated.parquet",
        "not-parquet": tmp_path / "notes.parquet",
        "footer-only-magic": tmp_path / "magic.parquet",
    }
    files["zero-byte"].write_bytes(b"")
    files["truncated"].write_bytes(data[: len(data) // 2])
    files["not-parquet"].write_text("item_id,f0\n1,0.5\n2,0.25\n" * 50)
    files["footer-only-magic"].write_bytes(b"PAR1" + b"\x00" * 64 + b"PAR1")
    return files


@pytest.mark.parametrize("which", ["zero-byte", "truncated", "not-parquet", "footer-only-magic"])
def test_unreadable_shards_raise_shard_error(tmp_path: Path, which: str) -> None:
    path = str(_unreadable_files(tmp_path)[which])
    with pytest.raises(ShardError) as e1:
        read_footer(path)
    assert e1.value.kind == "unreadable"
    assert e1.value.shard == path
    assert path in str(e1.value)
    with pytest.raises(ShardError) as e2, open_parquet(path):
        pass
    assert e2.value.kind == "unreadable"
    assert path in str(e2.value)


def test_missing_shard_raises_shard_error(tmp_path: Path) -> None:
    path = str(tmp_path / "gone.parquet")
    with pytest.raises(ShardError) as e:
        read_footer(path)
    assert e.value.kind == "unreadable"
    assert path in str(e.value)


# --- check_schema ------------------------------------------------------------------------


def test_demo_schema_fits() -> None:
    assert _check(_demo_schema()) == []


def test_extra_columns_and_other_numeric_types_are_fine() -> None:
    schema = _demo_schema(
        f0=pa.int64(), f1=pa.float64(), f2=pa.int32(), f3=pa.uint8(), f4=pa.float16(), f5=pa.int16()
    )
    schema = schema.append(pa.field("unrelated", pa.string()))
    schema = schema.append(pa.field("blob", pa.large_binary()))
    schema = schema.append(pa.field("nested", pa.struct([("a", pa.int8())])))
    assert _check(schema) == []


def test_missing_feature_column() -> None:
    schema = _demo_schema()
    schema = schema.remove(schema.get_field_index("f7"))
    (msg,) = _check(schema)
    assert SHARD in msg and "'f7'" in msg and "missing" in msg
    assert "feature column" in msg


@pytest.mark.parametrize(
    "bad_type", [pa.string(), pa.bool_(), pa.large_string(), pa.list_(pa.float32())]
)
def test_non_numeric_feature_column(bad_type: pa.DataType) -> None:
    (msg,) = _check(_demo_schema(f3=bad_type))
    assert SHARD in msg and "'f3'" in msg
    assert str(bad_type) in msg and "not numeric" in msg


def test_missing_id_column() -> None:
    schema = _demo_schema()
    schema = schema.remove(schema.get_field_index("item_id"))
    (msg,) = _check(schema)
    assert SHARD in msg and "'item_id'" in msg and "id column" in msg and "missing" in msg


def test_missing_passthrough_column() -> None:
    (msg,) = _check(_demo_schema(), passthrough=("category", "brand"))
    assert SHARD in msg and "'brand'" in msg and "pass-through column" in msg
    assert "missing" in msg


def test_list_input_fits_fixed_variable_and_large_lists() -> None:
    base = pa.schema([pa.field("item_id", pa.int64()), pa.field("category", pa.string())])
    for t in (
        pa.list_(pa.float32(), 16),
        pa.list_(pa.float64(), 16),
        pa.list_(pa.float32()),
        pa.large_list(pa.int32()),
    ):
        schema = base.append(pa.field("embedding", t))
        assert _check(schema, _list_spec()) == [], t


def test_wrong_fixed_size_list_length() -> None:
    schema = pa.schema(
        [
            pa.field("item_id", pa.int64()),
            pa.field("category", pa.string()),
            pa.field("embedding", pa.list_(pa.float32(), 12)),
        ]
    )
    (msg,) = _check(schema, _list_spec())
    assert SHARD in msg and "'embedding'" in msg
    assert "12" in msg and "16" in msg


@pytest.mark.parametrize(
    "bad_type", [pa.float32(), pa.string(), pa.list_(pa.string(), 16), pa.list_(pa.bool_())]
)
def test_list_input_of_the_wrong_kind(bad_type: pa.DataType) -> None:
    schema = pa.schema(
        [
            pa.field("item_id", pa.int64()),
            pa.field("category", pa.string()),
            pa.field("embedding", bad_type),
        ]
    )
    (msg,) = _check(schema, _list_spec())
    assert SHARD in msg and "'embedding'" in msg and "16" in msg


def test_missing_list_column() -> None:
    schema = pa.schema([pa.field("item_id", pa.int64()), pa.field("category", pa.string())])
    (msg,) = _check(schema, _list_spec())
    assert SHARD in msg and "'embedding'" in msg and "missing" in msg


def test_all_problems_are_reported_at_once() -> None:
    schema = _demo_schema(f2=pa.string(), f9=pa.bool_())
    for gone in ("item_id", "f5", "f11"):
        schema = schema.remove(schema.get_field_index(gone))
    schema = schema.append(pa.field("extra", pa.string()))
    problems = _check(schema, passthrough=("category", "brand"))
    assert len(problems) == 6
    assert all(SHARD in p for p in problems)
    for col in ("'item_id'", "'brand'", "'f2'", "'f5'", "'f9'", "'f11'"):
        assert sum(col in p for p in problems) == 1, col
    assert not any("extra" in p for p in problems)


def test_data_widths_of_list_inputs() -> None:
    base = pa.schema([pa.field("item_id", pa.int64())])
    toml = (
        'name = "emb"\nversion = "1"\nformat = "exported_program"\nfile = "model.pt2"\n'
        '[inputs]\ncolumn = "embedding"\n[outputs]\nscore = "softmax:1"\n'
    )
    spec = parse_bundle_toml(toml.encode(), "bundle-under-test")  # no dim: the data decides
    assert data_widths(base.append(pa.field("embedding", pa.list_(pa.float32(), 24))), spec) == (
        24,
    )
    assert data_widths(base.append(pa.field("embedding", pa.list_(pa.float32()))), spec) == (None,)
    assert data_widths(base, spec) == (None,)
    # A declared width is the width, whatever the data says.
    assert data_widths(base, _list_spec()) == (16,)
    assert data_widths(_demo_schema(), _columns_spec()) == (16,)


def test_schema_of_a_real_shard_fits(tmp_path: Path) -> None:
    (path,) = write_shards(tmp_path / "in", [10])
    info = read_footer(str(path))
    assert _check(info.schema) == []


def test_duplicated_feature_column_is_reported_not_raised(tmp_path: Path) -> None:
    t = make_rows(0, 5, 0)
    t = t.append_column("f3", t.column("f3"))  # Parquet allows repeated names
    path = tmp_path / "dup.parquet"
    pq.write_table(t, path)
    info = read_footer(str(path))
    problems = _check(info.schema)
    assert len(problems) == 1
    assert SHARD in problems[0] and "'f3'" in problems[0]


# ---------------------------------------------------------------- lossy casts (issue 13)


@pytest.mark.parametrize(
    ("values", "type_", "change"),
    [
        ([1, -(2**24), 2**24], pa.int64(), None),  # all exactly float32
        ([1, 2**24 + 1], pa.int64(), (2**24 + 1, 2**24)),
        ([None, -(2**25) - 1], pa.int64(), (-(2**25) - 1, -(2**25))),
        ([2**25], pa.int64(), None),  # beyond 2**24 but a float32 all the same
        ([2**31 - 1], pa.int32(), (2**31 - 1, 2**31)),
        ([2**24 + 1], pa.uint64(), (2**24 + 1, 2**24)),
        ([0.5, 0.25, None, float("nan"), float("inf")], pa.float64(), None),
        ([0.5, 0.1], pa.float64(), None),  # rounded to float32's precision: what float32 is
        ([0.1, 1e39], pa.float64(), (1e39, float("inf"))),  # beyond float32's range
        ([0.0, -1e-50], pa.float64(), (-1e-50, 0.0)),  # a nonzero value that becomes 0
        ([0.1], pa.float32(), None),  # already float32
        ([2**15 - 1], pa.int16(), None),  # narrow enough never to lose
    ],
)
def test_lossy_cast_finds_the_first_changed_value(
    values: list[Any], type_: pa.DataType, change: tuple[float, float] | None
) -> None:
    from pipeline.model.features import lossy_cast

    found = lossy_cast(pa.array(values, type_))
    if change is None:
        assert found is None
    else:
        assert found is not None and (found.value, found.as_float32) == change
        assert found.from_type == str(type_)


def test_lossy_casts_of_a_batch_check_features_only_and_skip_known_ones() -> None:
    from pipeline.model.features import lossy_casts

    rb = pa.record_batch(
        {
            "item_id": pa.array([2**40, 2**40 + 1], pa.int64()),  # not a feature: never checked
            "a": pa.array([2**24 + 1, 3], pa.int64()),
            "b": pa.array([0.1, 1e40], pa.float64()),
            "v": pa.array([[0.1, 1.0], [2.0, 1e-60]], pa.list_(pa.float64())),
        }
    )
    spec = parse_bundle_toml(demo_toml(columns=("a", "b")).encode(), "bundle")
    found = lossy_casts(rb, spec)
    assert set(found) == {"a", "b"}
    assert set(lossy_casts(rb, spec, skip={"a"})) == {"b"}
    toml = demo_toml().replace('columns = ["f0"', 'column = "v"\ndim = 2\n# ["f0"')
    listed = parse_bundle_toml(toml.encode(), "bundle")
    (only,) = lossy_casts(rb, listed).values()
    assert only.from_type == "double" and only.value == 1e-60
