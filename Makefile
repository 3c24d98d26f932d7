# Two set-up commands (see README): `make simulate` and `make test`.
# Each creates .venv if it is missing. TORCH picks the torch build: the default is the CPU wheel
# that lies on this machine's disk; on a GPU box use e.g. `make test TORCH=torch`.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: venv simulate test bench proto gpu-check docs

# One stamp per torch choice, so `make test TORCH=...` on an existing .venv installs that build.
TORCH_STAMP := $(VENV)/.torch-$(subst /,_,$(subst =,_,$(subst $() ,_,$(TORCH))))

$(TORCH_STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)" numpy
	rm -f $(VENV)/.torch-* $(VENV)/.installed
	touch $@

$(VENV)/.installed: pyproject.toml $(TORCH_STAMP)
	$(PY) -m pip install --quiet -e ".[test,dev,docs]"
	touch $@

venv: $(VENV)/.installed

simulate: $(VENV)/.installed
	$(VENV)/bin/fedpar simulate --clients 10 --rounds 10 --dataset digits --partition iid --out runs/digits

# Three pytest-xdist workers, each taking whole test files (a module's shared service stays in one worker): the tests
# spend a third of their time waiting (deadlines, processes starting), so on 2 cores two workers left the CPU idle that
# long (1,233 s wall, 1,635 s CPU for 2,404 tests on 2026-11-28) and three fill it (1,058 s wall, 1,585 s CPU, the same
# day and machine; on 2026-11-29, with every process leaving without the interpreter's teardown, three 886-952 s and
# four 890 s: no gain). The files go out in collection order, which tests/conftest.py makes longest first (not xdist's
# most-tests-first).
TEST_WORKERS ?= 3
test: $(VENV)/.installed
	$(PY) -m pytest -q --durations=30 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The documentation site in site/ (mkdocs.yml; the CLI reference and the benchmarks page are generated as it builds).
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

proto: $(VENV)/.installed
	$(PY) -m fedpar.protocol.generate

# On a machine with a CUDA GPU (docs/how-to/gpus.md; tools/gpu_box.sh sets one up): benchmarks/gpu_bench.py and its MFU
# of a 1.2B GPT (--large: the size where the MFU target applies) first, on an idle box (a suite cut short leaves
# processes of their own sessions behind: two benchmark runs after one were 0.75-0.84x), then the whole suite, CUDA
# tests included, for at most GPU_CHECK_TEST_SECONDS; each step runs whatever the one before gave. pytest runs with
# -v, so a run cut short still names each failure; logs and the benchmarks' JSON go to GPU_CHECK_OUT. GPU_PY is a
# python that has fedpar installed over the GPU build of torch (the default, .venv's, is the CPU wheel unless made
# with TORCH=torch).
GPU_PY ?= $(PY)
GPU_CHECK_OUT ?= runs/gpu-check
# one device call of a session fits (at most 10 minutes): the box's 16 cores took the suite's 2,479 tests in 392 s on
# 14 workers (2026-11-29), after gpu_bench.py's 140 s; GPU_CHECK_LARGE=0 leaves out the 1.2B GPT's minutes
GPU_CHECK_PYTEST_ARGS ?= -n 14
GPU_CHECK_TEST_SECONDS ?= 420
GPU_CHECK_LARGE ?= 1
gpu-check:
	@$(GPU_PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make gpu-check: torch ' + torch.__version__ + ' sees no CUDA GPU here')"
	mkdir -p $(GPU_CHECK_OUT)
	-bash -o pipefail -c '$(GPU_PY) benchmarks/gpu_bench.py --json $(GPU_CHECK_OUT)/gpu_bench.json 2>&1 | tee $(GPU_CHECK_OUT)/gpu_bench.log; echo $$? > $(GPU_CHECK_OUT)/gpu_bench.rc'
	-bash -o pipefail -c 'if [ "$(GPU_CHECK_LARGE)" = 0 ]; then echo 0 > $(GPU_CHECK_OUT)/gpu_bench_large.rc; exit; fi; $(GPU_PY) benchmarks/gpu_bench.py --only mfu --large --warmup 5 --steps 20 --json $(GPU_CHECK_OUT)/gpu_bench_large.json 2>&1 | tee $(GPU_CHECK_OUT)/gpu_bench_large.log; echo $$? > $(GPU_CHECK_OUT)/gpu_bench_large.rc'
	-bash -c 'set -m; log=$(GPU_CHECK_OUT)/tests.log; : > $$log; \
	  ($(GPU_PY) -m pytest -v -rs -p no:cacheprovider $(GPU_CHECK_PYTEST_ARGS) tests >> $$log 2>&1) & job=$$!; \
	  (sleep $(GPU_CHECK_TEST_SECONDS); echo "gpu-check: the suite ran out of its $(GPU_CHECK_TEST_SECONDS) s" >> $$log; \
	   kill -INT -- -$$job; sleep 10; kill -KILL -- -$$job) 2>/dev/null & timer=$$!; \
	  trap "kill -INT -- -$$job; kill -- -$$timer" INT TERM; \
	  wait $$job; rc=$$?; kill -- -$$timer 2>/dev/null; kill -KILL -- -$$job 2>/dev/null; echo $$rc > $(GPU_CHECK_OUT)/tests.rc; \
	  grep -E "FAILED|ERROR |[0-9]+ (passed|failed)|ran out" $$log | sort -u | tail -60; exit $$rc'
	@bash -c 'for step in gpu_bench gpu_bench_large tests; do rc=$$(cat $(GPU_CHECK_OUT)/$$step.rc 2>/dev/null || echo lost); \
	  [ "$$rc" = 0 ] || { echo "make gpu-check: $$step failed (exit $$rc; $(GPU_CHECK_OUT)/$$step.log)"; exit 1; }; done'
