# Development entry points. The README's Quick start uses `make demo` and `make test`.
# Environments are local virtual environments built from pinned constraints (requirements/).

PYTHON ?= python3.11
VENV ?= .venv
VENV_LATEST ?= .venv-latest
PIP_FLAGS ?= --disable-pip-version-check --no-input --progress-bar off
HOROVOD_ENV = HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
              HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1
PYTEST_ARGS ?=
# Tests run in 2 worker processes (pytest-xdist), a file per worker at a time (module fixtures built once).
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL = -n $(PYTEST_WORKERS) --dist loadfile
# The slowest tests, printed at the end of every run, so that the next slow file shows itself.
PYTEST_DURATIONS ?= --durations=25 --durations-min=10

.PHONY: demo test test-latest test-long env env-latest protos check-protos clean-env

# Primary environment (TF 2.15.1), without Horovod: enough for the demo and the core.
$(VENV)/.core: setup.py requirements/primary.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) -q -c requirements/primary.txt tensorflow-cpu grpcio-tools -e '.[test,demo]'
	touch $@

# Horovod compiles against the installed TF (about 6 minutes on 2 cores; pip caches the wheel).
# tf-slim (third-party nets for tests/test_pipeline_slim.py) is primary-only: unchecked on TF 2.21.
$(VENV)/.horovod: $(VENV)/.core
	$(VENV)/bin/pip install $(PIP_FLAGS) -q -c requirements/primary.txt cmake tensorflow-estimator tf-slim
	$(HOROVOD_ENV) $(VENV)/bin/pip install $(PIP_FLAGS) -q --no-build-isolation -c requirements/primary.txt horovod
	touch $@

# Latest environment (newest TF: Keras 3, no estimator, no Horovod): core tests only.
$(VENV_LATEST)/.core: setup.py requirements/latest.txt
	$(PYTHON) -m venv $(VENV_LATEST)
	$(VENV_LATEST)/bin/pip install $(PIP_FLAGS) -q -c requirements/latest.txt tensorflow-cpu -e '.[test,demo]'
	touch $@

env: $(VENV)/.horovod
env-latest: $(VENV_LATEST)/.core

demo: $(VENV)/.core
	$(VENV)/bin/dapple_demo

test: $(VENV)/.horovod
	$(VENV)/bin/python -m pytest -q $(PYTEST_PARALLEL) -m "not long" tests $(PYTEST_DURATIONS) $(PYTEST_ARGS)

test-latest: $(VENV_LATEST)/.core
	$(VENV_LATEST)/bin/python -m pytest -q $(PYTEST_PARALLEL) -m "not primary_only and not long" tests $(PYTEST_DURATIONS) $(PYTEST_ARGS)

# The long cases CI leaves out (pytest.ini's `long` marker), primary environment.
test-long: $(VENV)/.horovod
	$(VENV)/bin/python -m pytest -q $(PYTEST_PARALLEL) -m long tests $(PYTEST_DURATIONS) $(PYTEST_ARGS)

protos: $(VENV)/.core
	$(VENV)/bin/python scripts/gen_protos.py

check-protos: $(VENV)/.core
	$(VENV)/bin/python scripts/gen_protos.py --check

clean-env:
	rm -rf $(VENV) $(VENV_LATEST)
