"""Output column names: every column of an output file is named once."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.core.config import JobConfig
from pipeline.core.errors import ConfigError
from pipeline.driver.execution import _sweep_rows
from pipeline.driver.inspect import run_settings
from pipeline.model.bundle import parse_bundle_toml

TOML = """
name = "m"
version = "1"
format = "exported_program"
file = "model.pt2"
[inputs]
columns = ["f0", "f1"]
[outputs]
{outputs}
"""


def _bundle(outputs: str = 'score = "softmax:1"\nlabel = "argmax"') -> object:
    return parse_bundle_toml(TOML.format(outputs=outputs).encode(), "b")


def _config(**kw: object) -> JobConfig:
    return JobConfig(input="in", output="out", model="b", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "outputs", "name"),
    [
        ({"passthrough": ("score",)}, None, "score"),
        ({"passthrough": ("model_version",)}, None, "model_version"),
        ({"id_column": "label"}, None, "label"),
        ({"id_column": "sku"}, 'sku = "argmax"', "sku"),
        ({}, 'model_version = "argmax"', "model_version"),
    ],
)
def test_a_column_name_used_twice_is_refused(
    kw: dict[str, object], outputs: str | None, name: str
) -> None:
    bundle = _bundle(outputs) if outputs else _bundle()
    with pytest.raises(ConfigError, match=f"output column '{name}' comes twice"):
        run_settings(_config(**kw), bundle)  # type: ignore[arg-type]


def test_distinct_names_are_accepted() -> None:
    settings = run_settings(_config(passthrough=("category",)), _bundle())  # type: ignore[arg-type]
    assert settings.values["passthrough"] == ["category"]


# --------------------------------------------------------------------------- auto sweep size


def test_a_fast_model_s_sweep_uses_the_whole_sample() -> None:
    # The demo MLP: about 3 us a row through the pipeline; 5 sizes x 16,384 rows fit 0.3 s.
    assert _sweep_rows(16_384, 3e-6, 0.3, 5, 4096) == 16_384


def test_a_slow_model_on_a_small_job_is_not_swept() -> None:
    # A 2048-wide MLP at 10k rows/s, 200k rows on 2 workers: 5% of the job is 0.5 s, which a
    # round of 5 sizes over 8,192 rows (4 s) does not fit.
    assert _sweep_rows(16_384, 1e-4, max(0.3, 0.05 * 1e-4 * 200_000 / 2), 5, 4096) is None


def test_a_slow_model_on_a_big_job_is_swept_over_fewer_rows() -> None:
    # The same model over 2M rows: 5 s of budget, 10,000 rows a pass.
    assert _sweep_rows(16_384, 1e-4, 5.0, 5, 4096) == 10_000


def test_a_sample_smaller_than_two_defaults_is_swept_whole() -> None:
    assert _sweep_rows(5_000, 3e-6, 0.3, 5, 4096) == 5_000


@given(
    rows=st.integers(1, 100_000),
    per_row=st.floats(1e-8, 1e-2),
    budget=st.floats(0.01, 60),
    n_sizes=st.integers(1, 6),
    default=st.sampled_from([1024, 4096, 8192]),
)
def test_a_round_of_the_sweep_fits_its_budget_or_is_not_run(
    rows: int, per_row: float, budget: float, n_sizes: int, default: int
) -> None:
    n = _sweep_rows(rows, per_row, budget, n_sizes, default)
    if n is not None:
        assert 1 <= n <= rows
        assert n * n_sizes * per_row <= budget * (1 + 1e-9)
        assert n >= min(rows, 2 * default)
