"""Issue 22, 9a, through the real CLI: a lock left by a host whose clock is ahead.

The lock and heartbeat files are written as a run on ``elsewhere.example`` writes them, its
heartbeat stamped ten days ahead of this host's clock. While the storage keeps seeing the
heartbeat written, the run is refused with a message naming both clocks; once the storage has
not seen it written for ``stale_lock_after_s``, the run takes the lock over (it used to wait for
the ten days to pass).
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from pathlib import Path

import pytest

from pipeline.core.errors import EXIT_OK, EXIT_RUN_FAILED
from pipeline.io.layout import HEARTBEAT_PREFIX, LOCK_NAME
from tests.integration.helpers import cli

pytestmark = pytest.mark.integration

STALE_S = 60
AHEAD_S = 10 * 86_400


def _remote_lock(out: Path, *, written_ago: float) -> None:
    """The lock of run ``remote-run`` on another host whose clock is AHEAD_S ahead, its files
    last written ``written_ago`` seconds ago by this (the storage's) clock."""
    out.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    stamp = time.time() + AHEAD_S
    lock = {
        "host": "elsewhere.example",
        "boot_id": "another-boot",
        "pid_ns": "pid:[1]",
        "pid": 4242,
        "pid_start": "1",
        "run_id": "remote-run",
        "token": token,
        "started_at": "2026-12-13T02:15:00+00:00",
        "started_ts": stamp,
        "heartbeat_ts": stamp,
    }
    beat = {"run_id": "remote-run", "token": token, "heartbeat_ts": stamp}
    files = [(out / LOCK_NAME, lock), (out / f"{HEARTBEAT_PREFIX}{token}.json", beat)]
    for path, doc in files:
        path.write_text(json.dumps(doc))
        then = time.time() - written_ago
        os.utime(path, (then, then))


def _job(tmp_path: Path, catalog: Path, bundle_dir: Path) -> Path:
    job = tmp_path / "nightly.toml"
    job.write_text(
        f'input = "{catalog}"\noutput = "{tmp_path}/out"\nmodel = "{bundle_dir}"\n'
        f'scheduler = "sync"\nstale_lock_after_s = {STALE_S}\n[monitoring]\ndrift = false\n'
    )
    return job


def test_a_live_holder_whose_clock_is_ahead_is_refused_naming_both_clocks(
    tmp_path: Path, catalog: Path, bundle_dir: Path
) -> None:
    _remote_lock(tmp_path / "out", written_ago=5)  # heartbeating, as far as the storage sees
    r = cli("run", str(_job(tmp_path, catalog, bundle_dir)))
    assert r.returncode == EXIT_RUN_FAILED, r.output
    err = " ".join(r.stderr.split())
    assert "is locked by run remote-run (pid 4242 on elsewhere.example" in err
    assert "by host elsewhere.example's clock" in err
    assert f"ahead of this host's ({socket.gethostname()}: " in err
    assert f"more than stale_lock_after_s ({STALE_S}s)" in err and "looks alive" in err
    assert "Fix the clock on elsewhere.example (NTP)" in err


def test_a_dead_holder_whose_clock_is_ahead_is_taken_over(
    tmp_path: Path, catalog: Path, bundle_dir: Path
) -> None:
    _remote_lock(tmp_path / "out", written_ago=2 * STALE_S)  # silent for twice the limit
    r = cli("run", str(_job(tmp_path, catalog, bundle_dir)))
    assert r.returncode == EXIT_OK, r.output
    assert r.report is not None
    reason = r.report["lock_taken_over"]["reason"]
    assert "no heartbeat from host elsewhere.example" in reason
    assert "by the storage's clock" in reason and "elsewhere.example's clock" in reason
    assert any("took over a stale lock" in w for w in r.report["warnings"])
    assert r.report["rows_out"] + r.report["rows_rejected"] == r.report["rows_in"] > 0
