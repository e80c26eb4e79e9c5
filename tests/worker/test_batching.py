"""ShardBatches + make_loader: exact-size batches of one shard, every row once, in input order."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pipeline.cli.demo import FEATURES, make_rows
from pipeline.model.bundle import BundleSpec, parse_bundle_toml
from pipeline.model.features import check_schema
from pipeline.model.program import load_model
from pipeline.worker.batching import Batch, ShardBatches, make_loader
from tests.conftest import demo_toml

META = ("item_id", "category")
# Four features keep the many-row-group layouts that hypothesis draws fast; the layout logic
# does not depend on how many feature columns there are (16-column shards are tested below).
SMALL = ("f0", "f1", "f2", "f3")

HYP = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _spec(columns: tuple[str, ...]) -> BundleSpec:
    return parse_bundle_toml(demo_toml(columns).encode(), "bundle-under-test")


def _features(table: pa.Table, columns: Sequence[str]) -> np.ndarray:
    return np.column_stack(
        [table.column(c).to_numpy(zero_copy_only=False) for c in columns]
    ).astype(np.float32)


def _batches(
    path: Path,
    spec: BundleSpec,
    batch_size: int,
    *,
    width: int | None = None,
    meta: tuple[str, ...] = META,
) -> list[Batch]:
    ds = ShardBatches(
        str(path),
        spec,
        widths=(width if width is not None else len(spec.input_columns),),
        meta_columns=meta,
        batch_size=batch_size,
    )
    return list(make_loader(ds))


def _check_layout(path: Path, table: pa.Table, expected_rg: np.ndarray, batch_size: int) -> None:
    """Every row exactly once, in order, in exact-size batches, with its row group and features."""
    n = table.num_rows
    batches = _batches(path, _spec(SMALL), batch_size)
    sizes = [b.num_rows for b in batches]
    # Exactly batch_size rows per batch except the last, which holds the remainder (never 0).
    full, rem = divmod(n, batch_size)
    assert sizes == [batch_size] * full + ([rem] if rem else [])
    assert [b.start for b in batches] == [k * batch_size for k in range(len(batches))]
    for b in batches:
        assert isinstance(b, Batch)
        assert b.meta.schema.names == list(META)
        assert b.tensors[0].dtype == torch.float32
        assert tuple(b.tensors[0].shape) == (b.num_rows, len(SMALL))
        assert b.tensors[0].is_contiguous()
        assert len(b.row_groups) == b.num_rows
        assert len(b.features.valid) == b.num_rows
        assert b.features.valid.all() and b.features.reasons is None
    if not batches:
        assert n == 0
        return
    ids = np.concatenate([b.meta.column("item_id").to_numpy() for b in batches])
    np.testing.assert_array_equal(ids, table.column("item_id").to_numpy())
    cats = [c for b in batches for c in b.meta.column("category").to_pylist()]
    assert cats == table.column("category").to_pylist()
    x = torch.cat([b.tensors[0] for b in batches]).numpy()
    np.testing.assert_array_equal(x, _features(table, SMALL))
    rgs = np.concatenate([b.row_groups for b in batches])
    np.testing.assert_array_equal(rgs, expected_rg)


@given(
    n_rows=st.integers(0, 3000),
    rg_rows=st.integers(1, 1500),
    batch_size=st.integers(1, 1200),
    seed=st.integers(0, 2**16),
)
@pytest.mark.slow
@example(n_rows=0, rg_rows=1, batch_size=1, seed=0)
@example(n_rows=1, rg_rows=1, batch_size=1200, seed=0)
@example(n_rows=3000, rg_rows=600, batch_size=600, seed=0)  # batch == row group: no concat
@example(n_rows=3000, rg_rows=1200, batch_size=400, seed=0)  # row group a multiple of batch
@example(n_rows=3000, rg_rows=1000, batch_size=300, seed=0)  # batches span row groups
@example(n_rows=3000, rg_rows=1, batch_size=7, seed=0)  # one row per row group
@example(n_rows=2999, rg_rows=1500, batch_size=1, seed=0)
@HYP
def test_random_layouts_give_every_row_once_in_order(
    n_rows: int, rg_rows: int, batch_size: int, seed: int
) -> None:
    table = make_rows(1_000 * seed, n_rows, seed).select([*META, *SMALL, "label"])
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "shard.parquet"
        pq.write_table(table, path, row_group_size=rg_rows)
        md = pq.ParquetFile(path).metadata
        if n_rows:  # the fixture really has the layout we reason about
            assert md.num_row_groups == -(-n_rows // rg_rows)
        expected_rg = np.arange(n_rows) // rg_rows
        _check_layout(path, table, expected_rg, batch_size)


@st.composite
def _chunks_with_empty_groups(draw: st.DrawFn) -> list[int]:
    """Sizes of successive write_table calls: non-empty tables with empty ones between them."""
    nonempty = draw(st.lists(st.integers(1, 700), min_size=0, max_size=4))
    empties = draw(
        st.lists(st.integers(0, 2), min_size=len(nonempty) + 1, max_size=len(nonempty) + 1)
    )
    if len(nonempty) >= 2 and sum(empties[1:-1]) == 0:
        empties[1] = 1  # at least one empty row group between non-empty ones
    elif sum(empties) == 0:
        empties[0] = 1
    sizes: list[int] = []
    for k, e in enumerate(empties):
        sizes += [0] * e
        if k < len(nonempty):
            sizes.append(nonempty[k])
    return sizes


@given(
    sizes=_chunks_with_empty_groups(),
    rg_rows=st.integers(1, 1500),
    batch_size=st.integers(1, 1200),
)
@example(sizes=[0], rg_rows=10, batch_size=3)  # nothing but an empty row group
@example(sizes=[0, 5, 0, 0, 7, 0], rg_rows=3, batch_size=4)
@example(sizes=[600, 0, 600], rg_rows=600, batch_size=600)
@HYP
def test_layouts_with_empty_row_groups(sizes: list[int], rg_rows: int, batch_size: int) -> None:
    table = make_rows(0, sum(sizes), 7).select([*META, *SMALL])
    expected_rg: list[np.ndarray] = []
    group_rows: list[int] = []
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "shard.parquet"
        with pq.ParquetWriter(path, table.schema) as w:
            pos = 0
            for size in sizes:
                w.write_table(table.slice(pos, size), row_group_size=rg_rows)
                if size == 0:
                    group_rows.append(0)
                for lo in range(0, size, rg_rows):
                    k = min(rg_rows, size - lo)
                    expected_rg.append(np.full(k, len(group_rows)))
                    group_rows.append(k)
                pos += size
        md = pq.ParquetFile(path).metadata
        # The fixture really holds empty row groups where we wrote empty tables.
        assert [md.row_group(i).num_rows for i in range(md.num_row_groups)] == group_rows
        assert 0 in group_rows
        rg = np.concatenate(expected_rg) if expected_rg else np.zeros(0, dtype=np.int64)
        _check_layout(path, table, rg, batch_size)


def test_file_without_row_groups_gives_no_batches(tmp_path: Path) -> None:
    path = tmp_path / "none.parquet"
    with pq.ParquetWriter(path, make_rows(0, 0, 0).schema):
        pass
    assert pq.ParquetFile(path).metadata.num_row_groups == 0
    assert _batches(path, _spec(FEATURES), 10) == []


def test_sixteen_feature_shard_matches_source(tmp_path: Path) -> None:
    table = make_rows(500, 2345, 3)
    path = tmp_path / "s.parquet"
    pq.write_table(table, path, row_group_size=1000)
    batches = _batches(path, _spec(FEATURES), 512)
    assert [b.num_rows for b in batches] == [512] * 4 + [297]
    x = torch.cat([b.tensors[0] for b in batches])
    assert x.dtype == torch.float32 and tuple(x.shape) == (2345, 16)
    np.testing.assert_array_equal(x.numpy(), _features(table, FEATURES))
    # The tensor is a view of features.x (no extra copy), and both agree.
    for b in batches:
        assert np.shares_memory(b.tensors[0].numpy(), b.features.xs[0])
    ids = np.concatenate([b.meta.column("item_id").to_numpy() for b in batches])
    np.testing.assert_array_equal(ids, np.arange(500, 500 + 2345))
    rgs = np.concatenate([b.row_groups for b in batches])
    np.testing.assert_array_equal(rgs, np.arange(2345) // 1000)


def _corrupt_column(path: Path, column: str) -> None:
    """Overwrite every data page of ``column`` with garbage: reading it must fail."""
    md = pq.ParquetFile(path).metadata
    j = md.schema.names.index(column)
    raw = bytearray(path.read_bytes())
    for i in range(md.num_row_groups):
        c = md.row_group(i).column(j)
        start = c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset
        raw[start : start + c.total_compressed_size] = b"\xff" * c.total_compressed_size
    path.write_bytes(bytes(raw))


def test_only_needed_columns_are_read(tmp_path: Path) -> None:
    n = 1200
    table = make_rows(0, n, 1)
    rng = np.random.default_rng(5)
    # An extra 12 MB column of incompressible bytes that the model does not need, then its
    # pages are destroyed: reading the whole file fails, so the batches prove it is skipped.
    blob = pa.array([rng.bytes(10_000) for _ in range(n)], pa.large_binary())
    table = table.append_column("blob", blob)
    path = tmp_path / "wide.parquet"
    pq.write_table(table, path, row_group_size=500, compression="none", use_dictionary=False)
    assert path.stat().st_size > 12_000_000
    _corrupt_column(path, "blob")
    with pytest.raises((OSError, pa.ArrowException)):
        pq.read_table(path)
    batches = _batches(path, _spec(FEATURES), 256)
    assert sum(b.num_rows for b in batches) == n
    for b in batches:
        assert b.meta.schema.names == list(META)
    x = torch.cat([b.tensors[0] for b in batches]).numpy()
    np.testing.assert_array_equal(x, _features(table, FEATURES))


def test_make_loader_yields_ready_batches_in_order(tmp_path: Path) -> None:
    table = make_rows(0, 1000, 2)
    path = tmp_path / "s.parquet"
    pq.write_table(table, path, row_group_size=300)
    ds = ShardBatches(str(path), _spec(FEATURES), widths=(16,), meta_columns=META, batch_size=128)
    loader = make_loader(ds)
    assert loader.dataset is ds
    assert loader.batch_size is None  # no default collation: the dataset yields whole batches
    assert loader.batch_sampler is None
    assert loader.num_workers == 0
    assert loader.pin_memory is False
    # shuffle=True on an IterableDataset is refused by torch, so constructing it proves False;
    # the sampler of an unshuffled iterable loader is the constant one.
    assert type(loader.sampler).__name__ == "_InfiniteConstantSampler"
    first = [b.start for b in loader]
    second = [b.start for b in loader]
    assert first == second == list(range(0, 1000, 128))
    ids = np.concatenate([b.meta.column("item_id").to_numpy() for b in loader])
    np.testing.assert_array_equal(ids, np.arange(1000))


def test_batch_size_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        ShardBatches(
            str(tmp_path / "x.parquet"), _spec(SMALL), widths=(4,), meta_columns=META, batch_size=0
        )


def test_integer_and_double_features_are_cast_to_float32(tmp_path: Path) -> None:
    n = 700
    rng = np.random.default_rng(11)
    f0 = rng.integers(-(2**23), 2**23, n, dtype=np.int64)
    f1 = rng.standard_normal(n) * 1e3  # float64
    f2 = rng.integers(-(2**20), 2**20, n, dtype=np.int32)
    f3 = rng.standard_normal(n).astype(np.float32)
    table = pa.table(
        {
            "item_id": pa.array(np.arange(n, dtype=np.int64)),
            "category": pa.array(["a"] * n),
            "f0": pa.array(f0, pa.int64()),
            "f1": pa.array(f1, pa.float64()),
            "f2": pa.array(f2, pa.int32()),
            "f3": pa.array(f3, pa.float32()),
        }
    )
    path = tmp_path / "typed.parquet"
    pq.write_table(table, path, row_group_size=250)
    batches = _batches(path, _spec(SMALL), 100)
    x = torch.cat([b.tensors[0] for b in batches])
    assert x.dtype == torch.float32
    expected = np.column_stack(
        [f0.astype(np.float32), f1.astype(np.float32), f2.astype(np.float32), f3]
    )
    np.testing.assert_array_equal(x.numpy(), expected)
    # Integers below 2**24 are exact in float32: the values are preserved, not just close.
    np.testing.assert_array_equal(x[:, 0].numpy().astype(np.int64), f0)
    np.testing.assert_array_equal(x[:, 2].numpy().astype(np.int64), f2)
    assert all(b.features.valid.all() and b.features.reasons is None for b in batches)


def test_null_nan_and_infinite_features_mark_rows_invalid(tmp_path: Path) -> None:
    n = 40
    cols = tuple(f"f{i}" for i in range(6))
    rng = np.random.default_rng(3)
    data: dict[str, list[float | None]] = {
        c: [float(v) for v in rng.standard_normal(n)] for c in cols
    }
    ints: list[int | None] = [int(v) for v in rng.integers(-50, 50, n)]
    bad = {
        3: "null in f3",
        7: "NaN in f5",
        10: "infinite value in f0",
        11: "infinite value in f0",
        15: "null in f1",
        20: "infinite value in f0; null in f3; NaN in f5",
        39: "NaN in f2",
    }
    data["f3"][3] = None
    data["f5"][7] = float("nan")
    data["f0"][10] = float("inf")
    data["f0"][11] = float("-inf")
    ints[15] = None  # a null in an integer column
    data["f0"][20] = float("inf")
    data["f3"][20] = None
    data["f5"][20] = float("nan")
    data["f2"][39] = float("nan")
    table = pa.table(
        {
            "item_id": pa.array(np.arange(n, dtype=np.int64)),
            "category": pa.array(["x"] * n),
            **{c: pa.array(data[c], pa.float32()) for c in cols if c != "f1"},
            "f1": pa.array(ints, pa.int64()),
        }
    )
    path = tmp_path / "bad.parquet"
    pq.write_table(table, path, row_group_size=6)
    batches = _batches(path, _spec(cols), 8)
    assert [b.num_rows for b in batches] == [8] * 5
    for b in batches:
        rows = range(b.start, b.start + b.num_rows)
        expected_valid = np.array([r not in bad for r in rows])
        np.testing.assert_array_equal(b.features.valid, expected_valid)
        expected_reasons = [bad[r] for r in rows if r in bad]
        assert b.features.reasons == (expected_reasons or None)
        ok = b.features.valid
        src = _features(table.slice(b.start, b.num_rows), cols)
        np.testing.assert_array_equal(b.tensors[0].numpy()[ok], src[ok])


# --- list inputs: [inputs] column = "embedding", dim = 16 ------------------------------------


def _list_bundle(tmp_path: Path, bundle_dir: Path) -> Path:
    d = tmp_path / "list_bundle"
    d.mkdir()
    shutil.copy(bundle_dir / "model.pt2", d / "model.pt2")
    (d / "model.toml").write_text(
        'name = "emb"\nversion = "1"\nformat = "exported_program"\nfile = "model.pt2"\n'
        '[inputs]\ncolumn = "embedding"\ndim = 16\n[outputs]\nscore = "softmax:1"\n'
    )
    return d


def test_fixed_size_list_column_equals_the_sixteen_columns(
    tmp_path: Path, bundle_dir: Path
) -> None:
    n = 1000
    table = make_rows(0, n, 4)
    x = _features(table, FEATURES)
    emb = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 16)
    assert emb.type == pa.list_(pa.float32(), 16)
    table = table.append_column("embedding", emb)
    path = tmp_path / "emb.parquet"
    pq.write_table(table, path, row_group_size=300)
    model = load_model(str(_list_bundle(tmp_path, bundle_dir)), "cpu")
    assert model.spec.column == "embedding" and model.width == 16
    schema = pq.read_schema(path)
    assert (
        check_schema(
            schema, model.spec, widths=(16,), id_column="item_id", passthrough=(), shard=str(path)
        )
        == []
    )
    from_list = _batches(path, model.spec, 128, width=model.width)
    from_cols = _batches(path, _spec(FEATURES), 128)
    assert [b.num_rows for b in from_list] == [b.num_rows for b in from_cols]
    for a, b in zip(from_list, from_cols, strict=True):
        assert a.start == b.start
        assert a.tensors[0].dtype == torch.float32
        assert torch.equal(a.tensors[0], b.tensors[0])
        assert a.features.valid.all() and a.features.reasons is None
        np.testing.assert_array_equal(a.row_groups, b.row_groups)
    np.testing.assert_array_equal(torch.cat([b.tensors[0] for b in from_list]).numpy(), x)


def test_variable_length_list_with_a_wrong_length_row(tmp_path: Path, bundle_dir: Path) -> None:
    n = 600
    table = make_rows(0, n, 6)
    x = _features(table, FEATURES)
    rows: list[list[float] | None] = [list(map(float, r)) for r in x]
    rows[137] = rows[137][:15]  # too short
    rows[401] = [*rows[401], 0.5]  # too long
    rows[402] = None
    table = table.append_column("embedding", pa.array(rows, pa.list_(pa.float32())))
    path = tmp_path / "ragged.parquet"
    pq.write_table(table, path, row_group_size=100)
    model = load_model(str(_list_bundle(tmp_path, bundle_dir)), "cpu")
    batches = _batches(path, model.spec, 64, width=model.width)
    assert sum(b.num_rows for b in batches) == n
    valid = np.concatenate([b.features.valid for b in batches])
    assert np.flatnonzero(~valid).tolist() == [137, 401, 402]
    reasons = [r for b in batches for r in (b.features.reasons or [])]
    assert reasons == [
        "embedding has 15 values, expected 16",
        "embedding has 17 values, expected 16",
        "null in embedding",
    ]
    got = torch.cat([b.tensors[0] for b in batches]).numpy()
    np.testing.assert_array_equal(got[valid], x[valid])
    ids = np.concatenate([b.meta.column("item_id").to_numpy() for b in batches])
    np.testing.assert_array_equal(ids, np.arange(n))
