"""The words every layer shares: errors and exit codes, statuses, the frozen job configuration
(job file < environment < flags), output templates as text, strict JSON, signals and the stop
request, crash points for the tests, and the run id on every log line.

Imports nothing else of ``pipeline``; everything above may import it.
"""
