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
#   make wheel     a release wheel in dist/: abi3, manylinux_2_28_x86_64, the kernels inside, built
#                  with this machine's nvcc (diffkv-<version>+cu13-...whl for CUDA 13);
#                  `make wheel CUDA=12` builds the CUDA 12 one with a CUDA 12.4 toolkit put
#                  together from PyPI and Debian packages (packaging/cuda12-toolkit.sh)
#   make test-wheel  make wheel, then the wheel installed into a fresh virtual environment with
#                  torch from PyPI, and the CPU suite run against it (not against the tree)

PYTHON ?= python3
PIP := $(PYTHON) -m pip
PYTEST_ARGS ?=
# The CPU suites (test, asan, test-wheel) spread their tests over every core with pytest-xdist;
# PYTEST_JOBS=0 runs them in one process (the GPU suite always runs in one).
PYTEST_JOBS ?= auto
# Every C and CUDA file, subfolders included (csrc/py/ and any later one).
C_FILES := $(shell find csrc cuda -name '*.[ch]' -o -name '*.cu' -o -name '*.cuh' | sort)

.PHONY: deps install inplace demo test test-gpu test-vllm bench lint format asan fuzz sanitize-gpu clean \
	wheel test-wheel

# torch is a large download: install it only when no suitable one (>= 2.10) imports.
deps:
	@$(PYTHON) -c "import sys, torch; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(0 if v >= (2, 10) else 1)" 2>/dev/null \
		|| $(PIP) install --quiet "torch>=2.10"
	@$(PYTHON) -c "import pytest, xdist, numpy, setuptools, wheel, hypothesis, matplotlib" 2>/dev/null \
		|| $(PIP) install --quiet pytest pytest-xdist numpy "setuptools>=61" wheel hypothesis matplotlib
ifeq ($(shell uname -sm),Linux x86_64)
	@# cuobjdump + nvdisasm (~5 MB) for tests/test_sass.py's check of the Hopper kernels' SASS
	@$(PIP) show nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm >/dev/null 2>&1 \
		|| $(PIP) install --quiet nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
endif

install: deps
	DIFFKV_WERROR=1 $(PIP) install --quiet --no-build-isolation --no-deps --force-reinstall .

# Development build: the extension next to the sources (python/diffkv/_C*.so).  setup.py
# rebuilds what changed: objects live in build/temp.*/<identity>/ (CPU or CUDA, archs, flags).
inplace: deps
	DIFFKV_WERROR=1 $(PYTHON) setup.py -q build_ext --inplace

demo: install
	cd /tmp && $(PYTHON) -m diffkv demo

test: install
	$(PYTHON) -m pytest -q -m "not gpu" -n $(PYTEST_JOBS) tests $(PYTEST_ARGS)

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
	$(PYTHON) -m ruff check python tests benchmarks packaging setup.py
	$(PYTHON) -m ruff format --check python tests benchmarks packaging setup.py
	clang-format --dry-run -Werror $(C_FILES)

format:
	$(PYTHON) -m ruff format python tests benchmarks packaging setup.py
	clang-format -i $(C_FILES)

# tests/test_build.py builds scratch copies of the source tree with setup.py in subprocesses of
# their own environment: it checks setup.py, not the extension under test, so it runs once, in
# `make test`, and not again under the sanitizers or against the installed wheel (about 100 s
# per run, most of it one nvcc build).
ONCE_ONLY_TESTS = --ignore=$(CURDIR)/tests/test_build.py

asan: deps
	rm -f python/diffkv/_C*.so
	DIFFKV_SANITIZE=1 DIFFKV_WERROR=1 $(PYTHON) setup.py -q build_ext --inplace --build-temp build/asan/temp --build-lib build/asan/lib
	ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1 LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
		PYTHONPATH=python $(PYTHON) -m pytest -q -m "not gpu" -n $(PYTEST_JOBS) -p no:cacheprovider $(ONCE_ONLY_TESTS) tests $(PYTEST_ARGS)
	rm -f python/diffkv/_C*.so

fuzz: inplace
	DIFFKV_FUZZ_PROFILE=long PYTHONPATH=python $(PYTHON) -m pytest -q -p no:cacheprovider tests/test_fuzz.py $(PYTEST_ARGS)
	DIFFKV_LEAK_CALLS_PER_CASE=100000 PYTHONPATH=python $(PYTHON) -m pytest -q -p no:cacheprovider tests/test_leaks.py

sanitize-gpu: inplace
	for tool in memcheck racecheck initcheck synccheck; do \
		PYTHONPATH=python compute-sanitizer --tool $$tool --error-exitcode 1 \
			$(PYTHON) tests/gpu_sanitize.py || exit 1; \
	done

# Release wheels.  The tools live in a virtual environment of their own (WHEEL_TOOLS): zig links
# the extension against glibc 2.28's symbol versions (setup.py, DIFFKV_MANYLINUX=1) and
# auditwheel judges the result (packaging/check_wheel.py).  The wheel is built with the flags of
# `make install` (DIFFKV_WERROR=1), so after `make install` only the link runs again.
# CUDA=12 puts a CUDA 12.4 toolkit together in CUDA12_HOME first; CUDA unset: the nvcc setup.py
# finds (CUDA_HOME, PATH, /usr/local/cuda), whatever its major version, or a +cpu wheel without one.
CUDA ?=
WHEEL_TOOLS ?= build/wheel-tools
CUDA12_HOME ?= build/cuda-12.4
ZIGLANG_VERSION ?= 0.17.1
AUDITWHEEL_VERSION ?= 6.8.2
WHEEL_TEST_VENV ?= build/wheel-test
TORCH_SPEC ?= torch>=2.10
WHEEL_ENV = DIFFKV_MANYLINUX=1 DIFFKV_WERROR=1 ZIG_GLOBAL_CACHE_DIR=$(CURDIR)/build/zig-cache \
	$(if $(filter 12,$(CUDA)),CUDA_HOME=$(CURDIR)/$(CUDA12_HOME))

$(WHEEL_TOOLS)/ready:
	rm -rf $(WHEEL_TOOLS)
	$(PYTHON) -m venv $(WHEEL_TOOLS)
	$(WHEEL_TOOLS)/bin/pip install --quiet "setuptools>=70.1" wheel "ziglang==$(ZIGLANG_VERSION)" \
		"auditwheel==$(AUDITWHEEL_VERSION)"
	touch $@

wheel: $(WHEEL_TOOLS)/ready
	@case "$(CUDA)" in ""|12|13) ;; *) echo "make wheel: CUDA must be 12, 13 or unset, got $(CUDA)"; exit 1;; esac
	$(if $(filter 12,$(CUDA)),PYTHON=$(WHEEL_TOOLS)/bin/python bash packaging/cuda12-toolkit.sh $(CUDA12_HOME))
	rm -rf build/wheel-out
	$(WHEEL_ENV) $(WHEEL_TOOLS)/bin/python -m pip wheel --quiet --no-build-isolation --no-deps \
		-w build/wheel-out .
	@wheel=$$(ls build/wheel-out/diffkv-*.whl) && case "$(CUDA)" in "") ;; *) \
		case "$$wheel" in *+cu$(CUDA)-*) ;; *) echo "make wheel: $$wheel is not CUDA $(CUDA)"; exit 1;; esac;; esac
	$(WHEEL_TOOLS)/bin/python packaging/check_wheel.py build/wheel-out/diffkv-*.whl
	@wheel=$$(cd build/wheel-out && ls diffkv-*.whl) && mkdir -p dist && mv build/wheel-out/$$wheel dist/ \
		&& echo dist/$$wheel >build/last-wheel && echo "make wheel: dist/$$wheel"

# The wheel as a user gets it: a fresh virtual environment, the wheel and its dependencies (torch
# from PyPI), then the CPU suite from outside the tree, so every import is the installed wheel's.
test-wheel: wheel
	rm -rf $(WHEEL_TEST_VENV)
	$(PYTHON) -m venv $(WHEEL_TEST_VENV)
	$(WHEEL_TEST_VENV)/bin/pip install --quiet "$$(cat build/last-wheel)[test,bench]" "$(TORCH_SPEC)" \
		"setuptools>=61" wheel
	cd $(WHEEL_TEST_VENV) && env -u PYTHONPATH bin/python -c "import sys, diffkv, diffkv._C; \
		assert diffkv.__file__.startswith(sys.prefix), diffkv.__file__; print(diffkv.__version__, diffkv.__file__)"
	cd $(WHEEL_TEST_VENV) && env -u PYTHONPATH bin/python -m diffkv info
	cd $(WHEEL_TEST_VENV) && env -u PYTHONPATH bin/python -m pytest -q -m "not gpu" -n $(PYTEST_JOBS) -p no:cacheprovider \
		--rootdir=$(CURDIR) $(ONCE_ONLY_TESTS) $(CURDIR)/tests $(PYTEST_ARGS)

clean:
	rm -rf build dist python/*.egg-info python/diffkv/_C*.so
