# Two commands for a new user: `make demo` and `make test` (each sets up first).
PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.hpcft-installed
DEBS    := slurm-wlm slurmctld slurmd slurmdbd slurm-client libslurm38 munge mariadb-server openmpi-bin libopenmpi-dev \
           libpmix2 lmod iproute2 gcc
TORCH   ?= torch==2.13.0
# Triton runs the GPU checksum kernel's tests on the CPU (its interpreter); GPU builds of torch bring their own
TRITON  ?= triton==3.6.0

.PHONY: setup debs venv testdeps test unit demo clean-venv

setup: debs $(STAMP)

debs:
	@missing=""; for p in $(DEBS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

# The CPU torch wheel is pinned first so that no CUDA build is pulled in; a site keeps its own ROCm torch.
# setup.py builds the streaming-store copy kernel into hpcft/store/ (in place: bin/hpcft uses it too)
$(STAMP): pyproject.toml setup.py hpcft/store/_ntcopy.c
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	@$(VPY) -m pip install -q --upgrade pip >/dev/null
	@$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q "$(TORCH)"
	@$(VPY) -m pip install -q -e ".[dev,mpi]"
	@$(VPY) -c "from hpcft.store import ntcopy; ok, why = ntcopy.probe(); ok or print('WARNING:', why)"
	@touch $(STAMP)

testdeps: setup
	@$(VPY) -c "import triton" 2>/dev/null || $(VPY) -m pip install -q "$(TRITON)"

test: testdeps
	$(VPY) -m pytest -q --durations=60 tests

unit: testdeps
	$(VPY) -m pytest -q tests/unit

demo: setup
	$(VENV)/bin/hpcft demo

clean-venv:
	rm -rf $(VENV)
