# Every target bootstraps .venv on first use. TORCH_SPEC pins the torch build;
# on a machine that keeps a CPU wheel locally `torch==2.13.0` comes from disk.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
VERIFY_ARGS ?=
SOAK_ARGS ?=
# bench: auto = cuda when torch sees a GPU, else cpu (Triton interpreter, reduced sizes).
BENCH_DEVICE ?= auto
BENCH_ARGS ?=

.PHONY: install test lint verify soak clean bench mutate

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,dev]"
	touch $@

# Tests go to the workers one at a time, the `long` ones first (tests/conftest.py): on two
# cores a long test handed out last leaves the other worker idle for its whole length.
# The 25 slowest tests are listed at the end: where CI's time goes.
test: $(STAMP)
	$(PY) -m pytest -n auto --maxschedchunk 1 --durations 25 $(PYTEST_ARGS)

# The default preset sweep (cp_size 1, 2, 4 and 8) on CPU: 8 spawned gloo ranks.
verify: $(STAMP)
	$(PY) -m cp_blocktables verify --world-size 8 $(VERIFY_ARGS)

# 20 s of soak on CPU: 2 gloo ranks, preset cp2-i1 in short rounds with fresh seeds.
soak: $(STAMP)
	$(PY) -m cp_blocktables soak --world-size 2 --preset cp2-i1 --preset-steps 8 --seconds 20 $(SOAK_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check cp_blocktables tests launch
	$(PY) -m ruff format --check cp_blocktables tests launch

# Mutation testing: Cosmic Ray mutates a copy of the implementation, the harness must fail it.
# MUTATE_ARGS='--sample 40 --seed 1' for a quick CI-sized run (docs/mutation.md).
MUTATE_ARGS ?=
mutate: $(STAMP)
	$(PY) -m cp_blocktables mutate --progress $(MUTATE_ARGS)

bench: $(STAMP)
	$(PY) -m cp_blocktables bench kernels --device $(BENCH_DEVICE) $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info

# Docker: build the CPU image and run the suite or the verify job inside it. Multi-process
# torch needs more shared memory than docker's 64 MB default (gloo runs fail or hang there).
DOCKER ?= docker
IMAGE ?= cp-blocktables:cpu
DOCKERFILE ?= docker/Dockerfile
BASE_IMAGE ?=
DOCKER_SHM ?= 1g
DOCKER_BUILD_ARGS ?=
DOCKER_RUN_ARGS ?=
DOCKER_RUN := $(DOCKER) run --rm --shm-size=$(DOCKER_SHM) $(DOCKER_RUN_ARGS)

.PHONY: docker-build docker-test docker-verify docker-ci

docker-build:
	$(DOCKER) build --force-rm -f $(DOCKERFILE) -t $(IMAGE) \
		$(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE)) \
		--build-arg TORCH_SPEC="$(TORCH_SPEC)" $(DOCKER_BUILD_ARGS) .

docker-test:
	$(DOCKER_RUN) $(IMAGE) make test PYTEST_ARGS="$(PYTEST_ARGS)"

docker-verify:
	$(DOCKER_RUN) $(IMAGE) make verify

docker-ci:
	bash docker/ci-local-base.sh
