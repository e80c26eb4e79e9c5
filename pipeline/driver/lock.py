"""The lock phase: take the output, clear what a crashed run left, and find what is done.

Two steps, so that the run holds the lock (and can write a failed report) from the moment it is
taken: :func:`take` refuses a folder holding what this tool did not write, then takes the
fenced run lock (released by the run's clean-up, whatever happens); :func:`claim` marks the
output as the run's, withdraws the previous run's ``_SUCCESS`` and report, moves older layouts,
loads the manifest and returns :class:`~pipeline.driver.phases.Locked`: the shards an earlier
run already scored with this model and settings (skipped), and the tasks left to score.
"""

from __future__ import annotations

import contextlib
import logging

from pipeline.core.errors import LockError, log_cleanup_error
from pipeline.core.faults import checkpoint
from pipeline.core.interrupt import StopRequest
from pipeline.driver import incremental
from pipeline.driver.phases import Locked, Prepared
from pipeline.driver.prepare import stop_if_asked
from pipeline.io import layout, nesting, storage
from pipeline.io.layout import LOCK_NAME
from pipeline.io.listing import ShardRef
from pipeline.io.locking import RunLock, holder_text, live_holder
from pipeline.io.manifest import FencedManifest, Manifest
from pipeline.io.ownership import check_rejects_location
from pipeline.sinks.base import Begun
from pipeline.worker.shard import ShardResult
from pipeline.worker.spec import ShardTask

logger = logging.getLogger(__name__)

#: Schedulers whose workers run on this machine (they read the baseline index where the driver
#: wrote it); any other is a cluster's address.
LOCAL_SCHEDULERS = ("local", "threads", "sync")


def take(prepared: Prepared, stop: StopRequest, cleanup: contextlib.ExitStack) -> RunLock:
    """Refuse an output or rejects folder this run must not write, then take the run lock;
    ``cleanup`` releases it (after deleting this run's leftover temporary files)."""
    config, out, opts = prepared.config, prepared.output, prepared.config.storage
    for bucket in {b.uri: b for b in prepared.buckets_to_create}.values():
        storage.create_bucket(bucket)
    # A folder holding files this tool did not write is refused before anything is written.
    sink = prepared.sink
    sink.check(config.on_foreign_output, prepared.schema)
    shard_paths = [s.rel_path for s in prepared.shards]
    check_rejects_location(prepared.rejects, out, opts, shard_paths)
    lock = RunLock.acquire(
        sink.places.lock_root,
        prepared.run_id,
        stale_after_s=config.stale_lock_after_s,
        what=f"output {out.uri}",
    )
    try:
        # Again, now that no other run can change it: a run of another job may have taken the
        # output while this one planned. Refused, it writes nothing (no report either: the
        # report there is the other job's).
        nesting.check_owner(prepared.places, nesting.owner_record(config, prepared.places))
    except BaseException:
        log_cleanup_error(lock.release, "releasing the lock")
        raise
    cleanup.callback(_release, lock, prepared)
    for other in sink.places.exclusive_with:  # a table's maintenance: taken, then checked
        held = live_holder(other, config.stale_lock_after_s)
        if held is not None:
            raise LockError(
                f"output {out.uri}: {other.child(LOCK_NAME).uri} is held by {holder_text(held)} "
                "(a rollback, optimize or vacuum of its table); nothing was written. Run again "
                "once it is done."
            )
    checkpoint("locked")
    stop_if_asked(stop)  # the lock is released on the way out
    return lock


def claim(prepared: Prepared, lock: RunLock, cleanup: contextlib.ExitStack) -> Locked:
    """Take the output for this run and find what is left to score; ``cleanup`` saves the
    manifest (what was committed, so that a rerun skips it) whatever happens next."""
    config, out, sink = prepared.config, prepared.output, prepared.sink
    # An incremental night's baseline, read before this run changes anything it could be
    # reading (a fixed output is its own baseline): docs/incremental.md.
    remote = prepared.plan.scheduler not in LOCAL_SCHEDULERS
    night = None
    if prepared.scorer is not None:
        night = incremental.Night(
            config, prepared.scorer, prepared.model, out, prepared.control, sink
        )
    baseline = incremental.choose(night, lock.run_id, cleanup, remote=remote)
    lock.assert_held()
    layout.claim(prepared.places, lock.assert_held, sink.abort, mark=sink.places.mark)
    for root in (out, prepared.rejects):
        for path in storage.remove_temporaries(root):
            logger.info("removed a temporary file left by an interrupted run: %s", path)
    loaded = Manifest.load(prepared.control, prepared.places.old_controls)
    manifest = FencedManifest(
        loaded.loc,
        loaded.shards,
        verdict=loaded.verdict,
        format_state=loaded.format_state,
        owner=loaded.owner,
        fence=lock.assert_held,
    )
    cleanup.callback(log_cleanup_error, manifest.flush, "saving the manifest")
    moved = _rejects_moved(prepared, manifest)
    # The output is this job's from now on: recorded before anything is scored, so that a run
    # of another job is refused even if this one stops before its first shard.
    owned = manifest.set_owner(nesting.owner_record(config, prepared.places))
    if loaded.read_from is not None or moved or owned:
        # Written by an older version elsewhere (inside the output), naming rejects where it
        # kept them, or without this owner: save it to the control folder first, then drop
        # the old copy (a crash in between leaves both; the new one wins).
        manifest.save()
    if loaded.read_from is not None:
        storage.remove(loaded.read_from)
    # Where the previous run left the output (a table: its snapshot, and whether the previous
    # run's pending commit landed), before anything below trusts the manifest; outputs in the
    # way of this run's shards (an input shard that changed shape) taken away.
    wanted = tuple(s.rel_path for s in prepared.shards if s.rel_path not in prepared.failed)
    lock.assert_held()
    begun = sink.begin(
        manifest, prepared.rejects, wanted, config.on_foreign_output, prepared.schema
    )
    # What earlier runs wrote, before failed shards are forgotten: reconcile's "ours".
    previous = frozenset(manifest.shards)
    for removal in begun.cleared:
        manifest.forget(removal.rel_path)
    done = dict(prepared.failed)
    tasks: list[ShardTask] = []
    for s in prepared.shards:
        if s.rel_path in prepared.failed:
            manifest.forget(s.rel_path)
            continue
        skipped = _skipped(prepared, manifest, begun, s)
        if skipped is not None:
            done[s.rel_path] = skipped
        else:
            tasks.append(prepared.task(s))
    return Locked(lock, manifest, previous, begun, done, tuple(tasks), baseline)


def _skipped(
    prepared: Prepared, manifest: Manifest, begun: Begun, s: ShardRef
) -> ShardResult | None:
    """``s`` as skipped if the manifest says this model and settings scored it and the output
    file's footer agrees (its rows, model, settings and input shard); else None."""
    if prepared.config.force or not manifest.matches(s.rel_path, prepared.expectation(s)):
        return None
    done = manifest.shards[s.rel_path]
    expected = prepared.expected(s.rel_path, done["rows_scored"])
    problems = begun.done(s.rel_path, done, expected)
    if problems:
        # Deleted, replaced or copied over since: score it again instead of trusting it.
        logger.warning("scoring %s again: %s", s.rel_path, problems[0])
        return None
    if done.get("input") != s.uri:
        # The same shard at another place (the job's input moved): the entry names where it is
        # now, so that its removal, once it leaves the input, says why truthfully.
        manifest.record(s.rel_path, {**done, "input": s.uri})
    return ShardResult.skipped(s.rel_path, s.uri, done)


def _rejects_moved(prepared: Prepared, manifest: Manifest) -> bool:
    """Point the manifest's entries at the rejects :func:`layout.claim` moved from an older
    version's default location; True if any entry changed."""
    changed = False
    for old_loc, new_loc in prepared.places.rejects_moved:
        old, new = (loc.uri.rstrip("/") + "/" for loc in (old_loc, new_loc))
        for entry in manifest.shards.values():
            rejects = entry.get("rejects")
            if isinstance(rejects, str) and rejects.startswith(old):
                entry["rejects"] = new + rejects[len(old) :]
                changed = True
    return changed


def _release(lock: RunLock, prepared: Prepared) -> None:
    """Delete this run's leftover temporary files and release the lock; errors are logged."""
    log_cleanup_error(lambda: _remove_temporaries(prepared), "removing temporary files")
    log_cleanup_error(lock.release, "releasing the lock")


def _remove_temporaries(prepared: Prepared) -> None:
    """Staged files of this run that no writer will finish: a worker killed mid-write (SIGKILL,
    out of memory) left them; its shard was scored again elsewhere."""
    for root in (prepared.output, prepared.rejects):
        for path in storage.remove_temporaries(root, prepared.run_id):
            logger.info("removed a temporary file a killed worker left: %s", path)
