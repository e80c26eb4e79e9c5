"""The run a process works for: run ids, and the id every log line carries.

A run binds its id when it starts (:func:`bind_run_id`); every record then gets it
(:class:`RunContextFilter`, which the console's handlers install), and the embedded cluster's
worker processes, forked from the driver, inherit it. Also the levels of Dask's own loggers
during a run, in the driver and in each worker (:func:`configure_dask_logging`).
"""

from __future__ import annotations

import datetime as dt
import logging
import logging.config
import uuid
from typing import Any

logger = logging.getLogger("pipeline")


def new_run_id() -> str:
    """A sortable, unique run id: UTC start time and a random suffix."""
    return f"{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:6]}"


# The id of the run this process is working for: bound by the run when it starts (and, for
# the CLI's own lines before that, by the command). Worker processes forked from the driver
# inherit it. A dict, not a contextvar: Dask's and the overlap's threads must see it too.
_RUN: dict[str, str | None] = {"run_id": None}


def bind_run_id(run_id: str | None) -> None:
    """Make every log line of this process (and of workers forked from it later) carry
    ``run_id``."""
    _RUN["run_id"] = run_id


def current_run_id() -> str | None:
    """The run id that log lines carry now (None before a run has one)."""
    return _RUN["run_id"]


class RunContextFilter(logging.Filter):
    """Give every record the ``run_id`` of the run (unless it names one itself)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "run_id" not in record.__dict__:
            record.run_id = _RUN["run_id"]
        return True


def dask_logging_config(debug: bool) -> dict[str, Any]:
    """The levels of Dask's own loggers during a run, as an incremental ``dictConfig``.

    ``import distributed`` sets its loggers to INFO; its cluster chatter is noise in a nightly
    log unless debugging, so it is WARNING unless ``debug``. Only levels change: the handlers
    :func:`setup_logging` installed stay.
    """
    loggers = {} if debug else {"distributed": {"level": "WARNING"}}
    return {"version": 1, "incremental": True, "loggers": loggers}


def configure_dask_logging(debug: bool | None = None) -> None:
    """Apply :func:`dask_logging_config` in this process: the driver, or a Dask worker.

    ``debug`` defaults to whether the ``pipeline`` logger is enabled for DEBUG (-vv).
    """
    if debug is None:
        debug = logger.isEnabledFor(logging.DEBUG)
    logging.config.dictConfig(dask_logging_config(debug))
