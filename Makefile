# The two commands a new user needs: `make up` and `make test`. Every target bootstraps .venv.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: up test gen docs lint bench proto-baseline venv clean

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

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
