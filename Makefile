# p40fleet: `make demo` provisions a sandbox fleet end to end; `make test` runs every check.
SHELL := /bin/bash
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
# The harness's commands (sandbox, demo, fixtures): python/p40fleet_dev, in the checkout's venv only, not the wheel.
DEV := $(BIN)/python -m p40fleet_dev
PYTHON ?= python3
# What a controller needs to provision: ssh (Ansible's connection), git (`p40fleet bundle` clones the pinned
# Apex and verl) and the CA certificates TLS checks against.
CONTROLLER_PACKAGES := openssh-client git ca-certificates
# How each set is found already installed (the deps targets install a set where one of these is missing).
CONTROLLER_COMMANDS := ssh git
CA_BUNDLE := /etc/ssl/certs/ca-certificates.crt
# Only the sandbox and the tests: podman, runc and debootstrap build and run the sandbox hosts (nothing is pulled
# from a registry); apt-ftparchive (apt-utils) and gpg index and sign the sandbox's own apt repository.
SANDBOX_PACKAGES := podman runc debootstrap apt-utils gnupg
SANDBOX_COMMANDS := podman runc debootstrap apt-ftparchive gpg
# Tests only: headless Chromium renders the HTML fleet report into a screenshot; nft checks and loads Ray's firewall.
TEST_SYSTEM_PACKAGES := chromium nftables
TEST_COMMANDS := chromium nft
# What of a set is missing, each name after a space (empty when all is there): shell expansions for the deps
# targets' recipes, one home for each installed check.
missing_commands = $$(for cmd in $(1); do command -v $$cmd >/dev/null || printf ' %s' $$cmd; done)
missing_controller = $(call missing_commands,$(CONTROLLER_COMMANDS))$$([ -f $(CA_BUNDLE) ] || printf ' ca-certificates')
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
export PATH := $(BIN):$(PATH)

.PHONY: help deps controller-deps sandbox-deps sandbox-system-deps test-deps system-test-deps venv fixtures lint pytest molecule \
  test test-fast faults demo bench clean lock lock-verl lock-torch lock-cpu-torch gpu-bundle gpu-check \
  gpu-learn gpu-learn-record gpu-sweep gpu-sweep-record gpu-records

help:
	@echo "make demo   provision a sandbox fleet of 3 simulated P40 hosts, twice, and report"
	@echo "make test   lint and pytest, the molecule scenario among its tests (what CI runs)"
	@echo "make test-fast   lint and the tests that need no container (pytest -m unit)"
	@echo "make deps   what a controller needs to provision a real fleet (no sandbox, no podman)"
	@echo "make faults the fault suite, every case (docs/dev/faults.md), and the tests elsewhere it counts"
	@echo "make gpu-check   run each profile's rendered launch script on this machine's CUDA GPU (python/tests/gpu/)"
	@echo "make gpu-learn   the learning proof: three warm starts, the P40 script and its negative control (learning.py)"
	@echo "make gpu-sweep   time one P40 step per configuration on this machine's CUDA GPU (python/tests/gpu/sweep.py)"

# An operator's controller: the tools and the Python venv, nothing of the sandbox.
deps: controller-deps venv

controller-deps:
	@missing="$(missing_controller)"; \
	if [ -n "$$missing" ]; then \
	  echo "Installing system packages (missing:$$missing)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(CONTROLLER_PACKAGES); \
	fi

# The sandbox fleet and the tests: its system packages and the upstream fixtures, on top of deps.
sandbox-deps: deps sandbox-system-deps fixtures

sandbox-system-deps:
	@missing="$(call missing_commands,$(SANDBOX_COMMANDS))"; \
	if [ -n "$$missing" ]; then \
	  echo "Installing the sandbox's system packages (missing:$$missing)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SANDBOX_PACKAGES); \
	fi

test-deps:
	@missing="$(call missing_commands,$(TEST_COMMANDS))"; \
	if [ -n "$$missing" ]; then \
	  echo "Installing test-only system packages (missing:$$missing)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	  $(TEST_SYSTEM_PACKAGES); \
	fi

# Every system package `make test` needs, in one go: one `apt-get update`, then the controller's and the sandbox's
# packages (with their recommends: debootstrap checks the archive with debian-archive-keyring) and the tests'
# (without). `make test` runs it beside the venv's install, which needs none of them, so a fresh machine reaches
# pytest sooner (docs/benchmarks-code.md).
system-test-deps:
	@controller="$(missing_controller)"; sandbox="$(call missing_commands,$(SANDBOX_COMMANDS))"; \
	tests="$(call missing_commands,$(TEST_COMMANDS))"; \
	if [ -n "$$controller$$sandbox$$tests" ]; then \
	  echo "Installing system packages:$${controller:+ $(CONTROLLER_PACKAGES)}$${sandbox:+ $(SANDBOX_PACKAGES)}$${tests:+ $(TEST_SYSTEM_PACKAGES)}"; \
	  apt-get update -qq || exit 1; \
	  if [ -n "$$controller$$sandbox" ]; then DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    $${controller:+$(CONTROLLER_PACKAGES)} $${sandbox:+$(SANDBOX_PACKAGES)} || exit 1; fi; \
	  if [ -n "$$tests" ]; then DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    $(TEST_SYSTEM_PACKAGES) || exit 1; fi; \
	fi

venv: $(VENV)/.installed

# uv (its version from constraints.txt) installs the pinned tree, faster than pip (docs/benchmarks-code.md). pip
# stays in the venv for the editable install and the tests' own venvs.
$(VENV)/.installed: requirements.txt constraints.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt uv
	$(BIN)/uv pip install -q --python $(BIN)/python -r requirements.txt -c constraints.txt
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -e .
	touch $@

# Real upstream files the tests use (verl's sdist, wheels for its config, the wheels p40fleet's own wheel
# installs with), fetched before any test.
fixtures: venv
	$(DEV) fixtures

lint: venv
	$(BIN)/yamllint --strict .
	# Its syntax checks read ansible.cfg's inventory, the operator's copy, which a checkout lacks (and must fail on).
	ANSIBLE_INVENTORY=inventory/hosts.example.yml $(BIN)/ansible-lint --strict
	$(BIN)/ruff check python playbooks/files roles owner_scripts
	$(BIN)/ruff format --check python playbooks/files roles owner_scripts
	$(BIN)/ansible-playbook site.yml --syntax-check -i inventory/hosts.example.yml

molecule: sandbox-deps
	$(BIN)/molecule test --all

# One pytest-xdist worker a core: a fleet's run keeps about one core busy (controller, ssh, the hosts' Python).
# Work units are whole modules, or the modules sharing a fleet (conftest.py's groups), costliest first.
PYTEST_WORKERS ?= $(shell nproc)
pytest: sandbox-deps test-deps
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder

# The molecule scenario runs inside pytest (test_molecule.py), as a work unit beside the other fleets. Lint runs
# beside pytest at the lowest priority: it takes what the fleets leave of the cores (downloads, containers
# starting, the last unit's tail) instead of half a minute of its own before them. Its output follows pytest's;
# either failing fails `make test`.
LINT_LOG := .runs/lint.log
test:
	@mkdir -p $(dir $(LINT_LOG)); \
	$(MAKE) --no-print-directory system-test-deps & system=$$!; \
	$(MAKE) --no-print-directory venv; venv=$$?; \
	wait $$system; system=$$?; \
	[ $$venv -eq 0 ] && [ $$system -eq 0 ] || exit 1; \
	nice -n 19 $(MAKE) --no-print-directory lint > $(LINT_LOG) 2>&1 & lint=$$!; \
	$(MAKE) --no-print-directory pytest; tests=$$?; \
	wait $$lint; linted=$$?; \
	echo "--- make lint (run beside pytest), exit $$linted:"; cat $(LINT_LOG); \
	[ $$tests -eq 0 ] && [ $$linted -eq 0 ]

# The container-free tests (markers: unit, sandbox, converge in pyproject.toml), for a quick check while editing.
test-fast: lint fixtures
	$(BIN)/pytest -m unit

# The fault suite with its slow cases (make test runs the rest of it), and the tests elsewhere that prove part
# of a case; it ends with the table of cases.
faults: sandbox-deps
	P40FLEET_FAULTS=full $(BIN)/pytest python/tests/faults $$($(BIN)/python python/tests/faults/cases.py --reused)

demo: sandbox-deps
	$(DEV) demo --report .runs/demo-report.json

clean:
	-$(DEV) sandbox down --name demo
	rm -rf .runs .fact_cache

# Figures for the speed goals (prints a table, writes .runs/bench.json, never fails on time); a small version:
# make bench BENCH_ARGS=--quick. See python/tests/benchmarks/bench.py for what it measures.
bench: sandbox-deps
	$(BIN)/python python/tests/benchmarks/bench.py $(BENCH_ARGS)

# The GPU check (python/tests/gpu/): each case's rendered launch script for real on a CUDA GPU, under the emulated
# card's memory cap. gpu-bundle (needs PyPI once, then the cache) builds .gpu/ here: the rendered scripts, verl
# patched by verl_patches, the shim, the converter and the lock's wheels for the GPU machine's Python.
# gpu-check runs it where `python3` holds a CUDA torch (as root: it makes the unprivileged account the script
# needs); a machine without network gets .gpu/ and python/tests/gpu/run_check.py carried to it. gpu-records writes
# docs/gpu-runs/ from the results; test_gpu_records.py (in make test) holds the records to today's rendering.
GPU_PYTHON_VERSION ?= 3.12
# The cases the check runs (a refused case keeps its record: its evidence is an earlier run).
GPU_CASES ?= p40-1x,t4-1x-hf
GPU_OUT ?= .runs/gpu-check
# A case whose smoke and full batch outlast one call ran in two (GPU_CHECK_ARGS=--full-steps 0, then --smoke-steps
# 0): name both results.json files here, and gpu-records merges them (records.merged).
GPU_RESULTS ?= $(CURDIR)/$(GPU_OUT)/results.json
gpu-bundle: venv fixtures
	cd python && $(BIN)/python -m tests.gpu.bundle --out $(CURDIR)/.gpu --python-version $(GPU_PYTHON_VERSION)

gpu-check: gpu-bundle
	python3 -m pip install -q --no-index --no-deps --target .gpu/site .gpu/wheels/*.whl
	PYTHONPATH=$(CURDIR)/.gpu/site python3 python/tests/gpu/run_check.py --bundle .gpu --out $(GPU_OUT) \
	  --cases $(GPU_CASES) --site $(CURDIR)/.gpu/site $(GPU_CHECK_ARGS)

# The step-time sweep (python/tests/gpu/sweep.py): the 1x P40 rendering under its cap, one configuration at a time,
# alone on the GPU; gpu-sweep-record writes its record beside the others in docs/gpu-runs/.
GPU_SWEEP_OUT ?= .runs/gpu-sweep
gpu-sweep: gpu-bundle
	python3 -m pip install -q --no-index --no-deps --target .gpu/site .gpu/wheels/*.whl
	PYTHONPATH=$(CURDIR)/.gpu/site python3 python/tests/gpu/run_check.py --bundle .gpu --out $(GPU_SWEEP_OUT) \
	  --sweep p40-1x --site $(CURDIR)/.gpu/site

# The learning proof (python/tests/gpu/learning.py), alone on the GPU: three warm starts side by side, each trained
# by the 1x P40 rendering and by its negative control (the same script on a verl tree with the positions fix taken
# back), and fine-tuned on alone; about 9 minutes on an H100. Add a100-1x to GPU_LEARN for the bf16 reference.
# gpu-learn-record writes docs/gpu-runs/learning/p40-1x.json and docs/gpu-learning.png from it.
GPU_LEARN ?= p40-1x,control=p40-1x@positions-unfixed
GPU_LEARN_SEEDS ?= 0,1,2
GPU_LEARN_OUT ?= .runs/gpu-learn
gpu-learn: gpu-bundle
	python3 -m pip install -q --no-index --no-deps --target .gpu/site .gpu/wheels/*.whl
	PYTHONPATH=$(CURDIR)/.gpu/site python3 python/tests/gpu/run_check.py --bundle .gpu --out $(GPU_LEARN_OUT) \
	  --cases none --learn $(GPU_LEARN) --learn-seeds $(GPU_LEARN_SEEDS) --site $(CURDIR)/.gpu/site

# GPU_SWEEP_RECORD_ARGS=--add keeps the record's earlier runs (each run's figures are compared only within it).
gpu-sweep-record: venv
	cd python && $(BIN)/python -m tests.gpu.records --results $(CURDIR)/$(GPU_SWEEP_OUT)/results.json \
	  --manifest $(CURDIR)/.gpu/manifest.json $(GPU_SWEEP_RECORD_ARGS)

gpu-records: venv
	cd python && $(BIN)/python -m tests.gpu.records --results $(GPU_RESULTS) \
	  --manifest $(CURDIR)/.gpu/manifest.json --cases $(GPU_CASES)

gpu-learn-record: venv
	cd python && $(BIN)/python -m tests.gpu.records --results $(CURDIR)/$(GPU_LEARN_OUT)/results.json \
	  --manifest $(CURDIR)/.gpu/manifest.json
	cp $(GPU_LEARN_OUT)/learning.png docs/gpu-learning.png

# The CPU venv's torch lock (python/tests/fixtures, for make test only): torch 2.6.0 from PyPI and what it pulls in,
# less what the sandbox's verl lock holds (its constraint). Needs PyPI: never run by tests.
CPU_TORCH_LOCK := python/tests/fixtures/cpu-torch-2.6.0-py311.lock.txt
lock-cpu-torch: venv
	@set -euo pipefail; verl=roles/verl/files/verl-$(VERL_LOCK_VERSION)-py311.lock.txt; \
	skip=$$(sed -n 's/^\([A-Za-z0-9_.-]*\)==.*/--no-emit-package \1/p' $$verl); \
	head -n 6 $(CPU_TORCH_LOCK) > $(CPU_TORCH_LOCK).new; \
	echo torch==2.6.0 | $(BIN)/uv pip compile --quiet --generate-hashes --no-header --python-version 3.11 \
	  --python-platform x86_64-manylinux_2_28 --exclude-newer $(VERL_LOCK_EXCLUDE_NEWER) -c $$verl $$skip - \
	  >> $(CPU_TORCH_LOCK).new || { rm -f $(CPU_TORCH_LOCK).new; exit 1; }; \
	mv $(CPU_TORCH_LOCK).new $(CPU_TORCH_LOCK); echo "wrote $(CPU_TORCH_LOCK)"

# The hash locks the env installs from, one per Python each: verl's dependencies (PyPI, rewritten) and the torch
# stack (checked, never rewritten). Needs PyPI and PyTorch's cu118 index: never run by tests.
lock: lock-verl lock-torch

# verl's dependency locks, one per Python (the sandbox's env is Python 3.11). Needs PyPI: never run by tests.
VERL_LOCK_VERSION := 0.4.1
VERL_LOCK_PYTHONS := 3.10 3.11
VERL_LOCK_EXCLUDE_NEWER := 2025-06-27T12:00:00Z
VERL_LOCK_FILES := roles/verl/files
# Installed by the pytorch role (cu118 builds and what only they ask for) or editable by the verl role: kept out.
VERL_LOCK_NO_EMIT := verl torch triton sympy mpmath networkx jinja2 markupsafe \
  nvidia-cublas-cu12 nvidia-cuda-cupti-cu12 \
  nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12 nvidia-cudnn-cu12 nvidia-cufft-cu12 nvidia-curand-cu12 \
  nvidia-cusolver-cu12 nvidia-cusparse-cu12 nvidia-cusparselt-cu12 nvidia-nccl-cu12 nvidia-nvjitlink-cu12 \
  nvidia-nvtx-cu12
lock-verl: venv
	@set -euo pipefail; cd $(VERL_LOCK_FILES); \
	for python in $(VERL_LOCK_PYTHONS); do \
	  lock=verl-$(VERL_LOCK_VERSION)-py$${python/./}.lock.txt; \
	  sed -e "s/@VERL@/$(VERL_LOCK_VERSION)/g" -e "s/@PYTHON@/$$python/g" verl-lock-header.txt > $$lock.new; \
	  $(BIN)/uv pip compile --quiet --generate-hashes --python-version $$python \
	    --python-platform x86_64-manylinux_2_28 --exclude-newer $(VERL_LOCK_EXCLUDE_NEWER) \
	    $(addprefix --no-emit-package ,$(VERL_LOCK_NO_EMIT)) \
	    -c verl-$(VERL_LOCK_VERSION)-constraints.in verl-$(VERL_LOCK_VERSION)-requirements.in >> $$lock.new; \
	  mv $$lock.new $$lock; echo "wrote $(VERL_LOCK_FILES)/$$lock"; \
	done

# The torch locks, one per Python verl has a lock for: torch 2.6.0+cu118 at the sha256 published for PyTorch's
# file (the lock's header names the sources) and its requirements resolved against PyPI, with verl's lock of that
# Python as a constraint. This resolves them again and compares; a difference fails with the lines that differ and
# changes nothing (edit the lock, or the requirements, by hand). Needs PyPI and PyTorch's index; where the index
# cannot be reached, LOCK_TORCH_ARGS=--pypi-only checks the PyPI part alone.
PYTORCH_LOCK_VERSION := 2.6.0
PYTORCH_LOCK_CUDA_TAG := cu118
PYTORCH_LOCK_PYTHONS := $(VERL_LOCK_PYTHONS)
PYTORCH_LOCK_INDEX := https://download.pytorch.org/whl/$(PYTORCH_LOCK_CUDA_TAG)
lock-torch: venv
	$(BIN)/python -m p40fleet_dev.torch_lock --pythons "$(PYTORCH_LOCK_PYTHONS)" --torch $(PYTORCH_LOCK_VERSION) \
	  --tag $(PYTORCH_LOCK_CUDA_TAG) --index $(PYTORCH_LOCK_INDEX) --exclude-newer $(VERL_LOCK_EXCLUDE_NEWER) \
	  $(LOCK_TORCH_ARGS)
