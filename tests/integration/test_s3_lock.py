"""The run lock on a real S3-compatible server (moto on 127.0.0.1): exclusive create with
``If-None-Match: *``, heartbeats across "hosts", and the fence of a superseded holder.

Contenders are real processes (see ``tests/io/test_locking.py``); they reach the server only
through the storage options.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pipeline.core.errors import LockError
from pipeline.io import storage
from pipeline.io.layout import LOCK_NAME
from pipeline.io.locking import RunLock, assert_holder
from tests.integration.servers import S3Bucket, aws_env
from tests.io.test_locking import STALE_S, Contender, race, superseded_holder

pytestmark = pytest.mark.integration


@pytest.fixture
def s3_contenders(s3_bucket: S3Bucket) -> Iterator[Callable[..., Contender]]:
    made: list[Contender] = []

    def make(root: str, run_id: str, **kwargs: Any) -> Contender:
        c = Contender(root, run_id, options=s3_bucket.storage_options, env=aws_env(), **kwargs)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def _lock(bucket: S3Bucket, prefix: str) -> dict[str, Any]:
    return dict(json.loads(bucket.fs.cat_file(f"{bucket.name}/{prefix}/{LOCK_NAME}")))


@pytest.mark.slow
def test_two_runs_started_together_on_s3_one_wins(
    s3_bucket: S3Bucket, s3_contenders: Callable[..., Contender]
) -> None:
    for round_ in range(3):
        root = s3_bucket.uri(f"scored{round_}")
        procs = [s3_contenders(root, f"run-{round_}-{i}") for i in range(2)]
        results = race(procs)
        winners = [p for p, r in zip(procs, results, strict=True) if r["got"]]
        assert len(winners) == 1, results
        loser = next(r for r in results if not r["got"])
        assert f"locked by run {winners[0].run_id}" in loser["error"]
        assert _lock(s3_bucket, f"scored{round_}")["run_id"] == winners[0].run_id
        assert winners[0].check_and_release() == {"held": True, "error": ""}
        assert not s3_bucket.fs.exists(f"{s3_bucket.name}/scored{round_}/{LOCK_NAME}")


@pytest.mark.slow
def test_a_silent_holder_on_s3_is_superseded_and_fenced(
    s3_bucket: S3Bucket, s3_contenders: Callable[..., Contender]
) -> None:
    root_uri = s3_bucket.uri("scored")
    root = storage.locate(root_uri, s3_bucket.storage_options)
    holder, lock = superseded_holder(
        root_uri,
        s3_contenders,
        lambda: RunLock.acquire(root, "successor", stale_after_s=STALE_S),
        stale=STALE_S,
        heartbeat=0.1,
    )
    try:
        assert lock.took_over is not None and lock.took_over["run_id"] == "paused"
        held = holder.check_and_release()
        assert held["held"] is False
        assert f"{root_uri}/{LOCK_NAME}" in held["error"] and "successor" in held["error"]
        # The superseded holder's release did not delete the successor's lock.
        assert _lock(s3_bucket, "scored")["token"] == lock.token
        assert_holder(root_uri, "successor", lock.token, s3_bucket.storage_options)
        with pytest.raises(LockError, match="successor"):
            assert_holder(root_uri, "paused", "not-the-token", s3_bucket.storage_options)
    finally:
        lock.release()
    assert not s3_bucket.fs.exists(f"{s3_bucket.name}/scored/{LOCK_NAME}")
