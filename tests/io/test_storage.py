"""The storage seam: retries with a deadline, exclusive create, reads, overlap and ownership checks.

Local disk and ``memory://`` here; the S3 server variants are in ``tests/integration``.
"""

from __future__ import annotations

import errno
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pyarrow.parquet as pq
import pytest

from pipeline.core import retries
from pipeline.core.errors import ConfigError, InputError, StorageError
from pipeline.io import listing, ownership, storage
from pipeline.io.layout import MANIFEST_NAME
from tests.conftest import write_shards


@pytest.fixture
def mem_root() -> Iterator[str]:
    root = f"memory://h4-{uuid.uuid4().hex[:8]}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


# --------------------------------------------------------------------------- retries


class Flaky:
    """Fails ``n`` times with ``error``, then returns "ok"."""

    def __init__(self, n: int, error: BaseException) -> None:
        self.n, self.error, self.calls = n, error, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.n:
            raise self.error
        return "ok"


def test_transient_errors_are_retried_until_success() -> None:
    fn = Flaky(2, OSError(errno.EBUSY, "SlowDown"))
    assert retries.with_retries(fn, what="reading s3://b/k", base_delay=0.001) == "ok"
    assert fn.calls == 3


def test_retries_stop_at_the_deadline_with_the_uri_in_the_message() -> None:
    fn = Flaky(10**9, TimeoutError("read timed out"))
    with pytest.raises(StorageError) as e:
        retries.with_retries(fn, what="reading s3://b/key", base_delay=0.001, deadline_s=0.05)
    msg = str(e.value)
    assert "reading s3://b/key" in msg and "read timed out" in msg and "0.05s" in msg
    assert storage.RETRY_DEADLINE_OPTION in msg
    assert 1 < fn.calls < 10**9
    assert isinstance(e.value.__cause__, TimeoutError)


@pytest.mark.parametrize(
    "error",
    [
        FileNotFoundError("k"),
        FileExistsError("k"),
        PermissionError("denied"),
        OSError(errno.EINVAL, "InvalidBucketName"),
        ValueError("a bug, not storage"),
    ],
)
def test_permanent_errors_are_raised_at_once(error: BaseException) -> None:
    fn = Flaky(1, error)
    with pytest.raises(type(error)):
        retries.with_retries(fn, what="x", base_delay=0.001)
    assert fn.calls == 1


def test_attempts_still_bound_the_retries() -> None:
    fn = Flaky(10, ConnectionResetError("reset"))
    with pytest.raises(StorageError, match="after 3 attempt"):
        retries.with_retries(fn, what="x", attempts=3, base_delay=0.001)
    assert fn.calls == 3


def test_s3_locations_have_no_retry_layer_underneath() -> None:
    pytest.importorskip("s3fs")
    opts = {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"}
    loc = storage.locate("s3://bucket/x", {**opts, "retry_deadline_s": 7})
    assert loc.retry_deadline_s == 7.0
    assert loc.fs.retries == 1
    assert loc.fs.config_kwargs["retries"] == {"total_max_attempts": 1}
    assert loc.child("y").retry_deadline_s == 7.0
    # A job that sets botocore's retries explicitly keeps them.
    mine = storage.locate("s3://bucket/x", {**opts, "config_kwargs": {"retries": {"mode": "a"}}})
    assert mine.fs.config_kwargs["retries"] == {"mode": "a"}
    assert storage.locate("/tmp").retry_deadline_s == storage.DEFAULT_RETRY_DEADLINE_S


# --------------------------------------------------------------------------- one deadline per run


@pytest.fixture
def clock() -> Iterator[retries.RetryClock]:
    retries.RETRY_CLOCK.reset()
    yield retries.RETRY_CLOCK
    retries.RETRY_CLOCK.reset()


def test_a_store_failing_past_the_deadline_fails_later_calls_at_once(
    clock: retries.RetryClock,
) -> None:
    """The deadline counts from the store's first failure, not per call: with a dead server,
    each call used to wait the whole deadline again (218 s for a run with a 60 s deadline)."""
    first = Flaky(10**9, ConnectionRefusedError("refused"))
    with pytest.raises(StorageError, match="attempt"):
        retries.with_retries(first, what="a", base_delay=0.01, deadline_s=0.2, store="s3-x")
    assert first.calls > 1
    time.sleep(0.2)  # the first call gave up early, before a back-off would pass the deadline
    second = Flaky(10**9, ConnectionRefusedError("refused"))
    with pytest.raises(StorageError):
        retries.with_retries(second, what="b", base_delay=0.01, deadline_s=0.2, store="s3-x")
    assert second.calls == 1  # the store has been failing for longer than the deadline
    # Another store is not failing; and a call that succeeds ends this store's outage.
    other = Flaky(2, ConnectionRefusedError("refused"))
    assert retries.with_retries(other, what="c", base_delay=0.01, store="gs-y") == "ok"
    assert retries.with_retries(lambda: "up", what="d", store="s3-x") == "up"
    third = Flaky(2, ConnectionRefusedError("refused"))
    assert retries.with_retries(third, what="e", base_delay=0.01, store="s3-x") == "ok"
    assert third.calls == 3


def test_a_worker_that_outlives_a_run_forgets_its_outages(clock: retries.RetryClock) -> None:
    """A worker of an existing cluster serves many runs: an outage it saw in the last run (the
    store never answered it again) must not make the next run's first failure final."""
    clock.working_for("run-1")
    with pytest.raises(StorageError):
        retries.with_retries(
            Flaky(10**9, TimeoutError()), what="a", base_delay=0.01, deadline_s=0.05, store="s"
        )
    time.sleep(0.05)
    clock.working_for("run-1")  # the same run: the store is still failing
    with pytest.raises(StorageError):
        retries.with_retries(Flaky(1, TimeoutError()), what="b", deadline_s=0.05, store="s")
    clock.working_for("run-2")
    fn = Flaky(1, TimeoutError())
    assert retries.with_retries(fn, what="c", base_delay=0.001, deadline_s=0.05, store="s") == "ok"


def test_after_the_run_failed_on_storage_calls_are_not_retried(clock: retries.RetryClock) -> None:
    clock.expire()
    fn = Flaky(1, ConnectionResetError("reset"))
    with pytest.raises(StorageError, match="the run has already failed on storage"):
        retries.with_retries(fn, what="writing s3://b/_report.json", store="s3-x")
    assert fn.calls == 1
    assert retries.with_retries(lambda: "ok", what="f", store="s3-x") == "ok"  # one that works
    clock.reset()
    assert retries.with_retries(Flaky(1, TimeoutError()), what="g", base_delay=0.001) == "ok"


@pytest.mark.parametrize(
    ("error", "storage_failure"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), True),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), True),
        (OSError(errno.EROFS, "Read-only file system"), True),
        (PermissionError(errno.EACCES, "Permission denied"), True),
        (StorageError("reading s3://b/k failed after 12 attempt(s)"), True),
        (ConnectionResetError("reset"), False),  # transient: retried first
        (FileNotFoundError("gone"), False),  # a shard deleted: the data's
        (ValueError("a bug"), False),
    ],
)
def test_storage_failures_are_told_from_other_errors(
    error: BaseException, storage_failure: bool
) -> None:
    assert retries.is_storage_failure(error) is storage_failure


def test_a_corrupt_shard_is_not_a_storage_failure(tmp_path: Path) -> None:
    bad = tmp_path / "part-0.parquet"
    bad.write_bytes(b"PAR1" + b"\0" * 100 + b"PAR1")
    with pytest.raises(Exception) as e:
        pq.read_table(bad)
    assert not retries.is_storage_failure(e.value)
    assert storage.write_failure(storage.locate(str(bad)), e.value) is None


def test_a_write_that_cannot_be_done_names_the_path_and_the_cause(tmp_path: Path) -> None:
    """The OSError of a full disk names no path; the StorageError says what was being written."""
    loc = storage.locate(str(tmp_path / "out" / "part-0.parquet"))
    failure = storage.write_failure(loc, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    assert isinstance(failure, StorageError) and failure.uri == loc.uri
    assert loc.uri in str(failure) and os.strerror(errno.ENOSPC) in str(failure)
    assert storage.write_failure(loc, ConnectionResetError("reset")) is None  # written again
    # A real one: a file where the folder should be.
    (tmp_path / "blocked").write_text("a file")
    target = storage.locate(str(tmp_path / "blocked" / "_report.json"))
    with pytest.raises(StorageError) as info:
        storage.write_json(target, {"a": 1})
    assert target.uri in str(info.value) and info.value.uri == target.uri


# --------------------------------------------------------------------------- reads and creates


@pytest.mark.parametrize("where", ["local", "memory"])
def test_exclusive_create_refuses_an_existing_object(
    where: str, tmp_path: Path, mem_root: str
) -> None:
    root = storage.locate(str(tmp_path) if where == "local" else mem_root)
    loc = root.child("sub/_lock.json")
    assert storage.exclusive_create(loc, b'{"a": 1}') is True
    assert storage.exclusive_create(loc, b'{"a": 2}') is False
    assert storage.read_bytes(loc) == b'{"a": 1}'
    assert [c.name for c in storage.ls(root.child("sub"))] == ["_lock.json"]
    with pytest.raises(ValueError):
        storage.exclusive_create(root.child("empty"), b"")


@pytest.mark.parametrize("where", ["local", "memory"])
def test_reads_listings_and_bulk_reads(where: str, tmp_path: Path, mem_root: str) -> None:
    root = storage.locate(str(tmp_path) if where == "local" else mem_root)
    for name in ("b.json", "a.json", "_lock.one", "_lock.two"):
        storage.write_json(root.child(name), {"name": name})
    assert [c.name for c in storage.ls(root)] == ["_lock.one", "_lock.two", "a.json", "b.json"]
    assert [c.name for c in storage.glob_names(root, "_lock.")] == ["_lock.one", "_lock.two"]
    missing = root.child("missing.json")
    got = storage.read_many([root.child("a.json"), missing])
    assert json.loads(got[root.child("a.json").uri]) == {"name": "a.json"}  # type: ignore[arg-type]
    assert isinstance(got[missing.uri], FileNotFoundError)
    assert storage.read_json(missing) is None
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(missing)
    with pytest.raises(FileNotFoundError):
        storage.ls(root.child("nowhere"))
    storage.remove(root.child("a.json"))
    storage.remove(root.child("a.json"))  # already gone: fine
    assert not storage.exists(root.child("a.json"))


@pytest.mark.parametrize("where", ["local", "memory"])
def test_open_input_streams_a_multi_row_group_shard(
    where: str, tmp_path: Path, mem_root: str
) -> None:
    (path,) = write_shards(tmp_path / "in", [2500], row_group_rows=1000)
    if where == "memory":
        fsspec.filesystem("memory").put_file(str(path), f"{mem_root}/part.parquet")
        loc = storage.locate(f"{mem_root}/part.parquet")
    else:
        loc = storage.locate(str(path))
    with storage.open_input(loc) as f:
        pf = pq.ParquetFile(f, pre_buffer=False)
        assert pf.metadata.num_row_groups == 3
        rows = sum(b.num_rows for b in pf.iter_batches(batch_size=700))
    assert rows == 2500
    gone = storage.locate(str(tmp_path / "nope.parquet") if where == "local" else f"{mem_root}/x")
    with pytest.raises(FileNotFoundError), storage.open_input(gone):
        pass


# --------------------------------------------------------------------------- overlap


def test_output_symlinked_into_the_input_is_refused(tmp_path: Path) -> None:
    write_shards(tmp_path / "in", [300, 200], row_group_rows=100)
    (tmp_path / "in" / "scored").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "in" / "scored")
    out = storage.locate(str(tmp_path / "out"))
    rej = out.child("_rejects")
    assert storage.real_path(out).path == str(tmp_path / "in" / "scored")
    with pytest.raises(ConfigError) as e:
        listing.check_disjoint(str(tmp_path / "in"), out, rej)
    assert str(tmp_path / "out") in str(e.value) and str(tmp_path / "in") in str(e.value)


def test_a_glob_that_can_match_the_output_is_refused(tmp_path: Path) -> None:
    write_shards(tmp_path / "data" / "in", [300], row_group_rows=100)
    out = storage.locate(str(tmp_path / "data" / "scored"))
    rej = storage.locate(str(tmp_path / "rejects"))
    with pytest.raises(ConfigError, match="glob can match"):
        listing.check_disjoint(str(tmp_path / "data" / "*" / "*.parquet"), out, rej)
    # A glob that cannot reach the output is fine, even next to it.
    listing.check_disjoint(str(tmp_path / "data" / "in" / "*.parquet"), out, rej)
    listing.check_disjoint(str(tmp_path / "data" / "i*"), out, rej)


def test_input_inside_the_output_and_separate_trees(tmp_path: Path) -> None:
    write_shards(tmp_path / "out" / "in", [300], row_group_rows=100)
    out = storage.locate(str(tmp_path / "out"))
    with pytest.raises(ConfigError, match="output"):
        listing.check_disjoint(str(tmp_path / "out" / "in"), out, out.child("_rejects"))
    other = storage.locate(str(tmp_path / "elsewhere"))
    with pytest.raises(ConfigError, match="rejects"):
        listing.check_disjoint(str(tmp_path / "out" / "in"), other, out)
    listing.check_disjoint(str(tmp_path / "out" / "in"), other, other.child("_rejects"))


def test_a_shard_symlinked_from_the_output_is_refused(tmp_path: Path) -> None:
    write_shards(tmp_path / "in", [300], row_group_rows=100)
    (tmp_path / "out").mkdir()
    write_shards(tmp_path / "out", [100], row_group_rows=50)
    (tmp_path / "in" / "sneaky.parquet").symlink_to(tmp_path / "out" / "part-00000.parquet")
    out = storage.locate(str(tmp_path / "out"))
    rej = out.child("_rejects")
    listing.check_disjoint(str(tmp_path / "in"), out, rej)  # the trees themselves are apart
    shards = listing.list_shards(str(tmp_path / "in"))
    assert [s.rel_path for s in shards] == ["part-00000.parquet", "sneaky.parquet"]
    with pytest.raises(ConfigError, match=r"sneaky\.parquet") as e:
        listing.check_disjoint(str(tmp_path / "in"), out, rej, shards=shards)
    assert str(tmp_path / "out") in str(e.value)
    with pytest.raises(ConfigError, match="would read its own output"):
        listing.list_shards(str(tmp_path / "in"), exclude=[out, rej])
    (tmp_path / "in" / "sneaky.parquet").unlink()
    assert len(listing.list_shards(str(tmp_path / "in"), exclude=[out, rej])) == 1


def test_different_filesystems_never_overlap(tmp_path: Path, mem_root: str) -> None:
    write_shards(tmp_path / "in", [100], row_group_rows=50)
    out = storage.locate(f"{mem_root}{tmp_path}/in/out")
    listing.check_disjoint(str(tmp_path / "in"), out, out.child("_rejects"))


def test_listing_a_missing_input_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="does not exist"):
        listing.list_shards(str(tmp_path / "nothing"))


# --------------------------------------------------------------------------- ownership


def test_classify_output_states(tmp_path: Path, mem_root: str) -> None:
    assert ownership.classify_output(storage.locate(str(tmp_path / "none"))).kind == "absent"
    (tmp_path / "empty").mkdir()
    assert ownership.classify_output(storage.locate(str(tmp_path / "empty"))).kind == "empty"

    ours = tmp_path / "ours"
    write_shards(ours, [100], row_group_rows=50)
    (ours / MANIFEST_NAME).write_text("{}")
    assert ownership.classify_output(storage.locate(str(ours))).kind == "ours"
    marked = tmp_path / "marked"  # the layout with the manifest beside the output
    write_shards(marked, [100], row_group_rows=50)
    (marked / "_SCORE_CATALOG").write_bytes(b"")
    assert ownership.classify_output(storage.locate(str(marked))).kind == "ours"

    control = tmp_path / "control"
    (control / "_rejects").mkdir(parents=True)
    for name in ("_lock.json", "_SUCCESS", "_report.json", ".part.parquet.tmp-0123456789ab"):
        (control / name).write_text("x")
    state = ownership.classify_output(storage.locate(str(control)))
    assert state.kind == "ours" and state.foreign == ()

    foreign = tmp_path / "foreign"
    write_shards(foreign, [10] * 12, row_group_rows=5)
    (foreign / "_SUCCESS").write_text("")
    (foreign / "notes.txt").write_text("someone else's")
    state = ownership.classify_output(storage.locate(str(foreign)))
    assert state.kind == "foreign" and state.foreign_count == 13
    assert len(state.foreign) == 10 and state.foreign[0] == "notes.txt"
    assert "_SUCCESS" not in state.foreign

    storage.write_json(storage.locate(mem_root).child("data.json"), {})
    mem = ownership.classify_output(storage.locate(mem_root))
    assert mem.kind == "foreign" and mem.foreign == ("data.json",)


def test_classify_output_refuses_a_file_or_a_path_under_one(tmp_path: Path) -> None:
    target = tmp_path / "scores.parquet"
    target.write_bytes(b"not a folder")
    for path in (target, target / "out"):
        with pytest.raises(StorageError, match=r"is a file .*not a folder"):
            ownership.classify_output(storage.locate(str(path)))
    assert target.read_bytes() == b"not a folder"


@pytest.mark.parametrize("rejects", ["out", "out/rej", "."], ids=["same", "inside", "around"])
def test_rejects_overlapping_the_output_is_refused(tmp_path: Path, rejects: str) -> None:
    (tmp_path / "in").mkdir()
    out = storage.locate(str(tmp_path / "out"))
    rej = storage.locate(str(tmp_path / rejects))
    with pytest.raises(ConfigError, match="overlaps the output"):
        listing.check_disjoint(str(tmp_path / "in"), out, rej)


@pytest.mark.parametrize("count", [2, 4, 5, 6, 9])
def test_a_missing_partition_hint_lists_a_few_in_full_and_cuts_only_many(
    tmp_path: Path, count: int
) -> None:
    """Review 22: "only dt=1, dt=2, dt=3, ... dt=4" with four partitions elided nothing."""
    from pipeline.io import listing

    days = [f"dt=2025-01-0{i + 1}" for i in range(count)]
    for day in days:
        (tmp_path / day).mkdir()
    hint = listing.missing_hint(storage.locate(str(tmp_path / "dt=2025-02-01")), literal="02-01")
    if count <= 5:
        assert hint.endswith(f"only {', '.join(days)}")
        assert "..." not in hint
    else:
        assert hint.endswith(f"only {', '.join(days[:3])}, ... {days[-1]} ({count} in all)")
