"""The only module that talks to fsspec: URIs to filesystems, listing, fingerprints, staged commits.

Local paths and ``file://`` go to the local filesystem; ``s3://`` needs ``s3fs`` (the ``s3``
extra); any other fsspec protocol works where its package is installed. Writes of anything a
reader may see are staged: on local disk a hidden temporary file is renamed into place, on object
stores an object becomes visible only when its upload completes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from pipeline.errors import ConfigError, InputError, StorageError
from pipeline.faults import checkpoint

logger = logging.getLogger(__name__)

T = TypeVar("T")
TMP_MARK = ".tmp-"
_INSTALL_HINTS = {"s3": "s3fs (pip install 'score-catalog[s3]')", "gs": "gcsfs", "abfs": "adlfs"}


@dataclass(frozen=True)
class Location:
    """A filesystem plus a path on it, with the URI the user wrote for messages."""

    fs: Any
    path: str
    uri: str

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def child(self, rel: str) -> Location:
        rel = rel.lstrip("/")
        sep = "" if self.uri.endswith("/") else "/"
        return Location(self.fs, posixpath.join(self.path, rel), f"{self.uri}{sep}{rel}")


def locate(uri: str, options: Mapping[str, Any] | None = None) -> Location:
    """Resolve a local path or fsspec URI; a missing protocol package gets an install hint."""
    try:
        fs, path = fsspec.core.url_to_fs(uri, **dict(options or {}))
    except ImportError as e:
        proto = uri.split("://", 1)[0]
        hint = _INSTALL_HINTS.get(proto, f"the fsspec implementation for {proto}://")
        raise ConfigError(f"{uri}: reading {proto}:// needs {hint}") from e
    except ValueError as e:
        raise ConfigError(f"{uri}: not a usable location: {e}") from e
    if isinstance(fs, LocalFileSystem):
        # Absolute paths in every message and task: workers may run in another directory.
        path = os.path.abspath(path)
        uri = path
    return Location(fs, path, uri)


# Packages whose exceptions are network or service failures of an fsspec backend. They do not
# derive from OSError (botocore's EndpointConnectionError, for one, when an endpoint is down or
# wrong), so without this they would escape as tracebacks instead of storage errors.
_BACKEND_PACKAGES = frozenset(
    {"botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "google", "azure"}
)


def is_backend_failure(e: BaseException) -> bool:
    """True for an error raised by a storage backend's client library rather than by fsspec."""
    return any(c.__module__.split(".")[0] in _BACKEND_PACKAGES for c in type(e).__mro__)


def with_retries(
    fn: Callable[[], T], *, what: str, attempts: int = 4, base_delay: float = 0.2
) -> T:
    """Call ``fn``, retrying transient storage errors with bounded exponential backoff.

    Missing files and permission errors are not transient and are raised at once.
    """
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError):
            raise
        except Exception as e:
            if not isinstance(e, (OSError, TimeoutError)) and not is_backend_failure(e):
                raise
            if attempt == attempts:
                raise StorageError(f"{what} failed after {attempts} attempts: {e}") from e
            delay = base_delay * 2 ** (attempt - 1)
            logger.warning("%s failed (%s); retry %d in %.1fs", what, e, attempt, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover


@dataclass(frozen=True)
class ShardRef:
    """One input file: where it is, its path relative to the input root, and its fingerprint."""

    uri: str
    rel_path: str
    size: int
    # Modification time on disk or the ETag on object stores: what changes when the file does.
    version: str

    def fingerprint(self) -> dict[str, Any]:
        return {"size": self.size, "version": self.version}


def _is_hidden(rel_path: str) -> bool:
    return any(part.startswith(("_", ".")) for part in rel_path.split("/"))


def _version_of(info: Mapping[str, Any]) -> str:
    for key in ("ETag", "etag", "md5Hash", "generation"):
        if info.get(key):
            return str(info[key]).strip('"')
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        if info.get(key) is not None:
            val = info[key]
            return str(val.timestamp() if hasattr(val, "timestamp") else val)
    return ""


def list_shards(input_uri: str, options: Mapping[str, Any] | None = None) -> list[ShardRef]:
    """List input shards deterministically (sorted by path relative to the input root).

    A directory means every ``*.parquet`` file below it, recursively, skipping names that start
    with ``_`` or ``.`` (Spark and Hive write those for metadata); a glob or a single file also
    work. Matching nothing is an :class:`InputError`.
    """
    loc = locate(input_uri, options)
    fs = loc.fs
    try:
        if any(ch in loc.path for ch in "*?["):
            root = loc.path.split("*", 1)[0].split("?", 1)[0].split("[", 1)[0]
            root = root if root.endswith("/") else posixpath.dirname(root)
            found = fs.glob(loc.path, detail=True)
        elif fs.isdir(loc.path):
            root = loc.path
            found = fs.find(loc.path, detail=True)
        elif fs.exists(loc.path):
            root = posixpath.dirname(loc.path)
            found = {loc.path: fs.info(loc.path)}
        else:
            raise InputError(f"input {input_uri} does not exist")
    except (OSError, ValueError) as e:
        raise InputError(f"cannot list input {input_uri}: {e}") from e
    except Exception as e:
        if not is_backend_failure(e):
            raise
        # The storage service could not be reached or answered with an error (wrong endpoint,
        # network down): not a problem of the input itself, so a failed run (rerun when fixed).
        raise StorageError(f"cannot list input {input_uri}: {type(e).__name__}: {e}") from e
    shards = []
    for path, info in found.items():
        if info.get("type") == "directory":
            continue
        rel = posixpath.relpath(path, root) if root else path
        if not rel.endswith(".parquet") or _is_hidden(rel):
            continue
        shards.append(
            ShardRef(
                uri=_uri_for(loc, path),
                rel_path=rel,
                size=int(info.get("size") or 0),
                version=_version_of(info),
            )
        )
    shards.sort(key=lambda s: s.rel_path)
    if not shards:
        raise InputError(
            f"input {input_uri} matched no Parquet shards (*.parquet, names starting with _ or . "
            "are skipped)"
        )
    return shards


def _uri_for(loc: Location, path: str) -> str:
    if loc.is_local:
        return path
    return loc.fs.unstrip_protocol(path)


def tmp_name(final_path: str) -> str:
    """A hidden sibling of ``final_path`` that dataset readers skip."""
    d, base = posixpath.split(final_path)
    return posixpath.join(d, f".{base}{TMP_MARK}{uuid.uuid4().hex[:12]}")


@contextlib.contextmanager
def staged_open(loc: Location, *, point: str = "") -> Iterator[IO[bytes]]:
    """Open ``loc`` for writing; it appears under its final name only if the block succeeds.

    ``point`` names the crash point just before the rename, for the SIGKILL tests.
    """
    fs = loc.fs
    parent = posixpath.dirname(loc.path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    if loc.is_local:
        tmp = tmp_name(loc.path)
        try:
            with open(tmp, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            checkpoint(point or "before-rename")
            os.replace(tmp, loc.path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
    else:
        # Object stores publish an object only when its upload completes, so writing under
        # the final name is already atomic; an aborted upload leaves nothing behind.
        with fs.open(loc.path, "wb") as f:
            yield f


def write_bytes(loc: Location, data: bytes, *, point: str = "") -> None:
    """Atomically replace ``loc`` with ``data``."""

    def _write() -> None:
        with staged_open(loc, point=point) as f:
            f.write(data)

    with_retries(_write, what=f"writing {loc.uri}")


def write_json(loc: Location, obj: Any, *, point: str = "", compact: bool = False) -> None:
    """Write ``obj`` as JSON atomically; ``compact`` drops the indentation (big documents)."""
    if compact:
        data = json.dumps(obj, separators=(",", ":"), default=str) + "\n"
    else:
        data = json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n"
    write_bytes(loc, data.encode(), point=point)


def read_json(loc: Location) -> Any | None:
    """The JSON document at ``loc``, or None when there is none."""
    try:
        raw = with_retries(lambda: loc.fs.cat_file(loc.path), what=f"reading {loc.uri}")
    except FileNotFoundError:
        return None
    return json.loads(raw)


def exists(loc: Location) -> bool:
    return bool(with_retries(lambda: loc.fs.exists(loc.path), what=f"checking {loc.uri}"))


def remove(loc: Location) -> None:
    """Delete ``loc`` if it exists."""
    with contextlib.suppress(FileNotFoundError):
        loc.fs.rm_file(loc.path)


def remove_stale_temporaries(root: Location) -> list[str]:
    """Delete temporary files that a crashed run left below ``root``; returns their paths."""
    if not root.fs.exists(root.path):
        return []
    removed = []
    for path in root.fs.find(root.path):
        if TMP_MARK in posixpath.basename(path) and posixpath.basename(path).startswith("."):
            remove(Location(root.fs, path, path))
            removed.append(path)
    return removed
