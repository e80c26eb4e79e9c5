"""Tests for pipeline.driver.cluster's thread plan: how the cores are split, and the overlap
rule."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.core.hugepages import ENV as HUGE_PAGES
from pipeline.core.jobfile import build_config
from pipeline.driver.cluster import thread_plan

BASE: dict[str, Any] = {"input": "in", "output": "out", "model": "model"}


def plan_of(pending: int, device_type: str = "cpu", **overrides: Any) -> Any:
    return thread_plan(build_config(env={}, overrides={**BASE, **overrides}), pending, device_type)


@pytest.fixture
def huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HUGE_PAGES, "1")


@pytest.mark.usefixtures("huge_pages")
@pytest.mark.parametrize(
    ("overrides", "pending", "device", "overlap"),
    [
        # One worker process per core, each with one torch thread: nothing to spare.
        ({"cores": 2}, 16, "cpu", False),
        ({"cores": 2, "scheduler": "threads"}, 16, "cpu", False),
        ({"cores": 1, "scheduler": "sync"}, 16, "cpu", False),
        # A core to spare: one shard, sync, or fewer workers than cores.
        ({"cores": 2}, 1, "cpu", True),
        ({"cores": 2, "scheduler": "sync"}, 16, "cpu", True),
        ({"cores": 4, "workers": 2}, 16, "cpu", True),
        # The GPU computes while the threads read and write; an external cluster is unknown.
        ({"cores": 2}, 16, "cuda", True),
        ({"cores": 2, "scheduler": "tcp://127.0.0.1:8786"}, 16, "cpu", True),
    ],
)
def test_auto_overlap_is_off_only_where_every_core_runs_a_loop(
    overrides: dict[str, Any], pending: int, device: str, overlap: bool
) -> None:
    plan = plan_of(pending, device, **overrides)
    assert plan.overlap is overlap, plan


def test_auto_overlap_stays_on_without_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without them a worker without the threads once grew glibc's heap to 1.9 GB. torch takes
    # "1" only: "yes", "true" or "2" ask for nothing (it ignores them with a warning).
    for value in (None, "0", "", "yes", "true", "2", " 1"):
        if value is None:
            monkeypatch.delenv(HUGE_PAGES, raising=False)
        else:
            monkeypatch.setenv(HUGE_PAGES, value)
        assert plan_of(16, cores=2).overlap is True


@pytest.mark.usefixtures("huge_pages")
@pytest.mark.parametrize("setting", [True, False])
def test_an_explicit_overlap_setting_is_kept(setting: bool) -> None:
    for pending, cores in ((16, 2), (1, 2), (16, 8)):
        assert plan_of(pending, cores=cores, overlap=setting).overlap is setting


@pytest.mark.parametrize(
    ("overrides", "pending", "split"),
    [
        ({"cores": 2}, 16, (2, 1, 1)),
        ({"cores": 2}, 1, (1, 1, 2)),
        ({"cores": 8, "workers": 3}, 16, (3, 1, 2)),
        ({"cores": 4, "scheduler": "threads"}, 2, (1, 2, 2)),
        ({"cores": 4, "scheduler": "sync"}, 16, (1, 1, 4)),
    ],
)
def test_workers_threads_and_torch_threads_never_exceed_the_cores(
    overrides: dict[str, Any], pending: int, split: tuple[int, int, int]
) -> None:
    plan = plan_of(pending, **overrides)
    assert (plan.workers, plan.threads_per_worker, plan.torch_threads) == split
    assert plan.workers * plan.threads_per_worker * plan.torch_threads <= plan.cores
