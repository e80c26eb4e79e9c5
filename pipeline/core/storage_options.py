"""Which options an fsspec filesystem takes: the job's ``[storage]`` table checked before any
location is opened, and the one option that is this tool's own (the retry deadline).

Reads fsspec's registry only (a protocol's filesystem class and its constructors' parameters);
it never opens a filesystem: that is :mod:`pipeline.io.storage`'s, the one module that talks to
storage. Here so that the job configuration (``pipeline.core.config``) can name a misspelt
option with every other problem of the job, before anything runs.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Iterable, Mapping
from typing import Any

# fsspec is imported inside the functions: the command line reads the job configuration (and
# so this module) before --help, and importing fsspec costs about 70 ms here.

#: Total time a storage call may spend retrying transient errors before it gives up.
DEFAULT_RETRY_DEADLINE_S = 60.0
#: The ``[storage]`` key that overrides it for a job; taken out before the options reach fsspec.
RETRY_DEADLINE_OPTION = "retry_deadline_s"


def is_local_uri(uri: str) -> bool:
    """Whether ``uri`` is a local path (or ``file://``), without building a filesystem."""
    import fsspec.utils

    return "::" not in uri and fsspec.utils.get_protocol(uri) in ("file", "local")


# Options every fsspec filesystem takes besides its constructor's own (the instance and
# listings caches of AbstractFileSystem), and this module's retry bound.
_COMMON_OPTIONS = frozenset(
    {
        RETRY_DEADLINE_OPTION,
        "skip_instance_cache",
        "use_listings_cache",
        "listings_expiry_time",
        "max_paths",
    }
)


@functools.cache
def filesystem_options(protocol: str) -> frozenset[str] | None:
    """The option names the filesystem of ``protocol`` takes: the named parameters of its
    constructors (``S3FileSystem(endpoint_url=..., key=...)``). None when its class cannot be
    loaded here (its package is missing: :func:`locate` says so) or is unknown."""
    import fsspec

    try:
        cls = fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError):
        return None
    names = set(_COMMON_OPTIONS)
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    for c in cls.__mro__:
        init = c.__dict__.get("__init__")
        if init is None:
            continue
        try:
            params = inspect.signature(init).parameters
        except (TypeError, ValueError):  # pragma: no cover - a C constructor
            continue
        names.update(n for n, p in params.items() if p.kind in kinds and n != "self")
    return frozenset(names)


def unknown_options(uris: Iterable[str], options: Mapping[str, Any]) -> list[str]:
    """Problems naming each key of ``options`` that no object store among ``uris`` takes.

    The same options go to every location of a job, so a key is fine when one of its object
    stores takes it. A job on local paths only is not checked: fsspec's local filesystem
    ignores options it does not know, where an object store's client raises a ``TypeError``
    deep in its first request.
    """
    import fsspec.utils

    protocols = set()
    for uri in uris:
        if "::" in uri:
            return []  # a chained URL: options go to the chain's layers, not checked here
        proto = fsspec.utils.get_protocol(uri)
        if proto not in ("file", "local"):
            protocols.add(proto)
    known: set[str] = set()
    for proto in protocols:
        names = filesystem_options(proto)
        if names is None:
            return []
        known |= names
    bad = sorted(key for key in options if key not in known)
    if not protocols or not bad:
        return []
    where = ", ".join(f"{p}://" for p in sorted(protocols))
    guesses = [
        f"{key!r} -> {close[0]!r}"
        for key in bad
        if (close := difflib.get_close_matches(key, sorted(known), n=1))
    ]
    named = ", ".join(repr(k) for k in bad)
    return [
        f"storage option{'s' if len(bad) > 1 else ''} {named} "
        f"{'are not options' if len(bad) > 1 else 'is not an option'} of {where} storage"
        + (f" (did you mean {', '.join(guesses)}?)" if guesses else "")
        + f"; known: {', '.join(sorted(known))}"
    ]
