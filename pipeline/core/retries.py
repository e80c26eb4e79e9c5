"""One retry layer for every storage call: what is transient, what is a failure of the storage
itself, and how long a store may keep failing before a run gives up on it.

:func:`with_retries` retries transient errors with exponential backoff, bounded by a total time
(``retry_deadline_s``, default :data:`~pipeline.core.storage_options.DEFAULT_RETRY_DEADLINE_S`;
a job can set it in its ``[storage]`` table), and :class:`RetryClock` makes that one deadline per
store and process rather than one per call. s3fs and botocore each retry on their own by default
(s3fs 5 times around botocore's 5 attempts: up to 25 requests per call, and no bound on the total
time a caller can state), so :func:`pipeline.io.storage.locate` turns both off for ``s3://``:
every request is tried once underneath and retried here, with one deadline and one message
naming the URI. No fsspec and no I/O here (so it sits in core, where every layer reaches it):
:mod:`pipeline.io.storage` calls fsspec and wraps each call in this.
"""

from __future__ import annotations

import errno
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from pipeline.core.errors import ConfigError, StorageError
from pipeline.core.storage_options import DEFAULT_RETRY_DEADLINE_S, RETRY_DEADLINE_OPTION

logger = logging.getLogger(__name__)

T = TypeVar("T")
_MAX_DELAY_S = 8.0  # longest single back-off sleep

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
