"""Issue 13: progress by rows. Workers report rows scored as they go, so the progress bar and
its ETA move inside one big shard instead of jumping from 0% to 100% when it ends.

One shard of 20,000 rows in 2,000-row row groups, scored in batches of 1,024: through the library
API on the embedded Dask cluster (the reports travel as Dask events) and in this process
(``sync``), and through the real CLI on a pseudo-terminal, where the bar must show rows done
while no shard is finished yet.

A worker reports at most every ``PROGRESS_INTERVAL_S``, so a shard shows progress only if it
lasts longer than that: these tests used to score 200,000 rows with a wide model so that it
took seconds "on any CPU", which a faster machine breaks. Instead the scoring process is held
at fault points (``_SCORE_CATALOG_PAUSE_AT``) before batches 2, 6 and 10, each for one
interval (so the report after that batch is due) and, from the second on, until the report
before it has reached what the test looks at (the run's callback, the bar, the log): reports
inside the shard on any machine, however fast.
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline import JobConfig, run
from pipeline.worker.events import PROGRESS_INTERVAL_S
from tests.conftest import write_shards
from tests.integration.helpers import PAUSE_AT, Pause, cli_argv, cli_env, job_args, pause_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROWS = 20_000
BATCH = 1_024
HELD_AT = (2, 6, 10)  # before these batches; the reports after them: 2,048, 6,144 and 10,240 rows


@pytest.fixture(scope="module")
def one_big_shard(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("big") / "catalog"
    write_shards(root, [ROWS], row_group_rows=2_000)
    return root


class _Steer(threading.Thread):
    """Lets a run held at ``pauses`` (in order) go on one at a time: each once it has held the
    run for ``PROGRESS_INTERVAL_S`` and ``seen()`` shows the text that the pause before it
    asked for (``needs[i]``, or nothing). A failure is kept in :attr:`error` for the test."""

    def __init__(self, pauses: list[Pause], needs: list[str | None], seen: Callable[[], str]):
        super().__init__(daemon=True)
        self.steps = list(zip(pauses, needs, strict=True))
        self.seen = seen
        self.error: AssertionError | None = None

    def run(self) -> None:
        try:
            for pause, need in self.steps:
                pause.wait()
                held = time.monotonic()
                deadline = held + 180  # a safety net only: the run is held, waiting for us
                while need is not None and need not in self.seen():
                    assert time.monotonic() < deadline, f"{need!r} never shown:\n{self.seen()}"
                    time.sleep(0.01)
                # Held this long, the worker's last report is at least an interval old: the
                # batch after the pause sends one.
                time.sleep(max(0.0, held + PROGRESS_INTERVAL_S - time.monotonic()))
                pause.release()
        except AssertionError as e:
            self.error = e
            for pause, _ in self.steps:  # let the run end: the test fails with this error
                pause.release()

    def check(self) -> None:
        self.join(60)
        if self.error is not None:
            raise self.error
        assert not self.is_alive(), "the run ended before it got to every pause"


def _held(pauses: Callable[..., Pause]) -> list[Pause]:
    return [pauses("batch-read", n) for n in HELD_AT]


def _rows(n: int) -> str:
    """A row count as the bar and the log lines print it, inside the one shard."""
    return f"{n:,}/{ROWS:,} rows"


@pytest.mark.parametrize("scheduler", ["local", "sync"])
def test_rows_are_reported_while_one_big_shard_is_scored(
    scheduler: str,
    one_big_shard: Path,
    bundle_dir: Path,
    tmp_path: Path,
    pauses: Callable[..., Pause],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[tuple[str, str, int, float]] = []
    held = _held(pauses)
    # In this process (sync) and in the cluster's workers, which start from this environment.
    monkeypatch.setenv(PAUSE_AT, pause_env(*held)[PAUSE_AT])
    steer = _Steer(
        held,
        [None, *(f"rows {n * BATCH};" for n in HELD_AT[:-1])],
        lambda: "".join(f"{kind} {n};" for kind, _, n, _ in list(events)),
    )
    steer.start()
    t0 = time.monotonic()
    report = run(
        JobConfig(
            input=str(one_big_shard),
            output=str(tmp_path / "out"),
            model=str(bundle_dir),
            scheduler=scheduler,
            workers=1,
            batch_size=BATCH,
        ),
        on_rows=lambda rel, n: events.append(("rows", rel, n, time.monotonic() - t0)),
        on_shard=lambda r: events.append(
            ("shard", r.rel_path, r.rows_in or 0, time.monotonic() - t0)
        ),
    )
    steer.check()
    assert report.status == "succeeded", report["failure_reasons"]
    assert events[-1][:3] == ("shard", "part-00000.parquet", ROWS)
    reports = events[:-1]
    assert all(kind == "rows" and rel == "part-00000.parquet" for kind, rel, _, _ in reports)
    rows = [n for _, _, n, _ in reports]
    took = report["shards"][0]["duration_s"]
    # The reports due after each pause, and no more than one per PROGRESS_INTERVAL_S.
    assert {n * BATCH for n in HELD_AT} <= set(rows), (took, events)
    assert len(rows) <= took / PROGRESS_INTERVAL_S + 1, (took, events)
    assert rows == sorted(rows) and len(set(rows)) == len(rows)  # moving forward
    # Inside the shard (the last report may come after its last batch: all of its rows).
    assert 0 < rows[0] < ROWS and rows[-1] <= ROWS
    # Whole batches; the last may be all of the shard's rows, which end in a partial batch (a
    # report timed right after it: rare, likelier on a busy machine).
    assert all(n % BATCH == 0 for n in rows[:-1])
    assert rows[-1] % BATCH == 0 or rows[-1] == ROWS


def test_the_cli_bar_moves_inside_one_shard_on_a_terminal(
    one_big_shard: Path, bundle_dir: Path, tmp_path: Path, pauses: Callable[..., Pause]
) -> None:
    import pty

    args = ["run", *job_args(one_big_shard, tmp_path / "out", bundle_dir)]
    args += ["--scheduler", "local", "--workers", "1", "--batch-size", str(BATCH)]
    held = _held(pauses)
    chunks: list[bytes] = []

    def shown() -> str:
        return b"".join(list(chunks)).decode("utf-8", "replace")

    # Each pause after the first waits until the bar has drawn the report before it.
    steer = _Steer(held, [None, *(_rows(n * BATCH) for n in HELD_AT[:-1])], shown)
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            cli_argv(*args),
            env=cli_env({"COLUMNS": "160", **pause_env(*held)}),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=slave,
            close_fds=True,
        )
        os.close(slave)
        slave = -1
        steer.start()
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
    steer.check()
    text = shown()
    assert proc.returncode == 0, (text, stdout)
    inside = [
        int(m.group(1).replace(",", ""))
        for m in re.finditer(rf"([\d,]+)/{ROWS:,} rows  0/1 shards", text)
    ]
    moving = sorted({n for n in inside if 0 < n < ROWS})
    assert len(moving) >= 2, text  # the bar moved at least twice before the shard finished
    assert f"{ROWS:,}/{ROWS:,} rows  1/1 shards" in text
    percents = {int(p) for p in re.findall(r"\]\s+(\d+)%", text)}
    assert any(0 < p < 100 for p in percents), text


_LINE = re.compile(
    rf"INFO progress: ([\d,]+)/{ROWS:,} rows \((\d+)%\), (\d)/1 shards, ([\d,]+) rows/s, "
    r"ETA (\S+(?: \S+)?)$"
)


def test_progress_lines_when_stderr_is_not_a_terminal(
    one_big_shard: Path, bundle_dir: Path, tmp_path: Path, pauses: Callable[..., Pause]
) -> None:
    """Issue 22: cron's log showed nothing between "loaded model" and the summary. Where no bar
    can be drawn, a line every --progress-interval seconds: rows done inside the shard, rate,
    ETA; in JSON mode a record with those fields; none with -q."""
    args = ["run", *job_args(one_big_shard, tmp_path / "out", bundle_dir)]
    args += ["--scheduler", "local", "--workers", "1", "--batch-size", str(BATCH), "--force"]
    args += ["--progress-interval", "0.5"]

    def run_cli(*extra: str, inside: Callable[[int], str] | None = None) -> tuple[str, str]:
        """The run's stdout and stderr; with ``inside``, held at each pause until its stderr
        holds ``inside(rows)`` for the rows reported before it."""
        err = tmp_path / f"stderr-{len(list(tmp_path.glob('stderr-*')))}"
        held = _held(pauses) if inside is not None else []
        with err.open("w") as sink:
            proc = subprocess.Popen(
                cli_argv(*args, *extra),
                env=cli_env(pause_env(*held) if held else None),
                stdout=subprocess.PIPE,
                stderr=sink,
                text=True,
            )
            if inside is not None:
                needs = [None, *(inside(n * BATCH) for n in HELD_AT[:-1])]
                steer = _Steer(held, needs, lambda: err.read_text(errors="replace"))
                steer.start()
            stdout, _ = proc.communicate(timeout=300)
            if inside is not None:
                steer.check()
        stderr = err.read_text()
        assert proc.returncode == 0, stderr
        return stdout, stderr

    # The log line (every 0.5 s) that shows the rows reported before the pause, no shard done.
    _, text = run_cli(inside=lambda n: f"progress: {_rows(n)} (")
    found = [m for ln in text.splitlines() if (m := _LINE.search(ln))]
    inside = [m for m in found if m.group(3) == "0" and int(m.group(1).replace(",", "")) > 0]
    assert inside, text  # rows moved while the one shard was still being scored
    assert all(int(m.group(4).replace(",", "")) > 0 and m.group(5) != "unknown" for m in inside)
    assert "\r" not in text and "\x1b" not in text  # lines, not a bar

    _, text = run_cli("--log-format", "json", inside=lambda n: f"progress: {_rows(n)} (")
    records = [json.loads(ln) for ln in text.splitlines()]
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

    stdout, stderr = run_cli("-q")
    assert stderr == "" and stdout == ""
