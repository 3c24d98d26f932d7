# Two set-up commands (see README): `make simulate` and `make test`.
# Each creates .venv if it is missing. TORCH picks the torch build: the default is the CPU wheel
# that lies on this machine's disk; on a GPU box use e.g. `make test TORCH=torch`.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: venv simulate test bench proto

# One stamp per torch choice, so `make test TORCH=...` on an existing .venv installs that build.
TORCH_STAMP := $(VENV)/.torch-$(subst /,_,$(subst =,_,$(subst $() ,_,$(TORCH))))

$(TORCH_STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)" numpy
	rm -f $(VENV)/.torch-* $(VENV)/.installed
	touch $@

$(VENV)/.installed: pyproject.toml $(TORCH_STAMP)
	$(PY) -m pip install --quiet -e ".[test,dev]"
	touch $@

venv: $(VENV)/.installed

simulate: $(VENV)/.installed
	$(VENV)/bin/fedpar simulate --clients 10 --rounds 10 --dataset digits --partition iid --out runs/digits

test: $(VENV)/.installed
	$(PY) -m pytest -q

proto: $(VENV)/.installed
	$(PY) -m fedpar.protocol.generate
