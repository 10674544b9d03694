# Two commands do all set-up on a fresh Debian machine: `make train` and `make test`.
# Every step is idempotent: a second run checks stamps and finishes in seconds.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.asyncwebrl-installed
# The CPU build of torch; on this machine class it lies on local disk (no multi-GB CUDA download).
TORCH_SPEC ?= torch==2.13.0
CHROMIUM := /usr/lib/chromium/chromium-headless-shell
ARGS ?=
# SGLang release whose own receiving code the weight tests run our sender against (downloaded, never installed)
SGLANG_VERSION ?= 0.5.23
SGLANG_WHEEL_DIR ?= $(HOME)/.cache/asyncwebrl/sglang-wheel
# A second venv with SGLang's pinned torch and its HTTP stack (no sglang install): the weight tests run
# SGLang's own server code from the wheel in it, so the refresh crosses the two torch versions
SGLANG_TORCH_SPEC ?= torch==2.14.1
SGLANG_VENV ?= $(HOME)/.cache/asyncwebrl/sglang-venv
SGLANG_VENV_STAMP := $(SGLANG_VENV)/.asyncwebrl-$(SGLANG_VERSION)-installed

.PHONY: setup venv browser model sglang-wheel sglang-venv train train-multistep test lint clean bench

setup: venv browser model sglang-wheel sglang-venv

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]" "$(TORCH_SPEC)"
	touch $(STAMP)

venv: $(STAMP)

browser:
	@if [ ! -x "$(CHROMIUM)" ]; then \
	  echo "installing Debian's chromium-headless-shell"; \
	  (apt-get update -qq || true) && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium-headless-shell fonts-liberation >/dev/null; \
	fi
	@test -x "$(CHROMIUM)" || { echo "chromium-headless-shell missing at $(CHROMIUM)"; exit 1; }

sglang-wheel: venv
	@ls $(SGLANG_WHEEL_DIR)/sglang-$(SGLANG_VERSION)-*.whl >/dev/null 2>&1 || \
	  $(BIN)/pip download -q --no-deps "sglang==$(SGLANG_VERSION)" -d $(SGLANG_WHEEL_DIR)

$(SGLANG_VENV_STAMP):
	$(PY) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install -q "$(SGLANG_TORCH_SPEC)" fastapi msgspec orjson pydantic uvicorn safetensors
	touch $@

sglang-venv: $(SGLANG_VENV_STAMP)

model: venv
	$(BIN)/asyncwebrl prepare-model

# The default run (docs/training.md, "The default run"): default.yaml plus the behaviour-cloning warm
# start on oracle demonstrations of the training tasks, then RL. The warm start stays off in
# default.yaml itself: tests and benchmarks run synthetic and WebGym tasks, which have no oracles.
TRAIN_ARGS := warm_start.enabled=true warm_start.source=oracle warm_start.n_demos=24 warm_start.epochs=8

train: setup
	$(BIN)/asyncwebrl train $(TRAIN_ARGS) $(ARGS)

# The multi-step recipe (docs/training.md, "Multi-step tasks"): behaviour cloning on oracle
# demonstrations of miniwob-medium, then RL on it; held-out multi-step tasks evaluated beside.
# Extra overrides and flags through ARGS, e.g. ARGS="seed=2 --record --record-as multistep-seed2".
MULTISTEP_ARGS := trial_name=multistep env.tasks=miniwob-medium env.max_steps=4 \
	gconfig.max_new_tokens=16 gconfig.temperature=1.0 actor.temperature=1.0 \
	total_train_steps=30 actor.lr_decay_steps=30 checkpoint.every_n_steps=15 \
	actor.eps_clip_higher=0.28 actor.step_normalizer=episode_length rollout.dynamic_sampling=true \
	warm_start.enabled=true warm_start.source=oracle warm_start.n_demos=4 warm_start.epochs=2 \
	test_rollout.n_episodes=48 test_rollout.heldout_tasks=miniwob-medium-heldout test_rollout.heldout_n_episodes=9

train-multistep: setup
	$(BIN)/asyncwebrl train $(MULTISTEP_ARGS) $(ARGS)

test: setup
	$(BIN)/python -m pytest -q --durations=30 $(ARGS)

lint: venv
	$(BIN)/ruff check asyncwebrl tests

clean:
	rm -rf $(VENV) runs .pytest_cache
