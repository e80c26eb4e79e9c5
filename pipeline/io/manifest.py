"""``_manifest.json``: what was scored from what, so that a rerun skips finished shards.

It lives in the output's control folder, outside the template's root
(``data/_score_catalog/scored/run_date=X/``, see :mod:`pipeline.io.layout`); one an older version
wrote elsewhere (beside the output, or inside it) is still read.

An entry is reused only if the input shard's fingerprint (size, modification time or ETag, footer
row count and a hash of the footer's row-group layout and column statistics), the model's SHA-256
and the hash of the settings that change scores are all the same, and its output file still
exists. The file is replaced atomically, so a crash leaves either the
previous or the next version, never a torn one.

It is saved after each shard while saving is cheap, and less often once it is not: rewriting a
manifest of n entries after each of n shards is O(n^2) (200 tiny shards spent 2.7 s of a 10 s run
serialising it). Saves are spaced so that they take at most SAVE_BUDGET of the time; a shard whose
entry was not saved yet when a crash hits is simply scored again (its commit is idempotent).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipeline.core.errors import StorageError
from pipeline.io import storage
from pipeline.io.layout import MANIFEST_NAME
from pipeline.io.listing import ShardRef
from pipeline.io.storage import Location

if TYPE_CHECKING:
    from pipeline.io.parquet import ShardInfo

SCHEMA_VERSION = 1
SAVE_BUDGET = 0.1  # share of the driver's time that manifest saves may take


def settings_hash(settings: dict[str, Any]) -> str:
    """A stable hash of the settings that change what is written for a row."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def fingerprint_hash(fingerprint: dict[str, Any]) -> str:
    """A short stable hash of an input shard's fingerprint (what :func:`expectation` records):
    written into each output file's footer, so that the file names the version of its input."""
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]


def expectation(
    shard: ShardRef, footer: ShardInfo | int, model_sha256: str, settings_hash: str
) -> dict[str, Any]:
    """What an entry must say for ``shard`` to count as done: input, model and settings.

    ``footer``: the shard's :class:`~pipeline.io.parquet.ShardInfo`, whose row count and
    ``footer_hash`` (row-group layout and column statistics) join size and mtime/ETag in the
    fingerprint. A bare row count is accepted from older callers, without the content signal:
    such an expectation never matches an entry written with one, so the shard is rescored.
    """
    fingerprint: dict[str, Any] = {**shard.fingerprint()}
    if isinstance(footer, int):
        fingerprint["num_rows"] = footer
    else:
        fingerprint["num_rows"] = footer.num_rows
        fingerprint["footer_hash"] = footer.footer_hash
    return {
        "fingerprint": fingerprint,
        "model_sha256": model_sha256,
        "settings_hash": settings_hash,
    }


@dataclass
class Manifest:
    loc: Location
    shards: dict[str, dict[str, Any]] = field(default_factory=dict)
    _dirty: bool = field(default=False, repr=False)
    _last_cost: float = field(default=0.0, repr=False)  # seconds the last save took
    _last_end: float = field(default=float("-inf"), repr=False)

    # Where it was read from when that was an older version's place (see pipeline.io.layout):
    # the run that takes the lock saves it to ``loc`` and removes that copy.
    read_from: Location | None = field(default=None, repr=False)
    # The drift verdict on the dataset these entries describe (pipeline.report.verdict), kept with
    # them so that a rerun which leaves the dataset unchanged reports the same verdict.
    verdict: dict[str, Any] | None = field(default=None, repr=False)
    # What the output format keeps of the output as a whole (pipeline.sinks): a Delta
    # table's app id, its last committed run version and the one pending (recorded before a
    # commit, so that a resume can tell whether it landed). None for the Parquet folder.
    format_state: dict[str, Any] | None = field(default=None, repr=False)
    # The job that owns the output these entries describe (pipeline.nesting.owner_record): its
    # name, output template and the output's real path. None in manifests of older versions
    # (the first run of this version adopts the output and records itself).
    owner: dict[str, Any] | None = field(default=None, repr=False)

    @classmethod
    def load(cls, control: Location, old: Sequence[Location] = ()) -> Manifest:
        """The manifest of an output: from its control folder ``control``, or else from one
        of the places an older version kept it (``old``, see ``pipeline.io.layout.Places``);
        empty if none. It is saved to ``control``."""
        loc = control.child(MANIFEST_NAME)
        for where in (control, *old):
            src = where.child(MANIFEST_NAME)
            doc = cls._read(src)
            if doc is not None:
                verdict, owner = doc.get("verdict"), doc.get("owner")
                state = doc.get("output_format")
                return cls(
                    loc,
                    dict(doc.get("shards", {})),
                    read_from=None if src == loc else src,
                    verdict=verdict if isinstance(verdict, dict) else None,
                    format_state=state if isinstance(state, dict) else None,
                    owner=owner if isinstance(owner, dict) else None,
                )
        return cls(loc)

    @staticmethod
    def _read(loc: Location) -> dict[str, Any] | None:
        try:
            doc = storage.read_json(loc)
        except json.JSONDecodeError as e:
            raise StorageError(
                f"{loc.uri} is not valid JSON ({e}); it is written atomically, so something else "
                "changed it. Delete it to rescore everything."
            ) from e
        if doc is None:
            return None
        if doc.get("schema_version") != SCHEMA_VERSION:
            raise StorageError(
                f"{loc.uri} has schema_version {doc.get('schema_version')!r}; this version reads "
                f"{SCHEMA_VERSION}. Delete it (or use --force) to rescore everything."
            )
        return dict(doc)

    def matches(self, rel_path: str, expect: dict[str, Any]) -> bool:
        """True if the entry of ``rel_path`` says it was scored from the same input, model and
        settings (whether its output is still there is for the caller to check)."""
        entry = self.shards.get(rel_path)
        if entry is None:
            return False
        return all(entry.get(key) == value for key, value in expect.items())

    def record(self, rel_path: str, entry: dict[str, Any]) -> None:
        self.shards[rel_path] = entry
        self._changed()

    def forget(self, rel_path: str) -> None:
        if self.shards.pop(rel_path, None) is not None:
            self._changed()

    def set_verdict(self, verdict: dict[str, Any] | None) -> None:
        """Keep ``verdict`` with the entries (saved by the next :meth:`flush`)."""
        if verdict != self.verdict:
            self.verdict = verdict
            self._dirty = True

    def set_format_state(self, state: dict[str, Any] | None) -> None:
        """Keep the output format's ``state`` (saved by the next :meth:`flush` or :meth:`save`)."""
        if state != self.format_state:
            self.format_state = None if state is None else dict(state)
            self._dirty = True

    def set_owner(self, owner: dict[str, Any]) -> bool:
        """Record ``owner`` (saved by the next :meth:`flush`); True if it changed."""
        if owner == self.owner:
            return False
        self.owner = dict(owner)
        self._dirty = True
        return True

    def _changed(self) -> None:
        self._dirty = True
        if time.monotonic() - self._last_end >= self._last_cost / SAVE_BUDGET:
            self.save()

    def flush(self) -> None:
        """Save what has not been saved yet (call at the end of a run)."""
        if self._dirty:
            self.save()

    def save(self) -> None:
        t0 = time.monotonic()
        doc: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "updated_at": dt.datetime.now(dt.timezone.utc).isoformat(),
            "shards": dict(sorted(self.shards.items())),
        }
        # Optional keys: versions that do not know them read the shards as before.
        if self.owner is not None:
            doc["owner"] = self.owner
        if self.verdict is not None:
            doc["verdict"] = self.verdict
        if self.format_state is not None:
            doc["output_format"] = self.format_state  # optional, as the verdict
        try:
            storage.write_json(self.loc, doc, point="manifest-rename", compact=True)
        except OSError as e:
            if e.filename:
                raise
            # A full disk's ENOSPC names no file: say which one could not be written.
            raise StorageError(f"could not write {self.loc.uri}: {type(e).__name__}: {e}") from e
        self._dirty = False
        self._last_end = time.monotonic()
        self._last_cost = self._last_end - t0


@dataclass
class FencedManifest(Manifest):
    """The manifest of a locked run: every save first checks that the run still holds its lock
    (``fence`` raises :class:`~pipeline.io.locking.LockLostError` otherwise)."""

    fence: Callable[[], None] | None = field(default=None, repr=False)

    def save(self) -> None:
        if self.fence is not None:
            self.fence()
        super().save()
