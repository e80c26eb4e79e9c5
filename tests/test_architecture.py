"""The package's shape, checked: the import graph has no cycle (imports inside functions and
under TYPE_CHECKING counted), storage imports nothing of pipeline but core, every subpackage
says what it owns and may import, and ``--help`` imports no torch, pyarrow or Dask.

``lint-imports`` (``make lint``) keeps the layers contract; this checks what a contract cannot
state as well, from the same graph (grimp, which import-linter uses).
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grimp
import pytest

REPO = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("core", "io", "model", "worker", "report", "driver", "cli")


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("pipeline", include_external_packages=False)


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def out(module: str) -> Iterator[str]:
        return iter(sorted(graph.find_modules_directly_imported_by(module)))

    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, out(root))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append(
                        (child, iter(sorted(graph.find_modules_directly_imported_by(child))))
                    )
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_is_part_of_an_import_cycle(graph: grimp.ImportGraph) -> None:
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle(graph: grimp.ImportGraph) -> None:
    graph.add_import(importer="pipeline.io.storage", imported="pipeline.io.layout")
    try:
        assert ["pipeline.io.layout", "pipeline.io.storage"] in _cycles(graph)
    finally:
        graph.remove_import(importer="pipeline.io.storage", imported="pipeline.io.layout")


def test_storage_imports_nothing_of_pipeline_but_core(graph: grimp.ImportGraph) -> None:
    imported = graph.find_modules_directly_imported_by("pipeline.io.storage")
    assert imported and all(m.startswith("pipeline.core.") for m in imported), imported


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_every_subpackage_says_what_it_owns_and_may_import(name: str) -> None:
    doc = importlib.import_module(f"pipeline.{name}").__doc__ or ""
    assert len(doc.split()) > 20
    assert "import" in doc  # what it may import, and what may import it


@pytest.mark.parametrize("command", [[], ["run"], ["plan"], ["backfill"], ["report"]])
def test_help_imports_no_torch_pyarrow_or_dask(command: list[str]) -> None:
    code = (
        "import json, sys\n"
        "from pipeline.cli.commands import main\n"
        f"sys.argv = ['score-catalog', *{command!r}, '--help']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = ('torch', 'pyarrow', 'dask', 'distributed', 'numpy', 'fsspec')\n"
        "print(json.dumps([m for m in heavy if m in sys.modules]), file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    )
    loaded = json.loads(done.stderr.strip().splitlines()[-1])
    assert not {"torch", "pyarrow", "dask", "distributed"} & set(loaded), loaded


def test_every_pipeline_module_loaded_comes_from_this_checkout() -> None:
    # A shared virtual environment with another checkout installed in editable mode answers
    # an import of a module this checkout no longer has (a module that moved) from that other
    # checkout, silently. By the time this runs every test module has been collected, so their
    # imports are in sys.modules too.
    root = REPO / "pipeline"
    foreign = {
        name: getattr(module, "__file__", None)
        for name, module in list(sys.modules.items())
        if (name == "pipeline" or name.startswith("pipeline."))
        and getattr(module, "__file__", None)
        and not Path(module.__file__).resolve().is_relative_to(root)
    }
    assert not foreign, foreign


def test_a_module_over_600_lines_says_why() -> None:
    for path in sorted((REPO / "pipeline").rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        if len(lines) > 620:  # "about 600"
            head = "\n".join(lines[:40])
            assert "on purpose" in head and "line" in head, (path, len(lines))
