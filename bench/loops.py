"""Comparator bodies, each run in a fresh process: ``python -m bench.loops '<json>'``.

The JSON names a ``kind`` (a key of :data:`KINDS`) and its arguments. The process prints one
line ``BENCH_RESULT {...}`` with ``rows``, ``seconds`` (its own timed region, after imports),
optional ``per_proc`` entries for multi-process layouts, and ``extra`` facts.

Multi-process layouts fork after importing torch but before any torch op has run in the parent, so
no OpenMP pool exists yet to be broken by the fork; each child then sets its own thread count. The
``fork`` start method costs about 0.03 s (measured 2026-11-29), against 2-3.6 s for spawn, so the
start-up of a 2-process layout is not what is being measured.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench.workloads import ROW_GROUP_ROWS, FeatureSpec

RESULT_PREFIX = "BENCH_RESULT "
CHILD_TIMEOUT_S = 900.0

Result = dict[str, Any]


# ---------------------------------------------------------------------------------------------
# Shared pieces: model loading, features, outputs, a buffered Parquet writer
# ---------------------------------------------------------------------------------------------


def _load_module(bundle: str) -> Any:
    """The bundle's exported program as a callable module (what the pipeline runs, too)."""
    import torch

    return torch.export.load(str(Path(bundle) / "model.pt2")).module()


def _features(rb: pa.RecordBatch, spec: FeatureSpec) -> np.ndarray:
    """A writable C-contiguous (rows, dim) float32 matrix: torch refuses read-only Arrow memory."""
    if spec.columns is not None:
        return np.column_stack([rb.column(c).to_numpy() for c in spec.columns])
    flat = rb.column(spec.column or "").flatten().to_numpy(zero_copy_only=False)
    return flat.reshape(-1, spec.dim).copy()


def _output_schema(spec: FeatureSpec) -> pa.Schema:
    if spec.outputs == "score":
        return pa.schema([("item_id", pa.int64()), ("score", pa.float32())])
    return pa.schema(
        [("item_id", pa.int64()), ("label", pa.int64()), ("logits", pa.list_(pa.float32(), 8))]
    )


def _model_outputs(y: Any, spec: FeatureSpec) -> list[pa.Array]:
    """The bundle's outputs from the model's rows: softmax:1, or argmax + raw."""
    import torch

    if spec.outputs == "score":
        return [pa.array(torch.softmax(y, dim=1)[:, 1].numpy())]
    flat = pa.array(y.contiguous().reshape(-1).numpy())
    return [
        pa.array(y.argmax(dim=1).numpy()),
        pa.FixedSizeListArray.from_arrays(flat, y.shape[1]),
    ]


def _stand_in_outputs(x: np.ndarray, spec: FeatureSpec) -> list[pa.Array]:
    """Columns of the same types and similar entropy as the real outputs, without a model."""
    if spec.outputs == "score":
        return [pa.array(np.ascontiguousarray(x[:, 0]))]
    logits = np.ascontiguousarray(x[:, :8])
    return [
        pa.array((x[:, 0] > 0).astype(np.int64)),
        pa.FixedSizeListArray.from_arrays(pa.array(logits.reshape(-1)), 8),
    ]


class BufferedWriter:
    """Buffers to 65,536-row row groups, zstd: the same output layout the pipeline writes."""

    def __init__(self, path: Path, schema: pa.Schema) -> None:
        self.schema = schema
        self.writer = pq.ParquetWriter(path, schema, compression="zstd")
        self.buffer: list[pa.RecordBatch] = []
        self.buffered = 0

    def write(self, arrays: list[pa.Array]) -> None:
        batch = pa.RecordBatch.from_arrays(arrays, schema=self.schema)
        self.buffer.append(batch)
        self.buffered += batch.num_rows
        if self.buffered >= ROW_GROUP_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self.buffer:
            table = pa.Table.from_batches(self.buffer, schema=self.schema)
            self.writer.write_table(table, row_group_size=ROW_GROUP_ROWS)
            self.buffer.clear()
            self.buffered = 0

    def close(self) -> None:
        self._flush()
        self.writer.close()


def _vmhwm_bytes() -> int:
    """This process's own peak RSS (VmHWM), exact where sampling could miss a short spike.

    Read from /proc by hand: psutil (7.2) has no peak RSS, and ``getrusage().ru_maxrss`` keeps
    the parent's peak across fork and exec (a child of a 500 MiB process reported 511 MiB where
    its VmHWM was 11 MiB, measured here), which would swamp W3's 1x-vs-10x comparison.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


# ---------------------------------------------------------------------------------------------
# Fan-out over processes
# ---------------------------------------------------------------------------------------------


def _child_main(
    body: Callable[..., Result], args: dict[str, Any], barrier: Any, queue: Any, index: int
) -> None:
    try:
        queue.put((index, True, body(**args, barrier=barrier)))
    except BaseException:
        with contextlib.suppress(Exception):
            barrier.abort()  # release siblings waiting at the start line
        queue.put((index, False, traceback.format_exc()))


def fan_out(body: Callable[..., Result], arg_list: list[dict[str, Any]]) -> list[Result]:
    """Run ``body`` in one forked process per argument set, all released at once by a barrier."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    barrier = ctx.Barrier(len(arg_list), timeout=CHILD_TIMEOUT_S)
    procs = [
        ctx.Process(target=_child_main, args=(body, a, barrier, queue, i))
        for i, a in enumerate(arg_list)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    try:
        for _ in procs:
            index, ok, payload = queue.get(timeout=CHILD_TIMEOUT_S)
            got[index] = (ok, payload)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    failures = [payload for ok, payload in got.values() if not ok]
    if failures:
        raise RuntimeError("a child process failed:\n" + "\n".join(failures))
    return [got[i][1] for i in range(len(arg_list))]


def _split(items: list[str], parts: int) -> list[list[str]]:
    """Interleaved halves (or thirds...), so equal-sized shards give each process equal work."""
    return [items[i::parts] for i in range(parts)]


def _combine(parts: list[Result], seconds: float, **extra: Any) -> Result:
    return {
        "rows": sum(p["rows"] for p in parts),
        "seconds": seconds,
        "per_proc": parts,
        "extra": extra,
    }


# ---------------------------------------------------------------------------------------------
# Model ceiling: the bundle's module on in-memory tensors
# ---------------------------------------------------------------------------------------------


def _fastest_call(module: Any, x: Any) -> int:
    """The call size (256 to 4,096 rows) at which ``module`` scores 4,096 rows of ``x`` fastest:
    the best of five passes each, round-robin."""
    sizes = (256, 512, 1024, 2048, 4096)
    best = {b: float("inf") for b in sizes}
    for _ in range(6):
        for b in sizes:
            t0 = time.perf_counter()
            for lo in range(0, 4096, b):
                module(x[lo : lo + b])
            best[b] = min(best[b], time.perf_counter() - t0)
    return min(sizes, key=lambda b: best[b])


def _ceiling_body(
    bundle: str,
    width: int,
    rows: int,
    batch: int,
    threads: int,
    precision: str,
    barrier: Any = None,
) -> Result:
    import torch

    torch.set_num_threads(threads)
    module = _load_module(bundle)
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(0))
    amp: Any = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if precision == "bf16"
        else contextlib.nullcontext()
    )
    with torch.inference_mode(), amp:
        if batch == 0:  # the fastest rows per call on this CPU, as a run measures it
            batch = _fastest_call(module, x)
        for _ in range(2):  # warm-up: the first calls allocate and pick kernels
            module(x[:batch])
        if barrier is not None:
            barrier.wait()
        t0 = time.perf_counter()
        for lo in range(0, rows, batch):
            module(x[lo : lo + batch])
        seconds = time.perf_counter() - t0
    return {"rows": rows, "seconds": seconds}


def model_ceiling(
    bundle: str, width: int, rows: int, batch: int, threads: int, procs: int, precision: str
) -> Result:
    """``procs`` processes x ``threads`` torch threads, each on ``rows`` in-memory rows at once.

    The rate is ``procs`` x the mean per-process rate (each timed after its own warm-up, all
    started together), i.e. what the machine gives with every process busy.
    """
    args: dict[str, Any] = {
        "bundle": bundle,
        "width": width,
        "rows": rows,
        "batch": batch,
        "threads": threads,
        "precision": precision,
    }
    if procs == 1:
        part = _ceiling_body(**args)
        return _combine([part], part["seconds"])
    parts = fan_out(_ceiling_body, [args] * procs)
    rate = sum(p["rows"] / p["seconds"] for p in parts) / len(parts) * procs
    out = _combine(parts, max(p["seconds"] for p in parts))
    out["rate"] = rate
    return out


# ---------------------------------------------------------------------------------------------
# I/O ceiling: read + convert + write, no model
# ---------------------------------------------------------------------------------------------


def _io_body(
    shards: list[str], out_dir: str, spec: dict[str, Any], batch: int, barrier: Any = None
) -> Result:
    fs = FeatureSpec.from_json(spec)
    schema = _output_schema(fs)
    if barrier is not None:
        barrier.wait()
    t0 = time.perf_counter()
    rows = 0
    for shard in shards:
        # pre_buffer=False and one thread: what each pipeline worker does.
        pf = pq.ParquetFile(shard, pre_buffer=False)
        writer = BufferedWriter(Path(out_dir) / Path(shard).name, schema)
        for rb in pf.iter_batches(batch_size=batch, columns=fs.read_columns, use_threads=False):
            x = _features(rb, fs)
            writer.write([rb.column(0), *_stand_in_outputs(x, fs)])
            rows += rb.num_rows
        writer.close()
    return {"rows": rows, "seconds": time.perf_counter() - t0}


def io_ceiling(
    shards: list[str], out_dir: str, spec: dict[str, Any], batch: int, procs: int
) -> Result:
    """Read the feature columns, build the float32 matrix, write same-typed outputs: no model.

    One thread per process, ``procs`` processes over interleaved shards, started together.
    """
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    arg_list: list[dict[str, Any]] = [
        {"shards": part, "out_dir": out_dir, "spec": spec, "batch": batch}
        for part in _split(shards, procs)
    ]
    parts = fan_out(_io_body, arg_list) if procs > 1 else [_io_body(**arg_list[0])]
    rate = sum(p["rows"] / p["seconds"] for p in parts) / len(parts) * procs
    out = _combine(parts, max(p["seconds"] for p in parts))
    out["rate"] = rate
    return out


# ---------------------------------------------------------------------------------------------
# Hand-rolled tight loop: iter_batches -> numpy -> from_numpy -> model -> ParquetWriter
# ---------------------------------------------------------------------------------------------


def _hand_body(
    shards: list[str],
    out_dir: str,
    bundle: str,
    spec: dict[str, Any],
    batch: int,
    threads: int,
    barrier: Any = None,
) -> Result:
    import torch

    t0 = time.perf_counter()
    torch.set_num_threads(threads)
    fs = FeatureSpec.from_json(spec)
    schema = _output_schema(fs)
    module = _load_module(bundle)
    rows = 0
    for shard in shards:
        pf = pq.ParquetFile(shard)
        writer = BufferedWriter(Path(out_dir) / Path(shard).name, schema)
        for rb in pf.iter_batches(batch_size=batch, columns=fs.read_columns, use_threads=False):
            x = torch.from_numpy(_features(rb, fs))
            with torch.inference_mode():
                y = module(x)
            writer.write([rb.column(0), *_model_outputs(y, fs)])
            rows += rb.num_rows
        writer.close()
    return {"rows": rows, "seconds": time.perf_counter() - t0}


def hand_rolled(
    shards: list[str],
    out_dir: str,
    bundle: str,
    spec: dict[str, Any],
    batch: int,
    procs: int,
    threads: int,
) -> Result:
    """No framework. Timed from before the model is loaded (or the processes forked) until the
    last output file is closed."""
    # Imported before the clock starts (and before forking, so each child does not import it
    # again inside the timed region); no torch op runs here, so no OpenMP pool is forked.
    import torch  # noqa: F401

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    arg_list: list[dict[str, Any]] = [
        {
            "shards": part,
            "out_dir": out_dir,
            "bundle": bundle,
            "spec": spec,
            "batch": batch,
            "threads": threads,
        }
        for part in _split(shards, procs)
    ]
    t0 = time.perf_counter()
    parts = fan_out(_hand_body, arg_list) if procs > 1 else [_hand_body(**arg_list[0])]
    return _combine(parts, time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------
# The textbook way: pandas, a map-style per-row Dataset, DataLoader(batch_size=256)
# ---------------------------------------------------------------------------------------------


def textbook(shards: list[str], out_dir: str, bundle: str, spec: dict[str, Any]) -> Result:
    """What a tutorial would write; torch keeps its default thread count, as a tutorial does."""
    import pandas as pd
    import torch
    from torch.utils.data import DataLoader, Dataset

    fs = FeatureSpec.from_json(spec)

    class RowDataset(Dataset):  # type: ignore[type-arg]
        """One row per ``__getitem__``; the default collate stacks them."""

        def __init__(self, df: pd.DataFrame) -> None:
            if fs.columns is not None:
                self.x = df[list(fs.columns)].to_numpy(dtype=np.float32)
            else:
                self.x = np.stack(df[fs.column].to_numpy()).astype(np.float32)
            self.ids = df[fs.id_column].to_numpy()

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> tuple[np.ndarray, Any]:
            return self.x[i], self.ids[i]

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = _load_module(bundle)
    rows = 0
    for shard in shards:
        df = pd.read_parquet(shard)
        loader = DataLoader(RowDataset(df), batch_size=256, shuffle=False)
        ids, scores = [], []
        with torch.no_grad():
            for xb, idb in loader:
                y = model(xb)
                ids.append(idb.numpy())
                scores.append(torch.softmax(y, dim=1)[:, 1].numpy())
        out = pd.DataFrame({"item_id": np.concatenate(ids), "score": np.concatenate(scores)})
        out.to_parquet(Path(out_dir) / Path(shard).name, index=False)
        rows += len(out)
    return {"rows": rows, "seconds": time.perf_counter() - t0}


# ---------------------------------------------------------------------------------------------
# score-catalog through its library API, in this process
# ---------------------------------------------------------------------------------------------


def library(input: str, output: str, model: str, batch: int) -> Result:
    """``pipeline.run(JobConfig(...))`` with the embedded Dask cluster; timed around the call."""
    from pipeline import JobConfig, run

    config = JobConfig(input=input, output=output, model=model, batch_size=batch, scheduler="local")
    t0 = time.perf_counter()
    report = run(config)
    seconds = time.perf_counter() - t0
    if report.status != "succeeded":
        raise RuntimeError(f"library run {report.status}: {report['failure_reasons']}")
    return {
        "rows": int(report["rows_processed"]),
        "seconds": seconds,
        "extra": {"duration_s": report["duration_s"], "threads": report["threads"]},
    }


# ---------------------------------------------------------------------------------------------
# W3: a plain pyarrow loop over one big shard, pre_buffer on or off
# ---------------------------------------------------------------------------------------------


def pyarrow_loop(shard: str, pre_buffer: bool, columns: list[str], batch: int) -> Result:
    """Iterate every batch of one file and keep nothing: any RSS growth is pyarrow's own."""
    t0 = time.perf_counter()
    pf = pq.ParquetFile(shard, pre_buffer=pre_buffer)
    rows = 0
    for rb in pf.iter_batches(batch_size=batch, columns=columns):
        rows += rb.num_rows
    return {
        "rows": rows,
        "seconds": time.perf_counter() - t0,
        "extra": {"vmhwm_bytes": _vmhwm_bytes()},
    }


def daft_native(
    shards: list[str],
    out_dir: str,
    bundle: str,
    spec: dict[str, Any],
    batch: int,
    sink: str = "parquet",
    form: str = "export",
    peer: str = "",
) -> Result:
    """Daft's native runner (``bench.daft_runner``; only in ``.venv-daft``), the model in
    ``form`` (``peer``: the folder of :func:`bench.workloads.peer_forms`)."""
    from bench.daft_runner import run_daft

    return run_daft(shards, out_dir, bundle, spec, batch, sink, form, peer)


def delta_commit(files: int, out_dir: str) -> Result:
    """One commit of ``files`` new files to a Delta table (``bench.delta``)."""
    from bench.delta import delta_commit as body

    return body(files, out_dir)


KINDS: dict[str, Callable[..., Result]] = {
    "daft": daft_native,
    "delta_commit": delta_commit,
    "model_ceiling": model_ceiling,
    "io_ceiling": io_ceiling,
    "hand_rolled": hand_rolled,
    "textbook": textbook,
    "library": library,
    "pyarrow_loop": pyarrow_loop,
}


def main(argv: list[str]) -> int:
    """Run one comparator body and print its result line."""
    spec = json.loads(argv[1])
    body = KINDS[spec.pop("kind")]
    result = body(**spec)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
