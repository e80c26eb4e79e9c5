"""Running the real CLI in a subprocess and comparing output trees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[2]


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `score-catalog ARGS` as a real process (python -m pipeline.cli)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SCORE_CATALOG_")}
    full_env.pop("_SCORE_CATALOG_KILL_AT", None)
    full_env.update(env or {})
    full_env.setdefault("PYTHONPATH", str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=cwd or REPO,
    )


def job_args(inp: Path | str, out: Path | str, model: Path | str, *extra: str) -> list[str]:
    """``--input INP --output OUT --model MODEL EXTRA...`` for run, plan and friends."""
    return ["--input", str(inp), "--output", str(out), "--model", str(model), *extra]


def report(out: Path) -> dict[str, Any]:
    return json.loads((out / "_report.json").read_text())


def data_files(root: Path) -> list[Path]:
    """Files a dataset reader sees: *.parquet with no _ or . path component."""
    if not root.exists():
        return []
    return sorted(
        p
        for p in root.rglob("*.parquet")
        if not any(part.startswith(("_", ".")) for part in p.relative_to(root).parts)
    )


def read_tree(root: Path) -> dict[str, pa.Table]:
    return {str(p.relative_to(root)): pq.read_table(p) for p in data_files(root)}


def temporaries(*roots: Path) -> list[Path]:
    return [p for r in roots if r.exists() for p in r.rglob("*") if ".tmp-" in p.name]
