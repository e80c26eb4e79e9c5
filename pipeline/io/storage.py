"""The only module that talks to fsspec: URIs to filesystems, listing, fingerprints, staged commits.

Local paths and ``file://`` go to the local filesystem; ``s3://`` needs ``s3fs`` (the ``s3``
extra); any other fsspec protocol works where its package is installed. Writes of anything a
reader may see are staged: on local disk a hidden temporary file is renamed into place, on object
stores an object becomes visible only when its upload completes. Every other module reaches
storage through the functions here (``read_bytes``, ``ls``, ``open_input``, ``exclusive_create``
...), never through ``Location.fs`` itself.

Retries: one layer, :func:`with_retries`, bounded by a total time (``retry_deadline_s``, default
:data:`DEFAULT_RETRY_DEADLINE_S`; a job can set it in its ``[storage]`` table). s3fs and botocore
each retry on their own by default (s3fs 5 times around botocore's 5 attempts: up to 25 requests
per call, and no bound on the total time a caller can state), so :func:`locate` turns both off
for ``s3://``: every request is tried once underneath and retried here, with one deadline and one
message naming the URI. What this layer cannot repeat safely is a part upload in the middle of a
streamed write (the file object has already consumed the part); such a write fails, and since
every write is staged, the shard's task is simply run again.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import fnmatch
import io
import json
import logging
import math
import os
import posixpath
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, TypeVar

import fsspec
import fsspec.utils
from fsspec.implementations.local import LocalFileSystem

from pipeline.core.errors import ConfigError, InputError, MissingInputError, StorageError
from pipeline.core.faults import checkpoint
from pipeline.core.storage_options import DEFAULT_RETRY_DEADLINE_S, RETRY_DEADLINE_OPTION

logger = logging.getLogger(__name__)

T = TypeVar("T")
TMP_MARK = ".tmp-"
_INSTALL_HINTS = {"s3": "s3fs (pip install 'score-catalog[s3]')", "gs": "gcsfs", "abfs": "adlfs"}

_MAX_DELAY_S = 8.0  # longest single back-off sleep
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


def same_filesystem(a: Location, b: Location) -> bool:
    """True when ``a`` and ``b`` are on the same storage (then their paths can be compared)."""
    return bool(a.fs is b.fs or a.fs.protocol == b.fs.protocol)


# --------------------------------------------------------------------------- retries

# Packages whose exceptions are network or service failures of an fsspec backend. They do not
# derive from OSError (botocore's EndpointConnectionError, for one, when an endpoint is down or
# wrong), so without this they would escape as tracebacks instead of storage errors.
_BACKEND_PACKAGES = frozenset(
    {"botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "google", "azure"}
)
# Backend errors that no retry can fix: the job's credentials or parameters are wrong.
_PERMANENT_BACKEND_WORDS = ("Credential", "ParamValidation", "NoRegion", "InvalidConfig")
# errno values of transient failures: s3fs maps SlowDown/503/409 to EBUSY, 500 to EREMOTEIO and
# unknown service errors to EIO; the rest are the network's.
_TRANSIENT_ERRNOS = frozenset(
    {
        errno.EAGAIN,
        errno.EBUSY,
        errno.EINTR,
        errno.EIO,
        errno.ETIMEDOUT,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.ECONNREFUSED,
        errno.ENETUNREACH,
        errno.EHOSTUNREACH,
        errno.EPIPE,
        getattr(errno, "EREMOTEIO", 121),
    }
)
_PERMANENT = (
    FileNotFoundError,
    FileExistsError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
)


def is_backend_failure(e: BaseException) -> bool:
    """True for an error raised by a storage backend's client library rather than by fsspec."""
    return any(c.__module__.split(".")[0] in _BACKEND_PACKAGES for c in type(e).__mro__)


def is_transient(e: BaseException) -> bool:
    """True for a storage error that may go away if the call is repeated."""
    if isinstance(e, _PERMANENT):
        return False
    if isinstance(e, (TimeoutError, ConnectionError)):
        return True
    if is_backend_failure(e):
        return not any(w in c.__name__ for c in type(e).__mro__ for w in _PERMANENT_BACKEND_WORDS)
    if isinstance(e, OSError):
        return e.errno is None or e.errno in _TRANSIENT_ERRNOS
    return False


# errno values of storage failures no retry fixes: a full disk or quota, a read-only
# filesystem, no permission, a file over the filesystem's size limit.
_STORAGE_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}
)


def is_storage_failure(e: BaseException) -> bool:
    """True for an error of the storage itself that no retry fixes, and that is no fault of the
    data: a full disk or quota, a read-only filesystem, a permission refused (``ENOSPC``,
    ``EDQUOT``, ``EROFS``, ``EACCES``, ``EPERM``, ``EFBIG``), or a :class:`StorageError` (a
    store that stayed unreachable past the retry deadline, a write this module failed).

    A shard whose bytes are corrupt is not one: decoding errors are the data's
    (``pipeline.model.features``). A run stops at a storage failure instead of counting shards
    against the error budget: every shard after it would fail the same way.
    """
    if isinstance(e, StorageError):
        return True
    return isinstance(e, OSError) and (isinstance(e, PermissionError) or e.errno in _STORAGE_ERRNOS)


def is_permanent_storage_failure(e: BaseException) -> bool:
    """:func:`is_storage_failure` of the disk or the permissions (not a store that stopped
    answering): ``e`` or the error it wraps."""
    for err in (e, e.__cause__):
        if isinstance(err, OSError) and (
            isinstance(err, PermissionError) or err.errno in _STORAGE_ERRNOS
        ):
            return True
    return False


def cause_of(e: BaseException) -> str:
    """``e`` as ``Type: message`` (first line), for messages that name a path and a cause."""
    if isinstance(e, StorageError):
        return str(e)
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


class RetryClock:
    """When each store began failing in this process: one retry deadline across calls.

    With a deadline per call, a dead server cost every call the whole deadline in turn: with S3
    killed mid-run, a run took 218 s to give up (measured: the shard, the manifest, the report,
    the lock, each 60 s). Here a store's outage starts at the first transient failure of any
    call on it and ends when a call on it succeeds; a failing call gives up once the outage, or
    the call itself, is older than the deadline. So a dead store fails the run about
    ``retry_deadline_s`` after it died, and later calls fail at their first attempt.

    Each process keeps its own clock (a Dask worker cannot see the driver's). The driver stops
    the run at the first storage failure a worker reports and then calls :meth:`expire`: from
    then on a call that fails in the driver gives up at once (its report, manifest and lock
    release on a dead store take one attempt each, not another deadline). :meth:`reset` at the
    start of each run.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: dict[str, float] = {}
        self._expired = False
        self._run = ""

    def failed(self, store: str, now: float) -> float:
        """A call on ``store`` failed at ``now`` (monotonic): when its outage began."""
        with self._lock:
            if self._expired:
                return -math.inf
            return self._since.setdefault(store, now)

    def succeeded(self, store: str) -> None:
        """A call on ``store`` succeeded: it is not failing (any more)."""
        if store in self._since:
            with self._lock:
                self._since.pop(store, None)

    def expire(self) -> None:
        """The run failed on storage: failing calls in this process give up at once."""
        with self._lock:
            self._expired = True

    def reset(self) -> None:
        """A new run: no store is failing, and failing calls are retried again."""
        with self._lock:
            self._since.clear()
            self._expired = False

    def working_for(self, run_id: str) -> None:
        """:meth:`reset` if this process last worked for another run: a worker of an existing
        cluster outlives runs, and an outage it saw last night must not fail tonight's first
        retry."""
        if run_id != self._run:
            self.reset()
            self._run = run_id


#: The clock of this process (see :class:`RetryClock`).
RETRY_CLOCK = RetryClock()


def store_key(fs: Any) -> str:
    """What identifies a store for :data:`RETRY_CLOCK`: the filesystem's fsspec token (the
    same protocol and options give the same one in every process)."""
    token = getattr(fs, "_fs_token", None)
    return str(token) if token else f"{type(fs).__name__}-{id(fs)}"


def next_delay(
    *, store: str | None, start: float, attempt: int, deadline: float, base_delay: float = 0.2
) -> tuple[float, float]:
    """After the ``attempt``-th transient failure of a call that began at ``start`` (monotonic):
    (seconds to sleep before the next try, or -1 to give up; seconds the failure has lasted,
    the store's outage when ``store`` is given, else the call's)."""
    now = time.monotonic()
    since = start if store is None else min(start, RETRY_CLOCK.failed(store, now))
    elapsed = now - since
    delay = min(base_delay * 2 ** (attempt - 1), _MAX_DELAY_S)
    return (-1.0 if elapsed + delay > deadline else delay), elapsed


def gave_up(attempt: int, elapsed: float, deadline: float) -> str:
    """Why retrying stopped, for messages: ``after 12 attempt(s) over 58.1s (retries stop ...)``."""
    if math.isinf(elapsed):
        return "(not retried: the run has already failed on storage)"
    return (
        f"after {attempt} attempt(s) over {elapsed:.1f}s (retries stop after {deadline:g}s; set "
        f"[storage] {RETRY_DEADLINE_OPTION} to change that)"
    )


def with_retries(
    fn: Callable[[], T],
    *,
    what: str,
    attempts: int | None = None,
    base_delay: float = 0.2,
    deadline_s: float | None = None,
    store: str | None = None,
    uri: str | None = None,
) -> T:
    """Call ``fn``, retrying transient storage errors with exponential backoff.

    Gives up with a :class:`StorageError` (``what`` should name the URI; ``uri`` goes into it)
    once the next sleep would pass ``deadline_s`` seconds (default
    :data:`DEFAULT_RETRY_DEADLINE_S`) since the first try or, for a ``store``
    (:func:`store_key`), since that store began failing in this process (:class:`RetryClock`);
    or after ``attempts`` tries when given. Missing files, existing files (an exclusive create
    that lost), permission errors and anything that is not a storage failure are raised at once,
    unchanged.
    """
    deadline = DEFAULT_RETRY_DEADLINE_S if deadline_s is None else deadline_s
    start = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        try:
            result = fn()
        except Exception as e:
            if not is_transient(e):
                if is_missing_credentials(e):
                    raise credentials_error(what, e) from e
                raise
            delay, elapsed = next_delay(
                store=store, start=start, attempt=attempt, deadline=deadline, base_delay=base_delay
            )
            if (attempts is not None and attempt >= attempts) or delay < 0:
                raise StorageError(
                    f"{what} failed {gave_up(attempt, elapsed, deadline)}: {type(e).__name__}: {e}",
                    uri=uri,
                ) from e
            # One line per call that starts failing; its later retries at DEBUG (a dead store
            # would otherwise log a line every few seconds for each call waiting on it).
            logger.log(
                logging.WARNING if attempt == 1 else logging.DEBUG,
                "%s failed (%s); retry %d in %.1fs",
                what,
                e,
                attempt,
                delay,
            )
            time.sleep(delay)
        else:
            if store is not None:
                RETRY_CLOCK.succeeded(store)
            return result


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


# --------------------------------------------------------------------------- listing input


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


def _is_glob(path: str) -> bool:
    return any(ch in path for ch in "*?[")


def _glob_root(pattern: str) -> str:
    """The directory part of ``pattern`` before its first wildcard."""
    root = pattern.split("*", 1)[0].split("?", 1)[0].split("[", 1)[0]
    return root if root.endswith("/") else posixpath.dirname(root)


def _find_input(loc: Location, input_uri: str) -> tuple[str, dict[str, Any]]:
    """(root, path -> info) of everything ``loc`` names: a glob, a directory tree or a file."""
    fs = loc.fs
    if _is_glob(loc.path):
        return _glob_root(loc.path), fs.glob(loc.path, detail=True)
    if fs.isdir(loc.path):
        return loc.path, fs.find(loc.path, detail=True)
    if fs.exists(loc.path):
        return posixpath.dirname(loc.path), {loc.path: fs.info(loc.path)}
    raise MissingInputError(f"input {input_uri} does not exist{missing_hint(loc)}", uri=loc.uri)


def nearest_existing(loc: Location) -> tuple[Location, str, list[str]] | None:
    """For a ``loc`` that does not exist: the closest folder above it that does, the name of
    the first path segment below that folder that is missing, and the names of the folder's
    entries (sorted). None when no folder above it exists, or it cannot be told (this is for
    messages only, so storage errors are not raised)."""
    path, uri = loc.path.rstrip("/"), loc.uri.rstrip("/")
    try:
        for _ in range(64):
            head, _, name = path.rpartition("/")
            if not name or not (head or loc.is_local):
                return None  # the filesystem root, or a bucket that does not exist
            parent = Location(loc.fs, head or "/", uri.rpartition("/")[0] or "/")
            # Direct calls, not retried: a hint must not hold a failing run for a deadline.
            if bool(parent.fs.isdir(parent.path)):
                listed = (str(n).rstrip("/") for n in parent.fs.ls(parent.path, detail=False))
                own = parent.path.rstrip("/")
                names = {posixpath.basename(n) for n in listed if n != own}
                return parent, name, sorted(n for n in names if n)
            path, uri = head, uri.rpartition("/")[0]
    except Exception:  # a hint, never a reason to fail differently
        logger.debug("could not find the nearest folder above %s", loc.uri, exc_info=True)
    return None


def missing_hint(loc: Location, *, literal: str | None = None) -> str:
    """``"; <folder> holds no 'x': did you mean <folder>/y?"``: where the missing ``loc``
    stops existing, for the end of a "does not exist" message ("" when nothing above it does).
    A name holding ``literal`` (the date a template filled in) gets no guess: the partitions
    there are listed instead, since another date is not what was meant."""
    found = nearest_existing(loc)
    if found is None:
        return ""
    folder, name, entries = found
    visible = [e for e in entries if not e.startswith(("_", "."))]
    if not visible:
        return f"; {folder.uri} exists but is empty"
    guess = literal is None or literal not in name
    close = difflib.get_close_matches(name, visible, n=1, cutoff=0.7) if guess else []
    if close:
        return f"; {folder.uri} holds no {name!r}: did you mean {folder.child(close[0]).uri}?"
    shown = ", ".join(visible[:3])
    if len(visible) > 3:
        shown += f", ... {visible[-1]} ({len(visible)} in all)"
    return f"; {folder.uri} holds no {name!r}, only {shown}"


def list_shards(
    input_uri: str,
    options: Mapping[str, Any] | None = None,
    *,
    exclude: Sequence[Location] = (),
) -> list[ShardRef]:
    """List input shards deterministically (sorted by path relative to the input root).

    A directory means every ``*.parquet`` file below it, recursively, skipping names that start
    with ``_`` or ``.`` (Spark and Hive write those for metadata); a glob or a single file also
    work. Matching nothing is an :class:`InputError`. A shard whose real path lies inside one of
    the ``exclude`` trees (the run's output and rejects) is a :class:`ConfigError`: a run must
    never read what it writes.
    """
    loc = locate(input_uri, options)
    try:
        root, found = _retry(loc, lambda: _find_input(loc, input_uri), "listing input")
    except (OSError, ValueError) as e:
        raise InputError(f"cannot list input {input_uri}: {e}") from e
    except StorageError as e:
        # The storage service could not be reached or answered with an error (wrong endpoint,
        # network down): not a problem of the input itself, so a failed run (rerun when fixed).
        raise StorageError(f"cannot list input {input_uri}: {e}") from e
    except Exception as e:
        if not is_backend_failure(e):
            raise
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
    if exclude:
        _refuse_shards_inside(input_uri, loc, shards, exclude)
    return shards


def _uri_for(loc: Location, path: str) -> str:
    if loc.is_local:
        return path
    return str(loc.fs.unstrip_protocol(path))


# --------------------------------------------------------------------------- overlap


def real_path(loc: Location) -> Location:
    """``loc`` with symlinks resolved (local disk; object stores have none).

    Works for paths that do not exist yet: the existing part of the path is resolved.
    """
    if not loc.is_local:
        return loc
    real = os.path.realpath(loc.path)
    return Location(loc.fs, real, real, loc.retry_deadline_s)


def _inside(path: str, tree: str) -> bool:
    """True when ``path`` is ``tree`` or lies below it."""
    p, t = path.rstrip("/") + "/", tree.rstrip("/") + "/"
    return p.startswith(t)


def _pattern_reaches(pattern: str, tree: str) -> bool:
    """True when glob ``pattern`` can match ``tree`` itself or a path below it."""
    pat = [p for p in pattern.split("/") if p]
    parts = [p for p in tree.split("/") if p]
    for i, part in enumerate(parts):
        if i >= len(pat):
            return False
        if pat[i] == "**":
            return True
        if not fnmatch.fnmatchcase(part, pat[i]):
            return False
    return True


def _overlap_error(what: str, out: Location, input_uri: str, detail: str) -> ConfigError:
    return ConfigError(
        f"{what} {out.uri} overlaps the input {input_uri} ({detail}): the input is never written "
        f"to, and the next run would read the scores as input. Choose a separate {what}."
    )


def _refuse_shards_inside(
    input_uri: str, inp: Location, shards: Iterable[ShardRef], trees: Sequence[Location]
) -> None:
    resolved = [real_path(t) for t in trees]
    for s in shards:
        path = os.path.realpath(s.uri) if inp.is_local else inp.fs._strip_protocol(s.uri)
        for tree, real in zip(trees, resolved, strict=True):
            if same_filesystem(inp, tree) and _inside(path, real.path):
                raise ConfigError(
                    f"input {input_uri} matches {s.uri}, which lies inside {tree.uri} (real path "
                    f"{path}): the run would read its own output. Choose an input that does "
                    "not reach the output or rejects."
                )


def check_disjoint(
    input_uri: str,
    output_loc: Location,
    rejects_loc: Location,
    *,
    options: Mapping[str, Any] | None = None,
    shards: Sequence[ShardRef] | None = None,
) -> None:
    """Raise :class:`ConfigError` when the input and the output or rejects trees overlap.

    Compared after resolving symlinks (local disk): the output may not lie inside the input's
    directory, the input may not lie inside the output, and an input glob may not be able to
    match anything inside the output. ``shards`` (what :func:`list_shards` found) are checked
    one by one too, which catches a symlink inside the input that points into the output.
    """
    if same_filesystem(output_loc, rejects_loc):
        out_p, rej_p = real_path(output_loc).path, real_path(rejects_loc).path
        # A hidden subfolder (``<output>/_rejects``, the old default) is allowed: dataset
        # readers skip it. A visible one, the output itself, or one around it is not.
        below = posixpath.relpath(rej_p, out_p) if _inside(rej_p, out_p) else None
        if _inside(out_p, rej_p) or (below is not None and not _is_hidden(below)):
            raise ConfigError(
                f"rejects {rejects_loc.uri} overlaps the output {output_loc.uri}: rejected rows "
                "would be read as scores, or a shard's output would replace its rejects. Leave "
                "rejects unset (beside the output template's fixed part: <root's parent>/"
                "_rejects/<root's name>/...) or choose a separate folder."
            )
    inp = locate(input_uri, options)
    for loc, what in ((output_loc, "output"), (rejects_loc, "rejects")):
        if not same_filesystem(inp, loc):
            continue
        out = real_path(loc)
        if _is_glob(inp.path):
            pattern = real_path(Location(inp.fs, _glob_root(inp.path), "")).path.rstrip("/")
            pattern += "/" + inp.path[len(_glob_root(inp.path)) :].lstrip("/")
            if _pattern_reaches(pattern, out.path):
                raise _overlap_error(what, loc, input_uri, f"the glob can match {out.path}")
            if _inside(_glob_root(pattern), out.path):
                raise _overlap_error(what, loc, input_uri, f"the input lies inside {out.path}")
            continue
        src = real_path(inp).path
        if _inside(out.path, src) or _inside(src, out.path):
            raise _overlap_error(what, loc, input_uri, f"real paths {src} and {out.path}")
    if shards:
        _refuse_shards_inside(input_uri, inp, shards, [output_loc, rejects_loc])


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


def input_exists(loc: Location) -> bool:
    """Whether an input location names anything: a file or folder, or, for a glob, a match."""
    if _is_glob(loc.path):
        return bool(_retry(loc, lambda: loc.fs.glob(loc.path), "listing"))
    return exists(loc)


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


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON values: NaN and infinities become null (``NaN`` is not JSON),
    mapping keys str, numpy scalars and arrays Python numbers and lists, anything else str()."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, int, bool)):
        return value
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if getattr(value, "ndim", 0):  # a numpy array
        return jsonable(value.tolist())
    try:  # numpy scalars and the like
        item = value.item()
    except (AttributeError, TypeError, ValueError):
        return str(value)
    return jsonable(item) if isinstance(item, (str, int, float, bool)) else str(value)


def _plain(value: Any) -> Any:
    """``json.dumps``'s fallback for what it cannot encode: numpy values, else str()."""
    if getattr(value, "ndim", 0):
        return value.tolist()
    try:
        item = value.item()
    except (AttributeError, TypeError, ValueError):
        return str(value)
    return item if isinstance(item, (str, int, float, bool)) else str(value)


def to_json(obj: Any, *, compact: bool = False) -> str:
    """``obj`` as strict JSON text (RFC 8259): no ``NaN`` or ``Infinity`` tokens, ever.

    A non-finite float (an undefined statistic) is written as null. Every JSON document the tool
    writes or prints goes through here. The common case (nothing to replace) is one C-encoder
    pass; only a document that holds a non-finite number or an odd key is walked in Python.
    ``compact`` gives one line without spaces (big documents, log lines); otherwise indent 2.
    """
    kwargs: dict[str, Any] = (
        {"separators": (",", ":")} if compact else {"indent": 2, "sort_keys": False}
    )
    try:
        return json.dumps(obj, allow_nan=False, default=_plain, **kwargs)
    except (ValueError, TypeError):  # NaN/inf somewhere, or a key json cannot take
        return json.dumps(jsonable(obj), allow_nan=False, default=_plain, **kwargs)


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


def remove_tree(loc: Location) -> None:
    """Delete the folder ``loc`` and everything below it, if it exists."""

    def _rm() -> None:
        with contextlib.suppress(FileNotFoundError):
            loc.fs.rm(loc.path, recursive=True)

    _retry_write(loc, _rm, "deleting")


def remove_empty_folders(loc: Location) -> None:
    """Delete the folder ``loc`` and the folders below it that hold no file (local disk; object
    stores have no folders). A folder that still holds a file is left alone."""
    if not loc.is_local or not os.path.isdir(loc.path):
        return
    for path, _, _ in os.walk(loc.path, topdown=False):
        with contextlib.suppress(OSError):  # not empty: something in it stays
            os.rmdir(path)


def remove_stale_temporaries(root: Location) -> list[str]:
    """Delete temporary files that a crashed run left below ``root``; returns their paths."""
    return remove_temporaries(root)


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


# --------------------------------------------------------------------------- before a run writes


def is_missing_credentials(e: BaseException) -> bool:
    """Whether ``e`` says the object store client found no usable credentials (botocore's
    ``NoCredentialsError`` and ``PartialCredentialsError``, google-auth's
    ``DefaultCredentialsError``, ...)."""
    return is_backend_failure(e) and any("Credential" in c.__name__ for c in type(e).__mro__)


_CREDENTIAL_HINTS = {
    "s3": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE",
    "gs": "GOOGLE_APPLICATION_CREDENTIALS",
    "abfs": "AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME and _KEY",
}


def credentials_error(what: str, e: BaseException) -> ConfigError:
    """The message for an object store that found no credentials: what, where, how to fix it."""
    proto = next((p for p in _CREDENTIAL_HINTS if f"{p}://" in what), "s3")
    return ConfigError(
        f"{what}: no credentials for {proto}:// storage ({type(e).__name__}: {e}). Set them in "
        f"the environment ({_CREDENTIAL_HINTS[proto]}) or in the job's [storage] table "
        "(key and secret; or --storage-option key=... --storage-option secret=...)"
    )


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


def not_a_folder(what: str, loc: Location, blocker: str) -> StorageError:
    """The error for a ``what`` (output, rejects) location that a file keeps from being a folder."""
    return StorageError(
        f"{what} {loc.uri} is a file or lies under one ({blocker}), not a folder: nothing was "
        f"written. Point {what} at a folder (it is created if absent)."
    )


def check_write_target(loc: Location, what: str, *, create_bucket: bool) -> Location | None:
    """Refuse, before anything is written, a ``what`` (``output``, ``rejects``) location that
    cannot hold a folder: a local path that is a file or lies under one, or an object-store
    path whose bucket does not exist (unless ``create_bucket``: then that bucket is returned,
    for the caller to create with :func:`create_bucket` once it writes)."""
    if loc.is_local:
        blocker = file_in_the_way(loc)
        if blocker is not None:
            raise not_a_folder(what, loc, blocker)
        return None
    bucket = bucket_of(loc)
    if bucket is None or _bucket_exists(bucket):
        return None
    if create_bucket:
        return bucket
    raise ConfigError(
        f"{what} {loc.uri}: bucket {bucket.path!r} does not exist at {bucket.uri}. Check the "
        "name (and the endpoint in [storage]), create the bucket, or set "
        "create_output_bucket = true (--create-output-bucket) to let the run create it"
    )


def _bucket_exists(bucket: Location) -> bool:
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
