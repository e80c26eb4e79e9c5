"""The values one run's phases hand on, each frozen once its phase returns it.

:class:`Prepared` is what the run learned before writing anything (shards, footers, the model,
its settings, the thread plan, how the model runs); :class:`Locked` is the output taken (the lock,
the manifest, what an earlier run left done, the tasks still to score); :class:`Scored` is every
shard's result. Each phase is a function of the values before it (:mod:`pipeline.driver.prepare`,
:mod:`pipeline.driver.lock`, :mod:`pipeline.driver.score`, :mod:`pipeline.driver.finish`), and
:class:`pipeline.driver.run.ScoringRun` only calls them in order and releases what they took.

A phase never changes what an earlier one found. Three members are resources rather than facts,
and change underneath their fixed references: the Dask session, the run lock (its heartbeat) and
the manifest (a shard's entry is saved as the shard finishes).
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import torch

from pipeline.core.config import JobConfig
from pipeline.driver.cluster import DaskSession, Plan
from pipeline.driver.execution import Execution
from pipeline.driver.incremental import Baseline
from pipeline.driver.inspect import Inspection, Settings
from pipeline.io.layout import Places
from pipeline.io.listing import ShardRef
from pipeline.io.locking import RunLock
from pipeline.io.manifest import FencedManifest, expectation, fingerprint_hash
from pipeline.io.ownership import ForeignFiles
from pipeline.io.storage import Location
from pipeline.model.program import LoadedModel
from pipeline.model.registry import ModelSource
from pipeline.report.build import RunFacts, model_section
from pipeline.sinks.base import Begun, Expected, Removal, Sink
from pipeline.worker.shard import ShardResult
from pipeline.worker.spec import ShardTask


@dataclass(frozen=True)
class Prepared:
    """What the run learned before writing anything: the prepare phase's value."""

    config: JobConfig  # its model is the local bundle folder (a registry model's download)
    run_id: str
    input: str  # the input location, as its URI
    started_at: dt.datetime  # wall clock, for the report
    t0: float  # time.perf_counter() at the start, for durations
    places: Places  # the output, its control folder, the run index, older layouts' places
    sink: Sink[Any, Any]  # where the scores go (pipeline.sinks): the job's, holding no state
    schema: pa.Schema | None  # the run's output columns (None: no shard is left to score)
    rejects: Location
    source: ModelSource  # where the model came from (a bundle, or a registry version)
    shards: tuple[ShardRef, ...]  # the input, sorted by path
    buckets_to_create: tuple[Location, ...]  # create_output_bucket: made once the run writes
    device: torch.device
    sha: str  # the bundle's SHA-256
    settings: Settings  # what changes output rows (hashed into the manifest and footers)
    # What changes a row's scores (incremental nights: docs/incremental.md); None when the
    # output holds no fingerprints.
    scorer: Settings | None
    plan: Plan  # workers, threads, overlap
    session: DaskSession | None  # None: scored in this process (scheduler sync)
    found: Inspection  # footers, schema problems, the model loaded and dry-run checked
    failed: Mapping[str, ShardResult]  # shards failed before scoring: unreadable, schema
    execution: Execution  # batch size, precision, parity (the report's execution section)
    meta_types: Mapping[str, pa.Field]  # one type per id / pass-through column
    model_warnings: tuple[str, ...]  # said before scoring, kept for the report

    @property
    def output(self) -> Location:
        return self.places.output

    @property
    def control(self) -> Location:
        """The output's control folder: manifest, report, page."""
        return self.places.control

    @property
    def model(self) -> LoadedModel:
        """The model as loaded in the driver (dry-run checked)."""
        return self.found.model

    @functools.cached_property
    def by_path(self) -> dict[str, ShardRef]:
        return {s.rel_path: s for s in self.shards}

    def expectation(self, s: ShardRef) -> dict[str, Any]:
        """What a manifest entry must say for ``s`` to be done: its footer as read now (row
        count, layout and statistics), this model and these settings."""
        return expectation(s, self.found.infos[s.rel_path], self.sha, self.settings.hash)

    def input_fingerprint(self, rel_path: str) -> str:
        """The hash of shard ``rel_path``'s fingerprint, as its output's footer names it."""
        fingerprint = self.expectation(self.by_path[rel_path])["fingerprint"]
        return fingerprint_hash(dict(fingerprint))

    def expected(self, rel_path: str, rows: int) -> Expected:
        """What the output file of shard ``rel_path`` must say in its footer (``rows`` rows)."""
        fp = self.input_fingerprint(rel_path)
        return Expected(rows, self.sha, self.settings.hash, rel_path, fp)

    def task(self, s: ShardRef) -> ShardTask:
        """The task of scoring ``s``: where it is read from and written to."""
        info = self.found.infos[s.rel_path]
        config = self.config
        meta = [info.schema.field(c) for c in (config.id_column, *config.passthrough)]
        meta = [self.meta_types.get(f.name, f) for f in meta]
        return ShardTask(
            rel_path=s.rel_path,
            input_uri=s.uri,
            output_uri=self.sink.writer().target(s.rel_path, self.run_id),
            # What its rejects name as their output: the place a folder's file has, every run.
            output_name=self.output.child(s.rel_path).uri,
            rejects_uri=self.rejects.child(s.rel_path).uri,
            num_rows=info.num_rows,
            meta_schema=pa.schema(meta).serialize().to_pybytes(),
            input_fingerprint=self.input_fingerprint(s.rel_path),
        )

    def facts(self, lock: RunLock) -> RunFacts:
        """What the report says about the run itself (identity, locations, model, settings)."""
        config = self.config
        return RunFacts(
            run_id=self.run_id,
            job=config.name,
            started_at=self.started_at,
            input=self.input,
            output=self.output.uri,
            rejects=self.rejects.uri,
            id_column=config.id_column,
            error_budget=config.errors,
            model=model_section(self.source.uri, self.model, self.source.report()),
            device=str(self.device),
            threads=self.plan.public(),
            settings=self.settings.values,
            batch_size=self.execution.batch_size,
            execution=self.execution.report,
            lock_taken_over=lock.took_over,
            model_warnings=self.model_warnings,
        )


@dataclass(frozen=True)
class Locked:
    """The output taken: the lock phase's value."""

    lock: RunLock
    manifest: FencedManifest  # every save checks the lock first
    previous_outputs: frozenset[str]  # what the manifest listed when the run took the output
    begun: Begun  # what the sink found when the run took the output (pipeline.sinks.base)
    done: Mapping[str, ShardResult]  # known before scoring: failed (prepare) and skipped (done)
    tasks: tuple[ShardTask, ...]  # what is left to score, in input order
    # An incremental night's baseline (docs/incremental.md); the default: not incremental.
    baseline: Baseline = field(default_factory=Baseline)

    @property
    def foreign(self) -> ForeignFiles:
        """Files this tool did not write (replaced or kept)."""
        return self.begun.foreign

    @property
    def cleared(self) -> tuple[Removal, ...]:
        """Outputs taken away before scoring (their input changed shape)."""
        return self.begun.cleared


@dataclass(frozen=True)
class Scored:
    """Every shard's result: the score phase's value."""

    results: Mapping[str, ShardResult]  # by relative path, every shard of the input
    fatal: ShardResult | None  # the result that stopped the run (a fatal failure kind)

    def ordered(self, prepared: Prepared) -> list[ShardResult]:
        """The results in input order."""
        return [self.results[s.rel_path] for s in prepared.shards]
