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

.PHONY: setup test test-fast demo serve stats wheels lint bench-model clean help

help:
	@echo "make demo    set up .venv if needed, then run the main job on the embedded default data"
	@echo "make test    set up .venv if needed, then run the CPU test suite"
	@echo "make serve   set up .venv if needed, then k2 serve --preset tiny on localhost:8000"
	@echo "make stats   the K2 vs DeepSeek-V3 cost model (k2 model stats)"
	@echo "make wheels  build every package's wheel into dist/"
	@echo "make lint    ruff"

# torch and the build tools, once.
$(BASE_STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) "$(TORCH_SPEC)"
	$(PIP) "scikit-build-core>=0.10" "pybind11>=2.12" cmake ninja "hatchling>=1.20" editables
	touch $@

# The compiled kernels: rebuilt when csrc/ or the kernel build changes (incremental build dir).
$(KERNELS_STAMP): $(BASE_STAMP) $(KERNEL_SRCS)
	$(PIP) --no-build-isolation -e packages/k2-kernels
	touch $@

$(STAMP): $(KERNELS_STAMP) pyproject.toml $(foreach p,$(PY_PKGS),packages/$(p)/pyproject.toml)
	$(PIP) --no-build-isolation $(foreach p,$(PY_PKGS),-e packages/$(p)) -e ".[test]"
	touch $@

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not dist"

# The main job: a short MuonClip pretraining run of the tiny K2 on this Python's standard
# library source (tokenized once, then cached in ~/.cache/k2). Each run gets a new directory.
DEMO_OUT   ?= runs/demo-$(shell date +%Y%m%d-%H%M%S)
DEMO_FLAGS ?= --steps 120 --batch 8 --seq-len 256 --lr 0.02 --tau 30 --max-corpus-mb 4 --eval-every 40 --save-every 60
demo: $(STAMP)
	$(VENV)/bin/k2 pretrain --preset tiny --optimizer muonclip $(DEMO_FLAGS) --out $(DEMO_OUT)

# An OpenAI-compatible server on loopback with the tiny preset's random weights (Ctrl-C stops it).
SERVE_FLAGS ?= --preset tiny --port 8000
serve: $(STAMP)
	$(VENV)/bin/k2 serve $(SERVE_FLAGS)

stats: $(STAMP)
	$(VENV)/bin/k2 model stats --preset kimi-k2 --compare deepseek-v3

wheels: $(BASE_STAMP)
	rm -rf dist && mkdir -p dist
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w dist $(foreach p,$(PACKAGES),packages/$(p)) .
	@ls -1 dist

lint: $(STAMP)
	$(PY) -m ruff check src packages tests benchmarks scripts

bench-model: $(STAMP)
	$(PY) benchmarks/model_step.py

clean:
	rm -rf build dist packages/*/build packages/*/dist
