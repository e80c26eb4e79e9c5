"""The output-format seam: where a run's scores go, as a small protocol.

An :class:`OutputFormat` is to a run what Ray Data's ``Datasink`` (``on_write_start``, ``write``,
``on_write_complete``, ``on_write_failed``) and Daft's ``DataSink`` (``start``, ``write``,
``finalize``) are to theirs: the driver calls the same methods whatever the format, and a new
format is a new implementation, not a fork of the driver. Today's one is the Parquet folder
(:class:`pipeline.sinks.folder.sink.ParquetFolder`); a table format (Delta Lake) is the next.

In the order a run calls them:

* before the lock: :meth:`~OutputFormat.check_owner` refuses an output this tool did not write;
  the run lock is taken at :attr:`~OutputFormat.lock_root` (inside the folder; beside a table,
  inside which nothing but data may live), and given up at once while a lock in
  :attr:`~OutputFormat.exclusive_with` is held (a table's maintenance);
* ``start`` (once the lock is held): the output is marked as this tool's
  (:attr:`~OutputFormat.mark`, the folder's only), :meth:`~OutputFormat.withdraw` withdraws what
  says the previous run's output is complete (the folder's ``_SUCCESS``; a table keeps its
  versions), :meth:`~OutputFormat.begin` reads where the previous run left the output (a table:
  its snapshot, whether the previous run's pending commit landed, the schema), then
  :meth:`~OutputFormat.replace_foreign` and :meth:`~OutputFormat.clear` (what is in the way);
* per shard: the worker writes the shard's data file at :meth:`~OutputFormat.target` (the
  folder: a stable name that replaces the old file; a table: a fresh name per run, since older
  versions keep their files) and returns what it knows of it (:class:`WrittenFile`: size, and
  the facts the format's :attr:`~OutputFormat.file_facts` computes from the file's footer in the
  worker); the driver keeps what :meth:`~OutputFormat.commit_shard` says in the manifest entry;
  resume asks :meth:`~OutputFormat.is_done` (the manifest entry and what readers see agree);
* ``finalize``: :meth:`~OutputFormat.settle` takes out of the visible dataset what the run does
  not vouch for (the folder deletes files its manifest lists; a table prepares remove actions),
  :meth:`~OutputFormat.verify` checks what readers see against the report, and, when the run
  succeeded, :meth:`~OutputFormat.commit_run` makes the run's data visible as one version (a
  table: one transaction, idempotent by the run's token) before the report is written, and
  :meth:`~OutputFormat.seal` marks it complete after the report (the folder: ``_SUCCESS``);
* on failure: :meth:`~OutputFormat.withdraw` again (a commit that failed half-way).

:meth:`~OutputFormat.describe` is the report's ``output_format`` section;
:meth:`~OutputFormat.sealed` says, without a run, whether the output holds a complete run (a
backfill skips such a day); :attr:`~OutputFormat.dataset` is what readers query as one dataset
(outputs never nest: ``pipeline.io.nesting``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pipeline.io.manifest import Manifest
from pipeline.io.ownership import ForeignFiles
from pipeline.io.storage import Location

#: What a worker computes of a data file it wrote, from the file's Parquet footer
#: (``pyarrow.parquet.FileMetaData``) and the floating-point columns it saw a NaN in (footers
#: leave NaN out of min/max, so such a column's bounds are no bounds: Delta's
#: ``deltastats.file_stats(metadata, nan_free=...)``): module-level and picklable (it travels in
#: the worker spec), and pyarrow only (workers are forked: no table-format client there).
FileFacts = Callable[[Any, frozenset[str]], dict[str, Any]]


@dataclass(frozen=True)
class WrittenFile:
    """The data file a worker wrote for one shard."""

    uri: str
    size: int  # bytes
    facts: Mapping[str, Any] = field(default_factory=dict)  # the format's file_facts


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


@dataclass
class Reconciliation:
    """What reconciling did (``OutputFormat.settle``): outputs removed, and visible files it
    would not touch (not the run's to delete)."""

    removed: list[Removal] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    #: The removals take effect only when the run commits (a table's remove actions): a run
    #: that does not commit removed nothing, and its report lists none.
    pending: bool = False


@dataclass(frozen=True)
class Committed:
    """What :meth:`OutputFormat.commit_run` made visible: the format's words for it (a table's
    version), for the report's ``output_format`` section."""

    details: Mapping[str, Any] = field(default_factory=dict)
    #: The run's data is visible to readers now (a table's version): a stop that arrives after
    #: this cannot undo it, so the run's outcome stands as committed. The folder's data becomes
    #: complete only with its seal.
    visible: bool = False


@dataclass(frozen=True)
class Expected:
    """What an output file's footer must say to be the output the report (or manifest) lists."""

    rows: int
    model_sha256: str
    settings_hash: str | None = None  # None: not checked
    input_rel: str | None = None  # None: not checked
    input_fingerprint: str | None = None


class OutputFormat(Protocol):
    """Where a run's scores go (see the module doc for the order of the calls)."""

    @property
    def root(self) -> Location:
        """The output: a folder of Parquet files, or a table's folder."""
        ...

    @property
    def name(self) -> str:
        """The format's name in reports: ``parquet_folder``, ``delta``."""
        ...

    @property
    def file_facts(self) -> FileFacts | None:
        """What a worker computes of each data file it writes (None: nothing but its size)."""
        ...

    @property
    def dataset(self) -> Location:
        """What readers query as one dataset, that this output is part of: the folder itself;
        the table's root for one of its partitions."""
        ...

    @property
    def lock_root(self) -> Location:
        """The folder holding the run lock (``_lock.json``): the output folder itself; a
        partition's control folder for a table (nothing but data inside a table)."""
        ...

    @property
    def exclusive_with(self) -> tuple[Location, ...]:
        """Lock folders whose live holder keeps a run out (a table's maintenance lock): checked
        right after the run took its own lock."""
        ...

    @property
    def mark(self) -> str | None:
        """The empty file that marks the output as this tool's, written when a run takes it
        (the folder's ``_SCORE_CATALOG``); None: nothing is written inside (a table's log says
        whose it is)."""
        ...

    def check_owner(self, mode: str) -> None:
        """Refuse, before the lock is taken, an output holding what this tool did not write
        (``mode``: ``on_foreign_output``, "refuse" or "replace")."""
        ...

    def withdraw(self) -> None:
        """Make the visible dataset stop claiming a complete run (idempotent)."""
        ...

    def begin(self, manifest: Manifest) -> None:
        """Once the lock is held and the manifest loaded: read where the previous run left the
        output and bring ``manifest`` up to date with it (a table: whether its pending commit
        landed; its schema made or checked). The folder has nothing to do."""
        ...

    def replace_foreign(self, ours: set[str]) -> ForeignFiles:
        """With ``on_foreign_output = "replace"``: delete the data files this tool did not
        write (``ours``: what the manifest lists)."""
        ...

    def clear(self, rejects: Location, wanted: Iterable[str], ours: set[str]) -> list[Removal]:
        """Before scoring: take away outputs of ours that the shards ``wanted`` cannot be
        written beside (the folder: a file where a folder must go, or the reverse)."""
        ...

    def target(self, rel_path: str, run_id: str) -> str:
        """Where the worker writes the data file of shard ``rel_path`` in run ``run_id``."""
        ...

    def is_done(self, rel_path: str, entry: Mapping[str, Any], expected: Expected) -> list[str]:
        """Why shard ``rel_path``, which the manifest ``entry`` says is done, is not (the file
        is gone, or its footer says otherwise); empty when it is done."""
        ...

    def commit_shard(self, written: WrittenFile | None) -> dict[str, Any]:
        """What the manifest entry of a shard keeps of the file it wrote (for the run's commit,
        and for later runs); the folder keeps nothing more than the entry has."""
        ...

    def settle(
        self,
        rejects: Location,
        keep: set[str],
        ours: set[str],
        reasons: Mapping[str, str],
    ) -> Reconciliation:
        """Take out of the visible dataset what the run does not vouch for (``keep``: the
        shards scored or skipped now, and those not attempted; ``ours``: what the manifest
        lists; ``reasons``: why a shard's previous output goes)."""
        ...

    def verify(self, expected: Mapping[str, Expected]) -> list[str]:
        """How what a reader sees differs from the report (``expected``: each shard in it)."""
        ...

    def commit_run(self, run_id: str, entries: Mapping[str, Mapping[str, Any]]) -> Committed:
        """Make the run's data visible as one version (``entries``: the manifest's, by shard),
        after the run succeeded and before its report is written."""
        ...

    def seal(self) -> None:
        """Mark the output complete: the last write of a successful run."""
        ...

    def describe(self, committed: Committed | None) -> dict[str, Any]:
        """The report's ``output_format`` section (of ``committed``, or of what the output
        holds when the run committed nothing)."""
        ...

    def sealed(self) -> bool:
        """Whether the output holds a complete run now (the folder: ``_SUCCESS``; a table: its
        partition holds exactly the files of the manifest's last commit), read without a lock."""
        ...
