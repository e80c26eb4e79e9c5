"""Where the run's threads go, and the Dask cluster it scores on.

The thread plan splits the cores so that workers x threads per worker x torch threads never
exceeds them; :class:`DaskSession` starts (or connects to) the cluster in the background while
the driver plans, and warms each worker with the model before its first task.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from pipeline.core import hugepages, runcontext
from pipeline.core.errors import ClusterError, PipelineError
from pipeline.worker.loading import warm_worker
from pipeline.worker.spec import ModelSpec, Threads

if TYPE_CHECKING:
    from pipeline.core.config import JobConfig

logger = logging.getLogger(__name__)

START_METHOD = os.environ.get("_SCORE_CATALOG_START_METHOD", "fork")
# How long a scheduler address may take to accept a TCP connection before the run gives up on
# it; Dask's own handshake then has SCHEDULER_TIMEOUT.
CONNECT_TIMEOUT_S = 10.0
SCHEDULER_TIMEOUT = "30s"
MMAP_THRESHOLD = 64 * 1024 * 1024


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Plan:
    """Where each worker's threads go: workers x threads per worker x torch threads <= cores."""

    scheduler: str
    workers: int | None  # None for an external cluster (its own size)
    threads_per_worker: int | None
    torch_threads: int | None  # None: each task derives it from its worker
    cores: int = 1
    overlap: bool = True  # read-ahead and write-behind threads in each scoring loop

    def public(self) -> dict[str, Any]:
        """The ``threads`` section of ``_report.json`` and of the plan."""
        return {
            "scheduler": self.scheduler,
            "cores": self.cores,
            "workers": self.workers,
            "threads_per_worker": self.threads_per_worker,
            "torch_threads": self.torch_threads,
        }


def thread_plan(config: JobConfig, pending: int, device_type: str = "cpu") -> Plan:
    """Split the cores: workers x threads per worker x torch threads <= cores, and decide the
    overlap threads (:func:`overlap_rule`) for a run on ``device_type`` (docs/tuning.md)."""
    cores = config.cores or available_cores()
    if config.scheduler == "sync":
        plan = Plan("sync", 1, 1, cores, cores)
    elif config.scheduler == "threads":
        w = max(1, min(config.workers or cores, cores, max(pending, 1)))
        plan = Plan("threads", 1, w, max(1, cores // w), cores)
    elif config.scheduler == "local":
        w = max(1, min(config.workers or cores, max(pending, 1)))
        plan = Plan("local", w, 1, max(1, cores // w), cores)
    else:
        plan = Plan(config.scheduler, None, None, None, cores)
    overlap = overlap_rule(plan, device_type) if config.overlap == "auto" else config.overlap
    return dataclasses.replace(plan, overlap=overlap)


def overlap_rule(plan: Plan, device_type: str) -> bool:
    """``overlap = "auto"``: whether the read-ahead and write-behind threads run.

    Off only where every CPU core already runs a scoring loop of its own (a worker process or
    thread per core) and torch is asked for huge pages. There the threads only take turns on
    the cores with the loops: W1 on 2 cores scored 1.16x faster end to end without them (its
    scoring window 1.3x), W2 the same either way. With a core to spare they are what uses it
    (one shard, or ``--scheduler sync``, scored 1.1-1.2x faster with them): on. A GPU computes
    while they read and write, and an external cluster's cores are not known here: on.
    Without huge pages (the library, unless its caller asks), a worker without them once let
    glibc's heap grow to 1.9 GB on one 5M-row shard (pipeline.core.hugepages): on.
    """
    if device_type != "cpu" or plan.workers is None:
        return True
    loops = plan.workers * (plan.threads_per_worker or 1)
    return not (loops >= plan.cores and hugepages.asked())


def torch_threads_by_host(client: Any) -> dict[str, int]:
    """Torch threads per worker thread on each host of an existing cluster.

    Several workers often share a machine (``dask worker --nworkers 4``); each then gets the
    host's cores divided by all the worker threads on that host, never more than one busy
    thread per core (oversubscribed torch threads were 10-40x slower here).
    """
    workers = client.scheduler_info(n_workers=-1)["workers"]
    cores = client.run(available_cores)
    threads: dict[str, int] = {}
    host_cores: dict[str, int] = {}
    for address, w in workers.items():
        host = w.get("host") or urlsplit(address).hostname or ""
        threads[host] = threads.get(host, 0) + int(w.get("nthreads") or 1)
        host_cores[host] = int(cores.get(address, 1))
    return {h: max(1, host_cores[h] // max(1, n)) for h, n in threads.items()}


def probe_scheduler(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Fail fast, saying why, when nothing accepts connections at a ``tcp://`` or ``tls://``
    scheduler address: Dask's client would retry a refused connection for its whole timeout
    and then report only that it timed out."""
    parts = urlsplit(address)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("tcp", "tls") or not parts.hostname or port is None:
        return
    try:
        with socket.create_connection((parts.hostname, port), timeout=timeout):
            return
    except ConnectionRefusedError:
        why = f"nothing listens on {parts.hostname}:{port} (connection refused)"
    except socket.gaierror as e:
        why = f"host {parts.hostname!r} is unknown ({e})"
    except TimeoutError:
        why = f"{parts.hostname}:{port} did not answer within {timeout:.0f} s"
    except OSError as e:
        why = f"{type(e).__name__}: {e}"
    raise ClusterError(
        f"cannot reach the Dask scheduler at {address}: {why}. Start it (`dask scheduler`) or "
        "check the address (--scheduler, or scheduler in the job file); --scheduler local runs "
        "an embedded cluster instead. Nothing was written."
    )


# The embedded scheduler's HTTP server. ``dashboard_address=None`` alone does not turn it off:
# the scheduler then still listens on its default port, 8787 on every interface it can, and
# warns "Port 8787 is already in use" when another program holds it. No dashboard, and a port
# the OS picks on the loopback interface: nothing fixed, nothing reachable from elsewhere.
NO_DASHBOARD = {"dashboard": False, "dashboard_address": "127.0.0.1:0"}


def _start_local(plan: Plan) -> tuple[Any, Any]:
    import dask
    from distributed import Client, LocalCluster

    # Dask's nanny sets MALLOC_TRIM_THRESHOLD_=65536 in its workers, which pins glibc's mmap
    # threshold at 128 KiB: every MLP activation (4 MiB at batch 4096) is then mmapped and
    # page-faulted afresh, making the forward pass 2.4x slower (15.2 vs 6.5 ms measured). A
    # fixed 64 MiB mmap threshold keeps the trimming and restores the speed (6.8 ms).
    dask.config.set(
        {
            "distributed.nanny.pre-spawn-environ.MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
            "distributed.worker.multiprocessing-method": START_METHOD,
        }
    )
    cluster = LocalCluster(  # type: ignore[no-untyped-call]  # distributed is untyped
        n_workers=plan.workers,
        threads_per_worker=1,
        processes=True,
        dashboard_address=None,
        scheduler_kwargs=NO_DASHBOARD,
        silence_logs=logging.ERROR,
    )
    client = Client(cluster)  # type: ignore[no-untyped-call]
    client.register_plugin(_ignore_sigint_plugin())
    return cluster, client


def ignore_sigint() -> None:
    """Make this process ignore SIGINT (in a worker's main thread; elsewhere a no-op).

    Ctrl-C on a terminal signals the whole process group: the driver owns the shutdown (see
    :mod:`pipeline.core.interrupt`), and workers that died of KeyboardInterrupt would only print
    tracebacks and lose the shards the driver is letting them finish. SIGTERM gets its default
    back: a forked worker inherits the driver's stop handler, which would keep the nanny from
    terminating it when the cluster closes.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # A process group of its own: GNU timeout, `kill -- -PGID` and Ctrl-C signal the whole
        # group, and a worker killed by them is restarted by its nanny and reruns the shards
        # the driver was stopping. The driver closes the cluster (and so its workers) itself.
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)


def _ignore_sigint_plugin() -> Any:
    """A worker plugin that runs :func:`ignore_sigint` in every worker, restarted ones too."""
    from distributed import WorkerPlugin

    class IgnoreSigint(WorkerPlugin):
        name = "score-catalog-ignore-sigint"

        def setup(self, worker: Any) -> None:
            ignore_sigint()

    return IgnoreSigint()


def _start_threads(plan: Plan) -> tuple[Any, Any]:
    from distributed import Client, LocalCluster

    cluster = LocalCluster(  # type: ignore[no-untyped-call]  # distributed is untyped
        n_workers=1,
        threads_per_worker=plan.threads_per_worker,
        processes=False,
        dashboard_address=None,
        scheduler_kwargs=NO_DASHBOARD,
        silence_logs=logging.ERROR,
    )
    return cluster, Client(cluster)  # type: ignore[no-untyped-call]


class DaskSession:
    """A Dask client for the run, started in a background thread as soon as the run begins.

    Worker processes take seconds to start and import torch; starting them while the driver
    lists shards, reads footers and dry-runs the model hides most of that. Each worker also
    loads the model bundle once, before the first task arrives (``warm``).
    """

    def __init__(self, plan: Plan, warm: ModelSpec | None, warm_rows: int = 2) -> None:
        self.plan = plan
        self._warm = warm  # the model each worker loads before its first task
        self._warm_rows = warm_rows  # the batch size when known (a compiled model needs it)
        self._cluster: Any = None
        self._client: Any = None
        self.threads_by_host: dict[str, int] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._start, name="dask-start", daemon=True)
        # Worker processes are forked from this one once planning is over: they inherit the
        # imported torch and the loaded model, so they start in a fraction of a second instead
        # of importing everything again (several CPU-seconds each). Forking while another
        # thread imports modules can deadlock the child, so nothing starts before then.
        if plan.scheduler != "local" or START_METHOD != "fork":
            self._thread.start()

    def _start(self) -> None:
        try:
            # distributed sets its loggers to INFO when imported; its cluster chatter is noise
            # in a nightly log unless debugging. So: import it first, then configure.
            import distributed  # noqa: F401

            runcontext.configure_dask_logging(debug=logger.isEnabledFor(logging.DEBUG))
            plan = self.plan
            if plan.scheduler == "local":
                self._cluster, self._client = _start_local(plan)
            elif plan.scheduler == "threads":
                self._cluster, self._client = _start_threads(plan)
            else:
                from distributed import Client

                probe_scheduler(plan.scheduler)
                self._client = Client(plan.scheduler, timeout=SCHEDULER_TIMEOUT)  # type: ignore[no-untyped-call]
                self.threads_by_host = torch_threads_by_host(self._client)
            if self._warm is not None and plan.scheduler != "threads":
                self._warm_workers(self._warm)
        except BaseException as e:
            self._error = e

    def _warm_workers(self, model: ModelSpec) -> None:
        threads = Threads(self.plan.torch_threads, self.threads_by_host)
        try:
            self._client.run(warm_worker, model, threads, self._warm_rows)
        except Exception as e:  # the tasks will load (and report) it themselves
            logger.debug("preloading the model on the workers failed: %s", e)

    def client(self) -> Any:
        """The connected client; starts the cluster now if it has not started yet."""
        if not self._thread.is_alive() and self._thread.ident is None:
            self._thread.start()
        self._thread.join()
        if isinstance(self._error, PipelineError):
            raise self._error
        if self._error is not None:
            raise ClusterError(
                f"could not start or reach the Dask scheduler {self.plan.scheduler}: "
                f"{type(self._error).__name__}: {self._error}"
            ) from self._error
        return self._client

    def close(self) -> None:
        """Close the client, and the cluster if this session started it (its worker processes
        end with it). Each step is tried even if the one before failed; errors are logged.

        Dask's own loggers are silenced while an embedded cluster closes, in its workers too:
        the run is over, and workers racing the scheduler's shutdown (a last heartbeat, a
        closed comm) would otherwise leave error lines in a successful run's log.
        """
        if self._thread.ident is not None:
            self._thread.join()
        with contextlib.ExitStack() as steps:
            if self._cluster is not None:
                steps.enter_context(_dask_silenced())
                if self._client is not None:
                    _quietly(lambda: self._client.run(silence_dask), "quieting the workers")
                steps.callback(_quietly, self._cluster.close, "closing the Dask cluster")
            if self._client is not None:
                steps.callback(_quietly, self._client.close, "closing the Dask client")


def silence_dask() -> None:
    """Dask's loggers in this process to CRITICAL (a worker of a cluster that is closing)."""
    logging.getLogger("distributed").setLevel(logging.CRITICAL)


@contextlib.contextmanager
def _dask_silenced() -> Iterator[None]:
    """Dask's loggers in the driver at CRITICAL while the block runs, then as they were."""
    log = logging.getLogger("distributed")
    before = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(before)


def _quietly(step: Any, what: str) -> None:
    """Run a clean-up ``step``; an error is logged, never raised (it would hide the run's)."""
    try:
        step()
    except Exception as e:
        logger.warning("error while %s: %s", what, e)
