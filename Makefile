# Yutu: `make run` starts the whole stack, `make test` runs the test suite. Both set everything up.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
MODEL  ?=
PORT   ?= 8000
PYTEST_ARGS ?=

.PHONY: kernels run test lint typecheck bench clean image compose-test swarm-test k8s-check

$(STAMP): pyproject.toml
	@scripts/bootstrap.sh
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,load]'
	@touch $(STAMP)

# The native CPU kernels (yutu.engine.native), built once per machine and again when their source
# changes; a machine without a compiler still runs (on torch's attention), so a failed build is no error.
kernels: $(STAMP)
	@$(PY) -m yutu.engine.native || echo "(continuing: engines will decode on torch's attention)"

run: kernels
	$(VENV)/bin/yutu up --port $(PORT) $(if $(MODEL),--model $(MODEL))

test: $(STAMP)
	@scripts/bootstrap.sh --need-redis-binary
	$(PY) -m yutu.engine.native
	$(VENV)/bin/ruff check libs services tests loadtests
	$(VENV)/bin/mypy libs/yutu services
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check libs services tests loadtests
	$(VENV)/bin/ruff format --check libs services tests loadtests

typecheck: $(STAMP)
	$(VENV)/bin/mypy libs/yutu services

# Containers (docs/deployment.md): each target installs Docker and starts dockerd itself when needed.
image:
	@scripts/docker-build.sh

compose-test:
	@scripts/compose-test.sh

swarm-test:
	@scripts/swarm-test.sh

k8s-check:
	@scripts/k8s-check.sh

bench: $(STAMP)
	$(PY) loadtests/bench_engine.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
