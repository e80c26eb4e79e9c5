"""Signals as a stop request: the first asks, the second aborts, later ones wait for clean-up;
the exit codes of an interrupted run, from the run and from its report read back."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from pipeline import JobConfig, run
from pipeline.core.errors import EXIT_CODES_HELP
from pipeline.core.interrupt import (
    EXIT_CODES,
    REPEAT_WINDOW_S,
    Aborted,
    StopRequest,
    exit_code_of,
    handle_signals,
    interrupted_reason,
)
from pipeline.core.signals import EarlyStop
from pipeline.core.statuses import RunStatus
from pipeline.report.build import RunReport
from tests.integration.helpers import report_path


def _signal_self(sig: signal.Signals) -> None:
    """Deliver ``sig`` to this process; Python runs the handler before the next bytecode."""
    os.kill(os.getpid(), sig)


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_first_signal_requests_a_stop_second_aborts_third_waits(
    sig: signal.Signals, code: int
) -> None:
    before = signal.getsignal(sig)
    stop = StopRequest(grace_period_s=7)
    assert not stop.requested and stop.grace_left() == float("inf") and stop.exit_code == 0
    with handle_signals(stop):
        _signal_self(sig)
        assert stop.requested and stop.signal_name == sig.name and stop.exit_code == code
        assert 0 <= stop.grace_left() <= 7
        _signal_self(sig)  # a repeat within REPEAT_WINDOW_S is the same request (GNU timeout)
        assert stop.requested
        # Later than the window: a second request, which aborts (no sleeping: move the clock).
        assert stop.requested_at is not None
        stop.requested_at -= REPEAT_WINDOW_S + 1
        with pytest.raises(Aborted) as info:
            _signal_self(sig)
        assert info.value.signum == sig
        _signal_self(sig)  # a third one lets the clean-up after the abort finish
    assert signal.getsignal(sig) is before


def test_aborted_is_not_an_exception() -> None:
    """``except Exception`` in clean-up code must not swallow a second signal."""
    assert not issubclass(Aborted, Exception)


def test_outside_the_main_thread_signals_are_left_alone() -> None:
    seen: list[object] = []

    def body() -> None:
        with handle_signals(StopRequest()) as stop:
            seen.append(signal.getsignal(signal.SIGTERM))
            seen.append(stop.requested)

    before = signal.getsignal(signal.SIGTERM)
    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == [before, False]


def test_wait_wakes_on_request() -> None:
    stop = StopRequest()
    threading.Timer(0.05, stop.request, args=(signal.SIGTERM,)).start()
    assert stop.wait(60) is True


def test_the_exit_code_follows_the_reason_in_the_report() -> None:
    for sig, code in EXIT_CODES.items():
        reasons = [interrupted_reason(sig.name), "1 failed shards > errors.max_failed_shards = 0"]
        assert exit_code_of(reasons) == code
        data = {"status": RunStatus.INTERRUPTED, "failure_reasons": reasons}
        assert RunReport(data).exit_code == code
    assert RunReport({"status": "interrupted", "failure_reasons": []}).exit_code == 143
    assert RunReport({"status": "failed", "failure_reasons": []}).exit_code == 1


def test_the_help_lists_the_signal_exit_codes() -> None:
    assert "143" in EXIT_CODES_HELP and "130" in EXIT_CODES_HELP
    assert "interrupted" in EXIT_CODES_HELP


def test_a_stop_before_the_run_takes_its_output_writes_nothing_but_the_metrics(
    tmp_path: Path, catalog: Path, bundle_dir: Path
) -> None:
    """The library API: a stop already requested when the run starts ends it before it takes
    its output (it used to claim the output, withdrawing the last run's _SUCCESS, and report
    every shard interrupted): EarlyStop, nothing written, the metrics say interrupted."""
    stop = StopRequest(grace_period_s=0)
    stop.request(signal.SIGTERM)
    out = tmp_path / "out"
    metrics = tmp_path / "metrics.prom"
    config = JobConfig(
        input=str(catalog),
        output=str(out),
        model=str(bundle_dir),
        scheduler="sync",
        metrics_file=str(metrics),
    )
    with pytest.raises(EarlyStop) as stopped:
        run(config, stop=stop)
    assert stopped.value.exit_code == 143
    assert str(stopped.value) == "stopped by SIGTERM while starting; nothing was written"
    assert not out.exists() and not report_path(out).exists()
    assert 'status="interrupted"} 1' in metrics.read_text()


def test_a_signal_while_starting_is_recorded_and_the_run_takes_it_over() -> None:
    """The start-up handler records and never raises (it may run inside an import's callback,
    breakit22 M1); the run's own handler, once installed, takes the record over as its stop
    request, and the record is gone."""
    from pipeline.core import signals as launch

    launch.on_early_signal(signal.SIGINT, None)  # as the interpreter would call it
    launch.on_early_signal(signal.SIGTERM, None)  # a second one: the first decides
    with pytest.raises(EarlyStop) as info:
        launch.check_early_stop()  # a safe point
    assert info.value.exit_code == 130
    stop = StopRequest()
    with handle_signals(stop):
        assert stop.requested and stop.signal_name == "SIGINT"
    assert launch.take_early_signal() is None
    launch.check_early_stop()  # nothing left to stop for


def test_commands_without_stop_handling_change_nothing_where_signals_are_not_routed() -> None:
    """Click's test runner and library users never had the start-up handler installed."""
    from pipeline.core import signals as launch

    before = signal.getsignal(signal.SIGTERM)
    launch.raise_early_signals()
    assert signal.getsignal(signal.SIGTERM) is before
