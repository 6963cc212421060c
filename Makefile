# edgeflow — `make demo` runs the whole chain on the CPU demo profile; `make test` runs the tests.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PROFILE ?= configs/demo-cpu.yaml
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test down pools services venv clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: the CPU build, not a multi-GB CUDA one.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

services: venv
	$(PY) scripts/services.py up

pools: services

demo: services
	set -a; eval "$$($(PY) scripts/services.py env | sed 's/^export //')"; set +a; \
	$(PY) scripts/demo.py --profile $(PROFILE)

# --durations: the slowest tests in every run's log, where CI time goes (BENCHMARKS.md, "CI from a fresh clone").
test: venv
	$(PY) -m pytest -q --durations=25 $(PYTEST_ARGS)

down:
	@test -x $(PY) && $(PY) scripts/services.py down || true

clean: down
	rm -rf .edgeflow reports

# Kubernetes work pools from infra/kubernetes/*.json on the Prefect server at PREFECT_API_URL (not the demo's):
#   make k8s-pools K8S_POOLS_ARGS="--set a100.image=REGISTRY/edgeflow:TAG-cuda12 --set cpu.image=REGISTRY/edgeflow:TAG-cpu"
# Never part of `make test` or CI (the script refuses when CI is set); see infra/kubernetes/README.md.
.PHONY: k8s-pools
k8s-pools: venv
	$(PY) infra/kubernetes/create_pools.py $(K8S_POOLS_ARGS)
