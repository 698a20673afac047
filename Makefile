# diffkv: the commands README.md names.  Everything installs what it needs on a fresh machine.
#   make demo      the main job on a small built-in example (GPU when there is one, else CPU)
#   make test      the CPU suite (what CI runs)
#   make test-gpu  the GPU suite (on a CUDA machine)
#   make bench     the benchmarks
#   make lint      ruff + clang-format, failing on a diff
#   make asan      CPU-only build with AddressSanitizer + UBSan, CPU suite under it
#   make fuzz      the long fuzzing profile and 100,000-call leak checks per entry point
#   make test-vllm the vLLM-Omni integration against a real vllm-omni + vLLM (a virtual environment
#                  of their own, ~9 GB: they pin a torch of their own)
#   make sanitize-gpu  compute-sanitizer (memcheck, racecheck, initcheck, synccheck) over
#                  every CUDA kernel (tests/gpu_sanitize.py), on a CUDA machine

PYTHON ?= python3
PIP := $(PYTHON) -m pip
PYTEST_ARGS ?=
# Every C and CUDA file, subfolders included (csrc/py/ and any later one).
C_FILES := $(shell find csrc cuda -name '*.[ch]' -o -name '*.cu' -o -name '*.cuh' | sort)

.PHONY: deps install inplace demo test test-gpu test-vllm bench lint format asan fuzz sanitize-gpu clean

# torch is a large download: install it only when no suitable one (>= 2.10) imports.
deps:
	@$(PYTHON) -c "import sys, torch; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(0 if v >= (2, 10) else 1)" 2>/dev/null \
		|| $(PIP) install --quiet "torch>=2.10"
	@$(PYTHON) -c "import pytest, numpy, setuptools, wheel, hypothesis, matplotlib" 2>/dev/null \
		|| $(PIP) install --quiet pytest numpy "setuptools>=61" wheel hypothesis matplotlib

install: deps
	DIFFKV_WERROR=1 $(PIP) install --quiet --no-build-isolation --no-deps --force-reinstall .

# Development build: the extension next to the sources (python/diffkv/_C*.so).  setup.py
# rebuilds what changed: objects live in build/temp.*/<identity>/ (CPU or CUDA, archs, flags).
inplace: deps
	DIFFKV_WERROR=1 $(PYTHON) setup.py -q build_ext --inplace

demo: install
	cd /tmp && $(PYTHON) -m diffkv demo

test: install
	$(PYTHON) -m pytest -q -m "not gpu" tests $(PYTEST_ARGS)

test-gpu: install
	$(PYTHON) -m pytest -q -m gpu tests $(PYTEST_ARGS)

VLLM_VENV ?= .venv-vllm
VLLM_OMNI_VERSION ?= 0.30.0

test-vllm: inplace
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	@$(VLLM_VENV)/bin/python -c "import vllm_omni, pytest, hypothesis" 2>/dev/null \
		|| $(VLLM_VENV)/bin/pip install --quiet "vllm==$(VLLM_OMNI_VERSION)" "vllm-omni==$(VLLM_OMNI_VERSION)" pytest hypothesis numpy
	PYTHONPATH=python $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider -rs tests/test_vllm_real.py tests/test_vllm_omni.py tests/test_vllm_side_by_side.py $(PYTEST_ARGS)

bench: install
	mkdir -p out
	$(PYTHON) benchmarks/bench_bridge.py --json out/bridge.json
	$(PYTHON) benchmarks/bench_host.py --json out/host.json
	$(PYTHON) benchmarks/bench_kv_write.py --json out/kv_write.json
	$(PYTHON) benchmarks/bench_attention.py --json out/attention.json
	$(PYTHON) benchmarks/bench_layer.py --json out/layer.json
	$(PYTHON) benchmarks/bench_dense.py --json out/dense.json
	$(PYTHON) benchmarks/bench_fp8.py --json out/fp8.json

lint:
	@$(PYTHON) -c "import ruff" 2>/dev/null || $(PIP) install --quiet ruff
	$(PYTHON) -m ruff check python tests benchmarks setup.py
	$(PYTHON) -m ruff format --check python tests benchmarks setup.py
	clang-format --dry-run -Werror $(C_FILES)

format:
	$(PYTHON) -m ruff format python tests benchmarks setup.py
	clang-format -i $(C_FILES)

asan: deps
	rm -f python/diffkv/_C*.so
	DIFFKV_SANITIZE=1 DIFFKV_WERROR=1 $(PYTHON) setup.py -q build_ext --inplace --build-temp build/asan/temp --build-lib build/asan/lib
	ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1 LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
		PYTHONPATH=python $(PYTHON) -m pytest -q -m "not gpu" -p no:cacheprovider tests $(PYTEST_ARGS)
	rm -f python/diffkv/_C*.so

fuzz: inplace
	DIFFKV_FUZZ_PROFILE=long PYTHONPATH=python $(PYTHON) -m pytest -q -p no:cacheprovider tests/test_fuzz.py $(PYTEST_ARGS)
	DIFFKV_LEAK_CALLS_PER_CASE=100000 PYTHONPATH=python $(PYTHON) -m pytest -q -p no:cacheprovider tests/test_leaks.py

sanitize-gpu: inplace
	for tool in memcheck racecheck initcheck synccheck; do \
		PYTHONPATH=python compute-sanitizer --tool $$tool --error-exitcode 1 \
			$(PYTHON) tests/gpu_sanitize.py || exit 1; \
	done

clean:
	rm -rf build dist python/*.egg-info python/diffkv/_C*.so
