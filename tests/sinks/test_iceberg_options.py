"""The job's ``[storage]`` options as pyiceberg FileIO properties (:mod:`pipeline.sinks.iceberg.
options`): s3fs words mapped, ours dropped, anything else refused naming the key, never a value."""

from __future__ import annotations

import pytest

pytest.importorskip("pyiceberg")

from pipeline.core.errors import ConfigError
from pipeline.sinks.iceberg.options import fileio_properties


def test_s3fs_options_become_s3_properties(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    assert fileio_properties("/local/scored", {"key": "k"}) == {}
    options = {
        "key": "AKIA",
        "secret": "s3cret",
        "token": "",
        "endpoint_url": "http://127.0.0.1:9000",
        "anon": False,
        "retry_deadline_s": 30,
        "use_ssl": False,
        "config_kwargs": {"retries": {"max_attempts": 3}, "s3": {"addressing_style": "path"}},
    }
    assert fileio_properties("s3://lake/scored", options) == {
        "s3.access-key-id": "AKIA",
        "s3.secret-access-key": "s3cret",
        "s3.endpoint": "http://127.0.0.1:9000",
        "s3.anonymous": "false",
        "s3.force-virtual-addressing": "false",
        "s3.region": "us-east-1",  # an endpoint with no region: not asked of AWS
    }
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    regional = {"client_kwargs": {"endpoint_url": "https://minio:9000"}}
    assert fileio_properties("s3a://lake/x", regional)["s3.region"] == "eu-west-1"
    named = {"client_kwargs": {"region_name": "ap-south-1"}}
    assert fileio_properties("s3://lake/x", named) == {"s3.region": "ap-south-1"}


def test_an_option_pyiceberg_has_no_word_for_is_refused_by_name() -> None:
    with pytest.raises(ConfigError) as e:
        fileio_properties(
            "s3://lake/scored", {"requester_pays": "yes-secret", "client_kwargs": {"verify": 0}}
        )
    text = str(e.value)
    assert "'client_kwargs.verify', 'requester_pays' cannot be passed to pyiceberg" in text
    assert "yes-secret" not in text
    with pytest.raises(ConfigError, match="a local path or s3:// here, not gs://"):
        fileio_properties("gs://lake/scored", {})
