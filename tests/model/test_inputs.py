"""Named, typed model inputs: parsing ``[inputs.<name>]``, vocabularies, and Arrow -> arrays."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.core.errors import ModelError
from pipeline.model.bundle import parse_bundle_toml
from pipeline.model.columns import build, to_tensor
from pipeline.model.inputs import (
    InputSpec,
    data_width,
    parse_inputs,
    parse_vocabulary,
    schema_problems,
)

# The issue's model.toml, as written there.
RANKER_TOML = """\
name = "catalog-ranker"
version = "3"
format = "exported_program"
file = "model.pt2"

[inputs.numeric]              # forward(numeric, brand, seller), in this order
columns = ["price", "rating", "stock"]

[inputs.brand]
column = "brand"              # string column
dtype = "int64"
vocabulary = "brand.txt"      # one brand per line
oov = 0                       # unseen brand -> id 0

[inputs.seller]
column = "seller_id"          # int64 column
dtype = "int64"
num_embeddings = 1000         # outside 0..999 -> reject

[outputs]
score = "sigmoid"
"""


def _problems(raw: object) -> list[str]:
    p: list[str] = []
    parse_inputs(raw, p)
    return p


def test_the_issues_model_toml_parses_in_declared_order() -> None:
    spec = parse_bundle_toml(RANKER_TOML.encode(), "b")
    assert [i.name for i in spec.inputs] == ["numeric", "brand", "seller"]
    numeric, brand, seller = spec.inputs
    assert numeric.columns == ("price", "rating", "stock") and numeric.dtype == "float32"
    assert numeric.fixed_width() == 3
    assert brand.vocabulary == "brand.txt" and brand.oov == 0 and brand.fixed_width() == 0
    assert seller.num_embeddings == 1000 and seller.oov is None and seller.fixed_width() is None
    assert spec.input_columns == ("price", "rating", "stock", "brand", "seller_id")


def test_the_single_input_form_is_one_input() -> None:
    (inp,) = parse_inputs({"columns": ["a", "b"]}, [])
    assert inp.legacy and inp.columns == ("a", "b") and inp.dtype == "float32"
    assert inp.describe() == "inputs.columns = ['a', 'b']"


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ({"x": {"column": "a", "dtype": "float64"}}, "inputs.x.dtype = 'float64' is not one of"),
        ({"x": {"column": "a", "colour": 1}}, "unknown key inputs.x.colour"),
        ({"x": {"columns": ["a"], "vocabulary": "v.txt"}}, 'use column = "...", not columns'),
        ({"x": {"column": "a", "oov": 0}}, "inputs.x.oov needs a vocabulary"),
        ({"x": {"column": "a", "vocabulary": "v.txt", "oov": -1}}, "oov must be an id >= 0"),
        ({"x": {"column": "a", "vocabulary": "../v.txt"}}, "must be a file inside the bundle"),
        ({"x": {"column": "a", "vocabulary": "v.txt", "dtype": "float32"}}, "must be int64"),
        ({"x": {"column": "a", "num_embeddings": 10}}, "num_embeddings needs an integer dtype"),
        ({"x": {"column": "a", "dtype": "int64", "null": 0.5}}, "an integer for int64"),
        ({"x": {"column": "a", "null": "zero"}}, 'null must be "reject" or a fill value'),
        ({"x": {"column": "a", "dtype": "int64", "num_embeddings": 5, "oov": 7}}, "oov needs"),
        ({"x": {"column": "a", "vocabulary": "v", "num_embeddings": 5, "oov": 7}}, "outside 0..4"),
        ({"x": {"column": "a"}, "columns": ["b"]}, "mixes named inputs (x) with plain keys"),
        ({"x": {}}, "needs exactly one of columns"),
        ({"columns": ["a"], "dtype": "int64"}, "unknown key inputs.dtype"),
    ],
)
def test_bad_named_inputs_are_named(raw: object, fragment: str) -> None:
    problems = _problems(raw)
    assert any(fragment in p for p in problems), problems


def test_every_problem_at_once() -> None:
    toml = RANKER_TOML.replace('dtype = "int64"\nvocabulary', 'dtype = "int8"\nvocabulary')
    toml = toml.replace("num_embeddings = 1000", "num_embeddings = 0")
    with pytest.raises(ModelError) as excinfo:
        parse_bundle_toml(toml.encode(), "b")
    msg = str(excinfo.value)
    assert "inputs.brand.dtype = 'int8'" in msg and "inputs.seller.num_embeddings must be" in msg


def test_vocabulary_files() -> None:
    inp = InputSpec("brand", column="brand", dtype="int64", vocabulary="v.txt", num_embeddings=4)
    assert parse_vocabulary(b"a\nb\r\n\nc\n", inp, "v") == (("a", "b", "", "c"), [])
    _, problems = parse_vocabulary(b"a\nb\na\n", inp, "v")
    assert problems == ["v: 'a' is on line 1 and again on line 3"]
    assert parse_vocabulary(b"", inp, "v")[1] == [
        "v is empty: a vocabulary needs at least one value"
    ]
    assert (
        "holds 5 values but num_embeddings = 4"
        in parse_vocabulary(b"a\nb\nc\nd\ne\n", inp, "v")[1][0]
    )
    assert "not UTF-8" in parse_vocabulary(b"\xff\n", inp, "v")[1][0]


# --- Arrow -> arrays ------------------------------------------------------------------------

VOCAB = ("<unk>", "acme", "zenith", "orbit")


def _vocab_input(**kw: object) -> InputSpec:
    base: dict[str, object] = dict(column="brand", dtype="int64", vocabulary="v.txt", vocab=VOCAB)
    base.update(kw)
    return InputSpec("brand", **base)  # type: ignore[arg-type]


def _reasons(part: object, n: int) -> dict[int, str]:
    bad = part.bad  # type: ignore[attr-defined]
    return {} if bad is None else {i: part.why(i) for i in range(n) if bad[i]}  # type: ignore[attr-defined]


@pytest.mark.parametrize("encoding", ["plain", "dictionary", "large"])
def test_vocabulary_lookup_with_unseen_and_null(encoding: str) -> None:
    arr = pa.array(["zenith", "acme", None, "nova", "orbit", "acme"], pa.string())
    if encoding == "dictionary":
        arr = arr.dictionary_encode()
    elif encoding == "large":
        arr = arr.cast(pa.large_string())
    rb = pa.record_batch({"brand": arr})
    reject = build(rb, _vocab_input(), 0)
    assert reject.x.dtype == np.int64 and reject.x.shape == (6,)
    assert reject.x[[0, 1, 4, 5]].tolist() == [2, 1, 3, 1]
    assert _reasons(reject, 6) == {
        2: "null in brand",
        3: "brand = 'nova' is not in the vocabulary v.txt (oov = 'reject')",
    }
    mapped = build(rb, _vocab_input(oov=0, fill=0), 0)
    assert mapped.bad is None and mapped.x.tolist() == [2, 1, 0, 0, 3, 1]
    assert to_tensor(mapped.x, _vocab_input()).dtype.is_floating_point is False


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.one_of(st.none(), st.sampled_from([*VOCAB, "x", "", "ACME"])), max_size=40),
    st.booleans(),
)
def test_vocabulary_lookup_matches_a_dictionary(values: list[str | None], dictionary: bool) -> None:
    arr = pa.array(values, pa.string())
    if dictionary:
        arr = arr.dictionary_encode()
    part = build(pa.record_batch({"brand": arr}), _vocab_input(oov=0), 0)
    ids = {v: i for i, v in enumerate(VOCAB)}
    for i, v in enumerate(values):
        if v is None:
            assert part.bad is not None and part.bad[i]
        else:
            assert part.x[i] == ids.get(v, 0)
            assert part.bad is None or not part.bad[i]


def test_id_column_range_and_int32() -> None:
    rb = pa.record_batch({"seller_id": pa.array([0, 999, 1000, -1, None, 5], pa.int64())})
    inp = InputSpec("seller", column="seller_id", dtype="int64", num_embeddings=1000)
    part = build(rb, inp, 0)
    assert part.x.dtype == np.int64 and part.x[[0, 1, 5]].tolist() == [0, 999, 5]
    assert _reasons(part, 6) == {
        2: "seller_id = 1000 is outside 0..999 (num_embeddings = 1000)",
        3: "seller_id = -1 is outside 0..999 (num_embeddings = 1000)",
        4: "null in seller_id",
    }
    big = pa.record_batch({"n": pa.array([1, 2**31, -(2**31)], pa.int64())})
    p32 = build(big, InputSpec("n", column="n", dtype="int32"), 0)
    assert p32.x.dtype == np.int32
    assert _reasons(p32, 3) == {
        1: f"n = {2**31} is outside -2147483648..2147483647 (the range of int32)"
    }


def test_numeric_columns_with_a_fill_value_and_other_dtypes() -> None:
    rb = pa.record_batch(
        {"a": pa.array([1.0, None, float("nan"), float("inf")]), "b": pa.array([1, 2, 3, 4])}
    )
    filled = build(rb, InputSpec("n", columns=("a", "b"), fill=-1.0), 2)
    assert filled.x.tolist()[:3] == [[1.0, 1.0], [-1.0, 2.0], [-1.0, 3.0]]
    assert _reasons(filled, 4) == {3: "infinite value in a"}
    ints = build(rb.select(["b"]), InputSpec("n", columns=("b",), dtype="int32"), 1)
    assert ints.x.dtype == np.int32 and ints.x.tolist() == [[1], [2], [3], [4]]
    flags = pa.record_batch({"f": pa.array([True, None, False])})
    assert build(flags, InputSpec("f", column="f", dtype="bool", fill=False), 0).x.tolist() == [
        True,
        False,
        False,
    ]


def test_scalar_float_and_list_inputs() -> None:
    rb = pa.record_batch(
        {
            "p": pa.array([1.5, None], pa.float64()),
            "e": pa.array([[1, 2], [3]], pa.list_(pa.int64())),
        }
    )
    p = build(rb, InputSpec("p", column="p"), 0)
    assert p.x.shape == (2,) and _reasons(p, 2) == {1: "null in p"}
    e = build(rb, InputSpec("e", column="e", dtype="int64", dim=2), 2)
    assert e.x.dtype == np.int64 and e.x[0].tolist() == [1, 2]
    assert _reasons(e, 2) == {1: "e has 1 values, expected 2"}
    half = to_tensor(
        build(rb, InputSpec("p", column="p", dtype="bfloat16", fill=0.0), 0).x,
        InputSpec("p", column="p", dtype="bfloat16"),
    )
    assert str(half.dtype) == "torch.bfloat16" and half.tolist() == [1.5, 0.0]


def test_schema_problems_name_the_input_and_the_type() -> None:
    schema = pa.schema(
        [
            ("brand", pa.int64()),
            ("seller_id", pa.float64()),
            ("price", pa.string()),
            ("emb", pa.list_(pa.float32(), 8)),
        ]
    )
    names = set(schema.names)

    def problems(inp: InputSpec, width: int) -> list[str]:
        return schema_problems(schema, inp, width, names, set(), "s")

    assert "maps strings to ids through v.txt" in problems(_vocab_input(), 0)[0]
    assert (
        "which is not an integer type (input 'seller' is int64)"
        in problems(InputSpec("seller", column="seller_id", dtype="int64"), 0)[0]
    )
    assert "which is not numeric" in problems(InputSpec("n", columns=("price",)), 1)[0]
    assert (
        "holds lists (fixed_size_list<item: float>[8]); input 'e' takes one value"
        in problems(InputSpec("e", column="emb"), 0)[0]
    )
    assert problems(InputSpec("e", column="emb"), 8) == []
    assert data_width(schema, InputSpec("e", column="emb")) == 8
    assert data_width(schema, InputSpec("s", column="seller_id")) == 0


def test_values_an_input_cannot_hold_are_rejected_not_wrapped() -> None:
    # bool takes 0 and 1 only; uint64 above int64's range; float16 beyond ±65,504.
    flags = pa.record_batch({"f": pa.array([0, 1, 2, -1], pa.int16())})
    part = build(flags, InputSpec("f", column="f", dtype="bool"), 0)
    assert part.x.tolist()[:2] == [False, True]
    assert _reasons(part, 4) == {
        2: "f = 2 is not 0 or 1 (input 'f' is bool)",
        3: "f = -1 is not 0 or 1 (input 'f' is bool)",
    }
    big = pa.record_batch({"u": pa.array([1, 2**63 - 1, 2**63, 2**64 - 1], pa.uint64())})
    part = build(big, InputSpec("u", column="u", dtype="int64"), 0)
    assert part.x.dtype == np.int64 and part.x[:2].tolist() == [1, 2**63 - 1]
    assert _reasons(part, 4) == {
        2: f"u = {2**63} is outside {-(2**63)}..{2**63 - 1} (the range of int64)",
        3: f"u = {2**64 - 1} is outside {-(2**63)}..{2**63 - 1} (the range of int64)",
    }
    half = pa.record_batch({"h": pa.array([1.0, 1e5, -7e4], pa.float32())})
    part = build(half, InputSpec("h", column="h", dtype="float16"), 0)
    assert _reasons(part, 3) == {
        1: "h = 100000.0 is beyond float16's range",
        2: "h = -70000.0 is beyond float16's range",
    }
    emb = pa.record_batch({"e": pa.array([[1.0, 2.0], [1e5, 0.0]], pa.list_(pa.float32(), 2))})
    part = build(emb, InputSpec("e", column="e", dtype="float16"), 2)
    assert _reasons(part, 2) == {1: "e holds 100000.0, beyond float16's range"}


def test_list_ids_name_the_value_and_null_lists_take_the_fill() -> None:
    rb = pa.record_batch({"ids": pa.array([[1, 2], [3, 1000], None], pa.list_(pa.int64()))})
    inp = InputSpec("ids", column="ids", dtype="int64", dim=2, num_embeddings=1000)
    assert _reasons(build(rb, inp, 2), 3) == {
        1: "ids holds 1000 is outside 0..999 (num_embeddings = 1000)",
        2: "null in ids",
    }
    filled = build(rb, InputSpec("ids", column="ids", dtype="int64", dim=2, fill=0), 2)
    assert filled.bad is None and filled.x.tolist() == [[1, 2], [3, 1000], [0, 0]]
    emb = pa.record_batch({"e": pa.array([[1.0, None], None], pa.list_(pa.float32()))})
    part = build(emb, InputSpec("e", column="e", dim=2, fill=0.5), 2)
    assert part.bad is None and part.x.tolist() == [[1.0, 0.5], [0.5, 0.5]]


def test_a_byte_order_mark_is_not_part_of_the_first_value() -> None:
    inp = InputSpec("b", column="b", dtype="int64", vocabulary="v.txt")
    assert parse_vocabulary("\ufeffacme\nzenith\n".encode(), inp, "v") == (("acme", "zenith"), [])


@pytest.mark.parametrize(
    ("table", "fragment"),
    [
        (
            {"column": "s", "dtype": "int64", "num_embeddings": 10, "null": 10},
            "null = 10 is outside 0..9",
        ),
        (
            {"column": "s", "dtype": "float16", "null": 1e5},
            "null = 100000.0 is beyond float16's range",
        ),
        ({"column": "s", "null": 1e300}, "null = 1e+300 is beyond float32's range"),
        (
            {"column": "s", "dtype": "int32", "null": 2**31},
            "null = 2147483648 is outside int32's range",
        ),
    ],
)
def test_fill_values_the_input_cannot_hold_are_refused(
    table: dict[str, object], fragment: str
) -> None:
    problems = _problems({"x": table})
    assert any(fragment in p for p in problems), problems


@pytest.mark.parametrize(
    ("reason", "cause"),
    [
        (
            "brand = 'a b' is not in the vocabulary v.txt (oov = 'reject')",
            "brand is not in the vocabulary v.txt (oov = 'reject')",
        ),
        (
            "null in price; s = 7 is outside 0..3 (num_embeddings = 4)",
            "null in price; s is outside 0..3 (num_embeddings = 4)",
        ),
        (
            "ids holds 9 is outside 0..3 (num_embeddings = 4)",
            "ids holds a value outside 0..3 (num_embeddings = 4)",
        ),
        ("model error: ValueError: boom", "model error: ValueError: boom"),
    ],
)
def test_reasons_are_counted_by_cause_without_the_value(reason: str, cause: str) -> None:
    from pipeline.model.columns import cause_of

    assert cause_of(reason) == cause
