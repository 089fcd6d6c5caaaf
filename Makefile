# replog — every target installs what it needs into .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
TEST_WORKERS ?= 0

.DEFAULT_GOAL := help
.PHONY: help install jars mariadb demo demo-mysql demo-throughput test test-fast lint dist bench clean

help: ## show this help
	@echo "replog — make targets:"
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@command -v java >/dev/null || { echo "Spark needs a Java runtime (17+): apt-get install -y openjdk-17-jre-headless"; exit 1; }
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP) ## create .venv and install replog with its dev tools

# The JVM parts the tests run beside Spark (jvm/pom.xml): Apache Kafka's broker, Spark's
# Kafka connector, Debezium's PostgreSQL connector. Fetched from Maven Central once into
# .jars/ (Maven keeps its downloads in ~/.m2); never committed, never in the wheel.
JARS       := .jars
JARS_STAMP := $(JARS)/.installed-stamp
JVM_SOURCES := $(shell find jvm -name pom.xml -o -name '*.java')

$(JARS_STAMP): $(JVM_SOURCES)
	@command -v mvn >/dev/null || { echo "the tests' Kafka and Debezium jars need Maven: apt-get install -y maven"; exit 1; }
	rm -rf $(JARS)
	mvn -q -B -f jvm/pom.xml package -Djars.dir=$(abspath $(JARS))
	touch $(JARS_STAMP)

jars: $(JARS_STAMP) ## fetch the Kafka, Spark-Kafka and Debezium jars the tests use into .jars/

# MariaDB's server for the MySQL capture tests and `make demo-mysql` (each starts throwaway
# servers of its own in temporary directories: examples/embedded_mariadb.py): Debian's
# mariadb-server, installed when missing (these machines run as root and reach Debian's
# packages). Nothing of a system server is used; in a container the package's service does
# not start at all.
MARIADBD := $(shell command -v mariadbd || ls /usr/sbin/mariadbd 2>/dev/null)

mariadb: ## install MariaDB's server (Debian's mariadb-server) if it is missing
ifeq ($(MARIADBD),)
	@echo "the MySQL capture tests need MariaDB's server: installing Debian's mariadb-server (apt-get)"
	apt-get install -y -qq mariadb-server >/dev/null || { apt-get update -qq && apt-get install -y -qq mariadb-server >/dev/null; }
else
	@true
endif

# Bytecode for replog, as pip writes it for an installed wheel: with PYTHONDONTWRITEBYTECODE
# set (as on these machines), every Python process Spark starts would compile replog anew.
BYTECODE := $(PY) -m compileall -q src

demo: $(STAMP) ## the main job: PostgreSQL -> capture -> Spark masks e-mails -> replog-sink -> Delta; checks equality
	$(BYTECODE)
	PYSPARK_PYTHON=$(abspath $(PY)) $(PY) examples/demo.py

demo-mysql: $(STAMP) mariadb ## MariaDB -> capture mysql -> Spark -> apply_changes -> Delta; checks equality
	$(BYTECODE)
	PYSPARK_PYTHON=$(abspath $(PY)) $(PY) examples/demo_mysql.py

demo-throughput: $(STAMP) ## 1M synthetic CDC events -> replog -> mask -> replog-sink, exactly once, with events/s
	$(BYTECODE)
	PYSPARK_PYTHON=$(abspath $(PY)) $(PY) examples/demo_throughput.py

# Plain `pytest` deselects the spark and slow tiers (pyproject's addopts); -m "" selects all.
test: $(STAMP) $(JARS_STAMP) mariadb ## run every test (unit, Spark, S3 via moto, crash, spark-submit)
	$(BYTECODE)
	PYSPARK_PYTHON=$(abspath $(PY)) $(PY) -m pytest -m "" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=20 $(PYTEST_ARGS)

test-fast: $(STAMP) ## run the tests that need neither Spark, Spark Connect nor subprocesses (= plain pytest)
	$(PY) -m pytest -m "not spark and not slow and not connect" $(PYTEST_ARGS)

lint: $(STAMP) ## ruff and mypy (strict)
	$(VENV)/bin/ruff check src tests integration benchmarks examples
	$(VENV)/bin/mypy

dist: $(STAMP) ## build the wheel into dist/
	rm -rf dist build
	$(PY) -m build --wheel --outdir dist .

# Every script in benchmarks/ (a test checks this list against the folder), each as its
# docstring says to run it; hours in all (the chaos runs alone are 10 minutes each, more
# with the pipeline's catch-up).
SPARK_PY := PYSPARK_PYTHON=$(abspath $(PY)) $(PY)
bench: $(STAMP) $(JARS_STAMP) mariadb ## run every benchmark (hours; figures go to docs/BENCHMARKS.md)
	$(BYTECODE)
	$(PY) benchmarks/bench_log.py
	$(SPARK_PY) benchmarks/bench_source.py
	$(SPARK_PY) benchmarks/bench_sink.py
	$(SPARK_PY) benchmarks/bench_latency.py
	$(SPARK_PY) benchmarks/bench_fixed.py
	for section in python age spark s3 writers stream; do \
	  $(SPARK_PY) benchmarks/bench_commits.py $$section || exit 1; done
	$(PY) benchmarks/bench_capture.py
	$(PY) benchmarks/bench_capture_mysql.py
	$(PY) benchmarks/bench_debezium.py
	$(PY) benchmarks/bench_scale.py
	$(PY) benchmarks/bench_apply.py
	$(SPARK_PY) benchmarks/bench_apply_scale.py
	$(SPARK_PY) benchmarks/bench_apply_routing.py
	$(SPARK_PY) benchmarks/bench_as_of.py
	$(PY) benchmarks/bench_redelivery.py
	$(PY) benchmarks/fault_runs.py
	$(PY) benchmarks/compact_under_load.py
	$(SPARK_PY) benchmarks/chaos.py
	$(SPARK_PY) benchmarks/chaos_pipeline.py
	$(SPARK_PY) benchmarks/snapshot_soak.py
	$(SPARK_PY) benchmarks/pgbench_follow.py
	$(PY) benchmarks/idle_slot_wal.py

clean: ## remove build outputs and demo data
	rm -rf dist build demo-data bench-data .pytest_cache .mypy_cache .ruff_cache jvm/*/target
