# specdraft: `make demo` runs the main job on the embedded tiny world; `make test` runs the tests; `make lint` runs ruff.
# Both create .venv with pip if it is missing (CPU torch from the local wheel; pip, not uv/poetry).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test test-fast lint venv clean mlflow-ui

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev,triton,ray,suites]'
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/specdraft run configs/tiny.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -q -x --durations=15 tests

test-fast: $(STAMP)  # the unit tier, for an edit: no slow or integration tests
	$(BIN)/python -m pytest -q -x --durations=10 -m "not slow and not integration" tests

lint: $(STAMP)
	$(BIN)/ruff check .

mlflow-ui: $(STAMP)
	$(BIN)/mlflow ui --backend-store-uri sqlite:///mlruns/mlflow.db --default-artifact-root mlruns --host 127.0.0.1 --port 5000

clean:
	rm -rf artifacts .pytest_cache
