"""The README and docs/ against the code and against themselves.

The README is the page a new user reads to the end: short, with the two commands, and links
into docs/ for the reference. These tests keep it that way: its length, every relative link and
anchor in README.md and docs/*.md, every doc reachable from the README, and the flag reference
(docs/flags.md) against ``--help``. The Run report table in docs/report.md is checked against
the JSON Schema in tests/test_report_schema.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli.commands import main
from tests.conftest import REPO

README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_LINES = 200

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)


def _doc_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _prose(text: str) -> str:
    """The text outside fenced code blocks (a ``#`` comment in a block is not a heading)."""
    return _FENCE.sub("", text)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lower case, punctuation removed
    (hyphens and underscores kept), spaces turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").replace("*", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, with GitHub's -1, -2 suffixes for repeats."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for m in _HEADING.finditer(_prose(path.read_text(encoding="utf-8"))):
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    """Relative links of ``path`` whose file, or whose ``#anchor`` in that file, does not exist."""
    text = _CODE_SPAN.sub("", _prose(path.read_text(encoding="utf-8")))
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    return broken


def _help(*args: str) -> str:
    res = CliRunner().invoke(main, [*args, "--help"])
    assert res.exit_code == 0, res.output
    return res.stdout


# ---------------------------------------------------------------- the README


def test_readme_is_short_and_opens_with_the_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    n = len(text.splitlines())
    assert n < README_MAX_LINES, f"README.md has {n} lines; move reference material to docs/"
    quickstart = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    assert "make score-catalog" in quickstart and "make test" in quickstart


def test_every_doc_is_linked_from_the_readme() -> None:
    docs = sorted(DOCS.glob("*.md"))
    assert len(docs) >= 8, "the reference lives in docs/*.md"
    linked = set(re.findall(r"\]\((docs/[^)#\s]+)", README.read_text(encoding="utf-8")))
    missing = [d.name for d in docs if f"docs/{d.name}" not in linked]
    assert not missing, f"README.md links to no {missing}"


@pytest.mark.parametrize("path", _doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(path: Path) -> None:
    assert broken_links(path) == []


def test_the_link_check_finds_a_missing_file_and_a_missing_anchor(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# Title\n\n## `plan` and `report`\n\n## Title\n")
    page = tmp_path / "a.md"
    page.write_text(
        "[ok](b.md) [ok](b.md#plan-and-report) [ok](b.md#title-1) [ok](#here) [web](https://x.y)\n"
        "## Here\n"
        "[gone](c.md) [no anchor](b.md#nowhere) `[in code](d.md)`\n"
        "```\n[in a block](e.md)\n```\n"
    )
    assert broken_links(page) == [
        "c.md (no such file)",
        "b.md#nowhere (no heading #nowhere in b.md)",
    ]


# ---------------------------------------------------------------- docs/flags.md against --help


def test_flag_reference_matches_help() -> None:
    flags_doc = (DOCS / "flags.md").read_text(encoding="utf-8")
    helps = {
        name: _help(*name.split())
        for name in (
            "run",
            "demo",
            "bench",
            "plan",
            "report",
            "backfill",
            "bundle register",
            "bundle check",
            "accept-drift",
            "history",
            "rollback",
            "optimize",
            "vacuum",
        )
    }
    # Every option in the flag table is an option of `run`...
    table = re.findall(r"^\| `(--[a-z][a-z0-9-]+)", flags_doc, flags=re.M)
    assert len(table) >= 20
    for opt in table:
        assert opt in helps["run"], f"docs/flags.md's run table documents {opt}, not in --help"
    # ...every option mentioned anywhere in the docs belongs to some command...
    for path in _doc_files():
        text = path.read_text(encoding="utf-8")
        for opt in set(re.findall(r"`(--[a-z][a-z0-9-]+)", text)) - {"--help", "--version"}:
            assert any(opt in h for h in helps.values()), f"{path.name} documents unknown {opt}"
    # ...and every `run` option has a row in the table.
    for opt in re.findall(r"^\s+(--[a-z][a-z0-9-]+)", helps["run"], flags=re.M):
        if opt not in ("--help", "--verbose", "--quiet"):
            assert opt in table, f"`run {opt}` has no row in docs/flags.md"
