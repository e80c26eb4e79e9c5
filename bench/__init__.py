"""Benchmark harness for score-catalog (`make bench`, writes BENCHMARKS.md).

Layout:

- ``bench.run``: the entry point (``python -m bench.run [--quick]``): builds the workloads, runs
  every comparator alternating (A B C A B C ...), and writes the report.
- ``bench.workloads``: sizes (full and ``--quick``) and deterministic data and model bundles.
- ``bench.suites``: the comparators of each workload and how each one is launched.
- ``bench.loops``: comparator bodies that run in their own process (``python -m bench.loops``):
  model ceilings, the I/O ceiling, hand-rolled loops, the textbook DataLoader, the library call.
- ``bench.procs``: subprocess launching with whole-process-tree peak RSS sampling (psutil).
- ``bench.stats``: medians and ranges of repeated samples.
- ``bench.report``: machine facts and the markdown report.
- ``bench.mdtable``: the one Markdown table renderer (rows + column specs).
"""
