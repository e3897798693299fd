# Two commands on a fresh Debian/Ubuntu machine:
#   make demo   install what is missing, start the stack, show the walkthrough, leave it up
#   make test   install what is missing, run the default tier (every guarantee end to end)
# And: make test-long (the rest), make test-quick (no process started), make lint (ruff and mypy, as CI runs them).
# Python dependencies go to .venv at the repo root, pinned by uv.lock.

SHELL := /bin/bash
UV_VERSION := 0.13.9
PY := .venv/bin/python
# A uv already on PATH is used as is; otherwise a pinned one is put in .tools/.
UV := $(or $(shell command -v uv 2>/dev/null),.tools/uv/bin/uv)
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
PYTEST_ARGS ?=

.PHONY: demo test test-long test-quick test-newest lint test-docker down up deps system-deps python-deps node-deps lock

demo: deps
	$(PY) stack.py up -d
	$(PY) -m tools.walkthrough
	@echo
	@$(PY) stack.py ps
	@echo "The stack is still up. Stop it with: make down"

up: deps
	$(PY) stack.py up -d

down:
	@if [ -x $(PY) ]; then $(PY) stack.py down; fi

# The default tier: every guarantee end to end at least once, all but the tests marked `long`. In two
# runs: the files that time nothing on WORKERS parallel processes (pytest-xdist, a file to a worker), then
# those that compare times (tests/conftest.py's SERIAL) alone. MARK narrows both (a marker expression);
# JUNIT names a folder for each run's JUnit XML. Either run may select nothing, not both (pytest's exit 5).
WORKERS ?= 2
MARK ?=
JUNIT ?=
test: deps node-deps
	@set +e; \
	$(PY) -m pytest -m "not long and not serial$(if $(MARK), and ($(MARK)))" -n $(WORKERS) --dist loadfile \
	  $(if $(JUNIT),--junitxml=$(JUNIT)/test.xml) $(PYTEST_ARGS); parallel=$$?; \
	$(PY) -m pytest -m "not long and serial$(if $(MARK), and ($(MARK)))" \
	  $(if $(JUNIT),--junitxml=$(JUNIT)/test-serial.xml) $(PYTEST_ARGS); serial=$$?; \
	if [ $$parallel = 5 ] && [ $$serial = 5 ]; then exit 5; fi; \
	for rc in $$parallel $$serial; do [ $$rc = 0 ] || [ $$rc = 5 ] || exit $$rc; done

# The rest (tests/conftest.py's LONG: duplicate full HA checks, benchmarks, the abuse suite); CI runs both.
test-long: deps node-deps
	$(PY) -m pytest -m "long$(if $(MARK), and ($(MARK)))" $(if $(JUNIT),--junitxml=$(JUNIT)/test-long.xml) $(PYTEST_ARGS)

# The tests that start no process (redis, haproxy, replicas): seconds, for every edit. On WORKERS processes,
# SERIAL's files included: what those time is their stacks, and a quick test holds no time to an upper bound
# (on one process they took 30 s, on two 23 s).
test-quick: python-deps
	$(PY) -m pytest -m quick -n $(WORKERS) --dist loadfile $(PYTEST_ARGS)

# The quick tests and the SDK fence against the newest FastMCP and MCP SDK the index serves,
# resolved afresh within pyproject's ranges into .venv-newest: a release that breaks the kit
# is found here, while uv.lock keeps the versions `make test` runs.
NEWEST := .venv-newest
test-newest: python-deps
	rm -rf $(NEWEST)
	$(UV) venv --quiet --python $(PY) $(NEWEST)
	$(UV) pip install --quiet --python $(NEWEST)/bin/python --upgrade -e '.[ops]' --group dev
	@$(NEWEST)/bin/python -c "import importlib.metadata as m; print('newest:', *(f'{d} {m.version(d)}' for d in ('fastmcp', 'mcp')))"
	$(NEWEST)/bin/python -m pytest -m quick $(PYTEST_ARGS)
	$(NEWEST)/bin/python -m pytest tests/mcp_ha/test_sdk.py $(PYTEST_ARGS)

lint: python-deps
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy
	.venv/bin/mypy --strict mcp_ha tests/typing

deps: system-deps python-deps

# redis-server, haproxy (and pip, to fetch uv) from the distribution, only when missing.
system-deps:
	@missing=""; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	command -v haproxy >/dev/null 2>&1 || missing="$$missing haproxy"; \
	command -v uv >/dev/null 2>&1 || python3 -m pip --version >/dev/null 2>&1 || missing="$$missing python3-pip"; \
	if [ -n "$$missing" ]; then \
	  echo "installing from the distribution:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi

.tools/uv/bin/uv:
	python3 -m pip install --quiet --disable-pip-version-check --target .tools/uv uv==$(UV_VERSION)

python-deps: $(if $(shell command -v uv 2>/dev/null),,.tools/uv/bin/uv)
	$(UV) sync --frozen --python '>=3.11'

# The TypeScript SDK clients the tests drive (tests/clients/ts: @modelcontextprotocol/client v2 and
# @modelcontextprotocol/sdk v1, the failover benchmark's ts_sdk), pinned by its package-lock.json.
NODE_CLIENT := tests/clients/ts
node-deps: $(NODE_CLIENT)/node_modules/.package-lock.json

$(NODE_CLIENT)/node_modules/.package-lock.json: $(NODE_CLIENT)/package-lock.json
	@command -v npm >/dev/null 2>&1 || { echo "installing from the distribution: nodejs npm"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq nodejs npm; }
	npm ci --prefix $(NODE_CLIENT) --no-audit --no-fund --loglevel=error

lock:
	$(UV) lock

# docker-compose.yaml run for real (.ci/docker-stage): images built locally,
# host networking on loopback, tests/deploy/test_docker.py against the containers.
test-docker: deps
	.ci/docker-stage
