"""The model: bundles (``model.toml`` and the exported program), typed inputs and the features
built from Arrow columns, the pure scoring loop (``engine``), precision and parity, the program
cache, export, the model registry, batch-size tuning and the unseen-value checks.

May import ``pipeline.core`` and ``pipeline.io``.
"""
