# p40fleet: `make demo` provisions a sandbox fleet end to end; `make test` runs every check.
SHELL := /bin/bash
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
PYTHON ?= python3
SYSTEM_PACKAGES := podman runc debootstrap openssh-client git ca-certificates apt-utils gnupg
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
export PATH := $(BIN):$(PATH)

.PHONY: help deps system-deps venv fixtures lint pytest molecule test demo bench clean

help:
	@echo "make demo   provision a sandbox fleet of 3 simulated P40 hosts, twice, and report"
	@echo "make test   lint, molecule scenarios and pytest (what CI runs)"

deps: system-deps venv fixtures

# Podman, runc and debootstrap build and run the sandbox hosts; nothing is pulled from a registry.
# apt-ftparchive (apt-utils) and gpg index and sign the sandbox's own apt repository.
system-deps:
	@missing=""; for cmd in podman runc debootstrap ssh git apt-ftparchive gpg; do \
	  command -v $$cmd >/dev/null || missing="$$missing $$cmd"; done; \
	if [ -n "$$missing" ]; then \
	  echo "Installing system packages (missing:$$missing)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SYSTEM_PACKAGES); \
	fi

venv: $(VENV)/.installed

$(VENV)/.installed: requirements.txt constraints.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.txt -c constraints.txt
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -e .
	touch $@

# Real upstream files the tests use (verl's sdist, wheels for its config), fetched before any test.
fixtures: venv
	$(BIN)/p40fleet fixtures

lint: venv
	$(BIN)/yamllint --strict .
	$(BIN)/ansible-lint --strict
	$(BIN)/ruff check python playbooks/files roles
	$(BIN)/ruff format --check python playbooks/files roles
	$(BIN)/ansible-playbook site.yml --syntax-check -i inventory/hosts.example.yml

molecule: deps
	$(BIN)/molecule test --all

pytest: deps
	$(BIN)/pytest

test: lint molecule pytest

demo: deps
	$(BIN)/p40fleet demo --report .runs/demo-report.json

clean:
	-$(BIN)/p40fleet sandbox down --name demo
	rm -rf .runs .fact_cache

# Figures for the speed goal: a converged site.yml run next to a facts+ping play (prints, never fails on time).
bench: deps
	$(BIN)/python python/tests/benchmarks/converged_run.py
