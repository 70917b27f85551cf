# pytest-megatron-fsdp: `make smoke` (the functional suite on 2 ranks), `make test` (everything).
# Both create the virtualenv when it is missing.
#
# On a GPU runner keep the container's torch:
#   make smoke VENV_FLAGS=--system-site-packages TORCH_SPEC=
PYTHON      ?= python3
VENV        ?= .venv
VENV_FLAGS  ?=
# The CPU build of torch on machines without GPUs; empty = use whatever torch is importable.
TORCH_SPEC  ?= torch==2.13.0
NPROC       ?= 2
PYTEST_ARGS ?=

PY       := $(VENV)/bin/python
# torchrun leaves a torchelastic_* dir in $$TMPDIR on every run: give it one that is removed after.
TORCHRUN := scratch=$$(mktemp -d) && trap 'rm -rf "$$scratch"' EXIT && TMPDIR=$$scratch \
	$(PY) -m torch.distributed.run --standalone --nproc_per_node=$(NPROC)

.PHONY: venv smoke test unit lint clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	if [ -n "$(TORCH_SPEC)" ]; then $(PY) -m pip install -q "$(TORCH_SPEC)"; fi
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

# The main job: the functional suite on 2 ranks (GPUs over NCCL when there are 2, else CPU ranks).
smoke: venv
	$(TORCHRUN) -m pytest tests/functional -v $(PYTEST_ARGS)

# Everything the repo tests, as plain pytest (the plugin launches the 2-rank sets itself), then the
# seed's smoke test once more under torchrun, the way GPU runners launch it.
test: venv
	$(PY) -m pytest tests $(PYTEST_ARGS)
	$(TORCHRUN) -m pytest tests/functional/test_megatron_fsdp.py $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache *.egg-info
