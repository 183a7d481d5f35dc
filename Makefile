# hsgd: two commands on a fresh machine.
#   make train   create .venv if missing, install hsgd with MPI from PyPI, run the default training job:
#                mpirun -n 8 python -m hsgd.train   (tp = 2, dp = 4)
#   make test    same install, then the whole test suite (unit, MPI and tutorial tests)
#   make book    the course as a website in build/book/ (index.html): each chapter with the output and pictures of
#                its own run, kept by make test (a chapter without a fresh run is run first)
#   make book-test  make book, then open every page in headless Chromium (needs chromium and chromium-driver)
#   make bench   same install plus PyTorch, then the benchmarks in benchmarks/ (tables in benchmarks/results/), the
#                crosscheck of a PyTorch DTensor step (benchmarks/crosscheck_torch.py) and of an FSDP2 + TP step
#                saved with torch.distributed.checkpoint, correct and with each of its bug switches
#                (benchmarks/crosscheck_fsdp2.py)
#   make gpu-check  the GPU path on a machine with a GPU and CuPy: tests, verify, training, benchmark
#   make gpu-sim    the same script on the simulated GPU (tests/simgpu: NumPy with CuPy's rules), no GPU needed
# Use a system MPI instead of PyPI's mpich wheel:  make test EXTRAS=dev
# (mpi4py then builds against the mpicc found on PATH).

PYTHON ?= python3
VENV   ?= .venv
EXTRAS ?= mpi,dev
PY     := $(VENV)/bin/python
comma  := ,
STAMP  := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: train test lint book book-test bench gpu-check gpu-sim clean

# --no-compile: pip would byte-compile every file of every package (sympy's alone takes seconds); Python compiles
# what is imported instead, once, since RUN turns byte-code caching on whatever the environment says (the test
# suite starts hundreds of Python processes, up to 8 ranks at a time, and each would compile hsgd again).
$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q --no-compile -e '.[$(EXTRAS)]'
	touch $(STAMP)

NP     ?= 8
RUN    := PATH="$(abspath $(VENV))/bin:$$PATH" PYTHONDONTWRITEBYTECODE=
# For a system Open MPI (ignored by MPICH): allow more ranks than cores, and running as root in containers.
export OMPI_MCA_rmaps_base_oversubscribe ?= 1
export OMPI_ALLOW_RUN_AS_ROOT ?= 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM ?= 1

train: $(STAMP)
	$(RUN) mpirun -n $(NP) python -m hsgd.train

# The chapters' markdown tables (the cross-walks) cannot wrap: tests/test_tutorials.py holds every other line
# of a chapter to 120 characters.
lint: $(STAMP)
	$(VENV)/bin/ruff check --quiet --line-length 120 --select E,F,W --ignore E741,E731 \
	    --per-file-ignores 'tutorials/[0-9A-Z]*.py:E501' hsgd tests tutorials benchmarks

test: $(STAMP) lint
	$(RUN) python -m pytest -q

# The website: tutorials/book.py renders the runs tests/test_tutorials.py kept in build/book/runs/ (seconds after a
# make test), running through tutorials/cells.py any chapter that has none of its current version.
book: $(STAMP)
	$(RUN) python tutorials/book.py

BOOK_STAMP := $(VENV)/.installed-book

$(BOOK_STAMP): $(STAMP)
	$(PY) -m pip install --disable-pip-version-check -q --no-compile -e '.[$(EXTRAS),book]'
	touch $(BOOK_STAMP)

# selenium drives /usr/bin/chromium through /usr/bin/chromedriver (tests/book/test_site.py)
book-test: $(BOOK_STAMP) book
	$(RUN) HSGD_BOOK_TEST=1 python -m pytest -q -p no:cacheprovider tests/book

BENCH_STAMP := $(VENV)/.installed-bench
FSDP2       := --dp 3 --tp 2 --crosscheck

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --disable-pip-version-check -q -e '.[$(EXTRAS),bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(RUN) python benchmarks/bench_serial.py
	$(RUN) python benchmarks/bench.py
	$(RUN) python benchmarks/bench_llama.py
	$(RUN) python benchmarks/plan_narayanan.py
	$(RUN) OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 mpirun -n $(NP) python benchmarks/plan_this_machine.py
	$(RUN) python benchmarks/hf_llama_reference.py --check
	$(RUN) python benchmarks/hf_mixtral_reference.py --check
	$(RUN) python benchmarks/train_families.py --np $(NP)
	$(RUN) python benchmarks/bench_experts.py --np $(NP)
	d=$$(mktemp -d) && $(RUN) python benchmarks/crosscheck_torch.py --tp 2 --dp 2 --micro-batches 2 --out $$d/dump \
	    && $(RUN) python -m hsgd.crosscheck $$d/dump; rc=$$?; rm -rf $$d; exit $$rc
	d=$$(mktemp -d) && $(RUN) python benchmarks/crosscheck_fsdp2.py $(FSDP2) --out $$d/dcp \
	    && $(RUN) python benchmarks/crosscheck_fsdp2.py $(FSDP2) --out $$d/dcp --arch gpt2 \
	    && $(RUN) python benchmarks/crosscheck_fsdp2.py $(FSDP2) --out $$d/dcp --bug no-divide --expect 'constant factor' \
	    && $(RUN) python benchmarks/crosscheck_fsdp2.py $(FSDP2) --out $$d/dcp --bug wrong-mesh-dim --expect unreduced \
	    && $(RUN) python benchmarks/crosscheck_fsdp2.py $(FSDP2) --out $$d/dcp --bug missing-norm-grad --expect missing; \
	    rc=$$?; rm -rf $$d; exit $$rc

# The GPU path, on a machine with a GPU and CuPy (pip install -e '.[gpu]'); installs nothing itself.
gpu-check:
	$(RUN) python benchmarks/gpu_check.py

# A dry run of gpu-check on any machine: CuPy's host/device rules over NumPy (checks transfers, not a GPU).
gpu-sim: $(STAMP)
	$(RUN) PYTHONPATH="$(abspath tests/simgpu)" python benchmarks/gpu_check.py --quick

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
