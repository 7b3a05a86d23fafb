# Two commands do everything on a fresh machine:
#   make run    set up .venv (psdk + the torch, TensorFlow and JAX plugins) and train MNIST on 1 ps + 2 workers
#   make test   set up .venv and run lint, type checks and every test suite
# Extra Hydra overrides go in ARGS:  make run ARGS="backend=tf sync=sync optimizer=adam"
# The torch build comes from TORCH (CPU by default):  make setup TORCH="torch==2.13.0"
# TensorFlow comes from the tf plugin's extra TF_EXTRA: cpu (tensorflow-cpu, the default),
# gpu (tensorflow[and-cuda]), or empty to keep a TensorFlow you installed yourself.
# JAX comes with the jax plugin from PyPI: plain `jax` is the CPU build (add jax[cuda12] yourself for GPUs).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
TF_EXTRA ?= cpu
TF_PLUGIN := plugins/tf_backend$(if $(TF_EXTRA),[$(TF_EXTRA)])
STAMP := $(VENV)/.psdk-installed
# MNIST for every test suite: PSDK_DATA_DIR as the README says, else PSDK_TEST_DATA_DIR (the suites' old
# name), else ../shared/data/mnist beside the clone. The plugins' suites know only PSDK_DATA_DIR.
DATA = PSDK_DATA_DIR="$${PSDK_DATA_DIR:-$${PSDK_TEST_DATA_DIR:-$(CURDIR)/../shared/data/mnist}}"

.PHONY: setup run test lint typecheck test-core test-torch test-tf test-jax test-example test-bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml plugins/torch_backend/pyproject.toml plugins/tf_backend/pyproject.toml \
		plugins/jax_backend/pyproject.toml plugins/example_plugin/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[test,lint,ray]" -e plugins/torch_backend -e "$(TF_PLUGIN)" \
		-e plugins/jax_backend -e plugins/example_plugin
	touch $@

run: setup
	$(PY) -m psdk run backend=torch $(ARGS)

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

typecheck: setup
	$(PY) -m mypy

# Each suite runs in its own pytest process: torch, TensorFlow and JAX never share one.
test-core: setup
	$(DATA) $(PY) -m pytest tests $(PYTEST_ARGS)

test-torch: setup
	$(DATA) $(PY) -m pytest plugins/torch_backend/tests $(PYTEST_ARGS)

test-tf: setup
	$(DATA) $(PY) -m pytest plugins/tf_backend/tests $(PYTEST_ARGS)

test-jax: setup
	$(DATA) $(PY) -m pytest plugins/jax_backend/tests $(PYTEST_ARGS)

# The example plugin (a rule and a model): its jobs run every backend, each in a subprocess of its own.
test-example: setup
	$(DATA) $(PY) -m pytest plugins/example_plugin/tests $(PYTEST_ARGS)

# The peer scripts psdk is compared against (benchmarks/peers): short smoke runs, each in a subprocess.
test-bench: setup
	$(DATA) $(PY) -m pytest benchmarks/tests $(PYTEST_ARGS)

test: lint typecheck test-core test-torch test-tf test-jax test-example test-bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache outputs multirun
