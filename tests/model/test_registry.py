"""``pipeline.model.registry`` without a server: URI parsing, what a run needs before it asks one,
and what a registered version changes in a run's settings. The server side (register, resolve,
download, cache, errors from a real ``mlflow server``) is ``tests/integration/test_registry.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pipeline.core.config import JobConfig
from pipeline.core.errors import ConfigError
from pipeline.driver.inspect import run_settings
from pipeline.model import registry
from pipeline.model.bundle import parse_bundle_toml
from pipeline.report.build import RunReport
from pipeline.report.text import summary_table
from tests.conftest import demo_toml


@pytest.mark.parametrize(
    ("uri", "name", "version", "alias"),
    [
        ("models:/catalog-ranker/3", "catalog-ranker", "3", None),
        ("models:/catalog-ranker/12", "catalog-ranker", "12", None),
        ("models:/catalog-ranker@champion", "catalog-ranker", None, "champion"),
        ("models:/team.ranker_v2@shadow-1", "team.ranker_v2", None, "shadow-1"),
    ],
)
def test_registry_uris_name_a_version_or_an_alias(
    uri: str, name: str, version: str | None, alias: str | None
) -> None:
    assert registry.is_registry_uri(uri)
    assert registry.parse_uri(uri) == registry.RegistryRef(uri, name, version, alias)


@pytest.mark.parametrize(
    "uri",
    [
        "models:/",
        "models:/ranker",
        "models:/ranker/latest",  # MLflow's "latest": an alias says which one instead
        "models:/ranker/Production",  # a stage, which MLflow deprecates
        "models:/ranker/0",
        "models:/ranker/3/extra",
        "models:/ranker@",
        "models:/@champion",
        "models:/a/b@champion",
    ],
)
def test_other_registry_uris_are_a_config_error_naming_the_two_forms(uri: str) -> None:
    with pytest.raises(ConfigError) as e:
        registry.parse_uri(uri)
    assert e.value.exit_code == 2
    assert "models:/NAME/VERSION" in str(e.value) and "models:/NAME@ALIAS" in str(e.value)


def test_a_bundle_location_is_used_as_it_is_without_mlflow(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # importing it would fail
    for uri in (str(tmp_path), "s3://bucket/models/ranker", "data/models/catalog-mlp"):
        source = registry.resolve_model(uri)
        assert (source.uri, source.bundle, source.registry) == (uri, uri, None)
        assert source.model_version is None and source.report() is None


def test_a_registry_uri_needs_mlflow_and_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:1")
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ConfigError, match=r"pip install 'score-catalog\[mlflow\]'") as e:
        registry.resolve_model("models:/ranker/1")
    assert e.value.exit_code == 2


def test_a_registry_uri_needs_a_tracking_uri(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ConfigError, match="MLFLOW_TRACKING_URI is not set"):
        registry.resolve_model("models:/ranker@champion")


@pytest.mark.parametrize(
    ("uri", "shown"),
    [
        ("https://alice:s3cret@mlflow.example:5000/base", "https://mlflow.example:5000/base"),
        ("https://token@mlflow.example", "https://mlflow.example"),
        ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
        ("databricks", "databricks"),
    ],
)
def test_messages_show_the_tracking_uri_without_credentials(uri: str, shown: str) -> None:
    assert registry.safe_uri(uri) == shown


def test_the_registered_version_is_a_setting_only_for_registry_models() -> None:
    spec = parse_bundle_toml(demo_toml().encode(), "b")
    config = JobConfig(input="in", output="out", model="b")
    plain = run_settings(config, spec)
    assert "model_version" not in plain.values  # a plain bundle's hash is what it always was
    v1 = run_settings(config, spec, model_version="models:/ranker/1")
    v2 = run_settings(config, spec, model_version="models:/ranker/2")
    assert v1.values["model_version"] == "models:/ranker/1"
    assert len({plain.hash, v1.hash, v2.hash}) == 3  # a moved alias rescores every shard


def test_the_summary_names_the_registered_version() -> None:
    def data(reg: object) -> dict[str, object]:
        model = {"name": "m", "version": "1", "sha256": "a" * 64, "registry": reg}
        return {
            "run_id": "r",
            "status": "succeeded",
            "job": "j",
            "model": model,
            "device": "cpu",
            "batch_size": 8,
            "output": "/o",
            **dict.fromkeys(("shards_total", "shards_scored", "shards_skipped"), 0),
            **dict.fromkeys(("shards_failed", "rows_in", "rows_out", "rows_rejected"), 0),
            "rows_per_s": 0.0,
            "rows_processed": 0,
            "duration_s": 1.0,
            "batch_latency_ms": {"p50": None},
            "shards": [],
            "errors": [],
        }

    reg = {"uri": "models:/r@champion", "name": "r", "version": "4", "alias": "champion"}
    text = summary_table(RunReport(data(reg)))
    assert "  registry  models:/r/4 (alias champion)" in text.splitlines()
    assert "registry" not in summary_table(RunReport(data(None)))
