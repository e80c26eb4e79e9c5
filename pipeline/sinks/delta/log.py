"""The Delta log read directly, for what delta-rs does not hand back: which version holds one
app's commit (a resumed run's question), and the ``stats`` JSON of an add action as the log
holds it (delta-rs returns stats only parsed to the table's types)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from urllib.parse import unquote

import pyarrow.parquet as pq

from pipeline.core.errors import StorageError
from pipeline.io import storage
from pipeline.io.storage import Location
from pipeline.sinks.delta.client import TableRef, open_table

_MAX_SCAN = 200  # commit files read looking for one commit
_MAX_LISTED = 10  # files named in one message


def version_of(ref: TableRef, app_id: str, run_version: int, after: int = -1) -> int | None:
    """The table version holding run version ``run_version`` of ``app_id`` (a resumed run's
    question about a commit it did not see land), looked for from ``after + 1`` (a version it
    is known to be after) up to the latest, at most :data:`_MAX_SCAN` commit files; None when
    the log no longer has it (past the log retention) or it never landed.

    Read from the commit files themselves, not ``DeltaTable.history``: delta-rs reads history
    from the newest commit in storage but numbers it from the table object's own version, so
    one commit landing in between shifts every number (seen on S3: version 1 reported as 0).
    """
    latest = open_table(ref).version()
    start = max(after + 1, latest - _MAX_SCAN + 1, 0)
    for version in range(latest, start - 1, -1):
        try:
            raw = storage.read_bytes(ref.location.child(f"_delta_log/{version:020d}.json"))
        except FileNotFoundError:
            return None  # cleaned up past the log retention, as are all older ones
        actions = [json.loads(line) for line in raw.splitlines() if line.strip()]
        if any(
            a.get("txn", {}).get("appId") == app_id and a["txn"].get("version") == run_version
            for a in actions
        ):
            return version
    return None


_CHECKPOINT = re.compile(r"(\d{20})\.checkpoint(\.\d{10}\.\d{10})?\.parquet\Z")


def log_stats(ref: TableRef, version: int, paths: Sequence[str]) -> dict[str, str | None]:
    """path -> the ``stats`` of the add action that put it in the table, for files live at
    ``version``: from the commit files after the newest checkpoint at or before ``version``
    (newest first), then that checkpoint (its add actions are every file live at it). delta-rs
    hands stats back only parsed to the table's types, not as the JSON the log holds."""
    wanted = set(paths)
    found: dict[str, str | None] = {}
    if not wanted:
        return found
    checkpoint, parts = _checkpoint_parts(ref, version)
    oldest = 0 if checkpoint is None else checkpoint + 1
    log = ref.location.child("_delta_log")
    commits = [log.child(f"{v:020d}.json") for v in range(version, oldest - 1, -1)]
    blobs = storage.read_many(commits)
    for loc in commits:
        raw = blobs[loc.uri]
        if isinstance(raw, BaseException):
            raise StorageError(f"reading {loc.uri} failed: {ref._scrub(str(raw))}", uri=ref.uri)
        for line in raw.splitlines():
            add = json.loads(line).get("add") if line.strip() else None
            if add and unquote(add["path"]) in wanted:
                found.setdefault(unquote(add["path"]), add.get("stats"))
    for part in parts:
        if len(found) < len(wanted):
            with storage.open_input(part) as fh:
                adds = pq.read_table(fh, columns=["add"]).column("add").drop_null().to_pylist()
            for add in adds:
                if unquote(add["path"]) in wanted:
                    found.setdefault(unquote(add["path"]), add.get("stats"))
    missing = sorted(wanted - set(found))
    if missing:
        raise StorageError(
            f"the log of {ref.uri} has no add action for {len(missing)} file(s) of version "
            f"{version} ({', '.join(missing[:_MAX_LISTED])}): nothing was committed",
            uri=ref.uri,
        )
    return found


def _checkpoint_parts(ref: TableRef, version: int) -> tuple[int | None, list[Location]]:
    """The newest checkpoint at or before ``version`` (classic or multi-part), and its files."""
    try:
        entries = storage.ls(ref.location.child("_delta_log"))
    except FileNotFoundError:
        return None, []
    found: dict[int, list[Location]] = {}
    for e in entries:
        m = _CHECKPOINT.match(e.name)
        if m and int(m.group(1)) <= version:
            found.setdefault(int(m.group(1)), []).append(e)
    if not found:
        return None, []
    best = max(found)
    return best, found[best]
