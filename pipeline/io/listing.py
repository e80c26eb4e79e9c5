"""Input shards: what a run reads, and the rule that it never reads what it writes.

A directory means every ``*.parquet`` file below it, recursively, skipping names that start with
``_`` or ``.`` (Spark and Hive write those for metadata); a glob or a single file also work. Each
shard is listed with its fingerprint (size and modification time or ETag). An input that does
not exist says where it stops existing (:func:`missing_hint`). :func:`check_disjoint` refuses an
input that overlaps the output or the rejects, after resolving symlinks.
"""

from __future__ import annotations

import difflib
import fnmatch
import logging
import posixpath
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.core import retries
from pipeline.core.errors import ConfigError, InputError, MissingInputError, StorageError
from pipeline.io import storage
from pipeline.io.storage import Location

logger = logging.getLogger(__name__)


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
            parent = storage.Location(loc.fs, head or "/", uri.rpartition("/")[0] or "/")
            # Not retried: a hint must not hold a failing run for a deadline.
            names = storage.names_once(parent)
            if names is not None:
                return parent, name, names
            path, uri = head, uri.rpartition("/")[0]
    except Exception:  # a hint, never a reason to fail differently
        logger.debug("could not find the nearest folder above %s", loc.uri, exc_info=True)
    return None


#: How many partitions a "holds no ..." hint lists in full.
_LISTED = 5


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
    # A few are listed in full; more are cut to the first three and the last (a "..." that
    # elides nothing, with four, read as if some were left out).
    shown = ", ".join(visible if len(visible) <= _LISTED else visible[:3])
    if len(visible) > _LISTED:
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
    loc = storage.locate(input_uri, options)
    try:
        named = storage.find_named(loc, glob=_is_glob(loc.path))
        if named is None:
            hint = missing_hint(loc)
            raise MissingInputError(f"input {input_uri} does not exist{hint}", uri=loc.uri)
        root, found = named
    except (OSError, ValueError) as e:
        raise InputError(f"cannot list input {input_uri}: {e}") from e
    except StorageError as e:
        # The storage service could not be reached or answered with an error (wrong endpoint,
        # network down): not a problem of the input itself, so a failed run (rerun when fixed).
        raise StorageError(f"cannot list input {input_uri}: {e}") from e
    except Exception as e:
        if not retries.is_backend_failure(e):
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
                uri=storage.uri_of(loc, path),
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


def input_exists(loc: Location) -> bool:
    """Whether an input location names anything: a file or folder, or, for a glob, a match."""
    if _is_glob(loc.path):
        return bool(storage.glob(loc))
    return storage.exists(loc)


# --------------------------------------------------------------------------- overlap


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
    resolved = [storage.real_path(t) for t in trees]
    for s in shards:
        path = storage.real_path(storage.sibling(inp, s.uri)).path
        for tree, real in zip(trees, resolved, strict=True):
            if storage.same_filesystem(inp, tree) and _inside(path, real.path):
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
    if storage.same_filesystem(output_loc, rejects_loc):
        out_p, rej_p = storage.real_path(output_loc).path, storage.real_path(rejects_loc).path
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
    inp = storage.locate(input_uri, options)
    for loc, what in ((output_loc, "output"), (rejects_loc, "rejects")):
        if not storage.same_filesystem(inp, loc):
            continue
        out = storage.real_path(loc)
        if _is_glob(inp.path):
            root = storage.Location(inp.fs, _glob_root(inp.path), "")
            pattern = storage.real_path(root).path.rstrip("/")
            pattern += "/" + inp.path[len(_glob_root(inp.path)) :].lstrip("/")
            if _pattern_reaches(pattern, out.path):
                raise _overlap_error(what, loc, input_uri, f"the glob can match {out.path}")
            if _inside(_glob_root(pattern), out.path):
                raise _overlap_error(what, loc, input_uri, f"the input lies inside {out.path}")
            continue
        src = storage.real_path(inp).path
        if _inside(out.path, src) or _inside(src, out.path):
            raise _overlap_error(what, loc, input_uri, f"real paths {src} and {out.path}")
    if shards:
        _refuse_shards_inside(input_uri, inp, shards, [output_loc, rejects_loc])
