"""Issue 13: progress by rows. Workers report rows scored as they go, so the progress bar and
its ETA move inside one big shard instead of jumping from 0% to 100% when it ends.

One shard of 200,000 rows in 2,000-row row groups, scored by a wider MLP (16-768-768-2) so that
the shard takes seconds on any CPU: through the library API on the embedded Dask cluster (the
reports travel as Dask events) and in this process (``sync``), and through the real CLI on a
pseudo-terminal, where the bar must show rows done while no shard is finished yet.
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import time
from pathlib import Path

import pytest

from pipeline import JobConfig, run
from pipeline.cli.demo import export_bundle
from pipeline.worker.events import PROGRESS_INTERVAL_S
from tests.conftest import demo_toml, make_model, write_shards
from tests.integration.helpers import cli_argv, cli_env, job_args

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROWS = 200_000


@pytest.fixture(scope="module")
def one_big_shard(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("big") / "catalog"
    write_shards(root, [ROWS], row_group_rows=2_000)
    return root


@pytest.fixture(scope="module")
def wide_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("wide")
    export_bundle(make_model(hidden=(768, 768)), d, demo_toml(), n_in=16)
    return d


@pytest.mark.parametrize("scheduler", ["local", "sync"])
def test_rows_are_reported_while_one_big_shard_is_scored(
    scheduler: str, one_big_shard: Path, wide_bundle: Path, tmp_path: Path
) -> None:
    events: list[tuple[str, str, int, float]] = []
    t0 = time.monotonic()
    report = run(
        JobConfig(
            input=str(one_big_shard),
            output=str(tmp_path / "out"),
            model=str(wide_bundle),
            scheduler=scheduler,
            workers=1,
            batch_size=1024,
        ),
        on_rows=lambda rel, n: events.append(("rows", rel, n, time.monotonic() - t0)),
        on_shard=lambda r: events.append(
            ("shard", r.rel_path, r.rows_in or 0, time.monotonic() - t0)
        ),
    )
    assert report.status == "succeeded", report["failure_reasons"]
    assert events[-1][:3] == ("shard", "part-00000.parquet", ROWS)
    reports = events[:-1]
    assert all(kind == "rows" and rel == "part-00000.parquet" for kind, rel, _, _ in reports)
    rows = [n for _, _, n, _ in reports]
    took = report["shards"][0]["duration_s"]
    # One report per PROGRESS_INTERVAL_S while the shard is scored, the first after one interval.
    assert len(rows) >= 2, (took, events)
    assert len(rows) <= took / PROGRESS_INTERVAL_S + 1, (took, events)
    assert rows == sorted(rows) and len(set(rows)) == len(rows)  # moving forward
    # Inside the shard (the last report may come after its last batch: all of its rows).
    assert 0 < rows[0] < ROWS and rows[-1] <= ROWS
    # Whole batches; the last may be all of the shard's rows, which end in a partial batch (a
    # report timed right after it: rare, likelier on a busy machine).
    assert all(n % 1024 == 0 for n in rows[:-1])
    assert rows[-1] % 1024 == 0 or rows[-1] == ROWS


def test_the_cli_bar_moves_inside_one_shard_on_a_terminal(
    one_big_shard: Path, wide_bundle: Path, tmp_path: Path
) -> None:
    import pty

    args = ["run", *job_args(one_big_shard, tmp_path / "out", wide_bundle)]
    args += ["--scheduler", "local", "--workers", "1", "--batch-size", "1024"]
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            cli_argv(*args),
            env=cli_env({"COLUMNS": "160"}),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=slave,
            close_fds=True,
        )
        os.close(slave)
        slave = -1
        chunks: list[bytes] = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        stdout, _ = proc.communicate(timeout=60)
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)
    text = b"".join(chunks).decode("utf-8", "replace")
    assert proc.returncode == 0, (text, stdout)
    inside = [
        int(m.group(1).replace(",", ""))
        for m in re.finditer(r"([\d,]+)/200,000 rows  0/1 shards", text)
    ]
    moving = sorted({n for n in inside if 0 < n < ROWS})
    assert len(moving) >= 2, text  # the bar moved at least twice before the shard finished
    assert "200,000/200,000 rows  1/1 shards" in text
    percents = {int(p) for p in re.findall(r"\]\s+(\d+)%", text)}
    assert any(0 < p < 100 for p in percents), text


_LINE = re.compile(
    r"INFO progress: ([\d,]+)/200,000 rows \((\d+)%\), (\d)/1 shards, ([\d,]+) rows/s, "
    r"ETA (\S+(?: \S+)?)$"
)


def test_progress_lines_when_stderr_is_not_a_terminal(
    one_big_shard: Path, wide_bundle: Path, tmp_path: Path
) -> None:
    """Issue 22: cron's log showed nothing between "loaded model" and the summary. Where no bar
    can be drawn, a line every --progress-interval seconds: rows done inside the shard, rate,
    ETA; in JSON mode a record with those fields; none with -q."""
    args = ["run", *job_args(one_big_shard, tmp_path / "out", wide_bundle)]
    args += ["--scheduler", "local", "--workers", "1", "--batch-size", "1024", "--force"]
    args += ["--progress-interval", "0.5"]

    def run_cli(*extra: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            cli_argv(*args, *extra), env=cli_env(), capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
        return done

    text = run_cli().stderr
    found = [m for ln in text.splitlines() if (m := _LINE.search(ln))]
    inside = [m for m in found if m.group(3) == "0" and int(m.group(1).replace(",", "")) > 0]
    assert inside, text  # rows moved while the one shard was still being scored
    assert all(int(m.group(4).replace(",", "")) > 0 and m.group(5) != "unknown" for m in inside)
    assert "\r" not in text and "\x1b" not in text  # lines, not a bar

    records = [json.loads(ln) for ln in run_cli("--log-format", "json").stderr.splitlines()]
    progress = [r for r in records if r["event"] == "progress"]
    moving = [r for r in progress if r["shards_done"] == 0 and 0 < r["rows"] < ROWS]
    assert moving, progress
    for r in moving:
        assert r["rows_total"] == ROWS and r["shards_total"] == 1 and r["level"] == "info"
        assert (
            r["rows_per_s"] > 0
            and r["eta_s"] >= 0
            and r["percent"] == round(100 * r["rows"] / ROWS, 1)
        )

    quiet = run_cli("-q")
    assert quiet.stderr == "" and quiet.stdout == ""
