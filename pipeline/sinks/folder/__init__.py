"""``format = "parquet"``: a folder of Parquet files, one per input shard, and ``_SUCCESS``."""
