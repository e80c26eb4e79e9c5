"""The ``score-catalog`` command: the console script's first lines (signals routed before
anything heavy is imported), Click commands thin over the library, the console (log lines,
progress, summaries), and the demo data.

The top layer: may import everything below; nothing imports it. ``--help`` imports no torch,
pyarrow or Dask: commands import the driver inside their bodies (downward, a line each says so).
"""
