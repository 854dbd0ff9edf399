# diffpipe: `make demo` runs the whole workflow on the embedded tiny model and
# demo dataset; `make test` runs the test suite, `make test-fast` its unit tests. Both create .venv on first use.
#
# Override the torch build for your CUDA version, e.g.
#   make demo TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# Test workers (pytest-xdist): one per core plus one, which keeps the cores busy while the
# SLURM and workflow tests wait on their jobs; at most 4 (each holds torch and the tiny models).
TEST_WORKERS ?= $(shell n=$$(( $$(nproc 2>/dev/null || echo 2) + 1 )); [ $$n -gt 4 ] && n=4; echo $$n)
BIN := $(VENV)/bin
STAMP := $(VENV)/.diffpipe-installed

.PHONY: venv demo test test-fast lint schema clean-demo

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	# Pin exactly the torch that is now installed, so nothing pulls another build.
	$(BIN)/python -m pip freeze | grep -i '^torch==' > $(VENV)/torch-constraint.txt
	$(BIN)/python -m pip install --quiet -c constraints.txt -c $(VENV)/torch-constraint.txt -e ".[dev]"
	touch $(STAMP)

demo: venv
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/diffpipe run --config config/demo.yaml

# --durations: the 30 slowest steps end the log, which is what tests/conftest.py's LONGEST_FIRST
# order is kept from.
test: venv
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30 tests

# The edit loop: unit tests and the family contract (each family's tiny flavor takes a step), no
# end-to-end runs (the few in tests/unit are marked slow); about 2 minutes on 2 cores. `make test` stays
# the full suite (what CI runs).
test-fast: venv
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not slow" tests/unit

lint: venv
	$(BIN)/ruff check diffpipe tests benchmarks

schema: venv
	$(BIN)/diffpipe schema > workflow/schemas/config.schema.json

# The generated tables of docs/ (config reference, validation reasons; each file in
# diffpipe.readme_tables.TABLES) and the schema.
docs: schema
	$(BIN)/python -m diffpipe.readme_tables

clean-demo:
	rm -rf runs/demo .snakemake
