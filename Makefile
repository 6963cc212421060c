# edgeflow — `make demo` runs the whole chain on the CPU demo profile; `make test` runs the tests.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PROFILE ?= configs/demo-cpu.yaml
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo page-test test test-all test-durations docs down pools services venv edgellm-venv clean

# Two installs into one venv: what `make demo` runs (torch, the pipeline, cpu_native, the `demo` extra's OpenAI client),
# then what `make test` adds
# (the `test` extra: pytest, Playwright, linters, and llama-cpp-python for the llama_cpp engine).
# llama-cpp-python compiles llama.cpp from its sdist (about 5 min on 2 cores), once per machine: the wheel is kept in
# ~/.cache/edgeflow/wheels (below), so a later install, a fresh clone's included, takes seconds. x86: the ISA cpu_native is compiled for (AVX2, FMA, F16C), not
# -march=native, so the library runs on any AVX2 machine this venv is copied to.
# Override for another target, e.g. LLAMA_CMAKE_ARGS="-DGGML_NATIVE=ON" or "-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=87".
ifeq ($(shell uname -m),x86_64)
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAVA_BUILD=OFF
else
LLAMA_CMAKE_ARGS ?= -DLLAVA_BUILD=OFF
endif

# torch pinned, with the rest, by uv: the demo's install took 9 s this way and 41 s with pip installing torch from the
# same wheel, on 2 cores (BENCHMARKS.md#install-time). The CPU build comes from where pip's configuration finds it (PIP_FIND_LINKS or
# global.find-links: on this kind of machine a wheel on its disk); uv reads no pip configuration, so those
# locations are passed on. Without them the torch wheel is PyPI's, a multi-GB CUDA one, for pip as for uv.
# uv keeps its own cache in ~/.cache/uv.
UV := $(VENV)/bin/uv
PIP_LINKS = $(strip $(PIP_FIND_LINKS) $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_LINKS = $(foreach d,$(sort $(PIP_LINKS)),--find-links $(d))

# Bytecode is compiled once, at install (COMPILE). uv, unlike pip, leaves it to each module's first import, and where
# PYTHONDONTWRITEBYTECODE=1 is set (these machines set it, as many container images do) no process ever writes it:
# every process compiled every module it imported, every time. On the 2-core AVX2-only AMD EPYC, `import prefect`
# took 2.8-3.3 s that way and 1.5-2.2 s with bytecode, `from transformers import AutoTokenizer` 17.4 s against 10.7 s,
# `import mlflow` 5.6 against 2.3 s, and every stage process pays several of these (BENCHMARKS.md#stage-fixed-costs).
# Compiling site-packages and the project's packages takes about a minute there; modules already compiled are skipped.
# compileall exits 1 for the few vendored files written for newer Pythons (e.g. torch's py312_intrinsics.py), which
# this interpreter never imports: its status is not the install's.
SITE_PACKAGES = $(VENV)/lib/python3.*/site-packages
COMPILE = $(PY) -m compileall -q -j 0 $(SITE_PACKAGES) edgeflow scripts >/dev/null 2>&1 || true

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q uv==0.13.9
	$(UV) pip install -q --python $(PY) $(UV_LINKS) torch==2.13.0 -e '.[demo]'
	$(COMPILE)
	touch $@

# llama-cpp-python's wheel, built once per machine and build options into edgeflow's wheel cache: uv re-downloads
# the sdist whenever the registry's cache headers say so, and each new download compiled llama.cpp again (5 min here).
LLAMA_CPP_PIN := $(shell sed -n 's/.*"\(llama-cpp-python==[^"]*\)".*/\1/p' pyproject.toml)
LLAMA_WHEELS := $(HOME)/.cache/edgeflow/wheels/llama-cpp-$(shell printf '%s' "$(LLAMA_CPP_PIN) $(LLAMA_CMAKE_ARGS) $$(uname -m)" | sha256sum | cut -c1-12)

# TensorRT Edge-LLM's exporter in a venv of its own, kept with the machine's caches: tensorrt-edgellm 0.11.0's `export`
# extra pins transformers, onnx and numpy apart from edgeflow's (edgeflow/engines/edge_llm/plan.py EXPORTER_PYTHON_ENV
# names it; the tests export with it). ~2 s from uv's cache, a 200 MB wheel the first time.
EDGELLM_PIN := tensorrt-edgellm[export]==0.11.0
EDGELLM_VENV := $(HOME)/.cache/edgeflow/venvs/edgellm-$(shell printf '%s' "$(EDGELLM_PIN) torch==2.13.0 $$(uname -m)" | sha256sum | cut -c1-12)
EDGELLM_PY := $(EDGELLM_VENV)/bin/python

$(EDGELLM_VENV)/.installed: | $(VENV)/.installed
	test -x $(EDGELLM_PY) || $(PYTHON) -m venv $(EDGELLM_VENV)
	$(UV) pip install -q --python $(EDGELLM_PY) $(UV_LINKS) torch==2.13.0 '$(EDGELLM_PIN)'
	touch $@

edgellm-venv: $(EDGELLM_VENV)/.installed
	@echo "export EDGEFLOW_EDGELLM_PYTHON=$(EDGELLM_PY)"

$(VENV)/.installed-test: $(VENV)/.installed $(EDGELLM_VENV)/.installed
	ls $(LLAMA_WHEELS)/llama_cpp_python-*.whl >/dev/null 2>&1 || CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" \
	  CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PY) -m pip wheel -q --no-deps "$(LLAMA_CPP_PIN)" -w $(LLAMA_WHEELS)
	$(UV) pip install -q --python $(PY) --find-links $(LLAMA_WHEELS) --no-build-isolation-package deepspeed -e '.[test]'
	$(COMPILE)
	touch $@

venv: $(VENV)/.installed

services: venv
	$(PY) scripts/services.py up

pools: services

# After `make demo`: serve the demo's current engine under the supervisor with Prometheus, Alertmanager and a
# webhook recorder around it, wedge its engine, then freeze the whole server; print each page and its seconds.
page-test: $(VENV)/.installed
	$(PY) -m edgeflow.ops.monitoring page-test --profile $(PROFILE)

demo: services
	set -a; eval "$$($(PY) scripts/services.py env | sed 's/^export //')"; set +a; \
	$(PY) scripts/demo.py --profile $(PROFILE)

# Two tiers of one suite (docs/development/tests.md): `make test`, what CI runs, leaves out the tests marked
# `extended` (pyproject.toml: the ones that do not fit CI's budget on the slowest 2-core box); `make test-all` runs
# every test, the same ones, nothing lighter. Both write pytest's JUnit XML to $(TEST_RESULTS) and tests/conftest.py
# writes the machine beside it: `make test-durations` prints seconds per file and per test from them.
# --durations: the slowest tests in every run's log too.
# Two pytest workers (pytest-xdist): the two end-to-end modules (tests/pipeline/test_release_e2e.py, test_multihost.py)
# wait much of their time on their servers, workers and stage processes (one release test alone kept the 2 cores
# about 60 % busy), so they run side by side, each file whole on one worker (--dist loadfile: its services are
# module fixtures), started first (tests/conftest.py orders them; --no-loadscope-reorder keeps that order), and the
# other files fill in. PYTEST_WORKERS=0 runs everything in this one process.
PYTEST_WORKERS ?= 2
# torch's threads in each pytest worker and every stage process its releases start (EDGEFLOW_TORCH_THREADS,
# edgeflow/engines/cpu_host.py): the cores divided among the workers. Two test-tiny distillations at once on 2 cores
# took 44 s each with 2 threads apiece, 19 s with 1 (benchmarks/concurrent_distill.py; BENCHMARKS.md#torch-threads
# suite's time goes"). A value in the environment wins.
TEST_TORCH_THREADS := $(shell w=$(PYTEST_WORKERS); n=$$(nproc); t=$$(( w > 1 ? n / w : n )); echo $$(( t > 0 ? t : 1 )))
TEST_RESULTS := .edgeflow/test-results
PYTEST = EDGEFLOW_TORCH_THREADS=$${EDGEFLOW_TORCH_THREADS:-$(TEST_TORCH_THREADS)} \
	EDGEFLOW_EDGELLM_PYTHON=$${EDGEFLOW_EDGELLM_PYTHON:-$(EDGELLM_PY)} \
	$(PY) -m pytest -q --durations=25 -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder \
	--junitxml=$(TEST_RESULTS)/junit.xml
# `rotated`: the share of the `extended` tests that EDGEFLOW_EXTENDED_SHARE names (tests/rotation.py; .ci/run sets it,
# so each extended test runs in CI at least every third run); unset, `make test` leaves every extended test out.
test: $(VENV)/.installed-test
	$(PYTEST) -m "not extended or rotated" $(PYTEST_ARGS)

test-all: $(VENV)/.installed-test
	$(PYTEST) $(PYTEST_ARGS)

# The documentation site (docs/, mkdocs.yml): the reference pages regenerated from the code, then built strictly
# into .edgeflow/site. tests/scripts/test_docs.py checks both in `make test`.
docs: $(VENV)/.installed-test
	$(PY) scripts/docs_reference.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

test-durations:
	@$(PY) scripts/test_durations.py --xml $(TEST_RESULTS)/junit.xml $(DURATIONS_ARGS)

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
