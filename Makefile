# pytest-megatron-fsdp: `make smoke` (the functional suite on 2 ranks), `make test` (every tier but the
# end-to-end checks and the reproductions), `make unit` (the fast loop: in-process, no rank set). All
# create the virtualenv of the chosen stack when it is missing.
#
# Test tiers (each a directory; `make <tier>` runs one):
#   unit           tests/unit: in-process, no rank set, no pytest session in a subprocess
#   integration    tests/integration + tests/selftest: real rank sets, one plugin behaviour per pytester,
#                  torchrun or srun session; INTEGRATION_WORKERS=2 pytest-xdist workers
#   functional     tests/functional: the smoke suite users run
#   e2e            tests/e2e: whole scenarios: what re-runs a whole suite or drives the build (the
#                  functional files under pytest -n 2, reshards across world sizes 2/4/2/1, the wheel in
#                  a fresh venv, make test/smoke leaving $TMPDIR clean), a fault or a bound waited out
#                  (timeouts under every launcher, hangs beside CPU hogs, killed ranks and saves, srun
#                  steps, reruns in fresh rank sets), xdist and two-node launches, foreign suites;
#                  minutes each, so CI runs it on both stacks and `make test` does not (run it before
#                  a change to the launch, fault or foreign-suite code lands); INTEGRATION_WORKERS
#                  pytest-xdist workers too
#   reproductions  tests/reproductions: upstream bugs shown with torch alone; CI runs them, `make test`
#                  does not
#
# Stacks (STACK=newest|floor|bridge; default: bridge for `make bridge-test`, else newest when a Python 3.12 is
# found, else floor):
#   newest  Python 3.12 (on PATH, else the newest pyenv 3.12), megatron-core 0.19.2, torch 2.14.1, megatron-fsdp,
#           megatron-bridge 0.6.2 (no Transformer Engine; BRIDGE_REQ= leaves it out)
#   floor   Python 3.11, megatron-core 0.16.1, the CPU torch 2.13.0
#   bridge  Python 3.12, torch 2.14.1, megatron-core from MEGATRON_CORE (default: the Megatron-LM submodule of
#           MEGATRON_BRIDGE), Megatron-Bridge from MEGATRON_BRIDGE (a checkout, editable) with only what its
#           Megatron-FSDP test imports (BRIDGE_DEPS; no Transformer Engine): `make bridge-test`
# Gate your own Megatron-FSDP change: MEGATRON_CORE takes any pip requirement line, e.g.
#   make smoke MEGATRON_CORE=/path/to/megatron_core-0.20.0-py3-none-any.whl
#   make smoke MEGATRON_CORE="-e /path/to/Megatron-LM"
#   make smoke MEGATRON_CORE="megatron-core>=0.19,<0.20"
# When MEGATRON_CORE names a Megatron-LM checkout ("-e PATH" or PATH), the standalone megatron-fsdp
# comes from the same checkout (PATH/megatron/core/distributed/fsdp/src, editable when megatron-core is).
# MEGATRON_FSDP overrides it with any pip requirement line; MEGATRON_FSDP= keeps the registry's.
# On a GPU runner keep the container's torch:
#   make smoke PYTHON=python3 VENV_FLAGS=--system-site-packages TORCH_SPEC=

# A Python 3.12 that runs (pyenv's shim on PATH refuses unless that version is selected).
PYTHON312 := $(shell for p in python3.12 $$(ls -d $$(pyenv root 2>/dev/null || echo $$HOME/.pyenv)/versions/3.12*/bin/python3.12 2>/dev/null | sort -rV); do \
	"$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { command -v "$$p"; break; }; done)
PYTHON311 := $(shell for p in python3.11 python3; do \
	"$$p" -c 'import sys; assert sys.version_info[:2] == (3, 11)' >/dev/null 2>&1 && { command -v "$$p"; break; }; done)

STACK ?= $(if $(filter bridge-test,$(MAKECMDGOALS)),bridge,$(if $(PYTHON312),newest,floor))
# `make upstream MEGATRON_LM=PATH` runs that checkout's own tests against its own megatron-core (and its
# standalone megatron-fsdp), in a venv of its own (.venv-<stack>-upstream, which `make upstream-record
# MEGATRON_LM=PATH` uses too) so that the stack's usual venv is not rebuilt; MEGATRON_CORE and VENV still
# override either.
ifneq ($(and $(filter upstream upstream-record,$(MAKECMDGOALS)),$(strip $(MEGATRON_LM))),)
MEGATRON_CORE ?= -e $(patsubst %/,%,$(strip $(MEGATRON_LM)))
VENV          ?= .venv-$(STACK)-upstream
# The checkout's own tests need no Megatron-Bridge (the registry's pairs with a released megatron-core, not
# with a checkout's); MEGATRON_BRIDGE's run has a venv of its own.
EXTRAS        ?= dev,fully-shard
BRIDGE_REQ    ?=
endif
ifeq ($(STACK),newest)
PYTHON        ?= $(PYTHON312)
# The registry's only torch for Python 3.12 is the CUDA build (~5.5 GB venv); it runs on CPU too.
TORCH_SPEC    ?= torch==2.14.1
MEGATRON_CORE ?= megatron-core==0.19.2
# bridge: what Megatron-Bridge imports (pyproject.toml's extra says what it leaves out and why).
EXTRAS        ?= dev,fully-shard,bridge
# Megatron-Bridge from the registry (0.6.x pairs with megatron-core 0.19), installed without its declared
# dependencies: it declares a bare megatron-core[dev,mlm] and GPU-only builds (Transformer Engine,
# flashinfer, fast-hadamard-transform). BRIDGE_REQ= leaves Bridge out; its tests then skip.
BRIDGE_REQ    ?= megatron-bridge==0.6.2
# Bridge's pretrain imports nvidia_resiliency_ext; megatron-core 0.19.2's dev extra pins this one.
NVRX_SPEC     ?= nvidia-resiliency-ext==0.6.0
else ifeq ($(STACK),floor)
PYTHON        ?= $(PYTHON311)
# The CPU build of torch (a wheel on disk on these machines).
TORCH_SPEC    ?= torch==2.13.0
MEGATRON_CORE ?= megatron-core==0.16.1
EXTRAS        ?= dev
else ifeq ($(STACK),bridge)
_BRIDGE := $(patsubst %/,%,$(strip $(MEGATRON_BRIDGE)))
ifeq ($(_BRIDGE),)
$(error STACK=bridge needs MEGATRON_BRIDGE: set MEGATRON_BRIDGE=/path/to/Megatron-Bridge (a checkout))
endif
ifeq ($(wildcard $(_BRIDGE)/src/megatron/bridge/__init__.py),)
$(error MEGATRON_BRIDGE=$(MEGATRON_BRIDGE) holds no src/megatron/bridge: set it to a Megatron-Bridge checkout)
endif
PYTHON        ?= $(PYTHON312)
TORCH_SPEC    ?= torch==2.14.1
# Bridge pins megatron-core to its Megatron-LM submodule (pyproject's [tool.uv.sources]).
MEGATRON_CORE ?= -e $(_BRIDGE)/3rdparty/Megatron-LM
ifeq ($(MEGATRON_CORE),-e $(_BRIDGE)/3rdparty/Megatron-LM)
ifeq ($(wildcard $(_BRIDGE)/3rdparty/Megatron-LM/megatron/core),)
$(error MEGATRON_CORE: $(_BRIDGE)/3rdparty/Megatron-LM is empty: run git submodule update --init there, or set MEGATRON_CORE="-e /path/to/Megatron-LM")
endif
endif
EXTRAS        ?= dev,fully-shard
BRIDGE_REQ    := -e '$(_BRIDGE)'
# What Bridge's test imports beyond megatron-core, in the ranges Bridge's pyproject.toml declares (modelopt,
# energon: megatron-core's dev extra; its training.config imports energon); its other dependencies
# (Transformer Engine among them) stay out. The newest stack takes the same list from the extra `bridge`.
BRIDGE_DEPS   ?= transformers>=5.8,<=5.12.1 omegaconf>=2.3.0 datasets>=2.20.0 tensorboard>=2.19.0 nvidia-modelopt>=0.44 \
	megatron-energon~=7.0
# Bridge's pretrain imports nvidia_resiliency_ext; Megatron-LM main asserts it is >= 0.6.0 once installed.
NVRX_SPEC     ?= nvidia-resiliency-ext==0.6.0
else
$(error STACK=$(STACK): choose newest, floor or bridge)
endif
# Bridge is installed where the stack names it (newest: the registry's; bridge: the checkout).
_BRIDGE_ON := $(strip $(BRIDGE_REQ))
# A Megatron-LM checkout in MEGATRON_CORE ("-e PATH", "--editable PATH" or PATH) brings its own
# standalone megatron-fsdp (it has its own pyproject.toml there).
_MCORE_EDITABLE := $(filter -e --editable,$(firstword $(MEGATRON_CORE)))
_MCORE_PATH     := $(patsubst %/,%,$(if $(_MCORE_EDITABLE),$(word 2,$(MEGATRON_CORE)),$(MEGATRON_CORE)))
_FSDP_SRC       := $(_MCORE_PATH)/megatron/core/distributed/fsdp/src
MEGATRON_FSDP ?= $(if $(and $(_MCORE_PATH),$(filter 1,$(words $(_MCORE_PATH))),$(wildcard $(_FSDP_SRC)/pyproject.toml)),$(strip $(_MCORE_EDITABLE) $(_FSDP_SRC)))
# A pytest requirement installed with the package, in the same resolver run, so the dev plugins come
# in releases that accept it; empty: the newest the extras allow. CI's floor-pytest step sets
# PYTEST_SPEC='pytest==8.0.*', the oldest pyproject.toml's dependencies declare.
PYTEST_SPEC ?=
VENV        ?= .venv-$(STACK)
VENV_FLAGS  ?=
NPROC       ?= 2
PYTEST_ARGS ?=
# What `make test` / `make smoke` run (the repo's own by default; an empty tier is left out of `make test`).
UNIT          ?= tests/unit
INTEGRATION   ?= tests/integration tests/selftest
FUNCTIONAL    ?= tests/functional
REPRODUCTIONS ?= tests/reproductions
E2E           ?= tests/e2e
# pytest-xdist workers for the integration tier (0: one process). Its sessions spend their time
# starting processes (torch's import in every rank and torchrun agent) and waiting out timeouts, so
# two at a time finish sooner even on 2 cores; whole files per worker (--dist loadfile), so a session
# a module's tests share runs once, handed out in collection order, which puts the longest files first
# (tests/integration/conftest.py) instead of the files with most tests. The functional tier stays in
# one process: two rank sets training at once on 2 cores take twice as long as one after the other
# (docs/how-it-works.md, pytest-xdist).
INTEGRATION_WORKERS ?= 2
INTEGRATION_XDIST   := $(if $(filter-out 0,$(INTEGRATION_WORKERS)),-n $(INTEGRATION_WORKERS) --dist loadfile --no-loadscope-reorder)
SEED_TEST   ?= tests/functional/test_megatron_fsdp.py

PY       := $(VENV)/bin/python
# Every run gets a $$TMPDIR that is removed after it, so nothing is left in the caller's: torchrun's
# torchelastic_* dirs, pytest's basetemp (pytest-of-<user>, which the suite's pytester sessions fill),
# torch's inductor cache (megatron-core 0.19 makes one on import). The rank logs are kept
# (.pytest_cache/d/mfsdp-logs).
SCRATCH  := scratch=$$(mktemp -d) && trap 'rm -rf "$$scratch"' EXIT && trap 'exit 130' INT && \
	trap 'exit 143' TERM && TMPDIR=$$scratch
PYTEST   := $(SCRATCH) $(PY) -m pytest
TORCHRUN := $(SCRATCH) $(PY) -m torch.distributed.run --standalone --nproc_per_node=$(NPROC)
# What the venv was built from: a change of any of these rebuilds the installs.
SPEC := python=$(PYTHON) torch=$(TORCH_SPEC) megatron-core=$(MEGATRON_CORE) megatron-fsdp=$(MEGATRON_FSDP) \
	extras=$(EXTRAS) flags=$(VENV_FLAGS)$(if $(PYTEST_SPEC), pytest=$(PYTEST_SPEC))$(if $(_BRIDGE_ON), \
	megatron-bridge=$(or $(_BRIDGE),$(BRIDGE_REQ)) bridge-deps=$(BRIDGE_DEPS) nvrx=$(NVRX_SPEC))

.PHONY: venv smoke test unit integration functional e2e reproductions lint stack clean

venv:
	@test -n "$(PYTHON)" || { echo "make: no Python for STACK=$(STACK) (newest and bridge need 3.12, floor 3.11); set PYTHON=..." >&2; exit 2; }
	@if [ "$$(cat $(VENV)/.installed 2>/dev/null)" != "$(SPEC)" ] || [ pyproject.toml -nt $(VENV)/.installed ]; then \
		set -e; echo "make: building $(VENV) ($(SPEC))"; \
		test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV); \
		$(PY) -m pip install -q --upgrade pip; \
		if [ -n "$(TORCH_SPEC)" ]; then $(PY) -m pip install -q "$(TORCH_SPEC)"; fi; \
		echo '$(MEGATRON_CORE)' > $(VENV)/megatron-core.txt; \
		$(PY) -m pip install -q -r $(VENV)/megatron-core.txt; \
		echo '$(MEGATRON_FSDP)' > $(VENV)/megatron-fsdp.txt; \
		if [ -n '$(strip $(MEGATRON_FSDP))' ]; then \
			$(PY) -m pip install -q -r $(VENV)/megatron-fsdp.txt -e '.[$(EXTRAS)]' $(if $(PYTEST_SPEC),'$(PYTEST_SPEC)'); \
		else \
			$(PY) -m pip install -q -e '.[$(EXTRAS)]' $(if $(PYTEST_SPEC),'$(PYTEST_SPEC)'); \
		fi; \
		$(if $(_BRIDGE_ON),$(BRIDGE_INSTALL);) \
		echo '$(SPEC)' > $(VENV)/.installed; \
	fi
	@$(MAKE) --no-print-directory stack STACK=$(STACK)

# Megatron-Bridge without its dependencies (STACK=bridge: the checkout, editable; newest: BRIDGE_REQ from the
# registry), then BRIDGE_DEPS (newest: none, the extra `bridge` brought them), then NVRX_SPEC. nvrx's wheels
# from 0.5 on are tagged manylinux_2_39 (glibc 2.39); where pip finds none for this glibc, that wheel is fetched
# and installed under this machine's plain linux tag, in one line saying so: its one compiled module (the CUPTI
# straggler detector, CUDA 13) is never loaded on CPU ranks.
BRIDGE_INSTALL = $(PY) -m pip install -q --no-deps $(if $(_BRIDGE),$(BRIDGE_REQ),'$(BRIDGE_REQ)') && \
	$(if $(strip $(BRIDGE_DEPS)),$(PY) -m pip install -q $(foreach d,$(BRIDGE_DEPS),'$(d)') &&) \
	if ! $(PY) -m pip install -q '$(NVRX_SPEC)' 2>/dev/null; then \
		arch=$$(uname -m); wheels=$$(mktemp -d); \
		echo "make: $(NVRX_SPEC) has no wheel for this glibc; installing its manylinux_2_39_$$arch wheel as linux_$$arch"; \
		status=0; { $(PY) -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_39_$$arch \
			-d "$$wheels" '$(NVRX_SPEC)' && \
		for w in "$$wheels"/*.whl; do mv "$$w" "$${w%manylinux_2_39_$$arch.whl}linux_$$arch.whl"; done && \
		$(PY) -m pip install -q "$$wheels"/*.whl; } || status=$$?; rm -rf "$$wheels"; test $$status = 0; \
	fi

# One line naming the stack under test (the plugin's header says the same per session).
stack:
	@$(PY) -c "from pytest_megatron_fsdp.fsdp.versions import stack_description as d; print('stack: $(STACK) (' + d() + ')')"

# The main job: the functional suite on 2 ranks (GPUs over NCCL when there are 2, else CPU ranks), then
# upstream's own training and checkpoint code (upstream-code).
smoke: venv
	$(TORCHRUN) -m pytest $(FUNCTIONAL) -v $(PYTEST_ARGS)
	@$(UPSTREAM_CODE_RUN)

# The unit, integration and functional tiers, fastest first, each a plain pytest session (the plugin
# launches the rank sets itself), then the seed's smoke test once more under torchrun, the way GPU
# runners launch it, then upstream's own training and checkpoint code (upstream-code). Not the e2e tier
# (`make e2e`, CI) nor the reproductions.
test: venv
	$(if $(strip $(UNIT)),$(PYTEST) $(UNIT) $(PYTEST_ARGS))
	$(if $(strip $(INTEGRATION)),$(PYTEST) $(INTEGRATION) $(INTEGRATION_XDIST) $(PYTEST_ARGS))
	$(if $(strip $(FUNCTIONAL)),$(PYTEST) $(FUNCTIONAL) $(PYTEST_ARGS))
	$(TORCHRUN) -m pytest $(SEED_TEST) $(PYTEST_ARGS)
	@$(UPSTREAM_CODE_RUN)

# Upstream's own training and checkpoint code (tests/upstream_code): Megatron-Bridge's pretrain() and fsdp_dtensor
# checkpointing (resume exactly, fine-tune, damaged checkpoints) and Megatron-LM's save_checkpoint/load_checkpoint
# (resume exactly, another strategy, fine-tune, the plugin's checkpoints both ways, refusals), on NPROC ranks under
# torchrun in the foreign-suite mode, as Bridge's own functional tests run; `make smoke` and `make test` end
# with it. Each module skips itself where its code is not installed; a stack with neither (the floor) says why
# in one line and runs nothing.
UPSTREAM_CODE ?= tests/upstream_code
UPSTREAM_CODE_RUN = $(if $(strip $(UPSTREAM_CODE)),problem=$$($(PY) -c "from pytest_megatron_fsdp.fsdp.versions import upstream_code_problem as p; \
	print(p() or '')") && if [ -n "$$problem" ]; then echo "make: $(UPSTREAM_CODE) not run: $$problem"; else \
	echo "make: $(UPSTREAM_CODE) on $(NPROC) ranks under torchrun with --mfsdp-foreign-suite=true" && \
	$(TORCHRUN) -m pytest --mfsdp-foreign-suite=true $(UPSTREAM_CODE) $(PYTEST_ARGS); fi,true)
.PHONY: upstream-code
upstream-code: venv
	@$(UPSTREAM_CODE_RUN)

unit: venv
	$(PYTEST) $(UNIT) $(PYTEST_ARGS)

integration: venv
	$(PYTEST) $(INTEGRATION) $(INTEGRATION_XDIST) $(PYTEST_ARGS)

functional: venv
	$(PYTEST) $(FUNCTIONAL) $(PYTEST_ARGS)

reproductions: venv
	$(PYTEST) $(REPRODUCTIONS) $(PYTEST_ARGS)

# Whole files per worker and longest first, as the integration tier (tests/conftest.py's LONGEST_FIRST).
e2e: venv
	$(PYTEST) $(E2E) $(INTEGRATION_XDIST) $(PYTEST_ARGS)

# Collecting every tier imports every test module: a broken import between test modules (which
# neither ruff nor mypy, run on the package, sees) fails here in seconds, not at its tier.
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	@out=$$($(PYTEST) --collect-only -q -p no:randomly tests 2>&1) || { echo "$$out" | tail -n 30; exit 1; }

clean:
	rm -rf .venv-newest .venv-floor .venv-floor-pytest8 .venv-newest-upstream .venv-floor-upstream .venv-bridge .pytest_cache \
		*.egg-info upstream-results

# Regenerate docs/known-bugs.md from the known-bug registry (KNOWN_BUGS in pytest_megatron_fsdp/fsdp/versions.py)
# and docs/gpu-only-causes.md from CAUSES in pytest_megatron_fsdp/fsdp/gpu_only.py and docs/gpu-only-tests.json;
# tests/unit/test_docs.py fails while a page and its sources disagree.
.PHONY: docs
docs: venv
	$(PY) docs/generate_known_bugs.py
	$(PY) docs/generate_gpu_only_causes.py

# Megatron-LM's own Megatron-FSDP tests, unchanged, on CPU ranks (bench/upstream.py; docs/upstream-suites.md):
#   make upstream MEGATRON_LM=/path/to/Megatron-LM [UPSTREAM_TESTS="paths in it"] [UPSTREAM_WORLD_SIZES="2 4 8"]
#       [UPSTREAM_MARKERS="not flaky_in_dev"] [MEGATRON_BRIDGE=/path/to/Megatron-Bridge]
# one torchrun run per world size from the checkout's root, selected by upstream's markers (UPSTREAM_MARKERS,
# passed as -m; default Megatron-LM's dev CI's, "not flaky_in_dev"; UPSTREAM_MARKERS= runs every test), then with
# MEGATRON_BRIDGE one run of `make bridge-test` (its BRIDGE_TEST) in BRIDGE_VENV, whose megatron-core is the
# Megatron-LM runs' (BRIDGE_MEGATRON_CORE overrides it); JUnit per run, a per-file table and summary.json in
# UPSTREAM_RESULTS (default upstream-results/), each run under UPSTREAM_WALL seconds. The checkout's own PEP 735
# `test` dependency group (what its conftests import: Megatron-LM's needs click) is installed into the venv first,
# its GPU-only packages left out, each said in one line (bench/upstream_deps.py). The defaults are the
# script's (python -m bench.upstream --help). The input is checked with the stack's base Python first, so
# that a wrong MEGATRON_LM or MEGATRON_BRIDGE stops in one line before a venv is built; both venvs are built
# before the first run starts.
MEGATRON_LM          ?=
MEGATRON_BRIDGE      ?=
UPSTREAM_TESTS       ?=
UPSTREAM_WORLD_SIZES ?=
UPSTREAM_RESULTS     ?= upstream-results
UPSTREAM_WALL        ?=
BRIDGE_VENV          ?= .venv-bridge
BRIDGE_MEGATRON_CORE ?= $(MEGATRON_CORE)
UPSTREAM_FLAGS = --megatron-lm='$(MEGATRON_LM)' --megatron-bridge='$(MEGATRON_BRIDGE)' \
	--tests='$(UPSTREAM_TESTS)' --results='$(UPSTREAM_RESULTS)' \
	$(if $(strip $(UPSTREAM_WORLD_SIZES)),--world-sizes='$(UPSTREAM_WORLD_SIZES)') \
	$(if $(strip $(UPSTREAM_WALL)),--wall='$(UPSTREAM_WALL)') \
	$(if $(filter undefined,$(origin UPSTREAM_MARKERS)),,--markers='$(UPSTREAM_MARKERS)') \
	$(if $(strip $(MEGATRON_BRIDGE)),--bridge-test='$(BRIDGE_TEST)' --bridge-venv='$(BRIDGE_VENV)' \
		--bridge-megatron-core='$(BRIDGE_MEGATRON_CORE)')
.PHONY: upstream upstream-record
upstream:
	@$(or $(PYTHON),python3) -m bench.upstream --check $(UPSTREAM_FLAGS)
	@$(MAKE) --no-print-directory venv MEGATRON_CORE='$(MEGATRON_CORE)' VENV='$(VENV)' EXTRAS='$(EXTRAS)' BRIDGE_REQ='$(BRIDGE_REQ)'
	@$(PY) -m bench.upstream_deps --checkout='$(MEGATRON_LM)'
	$(if $(strip $(MEGATRON_BRIDGE)),@$(MAKE) --no-print-directory venv STACK=bridge MEGATRON_BRIDGE='$(MEGATRON_BRIDGE)' \
		MEGATRON_CORE='$(BRIDGE_MEGATRON_CORE)' VENV='$(BRIDGE_VENV)')
	$(SCRATCH) $(PY) -m bench.upstream $(UPSTREAM_FLAGS)

# Megatron-Bridge's own Megatron-FSDP test group, unchanged, on NPROC CPU ranks (docs/upstream-suites.md,
# "Megatron-Bridge's test"), in STACK=bridge's venv (.venv-bridge), from the checkout's root (its tests import
# `tests.…`); BRIDGE_TEST=<node id> runs one of its tests:
#   make bridge-test MEGATRON_BRIDGE=/path/to/Megatron-Bridge [MEGATRON_CORE="-e /path/to/Megatron-LM"] [JUNIT=path]
# `-s` sends the last rank's training log to its rank log (BRIDGE_LOGS/torchrun/), whose last loss bench/bridge_loss.py
# prints and requires finite; JUNIT: rank 0's JUnit file. Nothing is written into the checkout (no .pytest_cache).
BRIDGE_TEST ?= tests/functional_tests/test_groups/megatron_fsdp
BRIDGE_LOGS ?= $(CURDIR)/.pytest_cache/d/mfsdp-logs/bridge
JUNIT       ?=
.PHONY: bridge-test
bridge-test: venv
	@rm -rf '$(BRIDGE_LOGS)' && $(SCRATCH) && export TMPDIR && cd '$(_BRIDGE)' && \
	'$(abspath $(PY))' -m torch.distributed.run --standalone --nproc_per_node=$(NPROC) -m pytest -p no:cacheprovider \
		-p no:randomly --mfsdp-platform=cpu --mfsdp-foreign-suite=true --mfsdp-log-dir='$(BRIDGE_LOGS)' -s -rs \
		$(if $(JUNIT),--junitxml='$(abspath $(JUNIT))') '$(BRIDGE_TEST)' $(PYTEST_ARGS); status=$$?; \
	cd '$(CURDIR)' && '$(abspath $(PY))' -m bench.bridge_loss "$(BRIDGE_LOGS)/torchrun/rank$$(($(NPROC) - 1)).log" && \
	exit $$status

# Record the GPU-only skips of a `make upstream` run (UPSTREAM_RESULTS/summary.json) in docs/gpu-only-tests.json,
# then regenerate docs/gpu-only-causes.md from it; commit both.
upstream-record: venv
	$(PY) docs/generate_gpu_only_causes.py --record $(UPSTREAM_RESULTS)/summary.json

# Golden values (Megatron-LM's format) of the functional suite on this stack, recorded again: one
# file per test under $(GOLDEN_DIR)/<stack>/<platform>/ (the stack named from the installed
# versions). Recorded into a scratch dir first; only a passing session replaces the directory of the
# stack and platform it recorded. Compare with: pytest tests/functional --mfsdp-golden=$(GOLDEN_DIR)
GOLDEN_DIR ?= tests/data/golden
.PHONY: golden
golden: venv
	@$(SCRATCH) && export TMPDIR && set -e; fresh="$$scratch/golden"; \
	$(PY) -m pytest $(FUNCTIONAL) --mfsdp-golden="$$fresh" --mfsdp-golden-mode=record $(PYTEST_ARGS); \
	for dir in "$$fresh"/*/*; do \
		target="$(GOLDEN_DIR)/$${dir#$$fresh/}"; rm -rf "$$target"; mkdir -p "$$(dirname "$$target")"; \
		cp -r "$$dir" "$$target"; echo "golden values: $$(ls "$$target" | wc -l) files in $$target"; \
	done

# Line and branch coverage of Megatron-FSDP by the functional suite, every rank counted: both
# megatron_fsdp copies (megatron-core's vendored one, the standalone package), the adapter and the
# distributed optimizer. pyproject.toml's [tool.coverage.run] makes every rank measure itself
# (patch = subprocess, one data file per process); combined here, a table per file, HTML in
# $(COVERAGE_DIR)/html. The test session's own status is make's.
COVERAGE_DIR   := .pytest_cache/coverage
COVERAGE_TESTS ?= $(FUNCTIONAL)
COVERED_FILES  := */megatron/core/distributed/fsdp/*,*/megatron_fsdp/*,*/megatron/core/optimizer/distrib_optimizer.py
.PHONY: coverage
coverage: venv
	@rm -rf $(COVERAGE_DIR)
	@sources=$$($(PY) -c "import importlib.util as u, os; \
		top = [u.find_spec(n) for n in ('megatron.core', 'megatron_fsdp')]; \
		core = list(top[0].submodule_search_locations)[0]; \
		dirs = [os.path.join(core, 'distributed', 'fsdp'), os.path.join(core, 'optimizer')]; \
		dirs += [list(top[1].submodule_search_locations)[0]] if top[1] else []; print(','.join(dirs))") && \
	$(SCRATCH) $(PY) -m coverage run --source="$$sources" -m pytest $(COVERAGE_TESTS) $(PYTEST_ARGS); \
	status=$$?; $(PY) -m coverage combine -q && \
	$(PY) -m coverage report --include='$(COVERED_FILES)' && \
	$(PY) -m coverage html -q --include='$(COVERED_FILES)' && \
	echo "coverage HTML: $(COVERAGE_DIR)/html/index.html"; exit $$status

# Mutation testing of Megatron-FSDP (bench/mutants): the functional suite against each single-edit
# mutant of a shadowing copy of the installed packages; prints the kill matrix (JSON under .pytest_cache/).
MUTANTS_ARGS ?=
.PHONY: mutants
mutants: venv
	$(SCRATCH) $(PY) -m bench.mutants $(MUTANTS_ARGS)

# One GPU (bench/gpu_check.py): the functional suite's world-size-1 subset over NCCL, the bridge-reference preset in
# bf16 and golden values at Megatron-LM's GPU tolerances, then a dated table. Without a GPU it stops in one line
# (exit 2), never on CPU ranks. A stack's first GPU run records its golden values: GPU_CHECK_ARGS=--golden-mode=record.
GPU_CHECK_ARGS ?=
.PHONY: gpu-check
gpu-check: venv
	$(SCRATCH) $(PY) -m bench.gpu_check $(GPU_CHECK_ARGS)

# The distributions a release would upload: `python -m build` (an sdist, then the wheel built from that sdist, with
# build isolation: the build-system requirements of pyproject.toml), then `twine check --strict` on both. Into a
# scratch dir removed afterwards, or into WHEEL_DIR when given (e.g. make wheel WHEEL_DIR=dist).
WHEEL_DIR ?=
.PHONY: wheel
wheel: venv
	@out='$(WHEEL_DIR)'; if [ -z "$$out" ]; then out=$$(mktemp -d) && trap 'rm -rf "$$out"' EXIT; fi; \
		set -e; $(PY) -m build --outdir "$$out" . && $(PY) -m twine check --strict "$$out"/*.tar.gz "$$out"/*.whl && \
		ls -l "$$out"
