"""The real CLI on a real Dask cluster: `dask scheduler` + 2 `dask worker` processes on 127.0.0.1.

The cluster is the kind a team runs next to its data: started from the command line, reached by
``--scheduler tcp://HOST:PORT``. Workers run from this repository's virtualenv (they import
``pipeline``) with docs/scaling.md's MALLOC_MMAP_THRESHOLD_; each is pinned to one core, as if
it were its own one-core machine.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.cli.demo import FEATURES
from tests.conftest import write_shards
from tests.integration import servers
from tests.integration.helpers import (
    CliResult,
    Pause,
    cli,
    data_files,
    job_args,
    pause_env,
    read_tree,
    report,
    start_cli,
    temporaries,
)
from tests.integration.servers import DaskCluster

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _args(catalog: Path, out: Path, bundle: Path, scheduler: str, *extra: str) -> list[str]:
    opts = ("--passthrough", "category", "--batch-size", "500", "--scheduler", scheduler)
    return ["run", *job_args(catalog, out, bundle, *opts, *extra)]


def _run(*args: str, cluster: DaskCluster | None = None) -> CliResult:
    """The CLI must succeed; its failure message carries the cluster's logs."""
    r = cli(*args, timeout=240)
    logs = f"\n--- cluster logs\n{cluster.log_text()}" if cluster is not None else ""
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout}\n{r.stderr}{logs}"
    return r


def _sorted(t: pa.Table) -> pa.Table:
    return t.sort_by("item_id")


def test_tcp_cluster_output_equals_local_cluster_output(
    dask_cluster: DaskCluster, bundle_dir: Path, tmp_path: Path
) -> None:
    catalog = tmp_path / "catalog"
    write_shards(catalog, [3000, 1200, 2600, 4100, 900, 2200], row_group_rows=700)
    a, b = tmp_path / "tcp", tmp_path / "local"
    _run(*_args(catalog, a, bundle_dir, dask_cluster.address), cluster=dask_cluster)
    _run(*_args(catalog, b, bundle_dir, "local", "--workers", "2"))

    ta, tb = read_tree(a), read_tree(b)
    assert sorted(ta) == sorted(tb) == [p.name for p in sorted(catalog.glob("*.parquet"))]
    for name in ta:
        assert _sorted(ta[name]).equals(_sorted(tb[name])), name
    ra, rb = report(a), report(b)
    assert ra["status"] == rb["status"] == "succeeded"
    assert ra["threads"]["scheduler"] == dask_cluster.address
    assert ra["rows_out"] == rb["rows_out"] == ra["rows_in"] == 14000
    assert [s["rows_out"] for s in ra["shards"]] == [s["rows_out"] for s in rb["shards"]]
    assert not temporaries(a, b)


def test_model_is_loaded_once_per_worker_not_per_task(
    dask_cluster: DaskCluster, bundle_dir: Path, tmp_path: Path
) -> None:
    # A bundle at a path no worker has seen, so its first load happens during this run.
    bundle = tmp_path / "bundle"
    shutil.copytree(bundle_dir, bundle)
    catalog = tmp_path / "catalog"
    n_shards = 12
    write_shards(catalog, [1500] * n_shards, row_group_rows=500)
    with dask_cluster.client() as c:
        c.run(servers.install_load_counter)
        executed_before = c.run(servers.executed_count)
    out = tmp_path / "out"
    _run(*_args(catalog, out, bundle, dask_cluster.address), cluster=dask_cluster)
    rep = report(out)
    with dask_cluster.client() as c:
        loads = c.run(servers.load_count)
        executed = {a: n - executed_before[a] for a, n in c.run(servers.executed_count).items()}
        # Asked again for the bundle the run used, each worker answers from its cache.
        cached = c.run(
            servers.reuses_cached_model,
            str(bundle),
            rep["device"],
            rep["model"]["sha256"],
            len(FEATURES),
        )

    assert len(loads) == 2, loads
    tasks = sum(executed.values())
    assert tasks > len(loads), f"the run should give each worker several tasks: {executed}"
    assert all(n >= 1 for n in executed.values()), executed
    for addr, records in loads.items():
        assert len(records) == 1, (
            f"worker {addr} ran {executed[addr]} tasks and loaded the model {len(records)} "
            f"times: {records}"
        )
        assert cached[addr], f"worker {addr} does not cache {bundle}"
    assert rep["rows_out"] == 1500 * n_shards and rep["shards_scored"] == n_shards


def test_sigkilled_worker_mid_run_loses_no_row_and_duplicates_none(
    fresh_dask_cluster: DaskCluster,
    bundle_dir: Path,
    tmp_path: Path,
    pauses: Callable[..., Pause],
) -> None:
    cluster = fresh_dask_cluster
    n_shards, rows = 24, 2000
    catalog = tmp_path / "catalog"
    write_shards(catalog, [rows] * n_shards, row_group_rows=500)
    total = n_shards * rows
    out = tmp_path / "out"
    workers = cluster.workers
    assert len(workers) == 2
    victim_addr = sorted(workers)[0]
    victim = workers[victim_addr]
    assert victim["nanny"] == cluster.nannies[victim["name"]].pid

    # Each worker is held once it has committed its first shard: the victim dies mid-run with
    # a committed shard whose task is not finished (its replacement scores it again), and
    # the other worker is there to take its tasks over.
    committed = pauses("output-committed")
    with cluster.client() as c:  # a tcp:// cluster's workers are not the CLI's children
        c.run(servers.set_env, pause_env(committed))
    args = _args(catalog, out, bundle_dir, cluster.address, "--batch-size", "500")
    proc = start_cli(*args)
    try:
        held = committed.wait(proc, count=2)
        assert victim["pid"] in held, (held, workers)
        done_at_kill = len(data_files(out))
        cluster.kill_worker(victim)
        killed_at = time.monotonic()
        committed.release()
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            servers.stop_process(proc)
    assert done_at_kill == 2  # one shard each, held: the run was far from done
    for _ in range(50):
        if not (servers.pid_alive(victim["pid"]) or servers.pid_alive(victim["nanny"])):
            break
        time.sleep(0.1)
    assert not servers.pid_alive(victim["pid"]) and not servers.pid_alive(victim["nanny"])
    assert proc.returncode == 0, (
        f"rc={proc.returncode}\n{stdout}\n{stderr}\n--- cluster logs\n{cluster.log_text()}"
    )
    with cluster.client() as c:
        alive = c.scheduler_info(n_workers=-1)["workers"]
    assert victim_addr not in alive and len(alive) == 1

    tables = read_tree(out)
    assert sorted(tables) == [p.name for p in sorted(catalog.glob("*.parquet"))]
    ids = np.concatenate([t.column("item_id").to_numpy() for t in tables.values()])
    assert len(ids) == total, f"{len(ids)} rows in the output, {total} in the input"
    assert len(np.unique(ids)) == total, "some rows are in the output twice"
    assert np.array_equal(np.sort(ids), np.arange(total))
    for name, t in tables.items():  # each shard whole and in input order
        assert t.column("item_id").equals(pq.read_table(catalog / name).column("item_id")), name
    rep = report(out)
    assert rep["status"] == "succeeded"
    assert rep["rows_in"] == rep["rows_out"] == total and rep["rows_rejected"] == 0
    assert rep["shards_scored"] == n_shards and rep["shards_failed"] == 0
    assert (out / "_SUCCESS").exists()
    print(  # shown with -s: how far the run was when the worker died
        f"killed {victim['name']} with {done_at_kill}/{n_shards} shards committed; "
        f"the run ended {proc.returncode} {time.monotonic() - killed_at:.1f}s later"
    )
