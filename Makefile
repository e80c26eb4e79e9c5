# score-catalog: `make score-catalog` runs the nightly job on the demo data, `make test` the tests.
# Every target installs what it needs into .venv first.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
PYTEST_ARGS ?=
# tests/integration/test_registry.py's real `mlflow server` runs from its own venv: the full mlflow
# package pins pyarrow below the version the tool is tested with, and the tool itself needs only
# the mlflow-skinny client (the `mlflow` extra, also in `dev`).
MLFLOW_VENV ?= .venv-mlflow
DUCKDB_DELTA_VENV ?= .venv-duckdb-delta
DUCKDB_ICEBERG_VENV ?= .venv-duckdb-iceberg
JOB ?= jobs/score_catalog.toml
RUN_ARGS ?=
# torch wheel for machines without an NVIDIA GPU: the local CPU build, installed before the
# project so that the unpinned range in pyproject.toml does not pull a multi-GB CUDA build.
CPU_TORCH ?= torch==2.13.0

.PHONY: install data score-catalog test test-slow test-fast lint format clean distclean help-check bench \
	bench-scaling bench-ab bench-incremental bench-formats archive-demo test-spark-iceberg \
  gpu-check

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  echo "NVIDIA GPU found: installing the default (CUDA) torch build"; \
	else \
	  $(PY) -m pip install -q "$(CPU_TORCH)"; \
	fi
	$(PY) -m pip install -q -e '.[dev,iceberg]'
	touch $@

# The demo catalog (generated, not committed) and the demo bundle (committed; retrained if absent).
data: data/catalog/.done

data/catalog/.done: $(VENV)/.installed pipeline/cli/demo.py
	$(BIN)/score-catalog demo --catalog data/catalog --model-dir data/models/catalog-ranker
	touch $@

score-catalog: data
	$(BIN)/score-catalog run $(JOB) $(RUN_ARGS)

# Benchmarks -> BENCHMARKS.md (bench/); BENCH_ARGS="--quick" for a fast development run.
# The strongest peer, Daft, runs from its own venv: it pins pyarrow below the version this project
# is tested with. Best effort: without it the bench says Daft was not measured.
BENCH_ARGS ?=
DAFT_VENV ?= .venv-daft
bench: install
	$(MAKE) $(DAFT_VENV)/.installed || echo "bench: Daft could not be installed; it will not be measured"
	$(MAKE) $(DAFT_VENV)/.installed-deltalake || echo "bench: deltalake for Daft could not be installed"
	DO_NOT_TRACK=1 $(BIN)/python -m bench.run $(BENCH_ARGS)

$(DAFT_VENV)/.installed:
	test -x $(DAFT_VENV)/bin/python || $(PYTHON) -m venv $(DAFT_VENV)
	$(DAFT_VENV)/bin/python -m pip install -q "$(CPU_TORCH)"
	$(DAFT_VENV)/bin/python -m pip install -q "daft==0.7.26" numpy
	touch $@

# Daft's write_deltalake needs deltalake beside it (bench DELTA: Daft's Delta write), and
# pyiceberg: Daft 0.7.26's writer module imports its Iceberg writer for any table write.
$(DAFT_VENV)/.installed-deltalake: $(DAFT_VENV)/.installed
	$(DAFT_VENV)/bin/python -m pip install -q "deltalake==1.6.6" "pyiceberg==0.12.0"
	touch $@

# Two versions side by side on W1 (alternating runs): make bench-ab BASE=<git revision>
BASE ?= HEAD~1
bench-ab: install
	$(BIN)/python -m bench.ab --base $(BASE)

# W1 as a Parquet folder, a Delta table and an Iceberg table side by side (interleaved whole
# processes), then night 1 of a 30-night Delta and Iceberg table rescored (bench/formats.py):
# writes BENCHMARKS_FORMATS.md, a section for BENCHMARKS.md. FORMATS_ARGS="--smoke" checks the
# bench at a small size; "--rounds 7 --days 60" measures more.
FORMATS_ARGS ?=
bench-formats: install
	$(BIN)/python -m bench.formats $(FORMATS_ARGS)

# The INCREMENTAL suite alone (make bench runs it with the others): nights with 0/1/10/100% of
# the rows changed against a full rescore; INCR_ARGS="W2" for one workload, "--quick" for a tenth.
INCR_ARGS ?=
bench-incremental: install
	$(BIN)/python -m bench.incremental $(INCR_ARGS)

# 1 vs 2 workers, an external tcp:// cluster, tiny shards grouped or not -> BENCHMARKS_SCALING.md
bench-scaling: install
	$(BIN)/python -m bench.scaling

# Three daily partitions of demo data, then the backfill job over them and one missing day
# (accepted with --allow-missing-partitions; without it a missing day fails the backfill).
archive-demo: install
	for d in 1 2 3; do \
	  $(BIN)/score-catalog demo --catalog data/archive/dt=2025-01-0$$d --rows 50000 --shards 4 \
	    --seed $$d --skip-model || exit 1; \
	done
	$(BIN)/score-catalog backfill jobs/rescore_archive.toml --from 2025-01-01 --to 2025-01-04 \
	  --allow-missing-partitions

# The suite without the tests marked slow (each over ~5 s here: S3 outages, races, killed
# servers): under 10 minutes on 2 cores. `make test-slow` runs the rest; CI (.ci/run) runs both.
TEST_ENV = MLFLOW_SERVER_BIN=$(abspath $(MLFLOW_VENV))/bin/mlflow \
  DUCKDB_DELTA_PYTHON=$(abspath $(DUCKDB_DELTA_VENV))/bin/python \
  DUCKDB_ICEBERG_PYTHON=$(abspath $(DUCKDB_ICEBERG_VENV))/bin/python
TEST_VENVS = $(MLFLOW_VENV)/.installed $(DUCKDB_DELTA_VENV)/.installed \
  $(DUCKDB_ICEBERG_VENV)/.installed
test: install $(TEST_VENVS)
	$(TEST_ENV) $(BIN)/pytest -m "not slow" $(PYTEST_ARGS)

test-slow: install $(TEST_VENVS)
	$(TEST_ENV) $(BIN)/pytest -m slow $(PYTEST_ARGS)

$(MLFLOW_VENV)/.installed:
	test -x $(MLFLOW_VENV)/bin/python || $(PYTHON) -m venv $(MLFLOW_VENV)
	$(MLFLOW_VENV)/bin/python -m pip install -q --upgrade pip
	$(MLFLOW_VENV)/bin/python -m pip install -q "mlflow>=3.0"
	touch $@

# DuckDB's Delta reader (tests/integration/test_delta_duckdb.py) runs from its own venv: the tool
# is tested with duckdb 2.x, which cannot load its delta extension without network access;
# duckdb 1.4.4 loads it offline from the duckdb-ext-delta package (its version pins the DuckDB).
$(DUCKDB_DELTA_VENV)/.installed:
	test -x $(DUCKDB_DELTA_VENV)/bin/python || $(PYTHON) -m venv $(DUCKDB_DELTA_VENV)
	$(DUCKDB_DELTA_VENV)/bin/python -m pip install -q --upgrade pip
	$(DUCKDB_DELTA_VENV)/bin/python -m pip install -q "duckdb==1.4.4" "duckdb-ext-delta==1.4.4.20260205"
	touch $@

# DuckDB's Iceberg reader (tests/integration/test_iceberg_duckdb.py), the same way: duckdb 1.4.4
# loads its iceberg extension offline from duckdb-ext-iceberg, which reads the manifests through
# the avro extension (duckdb-ext-avro; the iceberg package does not depend on it).
$(DUCKDB_ICEBERG_VENV)/.installed:
	test -x $(DUCKDB_ICEBERG_VENV)/bin/python || $(PYTHON) -m venv $(DUCKDB_ICEBERG_VENV)
	$(DUCKDB_ICEBERG_VENV)/bin/python -m pip install -q --upgrade pip
	$(DUCKDB_ICEBERG_VENV)/bin/python -m pip install -q "duckdb==1.4.4" \
	  "duckdb-ext-iceberg==1.4.4.20260205" "duckdb-ext-avro==1.4.4.20260205"
	touch $@

# Spark's Iceberg reader (tests/integration/test_iceberg_spark.py), on demand, not in `make test`
# nor CI: its runtime jar is a Maven artifact, found offline only inside a third party's wheel
# without the shaded Jackson it references, which tests/spark_jars.py relocates from another
# with Debian's jarjar (docs/iceberg.md, Readers). Needs a JRE: apt-get install
# default-jre-headless libjarjar-java.
SPARK_ICEBERG_VENV ?= .venv-spark-iceberg
$(SPARK_ICEBERG_VENV)/.installed: $(VENV)/.installed
	command -v java >/dev/null || { echo "needs a JRE: apt-get install default-jre-headless"; exit 1; }
	test -x $(SPARK_ICEBERG_VENV)/bin/python || $(PYTHON) -m venv $(SPARK_ICEBERG_VENV)
	$(SPARK_ICEBERG_VENV)/bin/python -m pip install -q --upgrade pip
	$(SPARK_ICEBERG_VENV)/bin/python -m pip install -q "pyspark==3.5.9" \
	  "snowpark-connect-deps-iceberg==1.0.3"
	rm -rf $(SPARK_ICEBERG_VENV)/wheels
	$(SPARK_ICEBERG_VENV)/bin/python -m pip download -q --no-deps -d $(SPARK_ICEBERG_VENV)/wheels \
	  "snowpark-connect-deps-2==3.56.7"
	$(PY) -m tests.spark_jars $(SPARK_ICEBERG_VENV)/wheels/snowpark_connect_deps_2-*.whl \
	  $(SPARK_ICEBERG_VENV)/jars
	rm -rf $(SPARK_ICEBERG_VENV)/wheels
	touch $@

test-spark-iceberg: install $(SPARK_ICEBERG_VENV)/.installed
	SPARK_ICEBERG_PYTHON=$(abspath $(SPARK_ICEBERG_VENV))/bin/python \
	  SPARK_ICEBERG_JARS=$(abspath $(SPARK_ICEBERG_VENV))/jars \
	  $(BIN)/pytest tests/integration/test_iceberg_spark.py $(PYTEST_ARGS)

test-fast: install
	$(BIN)/pytest -m "not integration and not slow" $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check pipeline tests bench
	$(BIN)/ruff format --check pipeline tests bench
	$(BIN)/mypy --strict pipeline
	$(BIN)/lint-imports
	$(BIN)/python -m tests.lint_sizes pipeline

format: install
	$(BIN)/ruff format pipeline tests bench
	$(BIN)/ruff check --fix pipeline tests bench

# On a CUDA machine: CPU vs CUDA in fp32/TF32/bf16/fp16, throughput per batch size, and the
# H2D / compute / D2H split (bench/gpu_check.py). Paste its output into BENCHMARKS.md.
gpu-check: install
	$(PY) -m bench.gpu_check --out gpu-check.md

# `score-catalog --help` with runtime dependencies only (no dev extras).
help-check:
	rm -rf .venv-runtime
	$(PYTHON) -m venv .venv-runtime
	.venv-runtime/bin/pip install -q "$(CPU_TORCH)" && .venv-runtime/bin/pip install -q .
	.venv-runtime/bin/score-catalog --help
	rm -rf .venv-runtime

clean:
	rm -rf data/catalog data/scored data/rejects data/archive data/archive_scored data/archive_rejects \
	  data/_score_catalog data/_rejects data/api_scored .pytest_cache .ruff_cache \
	  .mypy_cache .hypothesis build dist *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(MLFLOW_VENV) $(DAFT_VENV) $(DUCKDB_DELTA_VENV) $(DUCKDB_ICEBERG_VENV) \
	  $(SPARK_ICEBERG_VENV)
