"""pyproject.toml builds without warnings with the setuptools it asks for (issue 22, item 9).

The ``license`` table made setuptools warn on every build that builds stop working after
2027-02-18; the SPDX string form needs setuptools 77 (PEP 639), so the build requires it. The
metadata is built here by the environment's setuptools, from a copy of the project (a build
leaves ``*.egg-info`` behind), through the same PEP 517 hook pip calls.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_FIRST_WITH_SPDX = (77,)  # setuptools 77.0: project.license as an SPDX expression


def _floor(requirement: str) -> tuple[int, ...]:
    name, _, version = requirement.partition(">=")
    assert name.strip() == "setuptools", requirement
    return tuple(int(part) for part in version.strip().split("."))


def test_the_build_asks_for_a_setuptools_that_reads_its_license() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    assert project["project"]["license"] == "Apache-2.0"  # an SPDX expression, not a table
    (requirement,) = project["build-system"]["requires"]
    assert _floor(requirement) >= _FIRST_WITH_SPDX


def test_the_metadata_builds_without_a_warning(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO / "pipeline", src / "pipeline", ignore=skip)
    out = tmp_path / "meta"
    out.mkdir()
    hook = (
        "import sys; from setuptools import build_meta; "
        "print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))"
    )
    done = subprocess.run(
        [sys.executable, "-W", "always", "-c", hook, str(out)],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "Warning" not in done.stderr and "deprecated" not in done.stderr, done.stderr
    dist_info = out / done.stdout.strip().splitlines()[-1]
    metadata = (dist_info / "METADATA").read_text(encoding="utf-8")
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    entry_points = (dist_info / "entry_points.txt").read_text(encoding="utf-8")
    # The console script enters through the launcher that routes signals first.
    assert "score-catalog = pipeline.cli.launch:main" in entry_points.splitlines()
