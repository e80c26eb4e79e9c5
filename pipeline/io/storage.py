"""Bytes on storage, and nothing else: the only module that talks to fsspec.

URIs to filesystems (:func:`locate`), listing, reads, staged writes, exclusive create, deletes and
buckets. Local paths and ``file://`` go to the local filesystem; ``s3://`` needs ``s3fs`` (the
``s3`` extra); any other fsspec protocol works where its package is installed. Writes of anything
a reader may see are staged: on local disk a hidden temporary file is renamed into place, on
object stores an object becomes visible only when its upload completes. Every other module
reaches storage through the functions here (``read_bytes``, ``ls``, ``open_input``,
``exclusive_create`` ...), never through ``Location.fs`` itself. What the files are called and
which are ours is :mod:`pipeline.io.layout`'s and :mod:`pipeline.io.ownership`'s; this module
knows only its own temporary names (:data:`TMP_MARK`). It is longer than the other modules
(about 650 lines) on purpose: every fsspec call is here, in one module, and nowhere else.

Every call is retried by the one retry layer, :mod:`pipeline.core.retries`, bounded by a total
time. What it cannot repeat safely is a part upload in the middle of a streamed write (the file
object has already consumed the part); such a write fails, and since every write is staged, the
shard's task is simply run again.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import os
import posixpath
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, TypeVar

import fsspec
import fsspec.utils
from fsspec.implementations.local import LocalFileSystem

from pipeline.core.errors import ConfigError, StorageError
from pipeline.core.faults import checkpoint
from pipeline.core.jsontext import to_json
from pipeline.core.retries import (
    cause_of,
    is_backend_failure,
    is_storage_failure,
    is_transient,
    store_key,
    with_retries,
)
from pipeline.core.storage_options import DEFAULT_RETRY_DEADLINE_S, RETRY_DEADLINE_OPTION

logger = logging.getLogger(__name__)

T = TypeVar("T")
TMP_MARK = ".tmp-"
_INSTALL_HINTS = {"s3": "s3fs (pip install 'score-catalog[s3]')", "gs": "gcsfs", "abfs": "adlfs"}

_S3_PROTOCOLS = frozenset({"s3", "s3a"})


@dataclass(frozen=True)
class Location:
    """A filesystem plus a path on it, with the URI the user wrote for messages."""

    fs: Any
    path: str
    uri: str
    # Bound on the total time one call on this location spends retrying (see with_retries).
    retry_deadline_s: float = field(default=DEFAULT_RETRY_DEADLINE_S, compare=False)

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def child(self, rel: str) -> Location:
        """The location ``rel`` below this one."""
        rel = rel.lstrip("/")
        sep = "" if self.uri.endswith("/") else "/"
        return Location(
            self.fs, posixpath.join(self.path, rel), f"{self.uri}{sep}{rel}", self.retry_deadline_s
        )

    @property
    def name(self) -> str:
        """The last path segment."""
        return posixpath.basename(self.path.rstrip("/"))


def _without_backend_retries(options: dict[str, Any]) -> dict[str, Any]:
    """Options for s3fs with botocore's own retries off (one attempt per request).

    A ``retries`` entry the job sets in ``config_kwargs`` is kept: an explicit choice wins.
    """
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1})
    return {**options, "config_kwargs": config}


def locate(uri: str, options: Mapping[str, Any] | None = None) -> Location:
    """Resolve a local path or fsspec URI; a missing protocol package gets an install hint.

    ``options`` go to fsspec unchanged, except ``retry_deadline_s`` (this module's retry bound).
    """
    opts = dict(options or {})
    deadline = float(opts.pop(RETRY_DEADLINE_OPTION, DEFAULT_RETRY_DEADLINE_S))
    proto = fsspec.utils.get_protocol(uri)
    if proto in _S3_PROTOCOLS:
        opts = _without_backend_retries(opts)
    if proto not in ("file", "local"):
        # No listings cache: workers in other processes (and other runs) write the folders
        # this process lists, and a cached listing of a folder makes fsspec answer "not found"
        # for a file written there since (s3fs's info() consults it). Every decision here is
        # about what storage holds now. A job's explicit choice wins.
        opts.setdefault("use_listings_cache", False)
    try:
        fs, path = fsspec.core.url_to_fs(uri, **opts)
    except ImportError as e:
        hint = _INSTALL_HINTS.get(proto, f"the fsspec implementation for {proto}://")
        raise ConfigError(f"{uri}: reading {proto}:// needs {hint}") from e
    except ValueError as e:
        raise ConfigError(f"{uri}: not a usable location: {e}") from e
    if proto in _S3_PROTOCOLS and hasattr(fs, "retries"):
        # s3fs's own retry loop around each request (a class attribute, not an option); one
        # attempt here, as botocore's above: with_retries is the only layer.
        fs.retries = 1
    if isinstance(fs, LocalFileSystem):
        # Absolute paths in every message and task: workers may run in another directory.
        path = os.path.abspath(path)
        uri = path
    return Location(fs, path, uri, deadline)


def real_path(loc: Location) -> Location:
    """``loc`` with symlinks resolved (local disk; object stores have none).

    Works for paths that do not exist yet: the existing part of the path is resolved.
    """
    if not loc.is_local:
        return loc
    real = os.path.realpath(loc.path)
    return Location(loc.fs, real, real, loc.retry_deadline_s)


def same_filesystem(a: Location, b: Location) -> bool:
    """True when ``a`` and ``b`` are on the same storage (then their paths can be compared)."""
    return bool(a.fs is b.fs or a.fs.protocol == b.fs.protocol)


def _retry(loc: Location, fn: Callable[[], T], what: str) -> T:
    return with_retries(
        fn,
        what=f"{what} {loc.uri}",
        deadline_s=loc.retry_deadline_s,
        store=store_key(loc.fs),
        uri=loc.uri,
    )


def _retry_write(loc: Location, fn: Callable[[], T], what: str) -> T:
    """:func:`_retry` for a write: an error no retry fixes (a full or read-only disk, a
    permission refused, a file where a folder should be) becomes a :class:`StorageError` naming
    ``loc`` and the cause (the ``OSError`` of a full disk names no path)."""
    try:
        return _retry(loc, fn, what)
    except Exception as e:
        failure = write_failure(loc, e, what)
        if failure is None:
            raise
        raise failure from e


# --------------------------------------------------------------------------- reading


def read_bytes(loc: Location) -> bytes:
    """The whole object at ``loc``; :class:`FileNotFoundError` when there is none."""
    return bytes(_retry(loc, lambda: loc.fs.cat_file(loc.path), "reading"))


def read_json(loc: Location) -> Any | None:
    """The JSON document at ``loc``, or None when there is none."""
    try:
        raw = read_bytes(loc)
    except FileNotFoundError:
        return None
    return json.loads(raw)


def read_many(locs: Sequence[Location]) -> dict[str, bytes | BaseException]:
    """Fetch several objects of one filesystem at once: ``uri`` -> bytes, or the error for it.

    Object stores serve these concurrently, instead of one round trip each.
    """
    if not locs:
        return {}
    fs = locs[0].fs
    paths = [loc.path for loc in locs]
    blobs = _retry(locs[0], lambda: fs.cat(paths, on_error="return"), "reading objects under")
    out: dict[str, bytes | BaseException] = {}
    for loc in locs:
        raw = blobs.get(loc.path) if isinstance(blobs, dict) else None
        if raw is None:
            # The bulk answer is keyed by the filesystem's own spelling of each path.
            try:
                raw = read_bytes(loc)
            except Exception as e:
                raw = e
        out[loc.uri] = raw
    return out


def ls(loc: Location) -> list[Location]:
    """The entries directly below ``loc`` (files and folders), sorted by name.

    :class:`FileNotFoundError` when ``loc`` does not exist.
    """
    names = _retry(loc, lambda: loc.fs.ls(loc.path, detail=False), "listing")
    own = loc.path.rstrip("/")
    children = []
    for name in sorted(str(n) for n in names):
        base = posixpath.basename(name.rstrip("/"))
        if name.rstrip("/") == own or not base:
            continue  # some filesystems list the folder itself
        children.append(loc.child(base))
    return children


def ls_typed(loc: Location) -> list[tuple[Location, bool]]:
    """The entries directly below ``loc``, sorted by name, each with whether it is a folder:
    one listing (on object storage a folder is a common prefix).

    :class:`FileNotFoundError` when ``loc`` does not exist.
    """
    infos = _retry(loc, lambda: loc.fs.ls(loc.path, detail=True), "listing")
    own = loc.path.rstrip("/")
    children = {}
    for info in infos:
        name = str(info["name"]).rstrip("/")
        base = posixpath.basename(name)
        if name == own or not base:
            continue  # some filesystems list the folder itself
        children[base] = info.get("type") == "directory"
    return [(loc.child(base), children[base]) for base in sorted(children)]


def names_once(loc: Location) -> list[str] | None:
    """The names of the entries of the folder ``loc`` (sorted), or None when it is not a folder;
    one attempt, not retried (for hints in messages, which must not hold a failing run)."""
    if not bool(loc.fs.isdir(loc.path)):
        return None
    listed = (str(n).rstrip("/") for n in loc.fs.ls(loc.path, detail=False))
    own = loc.path.rstrip("/")
    names = {posixpath.basename(n) for n in listed if n != own}
    return sorted(n for n in names if n)


def find_named(loc: Location, *, glob: bool) -> tuple[str, dict[str, Any]] | None:
    """(root, path -> info) of everything ``loc`` names: the matches of a glob (``glob``; its
    root is the folder before the first wildcard), every file below a folder, or a single file
    (its folder the root); None when nothing is there. Retried as one listing."""

    def find() -> tuple[str, dict[str, Any]] | None:
        fs = loc.fs
        if glob:
            root = loc.path.split("*", 1)[0].split("?", 1)[0].split("[", 1)[0]
            root = root if root.endswith("/") else posixpath.dirname(root)
            return root, fs.glob(loc.path, detail=True)
        if fs.isdir(loc.path):
            return loc.path, fs.find(loc.path, detail=True)
        if fs.exists(loc.path):
            return posixpath.dirname(loc.path), {loc.path: fs.info(loc.path)}
        return None

    return _retry(loc, find, "listing input")


def glob(loc: Location) -> list[str]:
    """The paths matching the glob ``loc.path``."""
    return [str(p) for p in _retry(loc, lambda: loc.fs.glob(loc.path), "listing")]


def uri_of(loc: Location, path: str) -> str:
    """The URI of ``path`` on ``loc``'s filesystem (a local path stays a path)."""
    if loc.is_local:
        return path
    return str(loc.fs.unstrip_protocol(path))


def sibling(loc: Location, uri: str) -> Location:
    """A Location for ``uri`` on ``loc``'s storage (same options, same client)."""
    path = loc.fs._strip_protocol(uri)
    return Location(loc.fs, path, path if loc.is_local else uri, loc.retry_deadline_s)


def list_files(root: Location) -> list[str]:
    """Paths relative to ``root`` of every file below it, recursively, sorted; [] if absent."""
    try:
        found = _retry(root, lambda: root.fs.find(root.path, detail=False), "listing")
    except FileNotFoundError:
        return []
    base = root.path.rstrip("/")
    rels = (posixpath.relpath(str(p), base) for p in found if str(p).rstrip("/") != base)
    return sorted(r for r in rels if r != "." and not r.startswith("../"))


def glob_names(loc: Location, prefix: str) -> list[Location]:
    """The entries directly below ``loc`` whose names start with ``prefix`` (no wildcards)."""
    pattern = posixpath.join(loc.path, f"{prefix}*")
    names = _retry(loc, lambda: loc.fs.glob(pattern), "listing")
    return [loc.child(posixpath.basename(str(n).rstrip("/"))) for n in sorted(names)]


def file_in_the_way(loc: Location) -> str | None:
    """The path of a file at ``loc``, or (local disk) at the nearest existing folder above it,
    that keeps a folder from being created there; None when nothing is in the way.

    Object stores have no folders: only an object at ``loc`` itself counts there.
    """
    if not loc.is_local:
        return loc.path if _retry(loc, lambda: loc.fs.isfile(loc.path), "checking") else None
    path = loc.path.rstrip("/") or "/"
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    return None if os.path.isdir(path) else path


def modified_time(loc: Location) -> float | None:
    """When ``loc`` was last written, in epoch seconds by the storage's clock (local disk: the
    file's mtime; S3: LastModified); None when it does not exist or the storage does not say."""
    try:
        info = _retry(loc, lambda: loc.fs.info(loc.path), "checking")
    except FileNotFoundError:
        return None
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(key)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        try:
            return float(value)
        except (TypeError, ValueError):
            continue
    return None


def size_of(loc: Location) -> int | None:
    """Bytes of the file at ``loc``; None when there is none."""
    try:
        info = _retry(loc, lambda: loc.fs.info(loc.path), "checking")
    except FileNotFoundError:
        return None
    size = info.get("size")
    return int(size) if size is not None else None


def exists(loc: Location) -> bool:
    """Whether anything (a file or a folder) is at ``loc``."""
    return bool(_retry(loc, lambda: loc.fs.exists(loc.path), "checking"))


class _RetryingReader(io.RawIOBase):
    """A read-only file whose reads are retried: a failed read leaves the position unchanged
    (fsspec advances it only after a range has arrived), so repeating it is safe."""

    def __init__(self, f: Any, loc: Location) -> None:
        super().__init__()
        self._f = f
        self._loc = loc

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        n = -1 if size is None else size
        return bytes(_retry(self._loc, lambda: self._f.read(n), "reading"))

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(memoryview(buffer)))
        memoryview(buffer)[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return int(self._f.seek(offset, whence))

    def tell(self) -> int:
        return int(self._f.tell())

    def close(self) -> None:
        if not self.closed:
            self._f.close()
        super().close()


@contextlib.contextmanager
def open_input(loc: Location) -> Iterator[IO[bytes]]:
    """Open ``loc`` for streaming reads; on object stores each read is retried.

    :class:`FileNotFoundError` when it does not exist.
    """
    f = _retry(loc, lambda: loc.fs.open(loc.path, "rb"), "opening")
    reader: IO[bytes] = f if loc.is_local else _RetryingReader(f, loc)  # type: ignore[assignment]
    try:
        yield reader
    finally:
        reader.close()


# --------------------------------------------------------------------------- writing


def tmp_name(final_path: str, tag: str = "") -> str:
    """A hidden sibling of ``final_path`` that dataset readers skip.

    ``tag`` (a run id) goes into the name, so that a run can find and delete what its own
    writers left behind when a worker was killed mid-write (:func:`remove_temporaries`).
    """
    d, base = posixpath.split(final_path)
    mark = f"{TMP_MARK}{tag}-" if tag else TMP_MARK
    return posixpath.join(d, f".{base}{mark}{uuid.uuid4().hex[:12]}")


def makedirs(loc: Location) -> None:
    """Create the folder ``loc`` and its parents (nothing to do on object stores)."""
    _retry_write(loc, lambda: loc.fs.makedirs(loc.path, exist_ok=True), "creating")


@contextlib.contextmanager
def staged_open(
    loc: Location,
    *,
    point: str = "",
    before_publish: Callable[[], None] | None = None,
    tag: str = "",
) -> Iterator[IO[bytes]]:
    """Open ``loc`` for writing; it appears under its final name only if the block succeeds.

    ``point`` names the crash point just before the rename, for the SIGKILL tests.
    ``before_publish`` runs last before the file becomes visible (the run lock's fence); if it
    raises, nothing is published. ``tag`` goes into the temporary file's name (:func:`tmp_name`).
    """
    fs = loc.fs
    parent = posixpath.dirname(loc.path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    if loc.is_local:
        tmp = tmp_name(loc.path, tag)
        try:
            with open(tmp, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            checkpoint(point or "before-rename")
            if before_publish is not None:
                before_publish()
            os.replace(tmp, loc.path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
    else:
        # Object stores publish an object when its upload completes, on close: a failed
        # block must discard the upload instead (fsspec's ``with`` would close, and so
        # publish the partial object).
        f = fs.open(loc.path, "wb")
        try:
            yield f
            if before_publish is not None:
                before_publish()  # before close, which uploads the last part
        except BaseException:
            _discard(f)
            raise
        f.close()


def _is_arrow_error(e: BaseException) -> bool:
    """An error pyarrow raised about the data it encodes or decodes (some are ``OSError``)."""
    return type(e).__module__.split(".")[0] == "pyarrow"


def write_failure(loc: Location, e: BaseException, what: str = "writing") -> StorageError | None:
    """The :class:`StorageError` naming ``loc`` and the cause for ``e``, an error raised while
    writing ``loc``, when it is one no retry fixes: a full or read-only disk, a permission
    refused, a folder or bucket gone. None for a transient error (the caller writes the whole
    file again), for a :class:`StorageError` already, and for anything not of the storage."""
    if isinstance(e, StorageError) or (is_transient(e) and not _is_arrow_error(e)):
        return None
    if (isinstance(e, OSError) and not _is_arrow_error(e)) or is_backend_failure(e):
        return StorageError(f"{what} {loc.uri} failed: {cause_of(e)}", uri=loc.uri)
    return None


@contextlib.contextmanager
def writing(loc: Location) -> Iterator[None]:
    """Raise :func:`write_failure`'s error instead of the one the block raised, where it has one
    (streamed writes: a ``ParquetWriter`` on :func:`staged_open`)."""
    try:
        yield
    except Exception as e:
        failure = write_failure(loc, e)
        if failure is None:
            raise
        raise failure from e


def _discard(f: Any) -> None:
    """Abandon an object-store upload: abort its multipart upload, never complete it."""
    with contextlib.suppress(Exception):
        if hasattr(f, "discard"):
            f.discard()
    f.closed = True  # so that neither close() nor garbage collection completes the upload


def write_bytes(loc: Location, data: bytes, *, point: str = "") -> None:
    """Atomically replace ``loc`` with ``data``."""

    def _write() -> None:
        with staged_open(loc, point=point) as f:
            f.write(data)

    _retry_write(loc, _write, "writing")


def write_json(loc: Location, obj: Any, *, point: str = "", compact: bool = False) -> None:
    """Write ``obj`` as strict JSON (:func:`to_json`) atomically; ``compact`` drops the
    indentation (big documents)."""
    write_bytes(loc, (to_json(obj, compact=compact) + "\n").encode(), point=point)


def _create_local(path: str, data: bytes) -> bool:
    # Write the whole content under a temporary name, then hard-link it to the final name:
    # link() fails if the name exists, and a reader never sees a half-written file (an
    # O_EXCL create would be visible, empty, until the write lands).
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = tmp_name(path)
    with open(tmp, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        # A filesystem without hard links: O_EXCL, where a reader can briefly see the file
        # empty (locking.py waits for a readable lock before judging it).
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def _create_remote(loc: Location, data: bytes) -> bool:
    try:
        # s3fs sends If-None-Match: * with "xb" (the store refuses the upload if the key
        # exists); memory:// checks at open. An empty body would go through an unconditional
        # touch in s3fs, hence the check below.
        with loc.fs.open(loc.path, "xb") as f:
            f.write(data)
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno == errno.EBUSY:
            # 409 ConditionalRequestConflict: a concurrent conditional write to the same key
            # is in flight; the caller looks again.
            return False
        raise
    return True


def exclusive_create(loc: Location, data: bytes) -> bool:
    """Create ``loc`` holding ``data`` only if nothing is there; True if this call created it.

    Atomic on local disk (link of a fully written file) and on S3 (``If-None-Match: *``): of
    several concurrent callers, at most one gets True, and readers never see partial content.
    """
    if not data:
        raise ValueError("exclusive_create needs non-empty data")
    if loc.is_local:
        return _retry_write(loc, lambda: _create_local(loc.path, data), "creating")
    return _retry_write(loc, lambda: _create_remote(loc, data), "creating")


def remove(loc: Location) -> None:
    """Delete ``loc`` if it exists."""

    def _rm() -> None:
        try:
            loc.fs.rm_file(loc.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            # A read-only disk refuses to delete even a file that is not there (EROFS, not
            # ENOENT): nothing to delete is no failure.
            if not is_storage_failure(e) or loc.fs.exists(loc.path):
                raise

    _retry_write(loc, _rm, "deleting")


def remove_empty_folders(loc: Location) -> None:
    """Delete the folder ``loc`` and the folders below it that hold no file (local disk; object
    stores have no folders). A folder that still holds a file is left alone."""
    if not loc.is_local or not os.path.isdir(loc.path):
        return
    for path, _, _ in os.walk(loc.path, topdown=False):
        with contextlib.suppress(OSError):  # not empty: something in it stays
            os.rmdir(path)


def remove_temporaries(root: Location, tag: str | None = None) -> list[str]:
    """Delete the temporary files (:func:`tmp_name`) below ``root``, only those tagged ``tag``
    when given; returns their paths.

    Only local disk has them: on object stores a write is an upload that becomes visible when
    it completes, and one cut short leaves no object (an incomplete multipart upload, which a
    bucket lifecycle rule aborts), so there is nothing to list.
    """
    if not root.is_local or not exists(root):
        return []
    mark = TMP_MARK if tag is None else f"{TMP_MARK}{tag}-"
    removed = []
    for path in _retry(root, lambda: root.fs.find(root.path), "listing"):
        name = posixpath.basename(path)
        if name.startswith(".") and mark in name:
            remove(Location(root.fs, path, path, root.retry_deadline_s))
            removed.append(path)
    return removed


# --------------------------------------------------------------------------- buckets


def bucket_of(loc: Location) -> Location | None:
    """The bucket (or container) holding ``loc`` on an object store; None elsewhere."""
    split = getattr(loc.fs, "split_path", None)
    if loc.is_local or split is None:
        return None
    try:
        bucket = str(split(loc.path)[0])
    except (TypeError, ValueError):  # pragma: no cover - an unusual path
        return None
    if not bucket:
        return None
    proto = loc.uri.split("://", 1)[0] if "://" in loc.uri else "s3"
    return Location(loc.fs, bucket, f"{proto}://{bucket}", loc.retry_deadline_s)


def bucket_exists(bucket: Location) -> bool:
    """Whether ``bucket`` exists. Through ``info``, not ``exists``: s3fs's ``exists`` answers
    False for a store it cannot even ask (no credentials), which would blame the bucket. A
    store that refuses to say (no permission to look) is taken at its word later, when writing.
    """
    try:
        _retry(bucket, lambda: bucket.fs.info(bucket.path), "checking bucket")
    except FileNotFoundError:
        return False
    except PermissionError:
        return True
    return True


def create_bucket(bucket: Location) -> None:
    """Create ``bucket`` (see :func:`check_write_target`); one that exists by now is fine."""
    logger.info("creating bucket %s (create_output_bucket = true)", bucket.uri)
    with contextlib.suppress(FileExistsError):
        _retry(bucket, lambda: bucket.fs.mkdir(bucket.path, create_parents=True), "creating")


def is_file(loc: Location) -> bool:
    """Whether ``loc`` is a file (an object), not a folder or nothing."""
    return bool(_retry(loc, lambda: loc.fs.isfile(loc.path), "checking"))
