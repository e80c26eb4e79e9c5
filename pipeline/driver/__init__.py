"""One run, driven from one process: phases that hand frozen values on (prepare -> lock ->
score -> finish), the Dask cluster and the dispatch of shard tasks, reconciling the output,
and the commands built on runs (``plan``, ``backfill``).

May import every layer below it (core, io, model, worker, report); never ``pipeline.cli``.
"""
