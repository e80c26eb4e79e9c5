"""Make the visible output equal the run's report before ``_SUCCESS`` is written.

A reader of the output folder (pyarrow.dataset, pandas, Dask, DuckDB, Polars, Spark) sees every
Parquet file in it whose path has no component starting with ``_`` or ``.``. After a run that
set must be exactly one scored file per current input shard that was scored or skipped, all
written by this tool for the run's model and settings. Upstream events break that if nothing
mends it: an input shard deleted or compacted leaves its old output behind (stale or duplicated
rows), a shard that fails this run keeps last night's output, a schema-skipped shard keeps a
previous model's rows. :func:`reconcile` removes those, and :func:`verify` checks what is left
against the report from the files' own footers; ``_SUCCESS`` is written only when it finds
nothing wrong.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline import storage
from pipeline.errors import ShardError
from pipeline.reading import read_footer
from pipeline.storage import Location

logger = logging.getLogger(__name__)

#: Key-value metadata every output file carries in its Parquet footer: who wrote it and with
#: which model, so that the final check needs nothing but the files themselves.
WRITER_KEY = b"score_catalog.writer"
MODEL_SHA_KEY = b"score_catalog.model_sha256"
SETTINGS_KEY = b"score_catalog.settings_hash"
WRITER = b"score-catalog"


def footer_metadata(model_sha256: str, settings_hash: str) -> dict[bytes, bytes]:
    """The footer metadata an output file is written with (see :data:`WRITER_KEY`)."""
    return {
        WRITER_KEY: WRITER,
        MODEL_SHA_KEY: model_sha256.encode(),
        SETTINGS_KEY: settings_hash.encode(),
    }


def is_visible(rel_path: str) -> bool:
    """True when dataset readers see this file: no path component starts with ``_`` or ``.``."""
    return not any(part.startswith(("_", ".")) for part in rel_path.split("/"))


def visible_files(root: Location) -> list[str]:
    """Paths, relative to ``root``, of every file a dataset reader would see there."""
    return [rel for rel in storage.list_files(root) if is_visible(rel)]


@dataclass(frozen=True)
class Removal:
    """An output this run took out of the dataset, and why (listed in the report)."""

    output: str
    reason: str
    rejects: str | None = None

    def public(self) -> dict[str, Any]:
        return {"output": self.output, "reason": self.reason, "rejects": self.rejects}


@dataclass
class Reconciliation:
    """What :func:`reconcile` did: outputs removed, and visible files it would not touch."""

    removed: list[Removal] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)


def reconcile(
    out_root: Location,
    rej_root: Location,
    keep: set[str],
    ours: set[str],
    reasons: Mapping[str, str],
    options: Mapping[str, Any] | None = None,
) -> Reconciliation:
    """Remove every visible output of ours that is not in ``keep``.

    ``keep``: relative paths of shards scored or skipped in this run (their outputs stay).
    ``ours``: relative paths this tool wrote earlier (the manifest's entries). ``reasons``:
    why a relative path is no longer wanted (failed this run, skipped by the schema policy);
    anything else in ``ours`` lost its input shard. A visible file in neither set was not
    written by this tool: it is never deleted, only reported, and :func:`verify` then refuses
    ``_SUCCESS``.
    """
    result = Reconciliation()
    for rel in visible_files(out_root):
        if rel in keep:
            continue
        if rel not in ours and not _written_by_us(out_root.child(rel), options):
            result.foreign.append(rel)
            continue
        reason = reasons.get(rel, "its input shard no longer exists")
        rejects = rej_root.child(rel)
        had_rejects = storage.exists(rejects)
        storage.remove(out_root.child(rel))
        if had_rejects:
            storage.remove(rejects)
        removal = Removal(out_root.child(rel).uri, reason, rejects.uri if had_rejects else None)
        logger.warning("removed %s from the output: %s", removal.output, reason)
        result.removed.append(removal)
    # Rejects of shards that are gone: their rows are no longer part of this dataset either.
    for rel in storage.list_files(rej_root):
        if is_visible(rel) and rel not in keep and (rel in ours or rel in reasons):
            storage.remove(rej_root.child(rel))
    return result


def _written_by_us(loc: Location, options: Mapping[str, Any] | None) -> bool:
    """True when the file's footer says this tool wrote it (a crash can lose its manifest entry)."""
    try:
        meta = read_footer(loc.uri, options).schema.metadata or {}
    except ShardError:
        return False
    return meta.get(WRITER_KEY) == WRITER


def verify(
    out_root: Location,
    expected_rows: Mapping[str, int],
    model_sha256: str,
    options: Mapping[str, Any] | None = None,
) -> list[str]:
    """Problems that forbid ``_SUCCESS``: what a reader would see differs from the report.

    ``expected_rows``: for each shard the report counts as output (scored or skipped), its row
    count. The check reads only footers: every visible file must be one of those shards, have
    that many rows, and carry this run's model SHA-256 in its footer metadata.
    """
    problems: list[str] = []
    seen = set(visible_files(out_root))
    for rel in sorted(seen - set(expected_rows)):
        problems.append(f"{out_root.child(rel).uri} is in the output but not in the report")
    for rel in sorted(set(expected_rows) - seen):
        problems.append(f"{out_root.child(rel).uri} is in the report but missing from the output")
    for rel in sorted(seen & set(expected_rows)):
        uri = out_root.child(rel).uri
        try:
            info = read_footer(uri, options)
        except ShardError as e:
            problems.append(f"{uri} cannot be read back: {e}")
            continue
        if info.num_rows != expected_rows[rel]:
            problems.append(
                f"{uri} holds {info.num_rows} rows, the report says {expected_rows[rel]}"
            )
        sha = (info.schema.metadata or {}).get(MODEL_SHA_KEY, b"").decode()
        if sha != model_sha256:
            problems.append(
                f"{uri} was scored by model {sha[:12] or 'unknown'}, not this run's "
                f"{model_sha256[:12]}"
            )
    return problems
