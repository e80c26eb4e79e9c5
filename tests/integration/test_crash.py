"""SIGKILL the real CLI at named points, rerun it, and demand exactly a clean run's output.

Each case sets ``_SCORE_CATALOG_KILL_AT=point:N``: the process SIGKILLs itself the N-th time it
reaches ``point`` (see pipeline/core/faults.py), so every case dies at a known place: mid-batch,
mid-write, between a shard's commits, while writing the manifest, between shards, before the
report, the HTML page, the run-index entry and _SUCCESS. Two more cases kill a run on the
embedded Dask cluster from outside at a random moment while it holds its lock.

The model is the TorchScript bundle: what is committed, and in which order, does not depend on
the format, and loading an exported program imports torch._dynamo (1.5 s more per process,
measured), which over the suite's 55 processes was 80 s of `make test`.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import write_shards
from tests.integration.helpers import (
    KILL_AT,
    Pause,
    cli,
    job_args,
    manifest_path,
    pause_env,
    read_tree,
    report,
    start_cli,
    temporaries,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# shard 0: 2,500 rows = 7 batches of 400; shard 1: 1,700 = 5; shard 2: 3,100 = 8 (20 in all).
# Shards 1 and 2 have rows with NaN/null features, so their rejects are committed too.
POINTS = [
    "locked:1",
    "batch-read:1",
    "batch-read:9",
    "batch-scored:3",
    "batch-scored:12",
    "batch-written:1",
    "batch-written:7",
    "batch-written:17",
    "rejects-rename:1",
    "rejects-rename:2",
    "rejects-committed:2",
    "output-rename:1",
    "output-rename:2",
    "output-rename:3",
    "output-committed:1",
    "output-committed:3",
    # The first shard's entry is saved at once and the rest by the end at the latest; saves in
    # between are spaced by time (at most 10% of the run: pipeline.io.manifest), so a third save
    # depends on how fast the shards went and is not a point every run reaches.
    "manifest-rename:1",
    "manifest-rename:2",
    "between-shards:1",
    "between-shards:2",
    "report-rename:1",
    "html-rename:1",
    "runindex-rename:1",
    "success-rename:1",
]


def _make_catalog(root: Path) -> Path:
    cat = root / "catalog"
    paths = write_shards(cat, [2500, 1700, 3100], row_group_rows=1000)
    for p, bad in ((paths[1], [17, 900]), (paths[2], [0, 3099])):
        t = pq.read_table(p)
        vals = t.column("f4").to_pylist()
        for i in bad:
            vals[i] = None if i % 2 else float("nan")
        t = t.set_column(t.schema.get_field_index("f4"), "f4", pa.array(vals, pa.float32()))
        pq.write_table(t, p, row_group_size=1000)
    return cat


def _args(cat: Path, out: Path, rejects: Path, bundle: Path, scheduler: str = "sync") -> list[str]:
    return [
        "run",
        *job_args(cat, out, bundle),
        "--rejects",
        str(rejects),
        "--passthrough",
        "category",
        "--batch-size",
        "400",
        "--scheduler",
        scheduler,
        "-q",
    ]


@pytest.fixture(scope="module")
def clean_run(
    tmp_path_factory: pytest.TempPathFactory, torchscript_bundle_dir: Path
) -> dict[str, object]:
    root = tmp_path_factory.mktemp("crash")
    cat = _make_catalog(root)
    out, rej = root / "clean", root / "clean_rejects"
    r = cli(*_args(cat, out, rej, torchscript_bundle_dir))
    assert r.returncode == 0, r.stderr
    return {
        "catalog": cat,
        "scores": read_tree(out),
        "rejects": read_tree(rej),
        "report": report(out),
    }


def _assert_same_as_clean(out: Path, rej: Path, clean: dict[str, object]) -> None:
    scores, rejects = read_tree(out), read_tree(rej)
    assert scores.keys() == clean["scores"].keys()  # type: ignore[attr-defined]
    for name, table in scores.items():
        assert table.equals(clean["scores"][name]), name  # type: ignore[index]
        ids = table.column("item_id").to_pylist()
        assert len(ids) == len(set(ids))
    assert rejects.keys() == clean["rejects"].keys()  # type: ignore[attr-defined]
    for name, table in rejects.items():
        assert table.equals(clean["rejects"][name]), name  # type: ignore[index]
    rep = report(out)
    assert rep["status"] == "succeeded_with_errors"
    assert rep["rows_out"] == 7296 and rep["rows_rejected"] == 4 and rep["rows_in"] == 7300
    assert not temporaries(out, rej)
    assert (out / "_SUCCESS").exists()
    assert not (out / "_lock.json").exists()
    json.loads(manifest_path(out).read_text())


@pytest.mark.parametrize("point", POINTS)
def test_sigkill_then_resume_equals_a_clean_run(
    point: str, clean_run: dict[str, object], torchscript_bundle_dir: Path, tmp_path: Path
) -> None:
    out, rej = tmp_path / "out", tmp_path / "rejects"
    args = _args(clean_run["catalog"], out, rej, torchscript_bundle_dir)  # type: ignore[arg-type]
    killed = cli(*args, env={KILL_AT: point})
    assert killed.returncode == -signal.SIGKILL, (
        f"the run did not reach {point}: rc={killed.returncode}\n{killed.stderr}"
    )
    assert not (out / "_SUCCESS").exists()
    if out.exists() and manifest_path(out).exists():
        json.loads(manifest_path(out).read_text())  # never torn
    resumed = cli(*args)
    assert resumed.returncode == 0, resumed.stderr
    _assert_same_as_clean(out, rej, clean_run)
    rep = report(out)
    assert rep["lock_taken_over"] is not None  # the dead run's lock was taken over
    assert rep["shards_scored"] + rep["shards_skipped"] == 3


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _lock_taken(proc: subprocess.Popen[str], locked: Pause) -> float:
    """Hold the run once it has taken its output's lock (it has claimed the output: from here
    on a kill leaves work to resume), note when (``time.perf_counter()``), let it go on. Held,
    it cannot have finished and released the lock before the test looked."""
    locked.wait(proc)
    at = time.perf_counter()
    locked.release()
    return at


@pytest.mark.parametrize("fraction", [0.3, 0.6])
def test_external_sigkill_of_a_dask_run_at_a_random_moment(
    fraction: float,
    clean_run: dict[str, object],
    torchscript_bundle_dir: Path,
    tmp_path: Path,
    pauses: Callable[..., Pause],
) -> None:
    """A kill from outside at a random moment between taking the lock and releasing it (a
    fraction of how long that took a whole run here), then a rerun equal to a clean run.

    The killed run is held once it has judged its outcome (every shard done, nothing of the
    end written: no manifest's last save, report or _SUCCESS) and never let go: a kill meant
    for later than the run has got lands there, so it always lands mid-run, however much
    faster this run goes than the one that was timed."""
    out, rej = tmp_path / "out", tmp_path / "rejects"
    args = _args(clean_run["catalog"], out, rej, torchscript_bundle_dir, "local")  # type: ignore[arg-type]
    locked = pauses("locked")
    first = start_cli(
        *args, env=pause_env(locked), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    locked_at = _lock_taken(first, locked)
    _, err = first.communicate()
    assert first.returncode == 0, err
    held = time.perf_counter() - locked_at  # how long a whole run holds its lock here
    shutil.rmtree(out)  # start again from nothing, then kill part-way
    shutil.rmtree(rej, ignore_errors=True)
    locked, judged = pauses("locked"), pauses("judged")
    proc = start_cli(
        *args, env=pause_env(locked, judged), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    _lock_taken(proc, locked)
    time.sleep(held * fraction * random.uniform(0.9, 1.1))
    family = _descendants(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for child in family:  # Dask's nanny and worker processes die with their parent's cluster
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    # Mid-run: killed while running (not after it exited), and before it released its lock.
    assert proc.returncode == -signal.SIGKILL, f"the run had ended: rc={proc.returncode}"
    assert (out / "_lock.json").exists(), "the kill landed after the run released its lock"
    resumed = cli(*args)
    assert resumed.returncode == 0, resumed.stderr
    _assert_same_as_clean(out, rej, clean_run)


def test_a_worker_killed_mid_write_leaves_no_temporary_file_after_the_run(
    torchscript_bundle_dir: Path, tmp_path: Path
) -> None:
    """A SIGKILLed worker cannot delete its staged file; Dask scores the shard again on a new
    worker, and the run deletes what the dead one left (staged names carry the run id)."""
    cat, out, rej = tmp_path / "catalog", tmp_path / "out", tmp_path / "rejects"
    write_shards(cat, [3000, 3000], row_group_rows=1000)
    args = ["run", *job_args(cat, out, torchscript_bundle_dir), "--rejects", str(rej)]
    args += ["--scheduler", "local", "--workers", "1", "--batch-size", "1000"]
    # The first worker to write a batch dies (only that one: the flag file says it happened);
    # its replacement scores the shard again.
    r = cli(*args, env={KILL_AT: f"batch-written:1:{tmp_path / 'killed'}"})
    assert r.returncode == 0, r.stderr
    assert "removed a temporary file a killed worker left" in r.stderr, r.stderr
    rep = report(out)
    assert rep["rows_out"] == 6000 and rep["shards_scored"] == 2
    assert not temporaries(out, rej)
    assert (out / "_SUCCESS").exists()
