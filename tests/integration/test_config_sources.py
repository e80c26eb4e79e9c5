"""Issue 22, 9d-9f: a configuration mistake names its real source, a typo gets a guess, and a
model path that does not exist says so; real CLI processes, as a user meets them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.core.errors import EXIT_INPUT, EXIT_USAGE
from tests.integration.helpers import cli

pytestmark = pytest.mark.integration


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


@pytest.fixture
def job(tmp_path: Path, catalog: Path, bundle_dir: Path) -> Path:
    path = tmp_path / "my_job.toml"
    path.write_text(
        f'input = "{catalog}"\noutput = "{tmp_path}/out"\nmodel = "{bundle_dir}"\n'
        'scheduler = "sync"\n'
    )
    return path


@pytest.mark.slow
def test_an_environment_or_flag_mistake_is_not_reported_in_the_job_file(job: Path) -> None:
    r = cli("run", str(job), env={"SCORE_CATALOG_WORKERS": "0"})
    assert r.returncode == EXIT_USAGE, r.output
    err = _flat(r.stderr)
    assert "error: invalid configuration: workers = 0 must be an integer >= 1 (from " in err
    assert "(from SCORE_CATALOG_WORKERS)" in err and "my_job.toml" not in err

    r = cli("run", str(job), "--batch-size", "0", env={"SCORE_CATALOG_TASK_ROWS": "-5"})
    assert r.returncode == EXIT_USAGE, r.output
    err = _flat(r.stderr)
    assert 'batch_size = 0 must be an integer >= 1 or "auto" (from --batch-size)' in err
    assert "task_rows = -5 must be an integer >= 1 (from SCORE_CATALOG_TASK_ROWS)" in err
    assert "my_job.toml" not in err

    # A mistake in the file and one in the environment: each says where it is.
    job.write_text(job.read_text() + "batch_size = 0\n")
    r = cli("run", str(job), env={"SCORE_CATALOG_WORKERS": "0"})
    err = _flat(r.stderr)
    assert f'batch_size = 0 must be an integer >= 1 or "auto" (in {job})' in err
    assert "workers = 0 must be an integer >= 1 (from SCORE_CATALOG_WORKERS)" in err
    assert f"invalid configuration in {job}" not in err


def test_an_environment_variable_typo_gets_the_closest_name(job: Path) -> None:
    r = cli("run", str(job), env={"SCORE_CATALOG_BACH_SIZE": "8192"})
    assert r.returncode == EXIT_USAGE, r.output
    err = _flat(r.stderr)
    assert (
        "invalid configuration: unknown environment variable SCORE_CATALOG_BACH_SIZE; "
        "did you mean SCORE_CATALOG_BATCH_SIZE?"
    ) in err
    assert "SCORE_CATALOG_TASK_RETRIES" not in err  # not the whole list of 36 names


def test_a_model_path_that_does_not_exist_says_so(
    catalog: Path, bundle_dir: Path, tmp_path: Path
) -> None:
    typo = bundle_dir.parent / (bundle_dir.name + "x")
    r = cli("run", "--input", str(catalog), "--output", str(tmp_path / "o"), "--model", str(typo))
    assert r.returncode == EXIT_INPUT, r.output
    err = _flat(r.stderr)
    assert f"model bundle {typo} does not exist" in err and "has no model.toml" not in err
    assert f"did you mean {bundle_dir}?" in err
    # A folder that exists without model.toml keeps its own message.
    empty = tmp_path / "empty-bundle"
    empty.mkdir()
    r = cli("run", "--input", str(catalog), "--output", str(tmp_path / "o"), "--model", str(empty))
    assert r.returncode == EXIT_INPUT and f"model bundle {empty} has no model.toml" in r.stderr
    assert not (tmp_path / "o").exists()
