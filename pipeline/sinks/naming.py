"""Names a sink gives things, pure functions of the job: a table's data file names (unique per
run), partition labels and the per-partition app id of the run token."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

#: Where a data file name's stem may come from (an input shard's relative path, flattened).
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def data_file_name(rel_path: str, run_id: str) -> str:
    """The name of shard ``rel_path``'s data file in run ``run_id``: readable, unique per run
    (a table keeps older versions' files), plain (no folder: every data file sits directly in
    its partition's folder), and ending in ``-<run_id>.parquet`` so that the files of a run that
    never committed can be found and deleted."""
    stem = rel_path[: -len(".parquet")] if rel_path.endswith(".parquet") else rel_path
    flat = _UNSAFE.sub("_", stem.replace("/", "--")).strip("._") or "part"
    digest = hashlib.sha256(rel_path.encode()).hexdigest()[:8]
    return f"{flat[:80]}-{digest}-{run_id}.parquet"


def partition_label(values: Mapping[str, str]) -> str:
    """``run_date=2026-12-01`` (``/``-joined for several columns); empty: the whole table."""
    return "/".join(f"{k}={v}" for k, v in values.items())


def app_id_of(job: str, values: Mapping[str, str]) -> str:
    """The app id of a job's runs on one partition of a table: runs of other partitions (and
    other jobs) never carry it, so their commits never conflict with this one's token."""
    return f"score-catalog/{job}/{partition_label(values) or 'table'}"
