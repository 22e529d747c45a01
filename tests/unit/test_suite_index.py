"""tests/README.md is the suite's index: every test file is listed in its folder's section and every file it lists
exists; CI runs `make test`, which both READMEs give beside `make test-fast`."""

from __future__ import annotations

import re

from tests.conftest import REPO

TESTS = REPO / "tests"
README = TESTS / "README.md"


def listed_files() -> dict[str, set[str]]:
    """Folder -> the test files the README's table rows name under that folder's `## `folder/`` heading."""
    listed: dict[str, set[str]] = {}
    folder = None
    for line in README.read_text().splitlines():
        if heading := re.fullmatch(r"## `(\w+)/`", line):
            folder = heading.group(1)
            listed[folder] = set()
        elif folder and (row := re.match(r"\| `(test_\w+\.py)` \|", line)):
            listed[folder].add(row.group(1))
    return listed


def test_every_test_file_is_listed_in_its_folders_section_and_only_those() -> None:
    present = {
        folder.name: {path.name for path in folder.glob("test_*.py")}
        for folder in TESTS.iterdir()
        if folder.is_dir() and (folder / "__init__.py").exists()
    }
    listed = listed_files()
    assert listed.keys() == present.keys(), "a folder of tests/ without its section in tests/README.md, or the reverse"
    for folder, files in present.items():
        assert files - listed[folder] == set(), f"tests/{folder}/: not in tests/README.md's `{folder}/` section"
        assert listed[folder] - files == set(), f"tests/README.md's `{folder}/` section names files not in it"
    assert not list(TESTS.glob("test_*.py")), "a test file at the top of tests/: it goes in the folder of its kind"


def test_ci_runs_make_test_as_the_readmes_give_it_with_make_test_fast_beside_it() -> None:
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1] == "make test"
    makefile = (REPO / "Makefile").read_text()
    # The suite needs the test extras: `make install-tests` (test_install.py).
    assert re.search(r"^test: install-tests$", makefile, re.MULTILINE)
    assert re.search(r"^test-fast: install-tests$", makefile, re.MULTILINE)
    for readme in (REPO / "README.md", README):
        assert re.search(r"^make test +#", readme.read_text(), re.MULTILINE), readme
        assert re.search(r"^make test-fast +#", readme.read_text(), re.MULTILINE), readme
