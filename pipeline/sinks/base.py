"""The sink seam: where a run's scores go, as a few calls that take and return frozen values.

A :class:`Sink` is to a run what Ray Data's ``Datasink`` (``on_write_start``, ``write``,
``on_write_complete``, ``on_write_failed``) and Daft's ``DataSink`` (``start``, ``write``,
``finalize``) are to theirs. :func:`pipeline.sinks.sink_for` makes one per run (the only place a
format is named); it holds only what the job says, and nothing a call finds is kept on it: each
call returns a value the driver hands to the next. In the order a run calls them:

====================  ===========================  =============================================
phase                 call                         what a reader of the output sees after it
====================  ===========================  =============================================
prepare (no lock)     ``check(mode)``              unchanged (a foreign output, a table that
                                                   does not fit the run: refused here)
lock                  ``begin(manifest, ...)``     unchanged; a table is made (empty) or its
                      -> :class:`Begun`            schema evolved; the folder's ``_SUCCESS``
                                                   was withdrawn before (``abort``)
plan (no lock)        ``state(manifest)``          unchanged (``plan``, a backfill's check)
                      -> :class:`Begun`
score (workers)       ``writer()``                 unchanged for a table (files no version
                      -> :class:`WriterSpec`       lists); the folder's files are replaced one
                                                   by one as shards finish
finish                ``plan(begun, ...)``         unchanged (pure: what goes and why)
                      -> :class:`WritePlan`
                      ``delete_stale(plan)``       the folder: outputs of shards no longer
                                                   wanted are gone; a table: unchanged (files of
                                                   runs that never committed deleted)
                      ``verify(begun, plan, ...)`` unchanged
commit                ``commit(begun, plan, ...)`` a table: the run's version, whole
                      -> :class:`Committed`
                      ``seal(begun, committed)``   the folder: ``_SUCCESS``; a table: unchanged
                                                   (its token settled)
on failure            ``abort()``                  the folder: no ``_SUCCESS``; a table: the
                                                   previous version, whole
report                ``section(begun, committed)`` -
incremental           ``visible(output)``           unchanged (the baseline's files: read only)
(before the lock)     ``keeps_fingerprints()``
====================  ===========================  =============================================

Workers see only :class:`WriterSpec` (pyarrow only: a Dask worker forked from a driver that
used a table client must never call it) and return a :class:`WrittenFile` per shard, of which
``entry_of`` says what the manifest keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import pyarrow as pa

from pipeline.io.manifest import Manifest
from pipeline.io.ownership import ForeignFiles
from pipeline.io.storage import Location
from pipeline.sinks.naming import data_file_name

#: What a worker computes of a data file it wrote, from the file's Parquet footer
#: (``pyarrow.parquet.FileMetaData``) and the floating-point columns it saw a NaN in (footers
#: leave NaN out of min/max): module-level and picklable (it travels in the worker spec), and
#: pyarrow only.
FileFacts = Callable[[Any, frozenset[str]], dict[str, Any]]


@dataclass(frozen=True)
class WrittenFile:
    """The data file a worker wrote for one shard."""

    uri: str
    size: int  # bytes
    facts: Mapping[str, Any] = field(default_factory=dict)  # the sink's file_facts


@dataclass(frozen=True)
class Removal:
    """An output this run took out of the dataset, and why (listed in the report)."""

    rel_path: str  # relative to the output root (and the rejects root)
    output: str
    reason: str
    rejects: str | None = None

    def public(self) -> dict[str, Any]:
        """The report's entry (``removed_outputs``)."""
        return {"output": self.output, "reason": self.reason, "rejects": self.rejects}


@dataclass(frozen=True)
class Expected:
    """What an output file's footer must say to be the output the report (or manifest) lists."""

    rows: int
    model_sha256: str
    settings_hash: str | None = None  # None: not checked
    input_rel: str | None = None  # None: not checked
    input_fingerprint: str | None = None


@dataclass(frozen=True)
class SinkPlaces:
    """Where a sink keeps what a run needs to know before it begins."""

    output: Location  # the run's output: a folder, or a table's partition folder
    dataset: Location  # what readers query as one dataset (the table's root for a partition)
    lock_root: Location  # the run lock's folder (beside a table: nothing but data inside it)
    #: Lock folders whose live holder keeps a run out (a table's maintenance): checked right
    #: after the run took its own lock.
    exclusive_with: tuple[Location, ...] = ()
    #: The empty file that marks the output as this tool's, written when a run takes it (the
    #: folder's ``_SCORE_CATALOG``); None: nothing is written inside (a table's log says whose).
    mark: str | None = None
    #: A table: one schema for all its partitions (an id or pass-through column whose types no
    #: promotion joins is refused), and it keeps its versions (a partition's new version is
    #: compared, for drift, with that partition's previous one).
    table: bool = False
    #: What a table keeps in its root besides its partitions (Delta's ``_delta_log``).
    table_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class WriterSpec:
    """What the workers need of the sink, for every shard: where a shard's file goes
    (:meth:`target`) and what they compute of it. Picklable, pyarrow only."""

    root: str  # URI of the folder data files go to (a table's partition folder)
    #: "stable": the shard's relative path, replaced each run (a folder); "per_run": a fresh
    #: name in each run, flat in ``root`` (a table keeps older versions' files).
    naming: str = "stable"
    file_facts: FileFacts | None = None

    def target(self, rel_path: str, run_id: str) -> str:
        """The URI of shard ``rel_path``'s data file in run ``run_id``."""
        name = rel_path if self.naming == "stable" else data_file_name(rel_path, run_id)
        sep = "" if self.root.endswith("/") else "/"
        return f"{self.root}{sep}{name}"


@dataclass(frozen=True)
class Outcome:
    """What the run's shards leave in the output: :meth:`Sink.plan`'s question."""

    keep: frozenset[str]  # shards scored or skipped now, and those not attempted
    ours: frozenset[str]  # what the manifest listed when the run took the output
    reasons: Mapping[str, str]  # shards whose previous output goes, and why


class Begun(Protocol):
    """What the output held when the run took it (or, from :meth:`Sink.state`, holds now)."""

    @property
    def cleared(self) -> tuple[Removal, ...]:
        """Outputs taken away before scoring (their input changed shape)."""
        ...

    @property
    def foreign(self) -> ForeignFiles:
        """Files this tool did not write, deleted or kept (``on_foreign_output``)."""
        ...

    @property
    def complete(self) -> bool:
        """Whether the output holds a complete run (a backfill skips such a day)."""
        ...

    def done(self, rel_path: str, entry: Mapping[str, Any], expected: Expected) -> list[str]:
        """Why shard ``rel_path``, which the manifest ``entry`` says is done, is not (its file
        is gone, or its footer says otherwise); empty when it is done."""
        ...


class WritePlan(Protocol):
    """What the run's finish takes out of the visible dataset, decided without changing it."""

    @property
    def removed(self) -> tuple[Removal, ...]:
        """What readers stop seeing, and why (the report's ``removed_outputs``)."""
        ...

    @property
    def foreign(self) -> tuple[str, ...]:
        """Visible files the run will not touch (not its to delete), relative paths."""
        ...

    @property
    def at_commit(self) -> bool:
        """The removals take effect with the commit (a table's): a run that does not commit
        removes nothing, and its report lists none."""
        ...


@dataclass(frozen=True)
class Committed:
    """What :meth:`Sink.commit` made visible."""

    #: The run's data is visible to readers now (a table's version): a stop that arrives after
    #: this cannot undo it, so the run's outcome stands as committed. The folder's data becomes
    #: complete only with its seal.
    visible: bool = False
    version: int | None = None  # a table's version readers see now
    made: bool = False  # this run made that version (else it held the output already)
    details: Mapping[str, Any] = field(default_factory=dict)  # the format's words for it


@dataclass(frozen=True)
class Visible:
    """The data files a reader of one output sees now (an incremental night's baseline)."""

    files: tuple[str, ...]  # URIs
    version: int | None = None  # a table's version they are of


@dataclass(frozen=True)
class Section:
    """The report's ``output_format``: the format's own keys, and the generic ones the report
    renders without knowing the format (a table's summary line, its heading on the page, the
    version a metric carries)."""

    details: Mapping[str, Any]

    def public(self) -> dict[str, Any]:
        return dict(self.details)


BegunT = TypeVar("BegunT", bound=Begun)
PlanT = TypeVar("PlanT", bound=WritePlan)


class Sink(Protocol, Generic[BegunT, PlanT]):
    """Where one run's scores go (see the module doc for the order of the calls). Generic in
    the values its format hands on: each call takes back the ones an earlier call returned."""

    @property
    def name(self) -> str:
        """The format's name in reports: ``parquet_folder``, ``delta``."""
        ...

    @property
    def places(self) -> SinkPlaces: ...

    def check(self, mode: str, schema: pa.Schema | None) -> None:
        """Refuse, before the lock is taken and read only, an output holding what this tool
        did not write (``mode``: ``on_foreign_output``), or one the run's output (``schema``;
        None: nothing will be written) cannot go to (a table of another schema)."""
        ...

    def state(self, manifest: Manifest) -> BegunT:
        """What the output holds now, read only, without the lock: ``plan`` and a backfill's
        question whether a day is complete."""
        ...

    def begin(
        self,
        manifest: Manifest,
        rejects: Location,
        wanted: tuple[str, ...],
        mode: str,
        schema: pa.Schema | None,
    ) -> BegunT:
        """Under the run lock: make the output ready for the shards ``wanted`` and the run's
        output ``schema`` (a table made or its schema evolved; files of ours in the way taken
        away; with ``mode`` "replace", foreign files deleted), bring ``manifest`` up to date with
        what the output holds (a table: whether the previous run's commit landed), and say what
        it found."""
        ...

    def writer(self) -> WriterSpec:
        """What the workers need (see :class:`WriterSpec`)."""
        ...

    def entry_of(self, written: WrittenFile | None) -> dict[str, Any]:
        """What the manifest entry of a shard keeps of the file it wrote."""
        ...

    def plan(self, begun: BegunT, manifest: Manifest, outcome: Outcome, rejects: Location) -> PlanT:
        """What goes from the visible dataset, and why: pure (reads only)."""
        ...

    def delete_stale(self, plan: PlanT) -> tuple[Removal, ...]:
        """Delete now what ``plan`` says goes now (the folder's outputs of shards no longer
        wanted, with their rejects; a table's files of runs that never committed, which no
        reader sees); returns the removals done (the folder's), for the report."""
        ...

    def verify(
        self, begun: BegunT, plan: PlanT, manifest: Manifest, expected: Mapping[str, Expected]
    ) -> list[str]:
        """How what a reader would see after the commit differs from the report
        (``expected``: each shard in it)."""
        ...

    def commit(
        self,
        begun: BegunT,
        plan: PlanT,
        manifest: Manifest,
        run_id: str,
        record: Callable[[], object] | None = None,
    ) -> Committed:
        """Make the run's data visible as one version (a table), after the run succeeded and
        before its report is written; the manifest records it. ``record`` (the run index's
        entry) is called once the sink has recorded what it is about to commit, where the next
        run finds it, and before anything is visible: a run killed in between is settled by
        the next one (its entry made to say the commit never landed)."""
        ...

    def seal(self, begun: BegunT, manifest: Manifest, committed: Committed) -> None:
        """The last write of a successful run, after its report (the folder: ``_SUCCESS``)."""
        ...

    def abort(self) -> None:
        """Make the visible dataset stop claiming a complete run (idempotent)."""
        ...

    def section(self, begun: BegunT | None, committed: Committed | None) -> Section:
        """The report's ``output_format`` (of ``committed``, or of what the output held)."""
        ...

    def visible(self, output: str) -> Visible:
        """The data files a reader of ``output`` (this job's output of another night, or of
        this one: a folder, or a table's partition folder) sees now, read only: an incremental
        night's baseline (docs/incremental.md). Raises where they cannot be listed."""
        ...

    def keeps_fingerprints(self) -> bool:
        """Whether the output holds the ``model_input_hash`` column already (a table that
        incremental runs wrote), which every run then keeps writing: a table keeps its
        columns."""
        ...
