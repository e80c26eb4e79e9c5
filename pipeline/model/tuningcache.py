"""Where measured choices are kept between runs: the batch-size cache (``batch_sizes.json``,
one entry per model, device, precision and threads), the CPU a choice was measured on (a
choice from another CPU is measured again), and the challenger's streak carried from night to
night (:mod:`pipeline.model.tuning` measures; this remembers). Split from it (the size rule:
modules <= 700 lines).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import platform
import tempfile
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from pipeline.model.programcache import cache_home

logger = logging.getLogger(__name__)


@dataclass
class BenchRow:
    """One batch size's timing: the best of several passes over the same sample."""

    batch: int  # rows per model call
    calls: int  # model calls in one pass (the last batch of a pass may be shorter)
    ms: float  # wall time of the best timed pass, in milliseconds
    samples_per_s: float  # rows in the pass / best pass time
    ms_per_sample: float  # best pass time / rows in the pass


class Outcome(Protocol):
    """What a revalidation found, as the cache records it (:class:`pipeline.model.tuning.
    Challenge`)."""

    @property
    def chosen(self) -> int: ...
    @property
    def outcome(self) -> str: ...
    @property
    def streak(self) -> Streak | None: ...


@dataclass(frozen=True)
class Streak:
    """A neighbour's wins in a row over the size it challenges, carried between runs."""

    size: int
    wins: int


def cache_key(
    model_sha256: str, device: str | torch.device, precision: str, threads: int | None = None
) -> str:
    """The :class:`BatchSizeCache` key of a model on a device at a precision (and thread count:
    the best batch on 1 torch thread is not the best on 2)."""
    key = f"{model_sha256}|{device}|{precision}"
    return key if threads is None else f"{key}|{threads}"


def default_cache_path() -> Path:
    """``batch_sizes.json`` in :func:`pipeline.model.programcache.cache_home`
    (``$XDG_CACHE_HOME/score-catalog``, else ``~/.cache/score-catalog``)."""
    return cache_home() / "batch_sizes.json"


CPUINFO = Path("/proc/cpuinfo")


def cpu_identity(cpuinfo: Path = CPUINFO) -> dict[str, str]:
    """The CPU a batch size is measured on: its model name and instruction-set flags (Linux:
    the first processor of ``/proc/cpuinfo``, ``model name`` and ``flags``, or ARM's ``CPU
    part`` and ``Features``; elsewhere the platform's processor name), and the kernel set torch
    dispatches to (``AVX512``, ``AVX2``...). The best batch follows the CPU's caches and
    instructions: the demo MLP was 1.26-2x faster at 1,024 rows than at 4,096 on a 2-core AMD
    EPYC without AMX, and not on an Intel Xeon with AMX."""
    fields: dict[str, str] = {}
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor is enough: a machine's cores are alike here
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    model = (
        fields.get("model name")
        or " ".join(filter(None, (fields.get("cpu implementer"), fields.get("cpu part"))))
        or platform.processor()
        or platform.machine()
    )
    flags = fields.get("flags") or fields.get("features") or ""
    return {
        "model": model or "unknown",
        "flags": " ".join(sorted(set(flags.split()))),
        "capability": str(torch.backends.cpu.get_cpu_capability()),
    }


def cpu_summary(cpu: Mapping[str, str]) -> str:
    """A CPU in a few words for a log line: its model and its vector extensions."""
    wide = [f for f in cpu.get("flags", "").split() if f.startswith(("avx512", "amx"))]
    return f"{cpu.get('model', 'unknown')} ({cpu.get('capability', '?')}" + (
        f"; {' '.join(wide)})" if wide else ")"
    )


class BatchSizeCache:
    """Chosen batch sizes in a small JSON file: key -> ``{batch_size, cpu, measured_at,
    sweep}``.

    Keys come from :func:`cache_key`. Each entry carries the CPU it was measured on (``cpu``,
    by default this machine's :func:`cpu_identity`); :meth:`get` returns an entry only on the
    same CPU model with the same flags, so a cache folder that moves to another machine (a
    shared home, a copied image) is measured again there. Writes replace the whole file
    atomically (a temporary file in the same directory, then ``os.replace``), so a reader never
    sees half a file; two processes writing at once may lose one entry, which only costs a new
    sweep. A file that is unreadable or not what this class writes is ignored with a warning: a
    cache must never stop a run.
    """

    def __init__(self, path: Path, cpu: Mapping[str, str] | None = None) -> None:
        self.path = Path(path)
        self.cpu = dict(cpu) if cpu is not None else cpu_identity()

    def _load(self) -> dict[str, Any]:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except OSError as e:
            logger.warning("ignoring batch-size cache %s: cannot read it (%s)", self.path, e)
            return {}
        try:
            doc = json.loads(text)
        except ValueError as e:
            logger.warning("ignoring batch-size cache %s: not valid JSON (%s)", self.path, e)
            return {}
        if not isinstance(doc, dict):
            logger.warning(
                "ignoring batch-size cache %s: expected a JSON object, found %s",
                self.path,
                type(doc).__name__,
            )
            return {}
        return doc

    def get(self, key: str, allowed: Collection[int] | None = None) -> int | None:
        """The cached batch size for ``key`` (see :meth:`entry`), or None."""
        entry = self.entry(key, allowed)
        return None if entry is None else int(entry["batch_size"])

    def entry(self, key: str, allowed: Collection[int] | None = None) -> dict[str, Any] | None:
        """The cached entry for ``key`` measured on this CPU, or None (missing, measured
        on another CPU or by a version that did not record it, or an unusable entry: not an
        integer >= 1, or not one of the ``allowed`` sizes the caller measures, so that a value
        edited by hand never reaches a run: a model exported for at most 2,000 rows took a
        cached 8,192)."""
        entry = self._load().get(key)
        if entry is None:
            return None
        size = entry.get("batch_size") if isinstance(entry, dict) else None
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            logger.warning(
                "ignoring batch-size cache entry %r in %s: batch_size %r is not an integer >= 1",
                key,
                self.path,
                size,
            )
            return None
        if allowed is not None and size not in allowed:
            logger.warning(
                "ignoring batch-size cache entry %r in %s: %d is not one of the sizes measured "
                "here (%s); measuring again",
                key,
                self.path,
                size,
                ", ".join(f"{b:,}" for b in sorted(allowed)),
            )
            return None
        assert isinstance(entry, dict)
        theirs = entry.get("cpu")
        if theirs != self.cpu:
            logger.info(
                "batch size %d in %s was measured on another CPU (%s; this is %s): measuring again",
                size,
                self.path,
                cpu_summary(theirs) if isinstance(theirs, dict) else "not recorded",
                cpu_summary(self.cpu),
            )
            return None
        return entry

    def put(
        self,
        key: str,
        batch_size: int,
        sweep: Sequence[BenchRow],
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """Record ``batch_size`` (with this CPU, the sweep it came from and any ``extra``
        fields, such as a challenger's :class:`Streak`) for ``key``, atomically."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        doc = self._load()
        doc[key] = {
            **(extra or {}),
            "batch_size": batch_size,
            "cpu": self.cpu,
            "measured_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "sweep": [asdict(r) for r in sweep],
        }
        self._write(doc)

    def revalidated(
        self,
        key: str,
        entry: Mapping[str, Any],
        found: Outcome,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """Record a revalidation of ``entry`` (as :meth:`entry` returned it): the size it
        kept or moved to, when, how many revalidations in all, the streak to continue, and any
        ``extra`` fields. The measurement the entry came from stays, and so does its CPU."""
        doc = self._load()
        doc[key] = {
            **entry,
            **(extra or {}),
            "batch_size": found.chosen,
            "checked_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "checks": int(entry.get("checks") or 0) + 1,
            "streak": asdict(found.streak) if found.streak is not None else None,
            **({"replaced": entry["batch_size"]} if found.outcome == "replaced" else {}),
        }
        self._write(doc)

    def _write(self, doc: Mapping[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Hidden and in the same directory: os.replace is atomic only within one filesystem.
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.tmp-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=2, sort_keys=True)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise


def streak_of(entry: Mapping[str, Any]) -> Streak | None:
    """The challenger's streak a cache entry carries (None: none, or not one this writes)."""
    got = entry.get("streak")
    if not isinstance(got, dict):
        return None
    size, wins = got.get("size"), got.get("wins")
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (size, wins))
    return Streak(int(size), int(wins)) if ok else None  # type: ignore[arg-type]
