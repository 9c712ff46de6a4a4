# Set-up and the main entry points. Every target creates the virtual environment if missing.
#
# TORCH_SPEC pins the PyTorch build installed before phalanx itself: on this kind of machine
# `torch==2.13.0` takes the CPU build from the local disk, and the project's `torch>=2.8` range
# then installs nothing more (a bare `torch` would pull a multi-GB CUDA build).
# On a GPU machine: make demo TORCH_SPEC='torch==2.13.0' (pip's default Linux build has CUDA).

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.phalanx-installed

# The other torch releases the compatibility suite runs on: the floor of the supported range,
# one in the middle, the newest this machine's registry offers (src/phalanx/torch_compat.py
# names the same; a test checks). Each gets a venv of its own, .venv-torch-<version>: PyPI's Linux
# builds carry the CUDA libraries (about 5 GB each) and run on a CPU.
TORCH_COMPAT ?= 2.8.0 2.10.0 2.14.1
COMPAT_VENVS := $(foreach version,$(TORCH_COMPAT),.venv-torch-$(version)/.phalanx-installed)

# The suites resolve host names from /etc/hosts alone where they can: tests/hosts_files_only.sh
# says why.
HOSTS_FILES_ONLY := sh tests/hosts_files_only.sh

.PHONY: demo test lint test-cluster test-compat compat-venvs cluster-deps bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet '$(TORCH_SPEC)'
	$(BIN)/python -m pip install --quiet -e '.[test,fabric]'
	touch $@

# The example training (handwritten digits, shipped with scikit-learn) on this one machine,
# rehearsed as two simulated nodes.
demo: $(STAMP)
	$(BIN)/phalanx run --simulate-nodes 2 --nproc-per-node 1 examples/train.py --epochs 5

# The everyday suite: everything but the second stage (under 15 minutes on 2 cores). Most of its
# time is spent waiting (for processes to start, for timeouts), so two pytest-xdist workers share
# it; the test beds' tests run on one of them, one at a time (tests/conftest.py).
TEST_WORKERS ?= 2
# The slowest tests are listed at the end: make test is kept under 15 minutes.
test: $(STAMP) lint
	$(HOSTS_FILES_ONLY) $(BIN)/python -m pytest -q -m "not cluster" -n $(TEST_WORKERS) --dist loadgroup --durations 15

# The linter, the formatter's check (pyproject.toml's [tool.ruff]; `ruff format` applies it) and
# the docstrings' examples as doctests. Part of make test.
LINTED := src tests benchmarks examples
lint: $(STAMP)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/python -m pytest -q -p no:cacheprovider --doctest-modules src/phalanx

# The second stage: a real two-node SLURM cluster (Debian's slurmctld and slurmd in network
# namespaces; root), phalanx launch over real sshd in test-bed hosts, and the test bed's own
# tests. About 22 minutes, one test at a time. `make cluster-deps` installs SLURM and OpenSSH first.
test-cluster: $(STAMP) cluster-deps
	$(HOSTS_FILES_ONLY) $(BIN)/python -m pytest -q -rP -m cluster --durations 15

# What the second stage runs besides Python: SLURM's daemons and client tools, OpenSSH's sshd and
# client (phalanx launch's tests) and iptables (a blocked port), from Debian's packages, when
# missing (needs root and apt-get).
CLUSTER_TOOLS := slurmctld slurmd sbatch sshd ssh ssh-keygen iptables
CLUSTER_PACKAGES := slurmctld slurmd slurm-client openssh-server openssh-client iptables
cluster-deps:
	@missing=""; for tool in $(CLUSTER_TOOLS); do \
		command -v $$tool >/dev/null || test -x /usr/sbin/$$tool || missing="$$missing $$tool"; done; \
	if [ -z "$$missing" ]; then \
		echo "SLURM, OpenSSH and iptables are installed: $$(slurmd -V)"; \
	elif [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
		echo "make cluster-deps: missing$$missing; installing needs root and apt-get; those tests will skip" >&2; \
	else \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			$(CLUSTER_PACKAGES) >/dev/null && slurmd -V; \
	fi

# The compatibility suite (the tests marked compat: launch, simulated nodes, two hosts, a foreign
# script, the check that ranks communicated, checkpoints and resume, preemption, the stall
# watchdog, compression, a heal, and the private-name canary) on each release of TORCH_COMPAT. The
# main suite (make test) covers TORCH_SPEC's. Each release's venv takes 6 to 8 GB (CUDA builds);
# COMPAT_KEEP=0 removes each one after its run, so that only one is on disk at a time (CI).
COMPAT_KEEP ?= 1
test-compat:
	@for version in $(TORCH_COMPAT); do \
		$(MAKE) --no-print-directory .venv-torch-$$version/.phalanx-installed || exit 1; \
		echo "== the compatibility suite on torch $$version"; \
		$(HOSTS_FILES_ONLY) .venv-torch-$$version/bin/python -m pytest -q -m compat -n $(TEST_WORKERS) --dist loadgroup || exit 1; \
		if [ "$(COMPAT_KEEP)" = 0 ]; then rm -rf .venv-torch-$$version; fi; \
	done

compat-venvs: $(COMPAT_VENVS)

.venv-torch-%/.phalanx-installed: pyproject.toml
	test -x .venv-torch-$*/bin/python || $(PYTHON) -m venv .venv-torch-$*
	.venv-torch-$*/bin/python -m pip install --quiet --no-cache-dir 'torch==$*'
	.venv-torch-$*/bin/python -m pip install --quiet --no-cache-dir -e '.[test]'
	touch $@

# Every benchmark (about six hours on 2 cores; root for the ones that build network namespaces)
# and one table of every target against its limit: benchmarks/results/summary.md. The test
# suite runs each one's smoke mode (tests/e2e/test_benchmarks.py).
bench: $(STAMP)
	$(BIN)/python benchmarks/summary.py

clean:
	rm -rf $(VENV) .venv-torch-* phalanx-logs .pytest_cache build src/*.egg-info
