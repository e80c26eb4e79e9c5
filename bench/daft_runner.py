"""The strongest peer, Daft 0.7's native runner, on W1 and W2: ``bench.loops`` kind ``daft``.

Run from its own virtual environment (``.venv-daft``: Daft pins pyarrow below the version this
project is tested with), with ``DO_NOT_TRACK=1`` set before Daft is imported: Daft sends usage
analytics on import otherwise, and the bench stays off the network. The model runs as a
``@daft.cls`` with a ``@daft.method.batch`` method, the way Daft documents batch inference:
the class is set up once per worker and each call gets a batch of rows. Module level, so that
Daft pickles the class by reference.

The model comes in one of three forms (``form``): ``eager``, the bundle's network rebuilt as
plain ``torch.nn`` layers from its weights (what a Daft user who trained the model would run);
``torchscript``, the same module scripted; both made from the bundle by
:func:`bench.workloads.peer_forms`; and ``export``, the bundle's own ``torch.export`` program
(``torch.export.load(...).module()``), which imports torch's export machinery in every UDF
instance (seconds on 2 cores) and costs about 75 us a call against 27 for the eager module.
The bench's ``daft`` comparator runs Daft's best form here (``bench.suites.DAFT_FORM``), and
``daft-export`` the export form beside it.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("DO_NOT_TRACK", "1")

import daft  # after DO_NOT_TRACK is set, above
import numpy as np
import pyarrow as pa
import torch

# torch.export.load is not thread-safe, and Daft sets up several instances in threads.
_LOAD_LOCK = threading.Lock()


def load_program(bundle: str, form: str = "export", peer: str = "") -> Any:
    """The model in ``form``: the bundle's exported program (under a lock, see
    :data:`_LOAD_LOCK`), or one of its peer forms from the folder ``peer``
    (:func:`bench.workloads.load_peer`)."""
    if form == "export":
        with _LOAD_LOCK:
            return torch.export.load(str(Path(bundle) / "model.pt2")).module()
    from bench.workloads import load_peer

    return load_peer(form, peer)


@daft.cls
class Scorer:
    """The model in one of its forms (:func:`load_program`), on one torch thread per
    instance."""

    def __init__(
        self,
        bundle: str,
        columns: list[str] | None,
        dim: int,
        outputs: str,
        form: str = "export",
        peer: str = "",
    ) -> None:
        # Imported here, not referenced as a global: Daft pickles the class by value and a
        # lock does not pickle.
        from bench.daft_runner import load_program

        torch.set_num_threads(1)
        self.module = load_program(bundle, form, peer)
        self.columns, self.dim, self.outputs = columns, dim, outputs

    def _x(self, cols: tuple[Any, ...]) -> torch.Tensor:
        if self.columns is not None:
            x = np.column_stack([c.to_arrow().to_numpy(zero_copy_only=False) for c in cols])
            return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        flat = cols[0].to_arrow().flatten().to_numpy(zero_copy_only=False)
        return torch.from_numpy(flat.reshape(-1, self.dim).copy())

    @daft.method.batch(return_dtype=daft.DataType.float32(), batch_size=4096)
    def score(self, *cols: Any) -> Any:
        """W1's output: softmax:1 of each row."""
        with torch.inference_mode():
            y = self.module(self._x(cols))
        return torch.softmax(y, dim=1)[:, 1].numpy()

    @daft.method.batch(return_dtype=daft.DataType.int64(), batch_size=4096)
    def label(self, *cols: Any) -> Any:
        """W2's label: argmax of each row (its logits are computed, and dropped)."""
        with torch.inference_mode():
            y = self.module(self._x(cols))
        return y.argmax(dim=1).numpy()


def run_daft(
    shards: list[str],
    out_dir: str,
    bundle: str,
    spec: dict[str, Any],
    batch: int,
    sink: str = "parquet",
    form: str = "export",
    peer: str = "",
) -> dict[str, Any]:
    """read_parquet -> the model's batch method -> write_parquet (``sink = "delta"``:
    write_deltalake, a new unpartitioned table), timed from before the plan is built (imports
    are outside, as for the other loops); the model in ``form`` (:func:`load_program`)."""
    if batch != 4096:
        raise ValueError("the Daft comparator's batch size is fixed at 4096 (its decorator)")
    columns, column, dim = spec.get("columns"), spec.get("column"), int(spec.get("dim") or 0)
    t0 = time.perf_counter()
    scorer = Scorer(bundle, columns, dim, spec["outputs"], form, peer)
    inputs = [daft.col(c) for c in (columns or [column])]
    df = daft.read_parquet(shards)
    if spec["outputs"] == "score":
        df = df.select(daft.col("item_id"), scorer.score(*inputs).alias("score"))
    else:
        df = df.select(daft.col("item_id"), scorer.label(*inputs).alias("label"))
    if sink == "delta":
        df.write_deltalake(out_dir)
    else:
        df.write_parquet(out_dir)
    seconds = time.perf_counter() - t0
    import pyarrow.dataset as ds

    if sink == "delta":
        from deltalake import DeltaTable  # only the log: no delta-rs scan

        # deltalake 1.x names the live files by URI (file_uris; files() was removed).
        files = [u.removeprefix("file://") for u in DeltaTable(out_dir).file_uris()]
        rows = ds.dataset(files, format="parquet").count_rows()
    else:
        rows = ds.dataset(out_dir, format="parquet").count_rows()
    return {
        "rows": rows,
        "seconds": seconds,
        "extra": {"daft": daft.__version__, "pyarrow": pa.__version__, "form": form},
    }
