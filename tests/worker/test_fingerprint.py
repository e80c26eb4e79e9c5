"""Tests for pipeline.worker.fingerprint: one hash per row of exactly what the model sees."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.worker.fingerprint import fingerprints, id_hashes


def _inputs(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 5, generator=g), torch.randint(0, 1000, (rows,), generator=g)


def test_a_row_s_fingerprint_does_not_depend_on_the_rows_beside_it() -> None:
    num, cat = _inputs(64)
    whole = fingerprints((num, cat))
    assert whole.dtype == np.int64 and whole.shape == (64,)
    for i in (0, 17, 63):
        assert fingerprints((num[i : i + 1], cat[i : i + 1]))[0] == whole[i]
    order = torch.randperm(64)
    assert np.array_equal(fingerprints((num[order], cat[order])), whole[order.numpy()])


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 40),
    row=st.integers(0, 39),
    col=st.integers(0, 5),
    bit=st.integers(0, 31),
)
def test_any_change_the_model_can_see_changes_the_fingerprint(
    rows: int, row: int, col: int, bit: int
) -> None:
    num, cat = _inputs(rows, seed=rows)
    row %= rows
    before = fingerprints((num, cat))
    if col < 5:  # one bit of one float feature
        changed = num.clone()
        bits = changed.view(torch.int32)
        bits[row, col] ^= 1 << bit
        after = fingerprints((changed, cat))
    else:  # one vocabulary id
        changed_cat = cat.clone()
        changed_cat[row] += 1 + bit
        after = fingerprints((num, changed_cat))
    differ = np.flatnonzero(before != after)
    assert differ.tolist() == [row]


def test_the_same_bytes_read_as_another_type_or_order_are_another_input() -> None:
    x = torch.arange(8, dtype=torch.int32).reshape(2, 4)
    assert not np.array_equal(fingerprints((x,)), fingerprints((x.view(torch.float32),)))
    a, b = torch.ones(3, 2), torch.zeros(3, 2)
    assert not np.array_equal(fingerprints((a, b)), fingerprints((b, a)))
    assert not np.array_equal(fingerprints((x,)), fingerprints((x.reshape(2, 2, 2),)))


def test_no_collision_among_a_million_distinct_rows() -> None:
    ids = torch.arange(1_000_000, dtype=torch.int64).reshape(-1, 1)
    h = fingerprints((ids, torch.zeros(1_000_000, 3)))
    assert np.unique(h).size == h.size


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        fingerprints(())
    with pytest.raises(ValueError, match="row counts"):
        fingerprints((torch.zeros(3, 2), torch.zeros(4)))


def test_fingerprints_and_id_hashes_stay_what_earlier_nights_wrote() -> None:
    """Known answers: a baseline's model_input_hash column was written by an earlier version;
    a change to the hash would make every row of the next night look changed."""
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    y = np.array([[1], [2], [3]], dtype=np.int64)
    assert fingerprints([x, y]).tolist() == [
        -8755855808244083658,
        6657976793611657732,
        -1802100716932281429,
    ]
    ints, _ = id_hashes(pa.array([1, 2, None, 4]))
    assert ints.tolist()[:2] == [2832646461707325668, 11887974587072941390]
    assert ints.tolist()[3] == 16368291371470781600
    strings, _ = id_hashes(pa.array(["a", "bb", None, "cccccccccc"]))
    assert strings.tolist()[:2] == [443152007074966827, 5072295120723408409]
    assert strings.tolist()[3] == 14619752522172788018
