"""The model in a worker process: its torch threads, its device, its bundle (or a registry's
pinned copy of it), loaded and prepared once per process and kept for every shard after."""

from __future__ import annotations

import functools
import os
from urllib.parse import urlsplit

import torch

from pipeline.model.precision import prepare
from pipeline.model.program import LoadedModel, load_model
from pipeline.model.registry import fetch_pinned
from pipeline.worker.spec import ModelSpec, Threads


def set_threads(threads: Threads) -> int:
    """Set this process's torch threads for the run (see :class:`Threads`); how many."""
    n = threads.torch
    if n is None:
        try:
            from distributed import get_worker

            worker = get_worker()
            worker_threads = worker.state.nthreads
            host = urlsplit(worker.address).hostname
            n = threads.by_host.get(host or "")
        except (ImportError, ValueError):
            worker_threads = 1
    if n is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - macOS
            cores = os.cpu_count() or 1
        n = max(1, cores // max(1, worker_threads))
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def pin_device(device: str, worker_name: object, device_count: int) -> str:
    """The CUDA device for this worker: one worker per GPU.

    An unindexed ``cuda`` on a worker that sees several GPUs (an embedded cluster on a multi-GPU
    machine, whose workers are named 0, 1, ...) maps worker i to ``cuda:i % count``. Workers
    started one per GPU (dask-cuda, or CUDA_VISIBLE_DEVICES per worker) see one device, so
    ``cuda`` is theirs already.
    """
    if device != "cuda" or device_count <= 1:
        return device
    try:
        index = int(str(worker_name))
    except ValueError:
        return device
    return f"cuda:{index % device_count}"


def _worker_device(device: str) -> str:
    if device != "cuda":
        return device
    try:
        from distributed import get_worker

        name: object = get_worker().name
    except (ImportError, ValueError):
        return device
    return pin_device(device, name, torch.cuda.device_count())


def load(model: ModelSpec, warm_rows: int) -> LoadedModel:
    """The model in this process, prepared (cached: loaded once per worker)."""
    loaded = load_model(
        _bundle_uri(model),
        _worker_device(model.device),
        widths=model.widths,
        options=model.storage_options,
        expected_sha256=model.sha256,
    )
    prepared, _ = prepare(loaded, model.execution, warm_rows=warm_rows)
    return prepared


def _bundle_uri(model: ModelSpec) -> str:
    """Where this worker reads the bundle: the run's location, or for a registry model whose
    downloaded copy this machine does not see, its own download of the same pinned version."""
    if not model.registry_uri or os.path.isdir(model.uri):
        return model.uri
    return _fetched(model.registry_uri, model.tracking_uri)


@functools.lru_cache(maxsize=8)
def _fetched(registry_uri: str, tracking_uri: str) -> str:
    """A pinned version's local folder, asked for once per worker process: a registered version
    never changes, and every shard would otherwise ask the server and hash the bundle again."""
    return fetch_pinned(registry_uri, tracking_uri)


def warm_worker(model: ModelSpec, threads: Threads, warm_rows: int = 2) -> None:
    """Load (and prepare) the model in this worker before its first task: once per process.
    ``warm_rows``: the batch size when known (a compiled model is compiled for it)."""
    set_threads(threads)
    load(model, warm_rows)
