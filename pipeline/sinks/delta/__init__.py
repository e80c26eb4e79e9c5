"""``format = "delta"``: a Delta Lake table through deltalake (delta-rs), one commit per run."""
