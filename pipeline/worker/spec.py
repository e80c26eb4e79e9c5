"""The worker contract: what every shard of a run is scored with, and what differs per shard.

A :class:`WorkerSpec` is sent to each worker once per run (``pipeline.driver.dispatch``), a few
small :class:`ShardTask` objects with every Dask task. The spec is a few frozen records, each
about one thing, made by one function in the driver (``pipeline.driver.workers.worker_spec``)
and never patched afterwards:

* :class:`ModelSpec`: which model, where a worker finds it, how it runs (precision, compile);
  the driver warms the workers with this record alone, before the run takes its lock;
* :class:`Threads`: torch threads per worker thread;
* :class:`Scoring`: batch size, read-ahead / write-behind depth, what an invalid row does;
* :class:`ShardIO`: the columns copied through, what each output file's footer says, storage
  options, and how the output format wants its files (``pipeline.sinks``);
* :class:`Fence`: the run lock each commit checks;
* :class:`Incremental`: fingerprints, and the baseline index rows are carried from;
* :class:`StopSignals`: the flags the driver raises on every worker when a signal stops the run,
  and the topic workers report rows on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline.io.locking import LockLostError, assert_holder
from pipeline.model.precision import ExecutionOptions
from pipeline.sinks.base import FileFacts
from pipeline.worker import events
from pipeline.worker.baseline import IndexRef


@dataclass(frozen=True)
class ModelSpec:
    """Which model a worker loads, where it finds it, and how the model runs."""

    uri: str  # the bundle folder as the driver sees it
    sha256: str  # a worker refuses a bundle whose content changed since the run started
    device: str  # cpu, cuda, cuda:N (an unindexed cuda is pinned per worker on a multi-GPU host)
    # Values per row of each model input (0: a (batch,) input); None only while warming, before
    # the data gave the width of an input that model.toml leaves open.
    widths: tuple[int, ...] | None = None
    execution: ExecutionOptions = field(default_factory=ExecutionOptions)
    storage_options: Mapping[str, Any] = field(default_factory=dict)  # to read the bundle
    # A model from a registry (pipeline.model.registry): the pinned models:/NAME/VERSION and
    # its tracking server, from which a worker on another machine, which does not see the
    # driver's downloaded copy at ``uri``, downloads the same version into its own cache.
    registry_uri: str = ""
    tracking_uri: str = ""


@dataclass(frozen=True)
class Threads:
    """Torch threads in a worker: workers x worker threads x torch threads <= cores."""

    torch: int | None = None  # None: derived from the Dask worker's thread count
    # On an existing cluster: torch threads for a worker on each host, so that all the worker
    # threads of one machine together use its cores once (see cluster.torch_threads_by_host).
    by_host: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Scoring:
    """How a shard's rows go through the model."""

    batch_size: int
    overlap_depth: int = 0  # batches read ahead / written behind in background threads
    on_invalid_rows: str = "reject"  # errors.on_invalid_rows: "reject" or "fail"
    # Rows per model call when a batch runs faster in slices on this CPU (the driver measures
    # it: pipeline.driver.autotune); None: one call per batch.
    call_rows: int | None = None


@dataclass(frozen=True)
class ShardIO:
    """What a shard's output files hold besides scores, and how they are written."""

    id_column: str
    passthrough: tuple[str, ...] = ()
    # Hash of the settings that change output rows (pipeline.driver.inspect.run_settings);
    # written with the model's SHA-256 into every output file's footer (layout.footer_metadata).
    settings_hash: str = ""
    # The output's model_version value: a registry model's pinned version (empty: the bundle's
    # own version).
    model_version: str = ""
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    # What the output format computes of each data file from its footer, in the worker (a
    # table's column statistics); None: nothing but its size.
    file_facts: FileFacts | None = None


@dataclass(frozen=True)
class Incremental:
    """An incremental night (docs/incremental.md): each output row carries its fingerprint
    (``model_input_hash``) and the files the scorer's identity in their footer; rows the
    baseline index holds with the same id and fingerprint are carried, not scored."""

    fingerprint: bool = False  # write model_input_hash (and the scorer into footers)
    scorer: str = ""  # the scorer identity's hash (pipeline.driver.inspect.scorer_identity)
    index: IndexRef | None = None  # None: every row is scored
    counted: bool = False  # incremental = true: shards count what they carried and scored


@dataclass(frozen=True)
class Fence:
    """The run lock (pipeline.io.locking): right before committing, each shard checks that run
    ``run_id`` still holds the lock of ``root`` with ``token``. Empty: no lock (tools, tests)."""

    root: str = ""
    run_id: str = ""
    token: str = ""


@dataclass(frozen=True)
class StopSignals:
    """Names of what the driver and its workers tell each other during a run (events).

    On a cluster, two flags the driver raises on every worker when a signal stops the run: once
    ``stop`` is raised no new shard starts; once ``abandon`` is (the grace period is over) no
    shard commits (see pipeline.driver.dispatch). ``progress``: where workers report the rows of
    the shard they are scoring, as they go (a Dask event topic the driver subscribes to, or a
    listener in this process). Empty names: none.
    """

    stop: str = ""
    abandon: str = ""
    progress: str = ""

    @property
    def names(self) -> tuple[str, ...]:
        """The flags and topic that name this run in a worker (forgotten when it ends)."""
        return tuple(n for n in (self.stop, self.abandon, self.progress) if n)


@dataclass(frozen=True)
class WorkerSpec:
    """What every shard of a run is scored with: sent to each worker once, not with every task."""

    model: ModelSpec
    threads: Threads
    scoring: Scoring
    io: ShardIO
    fence: Fence = field(default_factory=Fence)
    signals: StopSignals = field(default_factory=StopSignals)
    incremental: Incremental = field(default_factory=Incremental)

    def check_fence(self) -> None:
        """Raise :class:`~pipeline.io.locking.LockLostError` unless this run still holds its
        lock (and has not given up on the shards still in flight)."""
        if events.flag_raised(self.signals.abandon):
            raise LockLostError(
                f"run {self.fence.run_id} stopped before this shard could commit (interrupted)"
            )
        f = self.fence
        if f.token:
            assert_holder(f.root, f.run_id, f.token, self.io.storage_options)

    @property
    def run_id(self) -> str:
        """The run this spec scores for (empty outside a locked run)."""
        return self.fence.run_id


@dataclass(frozen=True)
class ShardTask:
    """What differs between shards: where one shard is read from and written to; small."""

    rel_path: str
    input_uri: str
    output_uri: str
    rejects_uri: str
    num_rows: int
    meta_schema: bytes  # Arrow IPC schema of the id + pass-through columns, from the footer
    # Hash of the input's fingerprint (manifest.fingerprint_hash), written with ``rel_path``
    # into the output's footer: the file names the version of the shard it was scored from.
    input_fingerprint: str = ""
    # The shard's output as its rejects name it (their footer's owner): the same every run. A
    # folder's file has that name; a table's file name changes per run (empty: output_uri).
    output_name: str = ""
