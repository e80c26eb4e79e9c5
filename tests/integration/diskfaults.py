"""Real storage failures for the tests: a full disk and a folder that stops being writable.

Nothing is mocked: the CLI under test gets the kernel's own errors.

- A full disk is a tmpfs of a few KiB mounted where the test writes (``ENOSPC``). Mounting
  needs root with the right to mount (``CAP_SYS_ADMIN``, which this project's test containers
  have); elsewhere the test skips, saying so.
- A folder that stops being writable: as root, a tmpfs remounted read-only (``EROFS``; root
  ignores file modes, so ``chmod`` would not stop it); as any other user, ``chmod a-w``
  (``EACCES``).

A test breaks the storage at a precise moment of a run by holding the run at a named point
meanwhile (:class:`tests.integration.helpers.Pause`), then lets it go on.
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=False)


@functools.cache
def can_mount() -> bool:
    """Whether this process may mount a tmpfs (root with ``CAP_SYS_ADMIN``)."""
    if os.geteuid() != 0:
        return False
    with tempfile.TemporaryDirectory(prefix="score-catalog-mount-") as d:
        if _run("mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", d).returncode != 0:
            return False
        _run("umount", "-l", d)
    return True


def _unmount(path: Path) -> None:
    _run("umount", "-l", str(path))


@contextlib.contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    """A filesystem of ``size`` (``64k``) at ``path`` while the block runs: writes beyond it fail
    with ``ENOSPC``. Skips the test where this process cannot mount one."""
    if not can_mount():
        pytest.skip("a full disk needs a tmpfs mount: root with CAP_SYS_ADMIN")
    path.mkdir(parents=True, exist_ok=True)
    done = _run("mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path))
    assert done.returncode == 0, done.stderr
    try:
        yield path
    finally:
        _unmount(path)


@contextlib.contextmanager
def breakable_folder(path: Path) -> Iterator[Callable[[], str]]:
    """A writable folder at ``path``, and a function that makes it unwritable from then on
    (returning the ``strerror`` writes will fail with). Restored when the block ends."""
    root = os.geteuid() == 0
    if root and not can_mount():
        pytest.skip("root ignores file modes: a read-only folder needs a tmpfs mount")
    path.mkdir(parents=True, exist_ok=True)
    if root:
        done = _run("mount", "-t", "tmpfs", "-o", "size=16m,mode=0755", "tmpfs", str(path))
        assert done.returncode == 0, done.stderr

    def break_it() -> str:
        if root:
            done = _run("mount", "-o", "remount,ro", str(path))
            assert done.returncode == 0, done.stderr
            return os.strerror(30)  # EROFS: Read-only file system
        path.chmod(0o555)
        return os.strerror(13)  # EACCES: Permission denied

    try:
        yield break_it
    finally:
        if root:
            _unmount(path)
        else:
            path.chmod(0o755)
