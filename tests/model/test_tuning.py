"""Tests for pipeline.model.tuning (batch-size sweeps, auto choice, cache) and the bench command.

No mocks: the models are real bundles, and where a test needs throughput it can predict, the
model is a plain function that sleeps a controlled time per call.
"""

from __future__ import annotations

import json
import logging
import math
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from pipeline.cli.bench import bench
from pipeline.core.errors import EXIT_INPUT, EXIT_USAGE
from pipeline.model import tuning
from pipeline.model.program import LoadedModel, forward, load_model
from pipeline.model.tuning import (
    BatchSizeCache,
    BenchRow,
    bench_batch_sizes,
    cache_key,
    default_cache_path,
    format_table,
)
from tests.conftest import write_shards

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One torch thread: on a 2-core machine shared with other test runs, two OpenMP threads
    make each call 10-40x slower whenever another process is busy (measured 2026-11-29: the
    small MLP's 4,096-row forward went from 1.8 ms to 43-56 ms)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model(bundle_dir: Path) -> LoadedModel:
    return load_model(str(bundle_dir), "cpu")


def model_fn(m: LoadedModel) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return forward(m, x)

    return fn


class SleepModel:
    """A model whose cost is known: ``max(floor_s, rows * per_row_s)`` of sleep per call.

    Up to ``floor_s / per_row_s`` rows a call costs the same, so throughput doubles with the
    batch size; beyond that it is flat. The gains the doubling rule sees are 2x or about 1x,
    never near the 5% threshold, so timing noise cannot change the outcome.
    """

    def __init__(self, floor_s: float = 0.02, per_row_s: float = 1e-5) -> None:
        self.floor_s = floor_s
        self.per_row_s = per_row_s
        self.calls: list[int] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.shape[0])
        time.sleep(max(self.floor_s, x.shape[0] * self.per_row_s))
        return x


# --------------------------------------------------------------------------------------------
# bench_batch_sizes and format_table
# --------------------------------------------------------------------------------------------


def test_bench_one_row_per_size_on_a_real_model(model: LoadedModel) -> None:
    x = torch.randn(300, model.width)
    sizes = [1, 7, 64, 300]
    rows = bench_batch_sizes(model_fn(model), x, CPU, sizes, repeats=2, warmup=1)
    assert [r.batch for r in rows] == sizes
    for r in rows:
        assert r.calls == math.ceil(300 / r.batch)
        assert r.ms > 0 and r.samples_per_s > 0 and r.ms_per_sample > 0
        # The three timing columns describe the same pass of 300 rows.
        assert r.samples_per_s == pytest.approx(300 / (r.ms / 1e3), rel=1e-9)
        assert r.ms_per_sample == pytest.approx(r.ms / 300, rel=1e-9)


def test_bench_repeats_rows_to_fill_one_batch() -> None:
    fn = SleepModel(floor_s=0.0, per_row_s=0.0)
    (row,) = bench_batch_sizes(fn, torch.randn(10, 4), CPU, [64], repeats=1, warmup=0)
    assert row.calls == 1
    assert fn.calls == [64]  # a full batch, not the 10 rows there are
    assert row.samples_per_s == pytest.approx(64 / (row.ms / 1e3), rel=1e-9)


def test_bench_splits_into_full_batches_and_a_short_tail() -> None:
    fn = SleepModel(floor_s=0.0, per_row_s=0.0)
    bench_batch_sizes(fn, torch.randn(100, 4), CPU, [32], repeats=1, warmup=0)
    assert fn.calls == [32, 32, 32, 4]


def test_bench_passes_run_under_inference_mode_with_cpu_batches_of_the_sample() -> None:
    seen: list[tuple[bool, str, torch.dtype]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen.append((torch.is_inference_mode_enabled(), x.device.type, x.dtype))
        return x

    bench_batch_sizes(fn, torch.randn(8, 3), CPU, [4], repeats=1, warmup=1)
    assert seen == [(True, "cpu", torch.float32)] * 4  # 2 passes (warmup + timed) x 2 calls


def test_bench_time_budget_stops_adding_passes() -> None:
    fn = SleepModel(floor_s=0.01, per_row_s=0.0)
    # A spent budget: only the first warmup pass and the first timed pass run.
    bench_batch_sizes(fn, torch.randn(4, 2), CPU, [4], repeats=10, warmup=5, time_budget_s=0.0)
    assert len(fn.calls) == 2
    fn.calls.clear()
    bench_batch_sizes(fn, torch.randn(4, 2), CPU, [4], repeats=10, warmup=0, time_budget_s=0.0)
    assert len(fn.calls) == 1
    fn.calls.clear()
    # A generous budget: every requested pass runs.
    bench_batch_sizes(fn, torch.randn(4, 2), CPU, [4], repeats=3, warmup=2, time_budget_s=60)
    assert len(fn.calls) == 5


def test_bench_reports_the_best_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    # A fake clock that each pass advances by a known duration: no wall-clock dependence.
    now = [0.0]
    monkeypatch.setattr(tuning, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    durations = iter([0.0, 0.08, 0.02, 0.05])  # warmup, then three timed passes

    def fn(x: torch.Tensor) -> torch.Tensor:
        now[0] += next(durations)
        return x

    (row,) = bench_batch_sizes(fn, torch.randn(4, 2), CPU, [4], repeats=3, warmup=1)
    assert row.ms == pytest.approx(20)  # the 20 ms pass


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_sizes": [0]}, "batch sizes must be integers >= 1"),
        ({"repeats": 0}, "repeats must be >= 1"),
        ({"warmup": -1}, "warmup must be >= 0"),
        ({"x": torch.empty(0, 4)}, "at least one row"),
        ({"x": torch.randn(4, 4, device="meta")}, "must be on the CPU"),
    ],
)
def test_bench_rejects_bad_arguments(kwargs: dict, message: str) -> None:
    args = {"x": torch.randn(4, 4), "batch_sizes": [2], **kwargs}
    with pytest.raises(ValueError, match=message):
        bench_batch_sizes(lambda t: t, args.pop("x"), CPU, args.pop("batch_sizes"), **args)


def test_format_table_has_header_and_one_aligned_line_per_size() -> None:
    rows = [
        BenchRow(1, 16384, 812.5, 20165.0, 0.0496),
        BenchRow(4096, 4, 7.25, 2259862.1, 0.00044),
    ]
    lines = format_table(rows).splitlines()
    assert lines[0].split() == ["batch", "calls", "ms", "samples/s", "ms/sample"]
    assert len(lines) == 1 + len(rows)
    assert len({len(line) for line in lines}) == 1  # right-aligned columns: equal widths
    assert lines[1].split()[:2] == ["1", "16,384"]
    assert lines[2].split()[:4] == ["4,096", "4", "7.25", "2,259,862"]
    # Each column's last character lines up with its header's.
    for word in ("batch", "calls", "ms/sample"):
        end = lines[0].index(word) + len(word)
        assert all(line[end - 1] != " " for line in lines)


# --------------------------------------------------------------------------------------------
# BatchSizeCache
# --------------------------------------------------------------------------------------------

SWEEP = [BenchRow(32, 4, 1.0, 32000.0, 0.03125), BenchRow(64, 2, 1.5, 42666.7, 0.0234)]


def test_cache_round_trip_and_file_contents(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "dir" / "batch_sizes.json"
    cache = BatchSizeCache(path)
    key = cache_key("ab" * 32, "cpu", "fp32")
    assert key == f"{'ab' * 32}|cpu|fp32"
    assert cache.get(key) is None  # no file yet
    cache.put(key, 64, SWEEP)
    assert BatchSizeCache(path).get(key) == 64
    entry = json.loads(path.read_text())[key]
    assert entry["batch_size"] == 64
    assert entry["measured_at"].endswith("+00:00")  # ISO 8601, UTC
    assert entry["sweep"][1] == {
        "batch": 64,
        "calls": 2,
        "ms": 1.5,
        "samples_per_s": 42666.7,
        "ms_per_sample": 0.0234,
    }
    cache.put(key, 128, SWEEP)  # overwrite
    assert cache.get(key) == 128


def test_cache_keys_separate_device_and_precision(tmp_path: Path) -> None:
    cache = BatchSizeCache(tmp_path / "c.json")
    sha = "0" * 64
    cache.put(cache_key(sha, "cpu", "fp32"), 4096, SWEEP)
    cache.put(cache_key(sha, "cpu", "bf16"), 8192, SWEEP)
    cache.put(cache_key(sha, torch.device("cuda:0"), "fp32"), 65536, SWEEP)
    assert cache.get(cache_key(sha, "cpu", "fp32")) == 4096
    assert cache.get(cache_key(sha, "cpu", "bf16")) == 8192
    assert cache.get(cache_key(sha, "cuda:0", "fp32")) == 65536
    assert cache.get(cache_key(sha, "cuda:1", "fp32")) is None
    assert cache.get(cache_key("1" * 64, "cpu", "fp32")) is None


def test_cache_writes_leave_no_temporary_files(tmp_path: Path) -> None:
    cache = BatchSizeCache(tmp_path / "batch_sizes.json")
    for i in range(5):
        cache.put(f"k{i}", 32 << i, SWEEP)
    assert [p.name for p in tmp_path.iterdir()] == ["batch_sizes.json"]


def test_cache_failed_write_keeps_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "batch_sizes.json"
    cache = BatchSizeCache(path)
    cache.put("k", 32, SWEEP)
    before = path.read_bytes()
    unserialisable = [BenchRow(32, 1, object(), 1.0, 1.0)]  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        cache.put("k2", 64, unserialisable)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["batch_sizes.json"]


@pytest.mark.parametrize(
    "content",
    ['{"k": {"batch_size": 3', "[1, 2]", "\x00\x01garbage", ""],
    ids=["truncated", "not-an-object", "binary", "empty"],
)
def test_corrupt_cache_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: str
) -> None:
    path = tmp_path / "batch_sizes.json"
    path.write_text(content)
    cache = BatchSizeCache(path)
    with caplog.at_level(logging.WARNING, logger="pipeline.model.tuning"):
        assert cache.get("k") is None
    assert any(r.levelno == logging.WARNING and str(path) in r.getMessage() for r in caplog.records)
    # The next put replaces the corrupt file with a good one.
    cache.put("k", 256, SWEEP)
    assert cache.get("k") == 256


@pytest.mark.parametrize("bad", [{"batch_size": "big"}, {"batch_size": 0}, {"batch_size": True}, 7])
def test_unusable_cache_entry_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, bad: object
) -> None:
    path = tmp_path / "batch_sizes.json"
    good = {"batch_size": 64, "cpu": tuning.cpu_identity()}
    path.write_text(json.dumps({"k": bad, "good": good}))
    cache = BatchSizeCache(path)
    with caplog.at_level(logging.WARNING, logger="pipeline.model.tuning"):
        assert cache.get("k") is None
    assert "ignoring batch-size cache entry 'k'" in caplog.text
    assert cache.get("good") == 64


def test_cache_put_rejects_a_bad_batch_size(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="integer >= 1"):
        BatchSizeCache(tmp_path / "c.json").put("k", 0, SWEEP)
    assert not (tmp_path / "c.json").exists()


def test_default_cache_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_path() == tmp_path / "xdg" / "score-catalog" / "batch_sizes.json"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for unusable in ("", "relative/dir"):
        monkeypatch.setenv("XDG_CACHE_HOME", unusable)
        expected = tmp_path / "home" / ".cache" / "score-catalog" / "batch_sizes.json"
        assert default_cache_path() == expected
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_path() == expected


# --------------------------------------------------------------------------------------------
# The CPU a choice was measured on
# --------------------------------------------------------------------------------------------

CPUINFO_X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni

processor\t: 1
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni
"""

CPUINFO_ARM = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd sve2 bf16 i8mm
CPU implementer\t: 0x41
CPU part\t: 0xd4f
"""


def test_cpu_identity_reads_the_model_and_flags_from_cpuinfo(tmp_path: Path) -> None:
    (tmp_path / "x86").write_text(CPUINFO_X86)
    (tmp_path / "arm").write_text(CPUINFO_ARM)
    x86 = tuning.cpu_identity(tmp_path / "x86")
    assert x86["model"] == "AMD EPYC 9R14 96-Core Processor"
    assert x86["flags"] == "avx2 avx512_bf16 avx512_vnni avx512f fpu sse2"  # sorted, once
    arm = tuning.cpu_identity(tmp_path / "arm")
    assert arm["model"] == "0x41 0xd4f" and arm["flags"] == "asimd bf16 fp i8mm sve2"
    # Without a cpuinfo (macOS, Windows): the platform's name, never an error.
    elsewhere = tuning.cpu_identity(tmp_path / "missing")
    assert elsewhere["model"] and elsewhere["flags"] == ""
    assert x86["capability"] == arm["capability"] == str(torch.backends.cpu.get_cpu_capability())
    assert "AMD EPYC 9R14" in tuning.cpu_summary(x86) and "avx512_bf16" in tuning.cpu_summary(x86)


def _other_cpu(flags_change: str) -> dict[str, str]:
    """This machine's CPU identity with one thing changed."""
    cpu = tuning.cpu_identity()
    if flags_change == "flags":
        cpu["flags"] = " ".join(sorted({*cpu["flags"].split(), "amx_tile", "amx_bf16"}))
    else:
        cpu["model"] = "Intel(R) Xeon(R) Platinum 8488C"
    return cpu


@pytest.mark.parametrize("what", ["flags", "model"])
def test_an_entry_measured_on_another_cpu_is_measured_again(
    what: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "batch_sizes.json"
    BatchSizeCache(path, cpu=_other_cpu(what)).put("k", 1024, SWEEP)  # another machine's
    here = BatchSizeCache(path)
    with caplog.at_level(logging.INFO, logger="pipeline.model.tuningcache"):
        assert here.get("k") is None
    assert "measured on another CPU" in caplog.text
    here.put("k", 2048, SWEEP)  # this machine's own choice replaces it
    assert BatchSizeCache(path).get("k") == 2048
    assert json.loads(path.read_text())["k"]["cpu"] == tuning.cpu_identity()


def test_an_entry_that_does_not_say_its_cpu_is_measured_again(tmp_path: Path) -> None:
    # Written before the CPU was recorded: nothing says it was measured here.
    path = tmp_path / "batch_sizes.json"
    path.write_text(json.dumps({"k": {"batch_size": 4096, "measured_at": "2026-12-01"}}))
    assert BatchSizeCache(path).get("k") is None


# --------------------------------------------------------------------------------------------
# score-catalog bench
# --------------------------------------------------------------------------------------------

BENCH_FAST = ["--batch-sizes", "1,32,256", "--rows", "512", "--repeats", "1", "--threads", "1"]


def table_sizes(output: str) -> list[str]:
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["batch", "calls"])
    return [line.split()[0] for line in lines[start + 1 :]]


def test_bench_command_prints_header_and_table(bundle_dir: Path) -> None:
    threads = torch.get_num_threads()
    result = CliRunner().invoke(bench, ["--model", str(bundle_dir), "--device", "cpu", *BENCH_FAST])
    assert result.exit_code == 0, result.output
    first = result.output.splitlines()[0]
    assert first.startswith("model test-mlp v1 (")
    assert "on cpu, torch threads 1, 512 rows random normal" in first
    assert table_sizes(result.output) == ["1", "32", "256"]
    assert torch.get_num_threads() == threads  # restored for the rest of this process


def test_bench_command_with_real_rows(bundle_dir: Path, tmp_path: Path) -> None:
    write_shards(tmp_path / "cat", [300, 200], row_group_rows=128)
    args = ["--model", str(bundle_dir), "--device", "cpu", "--input", str(tmp_path / "cat")]
    result = CliRunner().invoke(bench, [*args, *BENCH_FAST])
    assert result.exit_code == 0, result.output
    # Only the first shard is read; its 300 rows are repeated up to --rows.
    assert "part-00000.parquet (300 distinct rows repeated)" in result.output
    assert table_sizes(result.output) == ["1", "32", "256"]


@pytest.mark.parametrize("sizes", ["0,x", "0", "x", "32,,64", "-4"])
def test_bench_command_bad_batch_sizes_exit_2(bundle_dir: Path, sizes: str) -> None:
    result = CliRunner().invoke(bench, ["--model", str(bundle_dir), "--batch-sizes", sizes])
    assert result.exit_code == EXIT_USAGE
    assert "--batch-sizes" in result.output


def test_bench_command_missing_bundle_exits_3(tmp_path: Path) -> None:
    result = CliRunner().invoke(bench, ["--model", str(tmp_path / "nope"), *BENCH_FAST])
    assert result.exit_code == EXIT_INPUT
    assert "error: model bundle" in result.stderr
    assert (
        "does not exist" in result.stderr
    )  # a path that is not there, not a folder without model.toml


def test_bench_command_input_without_shards_exits_3(bundle_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(
        bench, ["--model", str(bundle_dir), "--input", str(tmp_path / "empty"), *BENCH_FAST]
    )
    assert result.exit_code == EXIT_INPUT
    assert "matched no Parquet shards" in result.stderr


def test_bench_command_unavailable_device_exits_2(bundle_dir: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    result = CliRunner().invoke(bench, ["--model", str(bundle_dir), "--device", "cuda"])
    assert result.exit_code == EXIT_USAGE
    assert "is not available on this machine" in result.stderr


def test_bench_command_input_missing_features_exits_3(bundle_dir: Path, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"item_id": [1, 2], "f0": [0.5, 1.5]}), tmp_path / "x.parquet")
    result = CliRunner().invoke(
        bench, ["--model", str(bundle_dir), "--input", str(tmp_path / "x.parquet"), *BENCH_FAST]
    )
    assert result.exit_code == EXIT_INPUT
    assert "feature column 'f1' is missing" in result.stderr
    assert "id column" not in result.stderr  # bench needs no id column


# --------------------------------------------------------------------------------------------
# challenge: a size against its neighbours, pair by pair, twice in a row by a margin


def _steps(seconds: dict[int, list[float]]) -> tuple[Any, list[int]]:
    """A fake step returning the given seconds per size, pass after pass; and the call log."""
    calls: list[int] = []
    left = {b: list(v) for b, v in seconds.items()}

    def step(batch: int) -> float:
        calls.append(batch)
        return left[batch].pop(0) if len(left[batch]) > 1 else left[batch][0]

    return step, calls


def test_neighbours_are_the_next_sizes_down_and_up() -> None:
    ladder = [1024, 2048, 4096, 8192]
    assert tuning.neighbours(ladder, 4096) == [2048, 8192]
    assert tuning.neighbours(ladder, 1024) == [2048]
    assert tuning.neighbours(ladder, 8192) == [4096]
    assert tuning.neighbours(ladder, 3000) == [2048, 4096]  # a size off the ladder
    assert tuning.neighbours([4096], 4096) == []


def test_challenge_replaces_a_size_beaten_twice_in_a_row() -> None:
    step, calls = _steps({4096: [1.0], 2048: [1.0], 8192: [0.8]})
    found = tuning.challenge(step, 4096, [2048, 8192], rounds=2)
    assert found.chosen == 8192 and found.outcome == "replaced"
    assert calls == [4096, 2048, 8192, 8192, 2048, 4096]  # forward, then backward
    assert found.ratios == {2048: [1.0, 1.0], 8192: [0.8, 0.8]}
    assert found.streak is None


def test_challenge_keeps_a_size_beaten_once_and_carries_the_streak() -> None:
    # 8192 wins the first pair by 20%, then loses: no streak; 2048 wins only the last pair.
    step, _ = _steps({4096: [1.0, 1.0], 2048: [1.0, 0.9], 8192: [0.8, 1.1]})
    found = tuning.challenge(step, 4096, [2048, 8192], rounds=2)
    assert found.chosen == 4096 and found.outcome == "kept"
    assert found.streak == tuning.Streak(2048, 1)


def test_a_streak_from_an_earlier_run_completes_in_the_next() -> None:
    step, _ = _steps({4096: [1.0], 8192: [0.9], 2048: [1.2]})
    one = tuning.challenge(step, 4096, [2048, 8192], rounds=1)
    assert one.chosen == 4096 and one.streak == tuning.Streak(8192, 1)
    two = tuning.challenge(step, 4096, [2048, 8192], rounds=1, streak=one.streak)
    assert two.chosen == 8192 and two.outcome == "replaced"
    # A streak for another size, or a loss in between, starts over.
    other = tuning.challenge(step, 4096, [2048, 8192], rounds=1, streak=tuning.Streak(2048, 1))
    assert other.chosen == 4096 and other.streak == tuning.Streak(8192, 1)


def test_a_win_below_the_margin_is_no_win() -> None:
    # 3% faster in every pair: within the 5% margin, so never a reason to move.
    step, _ = _steps({4096: [1.0], 8192: [0.97]})
    found = tuning.challenge(step, 4096, [8192], rounds=3, streak=tuning.Streak(8192, 1))
    assert found.chosen == 4096 and found.streak is None


def test_of_two_winners_the_larger_gain_replaces() -> None:
    step, _ = _steps({4096: [1.0], 2048: [0.9], 8192: [0.7]})
    assert tuning.challenge(step, 4096, [2048, 8192], rounds=2).chosen == 8192


def test_challenge_table_gives_each_size_its_fastest_pass() -> None:
    step, _ = _steps({4096: [1.0, 0.5], 8192: [2.0, 1.0]})
    table = tuning.challenge(step, 4096, [8192], rounds=2).table(10_000)
    assert [(r.batch, r.ms) for r in table] == [(4096, 500.0), (8192, 1000.0)]


def test_a_pair_shares_its_moment_where_fastest_passes_do_not() -> None:
    # The machine gets busy after round one: each size's own passes spread by 2x, which a
    # fastest-pass rule reads as noise; pair by pair 8192 still wins both rounds by 20%.
    step, _ = _steps({4096: [1.0, 2.0], 8192: [0.8, 1.6]})
    found = tuning.challenge(step, 4096, [8192], rounds=2)
    assert found.chosen == 8192
    assert found.ratios[8192] == pytest.approx([0.8, 0.8])


def test_recheck_call_rows_times_the_cached_size_against_its_neighbours() -> None:
    # Cost grows faster than the rows: 512 beats a cached 1,024 in every pair.
    fn, seen = _cost_model(0.0, 2e-9)
    found = tuning.recheck_call_rows(
        fn, torch.zeros(100, 3), torch.device("cpu"), batch=4096, cached=1024, rounds=2
    )
    assert sorted(found.passes) == [512, 1024, 2048]
    assert found.chosen == 512 and found.outcome == "replaced"
    assert set(seen) == {512, 1024, 2048}  # no call at another size, none over 2,048 rows
    # A per-call cost favours bigger calls: a cached 256 moves up, never past the batch.
    fn, _ = _cost_model(2e-3, 0.0)
    up = tuning.recheck_call_rows(
        fn, torch.zeros(100, 3), torch.device("cpu"), batch=1024, cached=512, rounds=2
    )
    assert sorted(up.passes) == [256, 512, 1024] and up.chosen == 1024


def test_the_cache_keeps_a_revalidation_beside_the_first_measurement(tmp_path: Path) -> None:
    cache = BatchSizeCache(tmp_path / "b.json", cpu={"model": "x", "flags": "y"})
    row = BenchRow(batch=2048, calls=2, ms=5.0, samples_per_s=1e6, ms_per_sample=1e-3)
    cache.put("k", 2048, [row], {"streak": None})
    entry = cache.entry("k")
    assert entry is not None and entry["batch_size"] == 2048
    step, _ = _steps({2048: [1.0], 1024: [0.8], 4096: [1.0]})
    kept = tuning.challenge(step, 2048, [1024, 4096], rounds=1)
    cache.revalidated("k", entry, kept, {"per_row_s": 1e-6})
    again = cache.entry("k")
    assert again is not None
    assert again["batch_size"] == 2048 and again["checks"] == 1
    assert tuning.streak_of(again) == tuning.Streak(1024, 1)
    assert again["measured_at"] == entry["measured_at"] and again["sweep"] == entry["sweep"]
    replaced = tuning.challenge(step, 2048, [1024, 4096], rounds=1, streak=tuning.streak_of(again))
    cache.revalidated("k", again, replaced)
    last = cache.entry("k")
    assert last is not None
    assert (last["batch_size"], last["replaced"], last["checks"]) == (1024, 2048, 2)
    assert tuning.streak_of(last) is None and last["per_row_s"] == 1e-6


@pytest.mark.parametrize("streak", [None, "x", {"size": 0, "wins": 1}, {"size": 8, "wins": True}])
def test_a_streak_the_cache_cannot_vouch_for_is_none(streak: Any) -> None:
    assert tuning.streak_of({"streak": streak}) is None


# --- rows per model call ----------------------------------------------------------------------


def _cost_model(per_call_s: float, per_row2_s: float) -> tuple[Any, list[int]]:
    """A model whose call costs ``per_call_s + rows**2 * per_row2_s`` (sleeps): a fixed cost
    per call favours one big call; a cost growing faster than the rows (activations that
    outgrow the cache) favours slices. Returns the callable and the row count of each call."""
    sizes: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        n = int(x.shape[0])
        sizes.append(n)
        time.sleep(per_call_s + n * n * per_row2_s)
        return x[:, :1]

    return fn, sizes


def test_choose_call_rows_splits_a_batch_whose_cost_grows_faster_than_its_rows() -> None:
    # 4,096 rows in one call: 17 ms; in calls of 256: 16 x 0.07 ms. Far beyond any noise.
    fn, seen = _cost_model(0.0, 1e-9)
    chosen, table, facts = tuning.choose_call_rows(
        fn, torch.zeros(100, 3), torch.device("cpu"), batch=8192, budget_s=0.3
    )
    assert [r.batch for r in table] == [256, 512, 1024, 2048, 4096]  # at most 4,096 rows
    assert chosen < 4096
    rate = {r.batch: r.samples_per_s for r in table}
    assert rate[chosen] == max(rate.values())
    assert facts["rounds"] >= 1 and set(seen) == {256, 512, 1024, 2048, 4096}


def test_choose_call_rows_keeps_one_call_when_each_call_costs_the_most() -> None:
    # 2 ms per call whatever its rows: calls of 256 take 16x as long as one call of 4,096.
    fn, _ = _cost_model(0.002, 0.0)
    chosen, table, _ = tuning.choose_call_rows(
        fn, torch.zeros(5000, 3), torch.device("cpu"), batch=4096, budget_s=0.1
    )
    assert chosen == 4096 and table[-1].batch == 4096


def test_choose_call_rows_measures_below_a_small_batch_only() -> None:
    fn, seen = _cost_model(0.0, 0.0)
    chosen, table, _ = tuning.choose_call_rows(
        fn, torch.zeros(10, 3), torch.device("cpu"), batch=1000, budget_s=0.0
    )
    assert [r.batch for r in table] == [256, 512, 1000]
    assert max(seen) == 1000 and chosen in (256, 512, 1000)


def _scripted_passes(monkeypatch: pytest.MonkeyPatch, seconds: dict[int, list[float]]) -> None:
    """``_one_pass`` returns these seconds per call size, in order (the warm-up pass first):
    the decision rule apart from the machine's timing."""
    left = {c: list(v) for c, v in seconds.items()}
    monkeypatch.setattr(
        tuning, "_one_pass", lambda fn, data, device, c: left[c].pop(0) if left[c] else 1.0
    )


def test_choose_call_rows_splits_despite_one_slow_pass_of_the_faster_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Calls of 1,024 win in three passes of four; one pass hit by the workers starting beside
    # it took 3x as long: the largest spread (200%) is not the noise of the best passes.
    whole = [9.0, 1.0, 1.0, 1.02, 1.01]
    _scripted_passes(
        monkeypatch,
        {
            256: [9.0, 0.9, 0.9, 0.9, 0.9],
            512: [9.0, 0.8, 0.8, 0.8, 0.8],
            1024: [9.0, 0.7, 2.1, 0.7, 0.71],
            2048: [9.0, 0.85, 0.85, 0.85, 0.85],
            4096: whole,
        },
    )
    chosen, _, facts = tuning.choose_call_rows(
        lambda x: x, torch.zeros(4096, 2), CPU, batch=4096, budget_s=60.0
    )
    assert chosen == 1024 and facts["rounds"] == 4


def test_choose_call_rows_does_not_split_on_one_lucky_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One pass of 512 rows a call was fast; its others were no faster than the whole batch.
    _scripted_passes(
        monkeypatch,
        {
            256: [9.0, 1.1, 1.1],
            512: [9.0, 0.6, 1.0],
            1024: [9.0, 1.05, 1.05],
            2048: [9.0, 1.03, 1.03],
            4096: [9.0, 1.0, 1.0],
        },
    )
    chosen, table, facts = tuning.choose_call_rows(
        lambda x: x, torch.zeros(4096, 2), CPU, batch=4096, budget_s=0.0
    )
    assert chosen == 4096 and facts["rounds"] == 2  # two rounds even on a spent budget
    assert min(table, key=lambda r: r.ms).batch == 512  # the table shows the lucky pass


def test_a_cached_size_the_caller_does_not_measure_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = BatchSizeCache(tmp_path / "batch_sizes.json")
    cache.put("k", 8192, [])
    assert cache.get("k") == 8192
    with caplog.at_level(logging.WARNING):
        assert cache.get("k", allowed={1024, 2048, 4096}) is None
    assert "8192 is not one of the sizes measured here (1,024, 2,048, 4,096)" in caplog.text
    assert cache.get("k", allowed={8192}) == 8192
