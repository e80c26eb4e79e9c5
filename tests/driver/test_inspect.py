"""Output column names: every column of an output file is named once."""

from __future__ import annotations

import pytest

from pipeline.core.config import JobConfig
from pipeline.core.errors import ConfigError
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
