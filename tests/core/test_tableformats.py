"""An Iceberg table's ``catalog`` and ``table`` keys through the configuration's layers (job
file < environment < flags): their shapes, every problem reported together naming the key and
the fix, the catalog described without its secrets (reports, logs, messages), and the object
storage rule (the embedded catalog is a local file)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.core.config import JobConfig
from pipeline.core.errors import ConfigError
from pipeline.core.jobfile import build_config
from pipeline.core.tableformats import CatalogSpec, public_uri, table_identifier

BASE = 'input = "in"\nmodel = "m"\nformat = "iceberg"\noutput = "data/scored/run_date={date}"\n'


def _job(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(BASE + text)
    return path


def _problems(excinfo: pytest.ExceptionInfo[ConfigError]) -> list[str]:
    return list(excinfo.value.problems)


def test_a_catalog_table_in_the_job_file_a_uri_from_the_environment_or_a_flag(
    tmp_path: Path,
) -> None:
    job = _job(
        tmp_path,
        'table = "analytics.scores"\n[catalog]\nname = "prod"\ntype = "rest"\n'
        'uri = "https://catalog.example/api"\ncredential = "client:hunter2"\n'
        '"s3.secret-access-key" = "abc123xyz"\nwarehouse = "s3://lake/wh"\n',
    )
    config = build_config(job, env={})
    assert config.table == "analytics.scores"
    assert isinstance(config.catalog, dict) and config.catalog["name"] == "prod"
    shown = config.redacted()["catalog"]
    assert shown == {
        "name": "prod",
        "type": "rest",
        "uri": "https://catalog.example/api",
        "warehouse": "s3://lake/wh",
    }
    text = json.dumps(config.redacted())
    assert "hunter2" not in text and "abc123xyz" not in text
    # A later layer replaces the catalog whole (never merged key by key with the file's).
    env = {"SCORE_CATALOG_CATALOG": f"sqlite:///{tmp_path}/c.db", "SCORE_CATALOG_TABLE": "t"}
    config = build_config(job, env=env)
    assert (config.catalog, config.table) == (f"sqlite:///{tmp_path}/c.db", "t")
    config = build_config(job, env=env, overrides={"catalog": "https://other/api"})
    assert config.catalog == "https://other/api"


def test_every_problem_of_the_two_keys_is_reported_together(tmp_path: Path) -> None:
    job = _job(
        tmp_path,
        'table = "a..b"\ncatalog = "postgresql://scorer:pa55word@db.internal/lake"\n',
    )
    with pytest.raises(ConfigError) as excinfo:
        build_config(job, env={"SCORE_CATALOG_OUTPUT": "s3://bucket/scored/run_date={date}"})
    problems = _problems(excinfo)
    assert len(problems) == 2, problems
    (uri,) = [p for p in problems if p.startswith("catalog = ")]
    assert "postgresql://scorer:***@db.internal/lake" in uri and "pa55word" not in uri
    assert "give sqlite:///PATH" in uri and "[catalog] table of pyiceberg catalog properties" in uri
    (table,) = [p for p in problems if p.startswith("table = ")]
    assert "give <namespace>.<table> or <table>" in table
    assert str(job) in str(excinfo.value)  # where the values came from


def test_the_keys_are_for_iceberg_only() -> None:
    with pytest.raises(ConfigError) as excinfo:
        JobConfig(
            input="i",
            output="data/scored/run_date={date}",
            model="m",
            format="delta",
            catalog="sqlite:///c.db",
            table="t",
        )
    assert _problems(excinfo) == [
        f"{key} is for format = 'iceberg', and format is 'delta': set format = 'iceberg' "
        f"(--format iceberg), or leave {key} unset"
        for key in ("catalog", "table")
    ]


@pytest.mark.parametrize(
    ("catalog", "fragment"),
    [
        ("sqlite://", "names no SQLite file"),
        ("sqlite:///:memory:", "names no SQLite file"),
        ("https:///api", "names no host"),
        ("thrift://hive:9083", "is not a catalog URI"),
        ({}, "[catalog] names no catalog"),
        ({"name": ""}, "catalog.name must be the catalog's name"),
        ({"type": "rest", "uri": ["a"]}, "catalog.uri must be a string, a number or true/false"),
    ],
)
def test_a_catalog_that_names_no_catalog_is_refused(catalog: object, fragment: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        JobConfig(
            input="i",
            output="data/scored/run_date={date}",
            model="m",
            format="iceberg",
            catalog=catalog,  # type: ignore[arg-type]
        )
    assert any(fragment in p for p in _problems(excinfo)), _problems(excinfo)


def test_an_iceberg_table_on_object_storage_needs_a_catalog(tmp_path: Path) -> None:
    output = "s3://bucket/scored/run_date={date}"
    with pytest.raises(ConfigError) as excinfo:
        JobConfig(input="i", output=output, model="m", format="iceberg")
    (problem,) = _problems(excinfo)
    assert problem.startswith(f"output = {output!r} is on object storage")
    assert "set catalog (--catalog, SCORE_CATALOG_CATALOG)" in problem
    config = JobConfig(
        input="i", output=output, model="m", format="iceberg", catalog=f"sqlite:///{tmp_path}/c"
    )
    assert config.catalog == f"sqlite:///{tmp_path}/c"


def test_a_catalog_spec_names_its_catalog_without_secrets(tmp_path: Path) -> None:
    monkey = pytest.MonkeyPatch()
    monkey.chdir(tmp_path)
    try:
        sql = CatalogSpec.of("sqlite:///catalogs/c.db")
    finally:
        monkey.undo()
    assert (sql.kind, sql.name, sql.sqlite_path) == (
        "sql",
        "score_catalog",
        str(tmp_path / "catalogs" / "c.db"),
    )
    assert sql.public() == f"sqlite:///{tmp_path}/catalogs/c.db"
    rest = CatalogSpec.of("https://user:s3cret@cat.example/api?token=t0k&warehouse=w")
    assert rest.kind == "rest" and rest.sqlite_path is None
    assert rest.public() == "https://user:***@cat.example/api?token=***&warehouse=w"
    props = CatalogSpec.of(
        {"name": "glue", "type": "glue", "client.secret-access-key": "K3Y", "retries": 3}
    )
    assert props.properties == {"type": "glue", "client.secret-access-key": "K3Y", "retries": "3"}
    assert props.public() == {"name": "glue", "type": "glue", "retries": "3"}
    assert props.text() == "'glue' (type=glue, retries=3)"
    assert props.scrub("denied for K3Y") == "denied for ***"


def test_the_default_identifier_is_the_folder_in_the_default_namespace() -> None:
    assert table_identifier(None, "scored-v2") == "score_catalog.scored_v2"
    assert table_identifier("scores", "scored") == "score_catalog.scores"
    assert table_identifier("lake.ml.scores", "scored") == "lake.ml.scores"


_NAMES = st.text("abcdefghij.-_", min_size=1, max_size=12)
_SECRET_KEYS = st.sampled_from(
    [
        "credential",
        "token",
        "s3.secret-access-key",
        "client.access-key-id",
        "password",
        "X-Key",
        # pyiceberg's REST catalog sends each header.<name> property as an HTTP header
        "header.Authorization",
        "header.X-Iceberg-Access-Delegation",
        "client.session",
        "gcs.oauth2.refresh-uri",
    ]
)


@given(
    plain=st.dictionaries(_NAMES.filter(lambda k: "key" not in k), _NAMES, max_size=4),
    secret=st.dictionaries(_SECRET_KEYS, st.text("XYZ0123456789", min_size=6), min_size=1),
    password=st.text("XYZ0123456789", min_size=6, max_size=10),
)
def test_no_secret_reaches_what_is_shown(
    plain: dict[str, str], secret: dict[str, str], password: str
) -> None:
    """Whatever the properties, no value under a secret key, and no password in a URI,
    appears in the catalog's public form, its text or a scrubbed message quoting them."""
    props: dict[str, str] = {
        **{k: v for k, v in plain.items() if k != "name"},
        **{k: f"S-{v}" for k, v in secret.items()},
        "uri": f"https://scorer:P-{password}@cat.example/api",
    }
    spec = CatalogSpec.of(props)
    shown = json.dumps(spec.public()) + spec.text()
    shown += spec.scrub(f"failed with {props} and P-{password}")
    for value in [*(f"S-{v}" for v in secret.values()), f"P-{password}"]:
        assert value not in shown
    assert public_uri(props["uri"]) == "https://scorer:***@cat.example/api"


def test_a_secret_in_a_rest_uris_query_is_scrubbed_from_what_pyiceberg_quotes() -> None:
    """pyiceberg's connection errors quote the URL it called, query string included (a
    second break-it review found ``?token=...`` in a run's stderr, log and history --json)."""
    spec = CatalogSpec.of("http://127.0.0.1:9/cat?token=SEK+RET/x&password=PW9&scope=ok")
    said = "Max retries exceeded with url: /cat?token=SEK%2BRET%2Fx&password=PW9/v1/config"
    shown = json.dumps(spec.public()) + spec.text() + spec.scrub(said) + spec.scrub("SEK+RET/x")
    assert "SEK" not in shown and "PW9" not in shown
    assert "scope=ok" in spec.text()
