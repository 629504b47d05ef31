# Two commands do everything on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test soak conformance clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/barter train

# `test` runs the tests in two worker processes (pytest-xdist), one per core: each test runs on one intra-op
# thread (tests/conftest.py), so one process would leave a core idle. The tests that fork processes (marked
# `forks` by tests/conftest.py) run after them, each in a process forked for it alone from a pytest process that runs
# no test (`--fork-each`, tests/fork_each.py): a test's children must not inherit the threads of the tests before it.
# It then executes the example notebooks
# (nbmake, in the venv's own kernel; a cell past 3 minutes fails). Their models are tiny, so one intra-op thread
# costs little and keeps torch from slowing down several-fold when other processes compete for the cores.
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n 2 --dist worksteal -m "not slow and not forks" tests
	$(PY) -m pytest -q --fork-each -m "forks and not slow" tests
	OMP_NUM_THREADS=1 $(PY) -m pytest -q --nbmake --nbmake-timeout=180 examples

# The property tests with 1,000 freshly drawn examples each (the `soak` hypothesis profile of tests/conftest.py; 200 for
# the own forward's, whose examples each analyse a model),
# every combination of the combination matrix's axes (tests/combinations; those over two processes after the others,
# in one process of their own, as in `test`), each with a freshly drawn seed, every
# conformance model analysed fresh, called and trained (tests/conformance/test_analysis_history.py, one draw each),
# then fxsurgery's analysis on every *ForCausalLM / *ForSequenceClassification / *ForImageClassification /
# *ForMaskedLM / *ForConditionalGeneration class of the installed transformers (benchmarks/hf_sweep.py), failing on a
# raw exception.
soak: $(STAMP)
	HYPOTHESIS_PROFILE=soak OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -n 2 --dist worksteal tests/fxsurgery/test_fxsurgery_properties.py \
		tests/fxsurgery/test_fxsurgery_module_calls.py tests/fxsurgery/test_fxsurgery_own_forward_fit.py
	HYPOTHESIS_PROFILE=soak OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -n 2 --dist worksteal \
		-m "(slow or not slow) and not forks" tests/combinations
	HYPOTHESIS_PROFILE=soak OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider --fork-each -m "(slow or not slow) and forks" \
		tests/combinations
	HYPOTHESIS_PROFILE=soak OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -n 2 --dist worksteal -m "slow or not slow" \
		tests/conformance/test_analysis_history.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/hf_sweep.py --timeout-per-model 120 --out runs/hf_sweep.md

clean:
	rm -rf $(VENV)

# Every row of the README's timm families table against the oracle run on its model; fails on any row that differs.
conformance: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -m slow tests/conformance/test_families_table.py
