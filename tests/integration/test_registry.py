"""Models from an MLflow model registry, against a real ``mlflow server`` on 127.0.0.1.

``score-catalog bundle register`` logs a bundle folder as a run's artifacts and registers it as a
model version; ``run --model models:/NAME/VERSION`` and ``models:/NAME@ALIAS`` resolve it through
the server, download it into a cache keyed by the version and score it. Everything goes through the
real CLI (one run as a separate process on the embedded Dask cluster, the rest in this process to
keep the suite short) and the real server over HTTP: SQLite backend store, and artifacts proxied by
the server from a local folder. The one stand-in is the worker of another machine, which here is a
:class:`~pipeline.worker.spec.ModelSpec` whose driver-side copy is absent.
"""

from __future__ import annotations

import json
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.cli.demo import export_bundle
from pipeline.model.bundle import read_bundle
from pipeline.model.registry import MARKER, SHA_TAG
from pipeline.worker.loading import warm_worker
from pipeline.worker.spec import ModelSpec, Threads
from tests.conftest import demo_toml, make_model, reference_scores, write_shards
from tests.integration.helpers import CliResult, cli, job_args, report_path
from tests.integration.servers import MlflowServer, free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SIZES = [2500, 1700]  # two shards, 1,000-row row groups


@pytest.fixture(scope="module")
def bundle_v2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same network as ``bundle_dir`` with other weights (another seed): another SHA-256."""
    d = tmp_path_factory.mktemp("bundle_v2")
    export_bundle(make_model(seed=1), d, demo_toml(), n_in=16)
    return d


@pytest.fixture
def env(mlflow_server: MlflowServer, tmp_path: Path) -> dict[str, str]:
    """The CLI's environment: this server, and a model cache of this test's own. Drift is off:
    these runs switch models on purpose, which the drift check would rightly flag (exit 4)."""
    return {
        **mlflow_server.env,
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "SCORE_CATALOG_DRIFT": "false",
    }


@pytest.fixture
def catalog(tmp_path: Path) -> Path:
    root = tmp_path / "catalog"
    write_shards(root, SIZES, row_group_rows=1000)
    return root


def _name() -> str:
    return f"ranker-{uuid.uuid4().hex[:8]}"


def _sha(bundle: Path) -> str:
    return read_bundle(str(bundle))[2]


def register(env: dict[str, str], bundle: Path, name: str, alias: str | None = None) -> str:
    """``score-catalog bundle register``; the pinned URI it printed."""
    extra = ["--alias", alias] if alias else []
    r = cli("bundle", "register", str(bundle), "--name", name, *extra, env=env, in_process=True)
    assert r.returncode == 0, r.output
    m = re.search(r"^registered (models:/\S+)", r.stdout, re.M)
    assert m, r.stdout
    return m.group(1)


def score(env: dict[str, str], catalog: Path, out: Path, model: str, *extra: str) -> CliResult:
    return cli(
        "run",
        *job_args(catalog, out, model, "--scheduler", "sync", "--batch-size", "512", *extra),
        env=env,
        in_process=True,
    )


def _outputs(out: Path) -> pa.Table:
    return pa.concat_tables(pq.read_table(out / f"part-{k:05d}.parquet") for k in range(len(SIZES)))


def _inputs(catalog: Path) -> pa.Table:
    return pa.concat_tables(
        pq.read_table(catalog / f"part-{k:05d}.parquet") for k in range(len(SIZES))
    )


def assert_scored_by(out: Path, catalog: Path, bundle: Path, version: str) -> None:
    """Every input row once, in order, scored by ``bundle``, its model_version ``version``."""
    got, inp = _outputs(out), _inputs(catalog)
    assert got.column("item_id").to_pylist() == inp.column("item_id").to_pylist()
    score_ref, label_ref = reference_scores(bundle, inp)
    np.testing.assert_allclose(got.column("score").to_numpy(), score_ref, atol=1e-6)
    assert (got.column("label").to_numpy() == label_ref).all()
    assert set(got.column("model_version").to_pylist()) == {version}


def _registry(r: CliResult) -> dict[str, Any]:
    assert r.report is not None, r.output
    reg = r.report["model"]["registry"]
    assert isinstance(reg, dict)
    return reg


# --------------------------------------------------------------------------- scoring


def test_a_registered_version_is_scored_by_its_number(
    mlflow_server: MlflowServer, bundle_dir: Path, catalog: Path, tmp_path: Path, env: Any
) -> None:
    name = _name()
    pinned = register(env, bundle_dir, name)
    assert pinned == f"models:/{name}/1"
    mv = mlflow_server.client().get_model_version(name, "1")
    assert mv.tags[SHA_TAG] == _sha(bundle_dir)  # the registry records what was registered

    # A separate process on the default embedded Dask cluster (the workers get the spec), with
    # JSON logs: MLflow's own log lines and warnings must come out as JSON too.
    out = tmp_path / "out"
    args = job_args(catalog, out, pinned, "--workers", "2", "--log-format", "json")
    r = cli("run", *args, env=env)
    assert r.returncode == 0, r.output
    events = [json.loads(line) for line in r.stderr.splitlines()]  # every line one JSON object
    assert any(pinned in e["message"] for e in events)
    assert json.loads(r.stdout)["event"] == "summary"
    assert r.report is not None
    assert r.report["shards_scored"] == len(SIZES)
    model = r.report["model"]
    assert model["uri"] == pinned
    assert model["sha256"] == _sha(bundle_dir)
    cache = tmp_path / "cache" / "score-catalog" / "models"
    reg = model["registry"]
    assert reg == {
        "uri": pinned,
        "name": name,
        "version": "1",
        "alias": None,
        "run_id": mv.run_id,
        "path": reg["path"],
    }
    assert Path(reg["path"]).is_relative_to(cache)
    assert _sha(Path(reg["path"])) == _sha(bundle_dir)
    assert r.report["settings"]["model_version"] == pinned
    assert_scored_by(out, catalog, bundle_dir, pinned)
    footer = pq.read_metadata(out / "part-00000.parquet").metadata
    assert footer[b"score_catalog.model_sha256"].decode() == _sha(bundle_dir)


def test_an_alias_is_followed_and_moving_it_rescores_every_shard(
    bundle_dir: Path, bundle_v2: Path, catalog: Path, tmp_path: Path, env: Any
) -> None:
    name = _name()
    out = tmp_path / "out"
    alias_uri = f"models:/{name}@champion"
    assert register(env, bundle_dir, name, alias="champion") == f"models:/{name}/1"

    first = score(env, catalog, out, alias_uri)
    assert first.returncode == 0, first.output
    assert first.report is not None and first.report["shards_scored"] == len(SIZES)
    reg = _registry(first)
    assert (reg["uri"], reg["version"], reg["alias"]) == (alias_uri, "1", "champion")
    assert_scored_by(out, catalog, bundle_dir, f"models:/{name}/1")
    marker = Path(reg["path"]).parent / MARKER
    downloaded = marker.stat().st_mtime_ns

    again = score(env, catalog, out, alias_uri)  # the alias has not moved: nothing to do
    assert again.returncode == 0, again.output
    assert again.report is not None and again.report["shards_skipped"] == len(SIZES)
    assert marker.stat().st_mtime_ns == downloaded  # the cached copy was reused
    assert "downloaded" not in again.stderr

    # The alias moves to a version with other weights: every shard is scored again by it.
    assert register(env, bundle_v2, name, alias="champion") == f"models:/{name}/2"
    moved = score(env, catalog, out, alias_uri)
    assert moved.returncode == 0, moved.output
    assert moved.report is not None
    assert (moved.report["shards_scored"], moved.report["shards_skipped"]) == (len(SIZES), 0)
    assert _registry(moved)["version"] == "2"
    assert moved.report["model"]["sha256"] == _sha(bundle_v2)
    assert_scored_by(out, catalog, bundle_v2, f"models:/{name}/2")

    # Even to a version holding the same bytes: every row's model_version changes.
    assert register(env, bundle_v2, name, alias="champion") == f"models:/{name}/3"
    same = score(env, catalog, out, alias_uri)
    assert same.returncode == 0, same.output
    assert same.report is not None
    assert same.report["model"]["sha256"] == moved.report["model"]["sha256"]
    assert (same.report["shards_scored"], same.report["shards_skipped"]) == (len(SIZES), 0)
    assert_scored_by(out, catalog, bundle_v2, f"models:/{name}/3")

    # `plan` resolves the alias the same way: it names the version and would skip every shard.
    plan = cli("plan", *job_args(catalog, out, alias_uri), "--json", env=env, in_process=True)
    assert plan.returncode == 0, plan.output
    planned = json.loads(plan.stdout)
    assert planned["model"]["registry"]["version"] == "3"
    assert planned["shards_skipped"] == len(SIZES)


def test_a_damaged_cached_copy_is_downloaded_again(
    bundle_dir: Path, catalog: Path, tmp_path: Path, env: Any
) -> None:
    pinned = register(env, bundle_dir, _name())
    out = tmp_path / "out"
    first = score(env, catalog, out, pinned)
    assert first.returncode == 0, first.output
    weights = Path(_registry(first)["path"]) / "model.pt2"
    weights.write_bytes(weights.read_bytes()[:1000])  # a copy cut short (a full disk, a kill)

    second = score(env, catalog, out, pinned)
    assert second.returncode == 0, second.output
    assert "incomplete or stale" in second.stderr
    assert weights.read_bytes() == (bundle_dir / "model.pt2").read_bytes()
    assert second.report is not None and second.report["shards_skipped"] == len(SIZES)


def test_a_worker_that_does_not_see_the_drivers_copy_downloads_the_pinned_version(
    mlflow_server: MlflowServer,
    bundle_dir: Path,
    tmp_path: Path,
    env: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker of a cluster on other machines: the spec names the driver's cache folder,
    which does not exist there, and the pinned version it can download itself."""
    pinned = register(env, bundle_dir, _name())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "worker-cache"))
    model = ModelSpec(
        str(tmp_path / "driver-cache" / "bundle"),  # not on this "machine"
        _sha(bundle_dir),
        "cpu",
        widths=(16,),
        registry_uri=pinned,
        tracking_uri=mlflow_server.tracking_uri,
    )
    warm_worker(model, Threads(torch=1), 64)  # raises unless it found the run's SHA-256
    copies = list((tmp_path / "worker-cache").rglob("model.pt2"))
    assert len(copies) == 1
    assert copies[0].read_bytes() == (bundle_dir / "model.pt2").read_bytes()


def test_backfill_scores_every_day_with_one_version_and_reruns_days_when_it_moves(
    bundle_dir: Path, tmp_path: Path, env: Any
) -> None:
    name = _name()
    days = ["2025-01-01", "2025-01-02"]
    for k, day in enumerate(days):
        write_shards(tmp_path / "archive" / f"dt={day}", [600, 400], start=10_000 * k, seed=k)
    job = tmp_path / "rescore.toml"
    job.write_text(
        f'input = "{tmp_path}/archive/dt={{date}}"\n'
        f'output = "{tmp_path}/scored/dt={{date}}"\n'
        f'model = "models:/{name}@champion"\n'
        'scheduler = "sync"\nbatch_size = 512\n'
        "[monitoring]\ndrift = false\n"
    )
    args = ["backfill", str(job), "--from", days[0], "--to", days[-1]]
    register(env, bundle_dir, name, alias="champion")

    def backfill() -> dict[str, Any]:
        r = cli(*args, env=env, in_process=True)
        assert r.returncode == 0, r.output
        area = tmp_path / "_score_catalog" / "scored"  # beside the template's fixed part
        path = area / "_backfills" / "rescore" / f"{days[0]}_{days[-1]}.json"
        summary: dict[str, Any] = json.loads(path.read_text())
        return summary

    def day_report(day: str) -> dict[str, Any]:
        path = report_path(tmp_path / "scored" / f"dt={day}")
        data: dict[str, Any] = json.loads(path.read_text())
        return data

    assert backfill()["partitions_by_status"] == {"succeeded": 2}
    for day in days:  # the alias resolved once, each day pinned to that version
        assert day_report(day)["model"]["registry"]["uri"] == f"models:/{name}/1"
    assert backfill()["partitions_by_status"] == {"skipped": 2}

    register(env, bundle_dir, name, alias="champion")  # the same bytes as version 2
    assert backfill()["partitions_by_status"] == {"succeeded": 2}
    for day in days:
        assert day_report(day)["shards_scored"] == 2
        assert day_report(day)["settings"]["model_version"] == f"models:/{name}/2"


# --------------------------------------------------------------------------- errors


def test_an_unknown_model_version_or_alias_is_exit_3_naming_what_exists(
    bundle_dir: Path, catalog: Path, tmp_path: Path, env: Any
) -> None:
    name = _name()
    register(env, bundle_dir, name, alias="champion")
    cases = {
        "models:/no-such-model/1": "there is no registered model named 'no-such-model'",
        f"models:/{name}/9": f"registered model '{name}' has no version 9 (versions: 1; "
        "aliases: champion -> 1)",
        f"models:/{name}@retired": f"registered model '{name}' has no alias 'retired'",
    }
    for uri, says in cases.items():
        out = tmp_path / "out"
        r = score(env, catalog, out, uri)
        assert r.returncode == 3, r.output
        assert says in r.stderr
        assert not out.exists()  # refused before anything was written


def test_an_unreachable_tracking_server_fails_in_bounded_time_with_exit_1(
    catalog: Path, tmp_path: Path
) -> None:
    server = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = {"MLFLOW_TRACKING_URI": server, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    t0 = time.monotonic()
    r = cli("run", *job_args(catalog, tmp_path / "out", "models:/m@champion"), env=env)
    took = time.monotonic() - t0
    assert r.returncode == 1, r.output
    assert f"the MLflow tracking server {server} (MLFLOW_TRACKING_URI) did not answer" in r.stderr
    assert "Connection refused" in r.stderr
    assert took < 60, f"took {took:.0f}s"  # MLflow's own retries alone take about 4 minutes
    assert not (tmp_path / "out").exists()


def test_configuration_problems_are_exit_2(
    catalog: Path, tmp_path: Path, env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    for uri in ("models:/ranker/latest", "models:/ranker", "models:/"):
        r = score(env, catalog, out, uri)
        assert r.returncode == 2, r.output
        assert "models:/NAME/VERSION" in r.stderr and "models:/NAME@ALIAS" in r.stderr

    no_server = {**env, "MLFLOW_TRACKING_URI": ""}
    r = score(no_server, catalog, out, "models:/ranker/1")
    assert r.returncode == 2, r.output
    assert "MLFLOW_TRACKING_URI is not set" in r.stderr

    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if MLflow were not installed
    r = score(env, catalog, out, "models:/ranker/1")
    assert r.returncode == 2, r.output
    assert "pip install 'score-catalog[mlflow]'" in r.stderr
    assert not out.exists()


def test_register_refuses_a_bundle_that_does_not_load(
    mlflow_server: MlflowServer, bundle_dir: Path, tmp_path: Path, env: Any
) -> None:
    import torch

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.toml").write_text((bundle_dir / "model.toml").read_text())
    torch.save(make_model().state_dict(), bad / "model.pt2")  # a pickle, never loaded
    name = _name()
    r = cli("bundle", "register", str(bad), "--name", name, env=env, in_process=True)
    assert r.returncode == 3, r.output
    assert "refusing to register" in r.stderr and "pickled" in r.stderr
    assert mlflow_server.client().search_registered_models(f"name = '{name}'") == []

    no_server = {**env, "MLFLOW_TRACKING_URI": ""}
    r = cli("bundle", "register", str(bundle_dir), "--name", name, env=no_server, in_process=True)
    assert r.returncode == 2, r.output
    assert "MLFLOW_TRACKING_URI" in r.stderr
