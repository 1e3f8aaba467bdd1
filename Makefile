# The two commands a new user needs: `make up` and `make test`. Every target bootstraps .venv.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: up test gen docs lint bench proto-baseline venv clean engines-check

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	@$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,dev,bench]'
	@touch $(STAMP)

venv: $(STAMP)

up: $(STAMP)
	@$(BIN)/motor up $(ARGS)

test: $(STAMP) lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

gen: $(STAMP)
	rm -rf gen/motor
	mkdir -p gen/motor/v1
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=gen --grpc_python_out=gen \
		--mypy_out=gen --mypy_grpc_out=gen protos/motor/v1/*.proto
	printf '' > gen/motor/__init__.py
	printf '' > gen/motor/v1/__init__.py
	printf '' > gen/motor/v1/py.typed

docs: $(STAMP)
	$(BIN)/python tools/apidoc.py
	$(BIN)/python -m services.common.config.reference > docs/configuration.md

lint: $(STAMP)
	$(BIN)/ruff check services tests bench tools
	$(BIN)/ruff format --check services tests bench tools
	$(BIN)/mypy services
	$(BIN)/buf lint
	$(BIN)/buf breaking --against protos/baseline.binpb

proto-baseline: $(STAMP)
	$(BIN)/buf build -o protos/baseline.binpb

bench: $(STAMP)
	$(BIN)/python -m bench $(ARGS)

# Motor's launch lines fed through the real engines' argument parsing and config resolution, on
# CPU (python -m tools.engines_check). Not part of `make test`: the engine venvs are several GB.
# Each venv is made once; its stamp says the install finished.
ENGINES := .engines
VLLM_VERSION ?= 0.33.0
SGLANG_VERSION ?= 0.5.23

$(ENGINES)/vllm/.installed:
	@echo "installing vllm==$(VLLM_VERSION) into $(ENGINES)/vllm (several GB, once)"
	$(PY) -m venv $(ENGINES)/vllm
	$(ENGINES)/vllm/bin/python -m pip install -q vllm==$(VLLM_VERSION)
	@touch $@

$(ENGINES)/sglang/.installed:
	@echo "installing sglang==$(SGLANG_VERSION) into $(ENGINES)/sglang (several GB, once)"
	$(PY) -m venv $(ENGINES)/sglang
	$(ENGINES)/sglang/bin/python -m pip install -q sglang==$(SGLANG_VERSION)
	@touch $@

engines-check: $(STAMP) $(ENGINES)/vllm/.installed $(ENGINES)/sglang/.installed
	$(BIN)/python -m tools.engines_check --engines-dir $(ENGINES)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
