"""What a run says about itself: the typed ``_report.json`` and its committed JSON Schema, the
HTML page, score drift against earlier runs and the dataset's drift verdict, the Prometheus
metrics, and the text summaries.

May import ``pipeline.core``, ``pipeline.io``, ``pipeline.model`` and ``pipeline.worker``.
"""
