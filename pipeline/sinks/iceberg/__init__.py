"""``format = "iceberg"``: a run's scores as one snapshot of an Apache Iceberg table
(:mod:`.sink`), through pyiceberg (the ``iceberg`` extra). Only the driver imports pyiceberg
(:mod:`.catalog` and the modules above it); Dask workers use :mod:`.facts` (pyarrow only)."""
