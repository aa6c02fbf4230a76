# Two entry points (see README): `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SEARCH_STAMP := $(VENV)/.search-extra

.PHONY: demo demo-lm test test-fast bench clean setup

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "setuptools>=64" wheel
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	@command -v ip >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && { apt-get install -y -q iproute2 >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q iproute2 >/dev/null 2>&1; }; }; } || echo "warning: iproute2 could not be installed; multi-host tests will be skipped"
	@command -v dot >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && \
	  { apt-get install -y -q graphviz >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q graphviz >/dev/null 2>&1; }; }; } || \
	  echo "warning: graphviz 'dot' could not be installed; renderings will be skipped with a message"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m model_parallel.cli.main demo $(DEMO_ARGS)

# A demo that learns: a tiny GPT-2 on Python's own sources, validation loss falling, exported and reloaded.
demo-lm: $(STAMP)
	$(PY) -m model_parallel.cli.main demo-lm $(DEMO_ARGS)

# The tests also install the optional `search` extra (numba): the three-level proof's tests then run
# compiled. Without it they pass too, as plain Python (about 10 more minutes on 2 cores); the package
# itself never needs it (tests/integration/test_optimizer_core.py checks the PipeDream vectors with numba blocked).
$(SEARCH_STAMP): $(STAMP)
	$(PY) -m pip install -q "numba==0.68.0"
	touch $(SEARCH_STAMP)

test: $(SEARCH_STAMP)
	$(PY) -m pytest $(TEST_ARGS)

# The unit tier only (tests/unit, plus the layer check): no worker processes (tests/unit/conftest.py
# fails a unit test that starts one), no multi-second searches; under a minute on 2 busy cores.
# tests/integration (worlds, HF/timm models) and tests/search (the opt-in search's proofs) run in `make test`.
test-fast: $(STAMP)
	$(PY) -m pytest tests/unit tests/test_layers.py -m "not slow" $(TEST_ARGS)

bench: $(STAMP)
	$(PY) bench/profiler.py --quick
	$(PY) bench/optimizer.py --quick
	$(PY) bench/runtime.py --quick
	$(PY) bench/machine_drift.py --seconds 20
	$(PY) bench/rebalance.py --quick
	$(PY) bench/schedules.py --quick
	$(PY) bench/memory.py
	$(PY) bench/recovery.py --quick

clean:
	rm -rf $(VENV) profiles runs .pytest_cache
