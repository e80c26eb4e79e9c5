"""``_manifest.json``: what was scored from what, so that a rerun skips finished shards.

An entry is reused only if the input shard's fingerprint (size, modification time or ETag, footer
row count), the model's SHA-256 and the hash of the settings that change scores are all the same,
and its output file still exists. The file is replaced atomically after each shard commits, so a
crash leaves either the previous or the next version, never a torn one.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from pipeline import storage
from pipeline.errors import StorageError
from pipeline.storage import Location

MANIFEST_NAME = "_manifest.json"
SCHEMA_VERSION = 1


def settings_hash(settings: dict[str, Any]) -> str:
    """A stable hash of the settings that change what is written for a row."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Manifest:
    loc: Location
    shards: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def load(cls, root: Location) -> Manifest:
        loc = root.child(MANIFEST_NAME)
        try:
            doc = storage.read_json(loc)
        except json.JSONDecodeError as e:
            raise StorageError(
                f"{loc.uri} is not valid JSON ({e}); it is written atomically, so something else "
                "changed it. Delete it to rescore everything."
            ) from e
        if doc is None:
            return cls(loc)
        if doc.get("schema_version") != SCHEMA_VERSION:
            raise StorageError(
                f"{loc.uri} has schema_version {doc.get('schema_version')!r}; this version reads "
                f"{SCHEMA_VERSION}. Delete it (or use --force) to rescore everything."
            )
        return cls(loc, dict(doc.get("shards", {})))

    def is_done(self, rel_path: str, expect: dict[str, Any], output: Location) -> bool:
        """True if ``rel_path`` was scored from the same input, model and settings."""
        entry = self.shards.get(rel_path)
        if entry is None:
            return False
        for key, value in expect.items():
            if entry.get(key) != value:
                return False
        return storage.exists(output)

    def record(self, rel_path: str, entry: dict[str, Any]) -> None:
        self.shards[rel_path] = entry
        self.save()

    def forget(self, rel_path: str) -> None:
        if self.shards.pop(rel_path, None) is not None:
            self.save()

    def save(self) -> None:
        storage.write_json(
            self.loc,
            {
                "schema_version": SCHEMA_VERSION,
                "updated_at": dt.datetime.now(dt.timezone.utc).isoformat(),
                "shards": dict(sorted(self.shards.items())),
            },
            point="manifest-rename",
        )
