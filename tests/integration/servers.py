"""Real servers for the integration tests: an S3-compatible server (moto), a Dask cluster and an
MLflow tracking server with its model registry.

Every server is a real process started on 127.0.0.1 on a free port and stopped by its PID when
its ``with`` block ends (SIGTERM, then SIGKILL after a timeout). Nothing is mocked: the CLI under
test talks to them over TCP exactly as it would to S3 or to a production Dask scheduler. The
fixtures that hand them to tests (``moto_server``, ``s3_bucket``, ``dask_cluster``,
``fresh_dask_cluster``, ``mlflow_server``) are in this folder's ``conftest.py``.

The helper functions ``install_load_counter``, ``load_count``, ``reuses_cached_model``,
``executed_count`` and ``set_env`` run *inside* the Dask workers through ``Client.run``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
REGION = "us-east-1"
DUMMY_KEY = "testing"
DUMMY_SECRET = "testing"
MMAP_THRESHOLD = "67108864"  # docs/tuning.md: start the workers of your own cluster with it


# --------------------------------------------------------------------------- processes


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process(proc: subprocess.Popen[Any], timeout: float = 10.0) -> None:
    """Stop ``proc`` by its PID: SIGTERM, then SIGKILL if it is still there after ``timeout``."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def kill_pid(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to ``pid`` if it still exists."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie, which still answers kill(0), is not)."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def _wait_until(
    ready: Callable[[], bool], *, timeout: float, what: str, proc: subprocess.Popen[Any]
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it was ready")
        if ready():
            return
        time.sleep(0.1)
    raise RuntimeError(f"{what} was not ready after {timeout:.0f}s")


def aws_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: os.environ) without the machine's AWS settings, plus dummy ones.

    Drops every ``AWS_*`` variable (profiles, CA bundles, real keys) and points the config and
    credentials files at nothing, so only what a test passes explicitly reaches botocore.
    """
    env = {k: v for k, v in (os.environ if base is None else base).items()}
    for k in [k for k in env if k.startswith("AWS_")]:
        del env[k]
    env.update(aws_overrides())
    return env


def aws_overrides() -> dict[str, str]:
    return {
        "AWS_ACCESS_KEY_ID": DUMMY_KEY,
        "AWS_SECRET_ACCESS_KEY": DUMMY_SECRET,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }


# --------------------------------------------------------------------------- S3 (moto)


@dataclass
class MotoServer:
    endpoint: str
    proc: subprocess.Popen[str]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=DUMMY_KEY,
            aws_secret_access_key=DUMMY_SECRET,
            region_name=REGION,
        )


def _answers_http(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            r.read()
        return True
    except urllib.error.HTTPError:
        return True  # it answered, if only with an error status
    except OSError:
        return False


@contextlib.contextmanager
def start_moto_server(log: Path, timeout: float = 30.0) -> Iterator[MotoServer]:
    """``python -m moto.server`` on 127.0.0.1 and a free port, until the block ends.

    Its request log goes to ``log``.
    """
    port = free_port()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            env=aws_env(),
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
        )
    try:
        endpoint = f"http://127.0.0.1:{port}"
        _wait_until(
            lambda: _answers_http(f"{endpoint}/moto-api/"),
            timeout=timeout,
            what=f"moto server (log: {log})",
            proc=proc,
        )
        yield MotoServer(endpoint, proc)
    finally:
        stop_process(proc)


@dataclass
class S3Bucket:
    """A fresh bucket on the moto server and everything a test needs to use it."""

    name: str
    endpoint: str
    key: str = DUMMY_KEY
    secret: str = DUMMY_SECRET
    fs: Any = field(default=None, repr=False)

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options for this server, as the job's ``[storage]`` table holds them."""
        return {
            "endpoint_url": self.endpoint,
            "key": self.key,
            "secret": self.secret,
            "client_kwargs": {"region_name": REGION},
        }

    def uri(self, path: str = "") -> str:
        return f"s3://{self.name}/{path.lstrip('/')}"

    def new_fs(self, **options: Any) -> Any:
        """A new s3fs filesystem with no instance or listing cache (sees every change at once)."""
        import s3fs

        opts = {**self.storage_options, **options}
        return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **opts)

    def upload_tree(self, local: Path, prefix: str) -> list[str]:
        """Upload every file below ``local`` to ``s3://bucket/prefix/`` (same relative paths)."""
        keys = []
        for p in sorted(local.rglob("*")):
            if p.is_file():
                key = f"{self.name}/{prefix.strip('/')}/{p.relative_to(local).as_posix()}"
                self.fs.put_file(str(p), key)
                keys.append(key)
        return keys

    def write_job(self, path: Path, storage: Mapping[str, Any] | None = None, **keys: Any) -> Path:
        """A TOML job file with ``keys`` at the top and a ``[storage]`` table (this server's)."""
        path.write_text(toml_job(keys, self.storage_options if storage is None else storage))
        return path


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML for {v!r}")


def toml_job(keys: Mapping[str, Any], storage: Mapping[str, Any]) -> str:
    """Top-level ``keys``, then ``[storage]`` (nested mappings become ``[storage.NAME]``)."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in keys.items()]
    flat = {k: v for k, v in storage.items() if not isinstance(v, Mapping)}
    nested = {k: v for k, v in storage.items() if isinstance(v, Mapping)}
    lines.append("[storage]")
    lines += [f"{k} = {_toml_value(v)}" for k, v in flat.items()]
    for name, table in nested.items():
        lines.append(f"[storage.{name}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- MLflow


@dataclass
class MlflowServer:
    """A real ``mlflow server``: SQLite backend store, artifacts in a local folder it serves."""

    tracking_uri: str
    proc: subprocess.Popen[str]
    root: Path  # its database, artifact folder and log

    @property
    def env(self) -> dict[str, str]:
        """What a CLI process needs to use this server."""
        return {"MLFLOW_TRACKING_URI": self.tracking_uri}

    def client(self) -> Any:
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)

    def log_text(self) -> str:
        return (self.root / "server.log").read_text(errors="replace")[-4000:]


def stop_process_tree(proc: subprocess.Popen[Any], timeout: float = 10.0) -> None:
    """Stop ``proc`` and the processes it started, each by its PID (SIGTERM, then SIGKILL)."""
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    stop_process(proc, timeout)
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=timeout)
    for child in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


def _mlflow_server_bin() -> str:
    """The ``mlflow`` executable with the server in it.

    ``make test`` builds it in its own venv (``MLFLOW_SERVER_BIN``): the full package pins pyarrow
    below the version this project is tested with. Else the repository's ``.venv-mlflow``, else
    this venv's.
    """
    if os.environ.get("MLFLOW_SERVER_BIN"):
        return os.environ["MLFLOW_SERVER_BIN"]
    side = REPO / ".venv-mlflow" / "bin" / "mlflow"
    return str(side if side.exists() else BIN / "mlflow")


@contextlib.contextmanager
def start_mlflow_server(root: Path, timeout: float = 120.0) -> Iterator[MlflowServer]:
    """``mlflow server`` on 127.0.0.1 and a free port, one web worker, until the block ends.

    Artifacts are proxied (``--artifacts-destination``): clients upload and download through
    the server over HTTP, as they would with a remote server, never through the folder itself.
    """
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # no background job workers
    args = [
        _mlflow_server_bin(),
        "server",
        "--backend-store-uri",
        f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination",
        str(root / "artifacts"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    with (root / "server.log").open("w") as sink:
        proc = subprocess.Popen(
            args, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True, cwd=root
        )
    try:
        uri = f"http://127.0.0.1:{port}"
        _wait_until(
            lambda: _answers_http(f"{uri}/health"),
            timeout=timeout,
            what=f"mlflow server (log: {root / 'server.log'})",
            proc=proc,
        )
        yield MlflowServer(uri, proc, root)
    finally:
        stop_process_tree(proc)


# --------------------------------------------------------------------------- Dask


@dataclass
class DaskCluster:
    """A real ``dask scheduler`` and ``dask worker`` processes (each a nanny and its worker)."""

    address: str
    scheduler: subprocess.Popen[str]
    nannies: dict[str, subprocess.Popen[str]]  # worker name -> the `dask worker` process
    logs: Path
    # At start: worker address -> {name, pid (the worker process), nanny (its parent's pid)}.
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)

    def client(self, **kwargs: Any) -> Any:
        from distributed import Client

        return Client(self.address, timeout="30s", **kwargs)  # type: ignore[no-untyped-call]

    def worker_pids(self) -> dict[str, dict[str, Any]]:
        """worker address -> {name, pid (the worker process), nanny (its parent)}."""
        with self.client() as c:
            pids = c.run(os.getpid)
            parents = c.run(os.getppid)
            names = {a: w["name"] for a, w in c.scheduler_info(n_workers=-1)["workers"].items()}
        return {a: {"name": names[a], "pid": pids[a], "nanny": parents[a]} for a in pids}

    def kill_worker(self, info: Mapping[str, Any]) -> None:
        """The machine dies: SIGKILL the nanny (so nothing restarts the worker) and the worker."""
        kill_pid(int(info["nanny"]))
        kill_pid(int(info["pid"]))

    def log_text(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}"
            for p in sorted(self.logs.glob("*.log"))
        )


def _dask_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCORE_CATALOG_")}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    )
    env["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
    return env


@contextlib.contextmanager
def start_dask_cluster(
    logs: Path, n_workers: int = 2, *, pin_cores: bool = True, timeout: float = 60.0
) -> Iterator[DaskCluster]:
    """``dask scheduler`` + ``n_workers`` single-threaded ``dask worker`` processes.

    With ``pin_cores`` each worker (nanny and worker process) is pinned to one core, as if each
    were a separate one-core machine; torch in the worker then uses one thread, as docs/tuning.md's
    rule workers x threads x torch threads <= cores asks.
    """
    logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    env = _dask_env()
    procs: list[subprocess.Popen[str]] = []

    def spawn(name: str, args: list[str], cores: set[int] | None = None) -> subprocess.Popen[str]:
        log = (logs / f"{name}.log").open("w")
        try:
            p = subprocess.Popen(
                [str(BIN / "dask"), *args],
                env=env,
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
            )
        finally:
            log.close()
        procs.append(p)
        return p

    try:
        sched = spawn(
            "scheduler", ["scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"]
        )
        ncpu = len(os.sched_getaffinity(0))
        nannies = {}
        for i in range(n_workers):
            name = f"w{i + 1}"
            nannies[name] = spawn(
                name,
                [
                    "worker",
                    address,
                    "--nthreads",
                    "1",
                    "--nworkers",
                    "1",
                    "--no-dashboard",
                    "--host",
                    "127.0.0.1",
                    "--name",
                    name,
                ],
                cores={sorted(os.sched_getaffinity(0))[i % ncpu]} if pin_cores else None,
            )
        cluster = DaskCluster(address, sched, nannies, logs)
        try:
            with cluster.client() as c:
                c.wait_for_workers(n_workers, timeout=timeout)
        except Exception as e:
            dead = {n: p.returncode for n, p in {"scheduler": sched, **nannies}.items() if p.poll()}
            raise RuntimeError(
                f"Dask cluster at {address} did not get {n_workers} workers ({e}); "
                f"exited: {dead}\n{cluster.log_text()}"
            ) from e
        cluster.workers = cluster.worker_pids()
        yield cluster
    finally:
        # Workers first (their nannies stop their worker processes), then the scheduler.
        for p in reversed(procs):
            stop_process(p)


# --------------------------------------------------------------------------- run inside workers

_LOADS: list[str] = []


class _LoadCounter(logging.Handler):
    """Counts pipeline.model.program's "loaded model" records: one per bundle actually
    deserialized."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("loaded model"):
            _LOADS.append(record.getMessage())


def install_load_counter() -> int:
    """In a worker: start counting model loads from now on (idempotent); returns the pid."""
    log = logging.getLogger("pipeline.model.program")
    if not any(isinstance(h, _LoadCounter) for h in log.handlers):
        log.addHandler(_LoadCounter(level=logging.INFO))
    log.setLevel(logging.INFO)
    _LOADS.clear()
    return os.getpid()


def load_count() -> list[str]:
    """In a worker: the model loads counted since :func:`install_load_counter`."""
    return list(_LOADS)


def reuses_cached_model(uri: str, device: str, sha256: str, width: int) -> bool:
    """In a worker: whether asking for this bundle again is served from pipeline.model.program's
    cache.

    Through the public ``load_model`` only: a load that is not a cache hit logs "loaded model",
    which :func:`install_load_counter` counts.
    """
    from pipeline.model.program import load_model

    before = len(_LOADS)
    load_model(uri, device, widths=(width,), expected_sha256=sha256)
    return len(_LOADS) == before


def executed_count(dask_worker: Any) -> int:
    """In a worker: how many tasks this worker has executed since it started."""
    return int(dask_worker.state.executed_count)


def set_env(values: Mapping[str, str | None]) -> int:
    """In a worker: set (or, for None, remove) environment variables; returns the pid. How a
    test gives a tcp:// cluster's workers a fault point (``pipeline.core.faults`` reads the
    environment again when it changes): they are not the CLI's children."""
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    return os.getpid()
