"""Fixtures shared by the integration tests: real servers on 127.0.0.1, started per session,
module or test, and stopped by PID (the machinery is in :mod:`tests.integration.servers`).

- ``moto_server`` (session): a running ``moto.server``; yields a :class:`MotoServer`.
- ``s3_bucket`` (function): a fresh bucket on it, with the process environment cleaned of the
  machine's AWS settings; yields an :class:`S3Bucket`.
- ``dask_cluster`` (module): ``dask scheduler`` + 2 ``dask worker`` processes; yields a
  :class:`DaskCluster`.
- ``fresh_dask_cluster`` (function): the same, for a test that kills a worker.
- ``mlflow_server`` (module): ``mlflow server`` with a SQLite store and a local artifact folder;
  yields a :class:`MlflowServer`.
- ``pauses`` (function): makes :class:`tests.integration.helpers.Pause` fault points (a run
  held at a named step until the test releases it) and releases them all when the test ends.

The CLI itself is run with :func:`tests.integration.helpers.cli` (a plain function: pytest asks
that conftest modules are not imported by tests).
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.integration.helpers import Pause
from tests.integration.servers import (
    DaskCluster,
    MlflowServer,
    MotoServer,
    S3Bucket,
    aws_overrides,
    start_dask_cluster,
    start_mlflow_server,
    start_moto_server,
)


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """One moto S3 server for the whole session (buckets keep tests apart)."""
    with start_moto_server(tmp_path_factory.mktemp("moto") / "moto.log") as server:
        yield server


@pytest.fixture
def s3_bucket(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> S3Bucket:
    """A new, empty bucket; this process's environment (and so the CLI's) has no real AWS setup."""
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    for k, v in aws_overrides().items():
        monkeypatch.setenv(k, v)
    name = f"test-{uuid.uuid4().hex[:12]}"
    moto_server.client().create_bucket(Bucket=name)
    bucket = S3Bucket(name, moto_server.endpoint)
    bucket.fs = bucket.new_fs()
    return bucket


@pytest.fixture(scope="module")
def dask_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaskCluster]:
    """A scheduler and two single-threaded workers, shared by one test module."""
    with start_dask_cluster(tmp_path_factory.mktemp("dask-logs")) as cluster:
        yield cluster


@pytest.fixture
def fresh_dask_cluster(tmp_path: Path) -> Iterator[DaskCluster]:
    """A cluster of its own, for a test that kills one of its workers."""
    with start_dask_cluster(tmp_path / "dask-logs") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """One MLflow tracking server per test module (registered model names keep tests apart)."""
    with start_mlflow_server(tmp_path_factory.mktemp("mlflow")) as server:
        yield server


@pytest.fixture
def pauses(tmp_path: Path) -> Iterator[Callable[..., Pause]]:
    """``pauses(point, n=1)``: a :class:`Pause` at ``point`` with its marker in ``tmp_path``.
    Every pause made is released when the test ends, so that a failed test leaves no process
    held until the pause's own timeout."""
    made: list[Pause] = []

    def make(point: str, n: int = 1) -> Pause:
        pause = Pause(point, tmp_path / f"paused-{len(made)}-{point}", n)
        made.append(pause)
        return pause

    try:
        yield make
    finally:
        for pause in made:
            pause.release()


class _Recorder(BaseHTTPRequestHandler):
    def do_PUT(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        server: Any = self.server
        server.requests.append((self.path, self.rfile.read(length)))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
        pass


@pytest.fixture
def gateway() -> Iterator[Any]:
    """A real HTTP server standing in for a Pushgateway: records every PUT."""
    server: Any = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    server.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
