"""One shard on a worker: the frozen :class:`~pipeline.worker.spec.WorkerSpec` sent once per
run, the shard task and its result, batches read ahead, the model called, rows written behind
through the shard sink, and the shard's statistics; ``bundle check`` scores a few rows through
the same path.

May import ``pipeline.core``, ``pipeline.io`` and ``pipeline.model``.
"""
