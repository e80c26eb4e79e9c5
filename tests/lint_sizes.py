"""The size rule of ``make lint``: no module of ``pipeline/`` over :data:`MAX_MODULE_LINES`
lines, no function or method over :data:`MAX_FUNCTION_LINES` lines (its ``def`` line to its
last line, docstring and comments included: what a reader has to hold on one screen; a Click
command's option decorators are declarations, not counted).

Run as ``python -m tests.lint_sizes pipeline``; exits 1 listing every offender. Neither ruff nor
mypy counts lines of a module or a function (ruff's PLR0915 counts statements), so the rule is
these few lines of ``ast``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 80


def offenders(root: Path) -> list[str]:
    """Every module and function under ``root`` over its limit, as ``path:line: what``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
        if lines > MAX_MODULE_LINES:
            found.append(f"{path}:1: module of {lines} lines (limit {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    found.append(
                        f"{path}:{node.lineno}: function {node.name} of {n} lines "
                        f"(limit {MAX_FUNCTION_LINES})"
                    )
    return found


def main(argv: list[str]) -> int:
    found = [o for root in argv or ["pipeline"] for o in offenders(Path(root))]
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} over the size rule: split them")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
