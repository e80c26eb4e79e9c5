"""Where bytes live and what the tool's files are called: storage (fsspec only: locations,
listing, reads, staged writes, exclusive create, retries), the layout (every name the tool
writes, the control area, what is ours, overlap and nesting checks), the run lock, the manifest,
the run index, Parquet footers and writers, and the output formats (``pipeline.sinks``).

May import ``pipeline.core`` only.
"""
