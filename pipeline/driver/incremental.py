"""An incremental night (``incremental = true``, docs/incremental.md): find the baseline, index
it for the workers, and say in the report what the night carried and scored.

The baseline is the dataset a drift check of this night would compare with
(:func:`pipeline.report.verdict.baseline_entry`): the newest earlier night of the job (by date
with a ``{date}`` template; a table's partition, its previous version; a fixed output, its last
run) whose verdict was clean or accepted. Its rows are read once, here, from the files a reader
of that output sees now (:meth:`pipeline.sinks.base.Sink.visible`), and only from files whose
footer names this run's scorer identity (:func:`pipeline.driver.inspect.scorer_identity`):
every row of such a file was scored, or carried, by that scorer from the input its
``model_input_hash`` names, so its scores are what the model gives that input tonight. That is
why the night's output equals a full rescore whichever files the baseline reads and whichever
run wrote them.

Every row is scored instead, and the report says why, when the run is forced, when the model's
output for a row depends on the other rows of its call, when there is no baseline, when the
baseline was scored by another scorer or without fingerprints, and when it cannot be read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import shutil
import time
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.core.config import JobConfig
from pipeline.core.errors import describe
from pipeline.core.statuses import ShardStatus
from pipeline.driver.inspect import Settings
from pipeline.io import runindex, storage
from pipeline.io.layout import INPUT_KEY, MODEL_INPUT_HASH_COLUMN, SCORER_KEY
from pipeline.io.parquet import open_parquet
from pipeline.io.storage import Location
from pipeline.model.program import LoadedModel
from pipeline.report import verdict as verdicts
from pipeline.sinks.base import Sink
from pipeline.worker.baseline import (
    BaselineIndex,
    IndexRef,
    IndexWriter,
    OutputLayout,
    new_folder,
    remove_folder,
    removed_ids,
    worker_files,
)
from pipeline.worker.batching import ShardBatches
from pipeline.worker.carry import Carry, CarryCounts
from pipeline.worker.fingerprint import id_hashes
from pipeline.worker.shard import ShardResult
from pipeline.worker.spec import Incremental

logger = logging.getLogger(__name__)

#: Footers of the baseline's files read at a time (one round trip each on an object store).
FOOTER_THREADS = 16
#: Rows read from a baseline file at a time while the index is built.
READ_ROWS = 1 << 16
#: Threads that read and hash the baseline's pieces while the index is built: the workers
#: have not started, so the second core is free (W1 x 10's 20M rows: 2.1 s -> 0.6-0.9 s).
BUILD_THREADS = 2
#: Rows of whole row groups one thread reads at a time (about 20 MB of arrays at W1's width).
PIECE_ROWS = 1 << 20
#: The control-area folder an index goes to for workers on other machines.
REMOTE_DIR = "_baseline"


@dataclass(frozen=True)
class Baseline:
    """What an incremental night carries scores from, or why it scores every row."""

    enabled: bool = False  # incremental = true
    fingerprint: bool = False  # output rows carry model_input_hash
    scorer: str = ""  # the scorer identity's hash, written into every output file's footer
    index: IndexRef | None = None  # None: every row goes through the model
    reason: str | None = None  # why every row is scored (enabled, no index)
    source: Mapping[str, Any] = field(default_factory=dict)  # the baseline, for the report
    folder: str | None = None  # the index folder this run made (removed when it ends)

    def spec(self) -> Incremental:
        """The workers' side of it."""
        return Incremental(self.fingerprint, self.scorer, self.index, self.enabled)


@dataclass(frozen=True)
class Night:
    """What finding a night's baseline needs to know of the run (or of ``plan``)."""

    config: JobConfig
    scorer: Settings  # this run's scorer identity
    model: LoadedModel  # the model as the driver loaded it (its outputs, its row check)
    output: Location  # the night's output (a folder, a table's partition folder)
    control: Location  # its control folder (the index goes below it for remote workers)
    sink: Sink[Any, Any]


class _Unusable(Exception):
    """The baseline cannot be used: every row is scored, for the reason this says."""


def choose(
    night: Night | None, run_id: str, cleanup: contextlib.ExitStack, *, remote: bool
) -> Baseline:
    """The night's baseline (None: the output holds no fingerprints), its index built where
    the workers will read it (this machine's temporary folder, or the output's control area
    for workers elsewhere: ``remote``); ``cleanup`` removes it."""
    if night is None:
        return Baseline()
    prepared = night
    config, scorer = night.config, night.scorer
    if not config.incremental:
        return Baseline(False, True, scorer.hash)
    t0 = time.perf_counter()
    try:
        reason = _refusal(config, prepared)
        if reason is not None:
            raise _Unusable(reason)
        entry = _entry(prepared, run_id)
        files, version = _files(prepared, entry)
        usable, rows = _usable(prepared, files, scorer.hash)
        read = sorted({p.uri for p in usable})
        source = {
            "run_id": entry.get("run_id"),
            "output": entry.get("output"),
            "date": entry.get("date"),
            "version": version,
            "files": len(read),
            "files_skipped": len(files) - len(read),
            "rows": rows,
        }
        folder = new_folder(run_id)
        cleanup.callback(remove_folder, folder)
        ref = _build(prepared, usable, rows, folder, run_id)
        source = {**source, "rows": ref.rows}
        if remote:
            ref = _upload(prepared, folder, ref, run_id, cleanup)
    except _Unusable as e:
        logger.warning("incremental: every row is scored: %s", e)
        return Baseline(True, True, scorer.hash, reason=str(e))
    logger.info(
        "incremental: baseline run %s (%s), %s rows from %d file(s), indexed in %.2fs",
        source["run_id"],
        source["output"],
        f"{ref.rows:,}",
        source["files"],
        time.perf_counter() - t0,
    )
    return Baseline(True, True, scorer.hash, ref, None, source, str(folder))


def _refusal(config: JobConfig, prepared: Night) -> str | None:
    """Why no row may be carried tonight whatever the baseline holds, or None."""
    if config.force:
        return "--force (force = true) rescores every row"
    from pipeline.driver.autotune import row_dependence  # the model's own check

    gap = row_dependence(prepared.model)
    if gap is not None:
        return (
            f"the model's output for a row depends on the other rows of its call (max "
            f"difference {gap:.3g} on {prepared.config.model}), so no row's scores can be "
            "carried; export it after model.eval()"
        )
    return None


def _entry(prepared: Night, run_id: str) -> Mapping[str, Any]:
    """The run-index entry of the night a drift check would compare this one with, checked
    to be scored by this run's scorer."""
    config = prepared.config
    index_root = runindex.index_root(config.output)
    try:
        entry = verdicts.baseline_entry(
            config, run_id, prepared.output.uri, index_root, versioned=prepared.sink.places.table
        )
    except Exception as e:
        raise _Unusable(f"the run index at {index_root} cannot be read: {describe(e)}") from e
    if entry is None:
        day = verdicts.run_day(config)
        earlier = f" before {day}" if day is not None else ""
        raise _Unusable(
            f"no earlier night of job {config.name!r}{earlier} with a clean or accepted verdict "
            f"(the run index at {index_root}): this is the first, and the next night has one"
        )
    recorded = entry.get("scorer")
    run = entry.get("run_id")
    if not isinstance(recorded, Mapping) and entry.get("restored_by") is not None:
        raise _Unusable(
            f"the baseline, run {run} ({entry.get('output')}), is what a rollback to version "
            f"{entry['restored_by']} restored, and the run index does not say which scorer "
            "scored it (its run's entry is gone or older than fingerprints): the next night "
            "has one"
        )
    if not isinstance(recorded, Mapping):
        raise _Unusable(
            f"the baseline, run {run} ({entry.get('output')}), was not incremental: its rows "
            "carry no fingerprints (the next night has them)"
        )
    if recorded.get("hash") != prepared.scorer.hash:
        raise _Unusable(
            f"the baseline, run {run}, was scored by another scorer: "
            + _changes(recorded.get("values") or {}, prepared.scorer.values)
        )
    return entry


def _changes(before: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    """What differs between two scorer identities, in words."""
    keys = sorted(set(before) | set(now))
    diff = [f"{k} {before.get(k)!r} -> {now.get(k)!r}" for k in keys if before.get(k) != now.get(k)]
    return "; ".join(diff) or "its identity differs"


def _files(prepared: Night, entry: Mapping[str, Any]) -> tuple[list[str], int | None]:
    """The data files a reader of the baseline's output sees now, and the table version."""
    output = str(entry.get("output") or "")
    try:
        found = prepared.sink.visible(output)
    except Exception as e:
        raise _Unusable(f"the baseline {output} cannot be listed: {describe(e)}") from e
    if not found.files:
        raise _Unusable(f"the baseline {output} holds no data file")
    return list(found.files), found.version


def _footer(uri: str, options: Mapping[str, Any]) -> tuple[bytes | None, str, list[int]]:
    """A file's scorer and input shard (its footer's), and the rows of each row group."""
    with open_parquet(uri, options) as pf:
        meta = pf.metadata
        groups = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        keys = meta.metadata or {}
        return keys.get(SCORER_KEY), keys.get(INPUT_KEY, b"").decode(), groups


@dataclass(frozen=True)
class _Piece:
    """Consecutive row groups of one baseline file: what one thread reads at a time."""

    uri: str
    input_rel: str  # the input shard the file scored (its footer's), "" when it says none
    groups: tuple[int, ...]
    rows: int


def _usable(prepared: Night, files: Sequence[str], scorer: str) -> tuple[list[_Piece], int]:
    """The row groups of the files whose footer names ``scorer`` (in pieces of about
    ``PIECE_ROWS`` rows, in file order), and their rows; a file that cannot be read makes the
    baseline unusable (its rows would be scored for no reason the report gives)."""
    opts = prepared.config.storage
    want = scorer.encode()
    with ThreadPoolExecutor(min(FOOTER_THREADS, len(files))) as pool:
        futures = [pool.submit(_footer, uri, opts) for uri in files]
        pieces: list[_Piece] = []
        for uri, fut in zip(files, futures, strict=True):
            try:
                found, input_rel, groups = fut.result()
            except Exception as e:
                raise _Unusable(f"baseline file {uri} cannot be read: {describe(e)}") from e
            if found == want:
                pieces.extend(_pieces(uri, input_rel, groups))
    if not pieces:
        raise _Unusable(
            f"none of the baseline's {len(files)} file(s) was scored by this scorer (written "
            "before incremental = true, or by another model or settings)"
        )
    return pieces, sum(p.rows for p in pieces)


def _pieces(uri: str, input_rel: str, groups: Sequence[int]) -> list[_Piece]:
    out: list[_Piece] = []
    run: list[int] = []
    rows = 0
    for i, n in enumerate(groups):
        if run and rows + n > PIECE_ROWS:
            out.append(_Piece(uri, input_rel, tuple(run), rows))
            run, rows = [], 0
        run.append(i)
        rows += n
    out.append(_Piece(uri, input_rel, tuple(run), rows))  # an empty file: no row group
    return out


def output_layouts(prepared: Night) -> tuple[OutputLayout, ...]:
    model = prepared.model
    return tuple(OutputLayout.of(o.name, o.arrow_type(model.out_width)) for o in model.spec.outputs)


def _build(
    night: Night, pieces: Sequence[_Piece], rows: int, folder: Path, run_id: str
) -> IndexRef:
    """Read the baseline's rows (id, fingerprint, outputs) into an index folder: the pieces
    read and hashed by ``BUILD_THREADS`` threads, a few ahead, added in file order."""
    config = night.config
    layouts = output_layouts(night)
    writer = IndexWriter(folder, rows, layouts)
    columns = (config.id_column, MODEL_INPUT_HASH_COLUMN, *(o.name for o in layouts))
    want = night.scorer.hash.encode()

    def read(piece: _Piece) -> tuple[tuple[int, int] | None, list[Any]]:
        """The piece's id bounds (its footer's) and rows."""
        with open_parquet(piece.uri, config.storage) as pf:
            # The footer of the very file read: one another run replaced since it was listed
            # (a rerun of that night) is read only if it is still this scorer's.
            if (pf.metadata.metadata or {}).get(SCORER_KEY) != want:
                logger.warning("incremental: %s changed since it was listed; not read", piece.uri)
                return None, []
            if not piece.groups:
                return None, []
            bounds = _id_bounds(pf, piece.groups, config.id_column)
            batches = pf.iter_batches(READ_ROWS, row_groups=piece.groups, columns=list(columns))
            return bounds, [_rows(batch, layouts, config.id_column) for batch in batches]

    ahead: deque[tuple[_Piece, Future[tuple[tuple[int, int] | None, list[Any]]]]] = deque()
    todo = iter(pieces)
    with ThreadPoolExecutor(BUILD_THREADS) as pool:
        for piece in itertools.islice(todo, BUILD_THREADS + 1):
            ahead.append((piece, pool.submit(read, piece)))
        while ahead:
            piece, fut = ahead.popleft()
            following = next(todo, None)
            if following is not None:
                ahead.append((following, pool.submit(read, following)))
            try:
                bounds, chunks = fut.result()
                if piece.input_rel and piece.groups[:1] == (0,) and chunks:
                    writer.start(piece.input_rel)  # where tonight's same shard is expected
                if chunks:
                    writer.bound(bounds)
                for ids, fps, outs in chunks:
                    writer.add(ids, fps, outs)
            except Exception as e:
                for _, other in ahead:
                    other.cancel()
                raise _Unusable(f"baseline file {piece.uri} cannot be read: {describe(e)}") from e
    return writer.finish(str(folder), run_id)


def _id_bounds(pf: Any, groups: Sequence[int], id_col: str) -> tuple[int, int] | None:
    """The smallest and largest id of row groups ``groups`` of the open file ``pf``, from its
    footer's statistics; None unless the ids are integers every row group bounds."""
    field = pf.schema_arrow.field(id_col)
    if not pa.types.is_integer(field.type):
        return None
    meta = pf.metadata
    lows, highs = [], []
    for g in groups:
        rg = meta.row_group(g)
        stats = next(
            (
                rg.column(k).statistics
                for k in range(rg.num_columns)
                if rg.column(k).path_in_schema == id_col
            ),
            None,
        )
        if stats is None or not stats.has_min_max:
            return None
        lows.append(int(stats.min))
        highs.append(int(stats.max))
    return (min(lows), max(highs)) if lows else None


def _rows(
    batch: pa.RecordBatch, layouts: Sequence[OutputLayout], id_col: str
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """A batch of baseline rows as the index holds them; rows without an id or a fingerprint
    are left out (a null id is never carried)."""
    ids, has_id = id_hashes(batch.column(id_col))
    fp_col = batch.column(MODEL_INPUT_HASH_COLUMN)
    keep = (
        has_id
        if fp_col.null_count == 0
        else has_id & fp_col.is_valid().to_numpy(zero_copy_only=False)
    )
    fps = fp_col.fill_null(0).to_numpy()
    outs = [lay.numpy(batch.column(lay.name)) for lay in layouts]
    if not keep.all():
        ids, fps, outs = ids[keep], fps[keep], [o[keep] for o in outs]
    return ids, fps, outs


def _upload(
    prepared: Night, folder: Path, ref: IndexRef, run_id: str, cleanup: contextlib.ExitStack
) -> IndexRef:
    """The index copied to the output's control area, for workers on other machines."""
    dest = prepared.control.child(f"{REMOTE_DIR}/{run_id}")
    cleanup.callback(_remove_remote, dest)
    for name in worker_files(ref):
        with open(folder / name, "rb") as src, storage.staged_open(dest.child(name)) as out:
            shutil.copyfileobj(src, out, 8 << 20)
    return dataclasses.replace(ref, where=dest.uri)


def _remove_remote(dest: storage.Location) -> None:
    try:
        for name in storage.list_files(dest):
            storage.remove(dest.child(name))
    except Exception as e:
        logger.warning("could not remove the baseline index %s: %s", dest.uri, e)


# -- after the run -----------------------------------------------------------------------------


def removed_rows(config: JobConfig, baseline: Baseline, unread: Sequence[str]) -> int | None:
    """Distinct ids of the baseline that no row of tonight's input has; None when it cannot be
    counted (an input that cannot be read now). The workers of this machine marked the ids of
    the shards they scored in the index (:meth:`BaselineIndex.mark`); the shards whose ids no
    one marked (``unread``: input URIs of shards skipped, failed, or scored elsewhere) are read
    here."""
    if baseline.index is None or baseline.folder is None:
        return None
    folder = Path(baseline.folder)
    index = BaselineIndex(folder, baseline.index)
    n = baseline.index.rows
    seen = np.zeros(n, dtype=bool) if index.seen is None else index.seen[:n].astype(bool)
    try:
        for uri in unread:
            with open_parquet(uri, config.storage) as pf:
                for batch in pf.iter_batches(batch_size=READ_ROWS, columns=[config.id_column]):
                    hashes, has_id = id_hashes(batch.column(0))
                    first = index.first_rows(hashes, has_id)
                    seen[first[first >= 0]] = True
            index.release()  # one input file's pages at a time, not the whole index
    except Exception as e:
        logger.warning("incremental: could not count the baseline's removed ids: %s", describe(e))
        return None
    return removed_ids(folder, baseline.index, seen)


def section(
    baseline: Baseline, results: Sequence[ShardResult], removed: int | None
) -> dict[str, Any] | None:
    """The report's ``incremental`` object (None when the run is not incremental)."""
    if not baseline.enabled:
        return None
    counts = CarryCounts()
    kept = 0
    for r in results:
        if r.status == ShardStatus.SCORED and r.incremental is not None:
            counts.add(r.incremental)
        elif r.status == ShardStatus.SKIPPED:
            kept += r.rows_out
    return {
        "baseline": dict(baseline.source) if baseline.source else None,
        **counts.public(),
        "rows_kept": kept,
        "rows_removed": removed,
        "full_reason": baseline.reason,
    }


def preview(
    night: Night,
    to_score: Sequence[tuple[str, str]],
    readable: Sequence[str],
    widths: tuple[int, ...],
    batch_size: int,
) -> dict[str, Any]:
    """What an incremental night would send through the model (``score-catalog plan``): the
    shards it would score (``to_score``, input URIs) read, fingerprinted and looked up in the
    baseline as a worker would, without the model. It reads every row it would score, so it
    costs what a run's reading and featurising costs. ``to_score``: (path relative to the
    input, URI) of each shard."""
    config = night.config
    with contextlib.ExitStack() as cleanup:
        baseline = choose(night, "plan", cleanup, remote=False)
        if baseline.index is None or baseline.folder is None:
            return {"baseline": None, "full_reason": baseline.reason}
        index = BaselineIndex(Path(baseline.folder), baseline.index)
        counts = CarryCounts()
        for rel, uri in to_score:
            carry = Carry(index, output_layouts(night), baseline.index.start_of(rel))
            batches = ShardBatches(
                uri,
                night.model.spec,
                widths=widths,
                meta_columns=(config.id_column,),
                batch_size=batch_size,
                storage_options=config.storage,
            )
            for batch in batches:
                carry.split(batch.tensors, batch.meta.column(0), batch.features.valid)
            counts.add(carry.counts)
        removed = removed_rows(config, baseline, readable)
    return {
        "baseline": dict(baseline.source),
        "full_reason": None,
        **counts.public(),
        "rows_removed": removed,
    }
