"""The render of the shipped configs against the golden renders committed in tests/golden/ (so a change to the
render shows in review as a YAML diff), and the render and lint of a 10,000-iteration target staying fast.

MOELOOP_REGENERATE_GOLDEN=1 rewrites the golden renders from the current code; review the diff, then commit."""

from __future__ import annotations

import difflib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from steps.config import load_config
from tests.argo_stand_in import moeloop
from tests.conftest import REPO
from workflows.dag import run_uri
from workflows.render import FILES, build, write_rendered

GOLDEN = REPO / "tests" / "golden"
REGENERATE_ENV = "MOELOOP_REGENERATE_GOLDEN"
RENDER_SECONDS = 2.0


@pytest.mark.parametrize("name", ["tiny", "eks"])
def test_the_render_of_a_shipped_config_is_its_golden_render(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`moeloop render configs/<name>.yaml -o DIR`, run from the repository root, writes exactly these files."""
    monkeypatch.chdir(REPO)  # the prompt paths become relative to it, as for the pods
    config = load_config(REPO / "configs" / f"{name}.yaml")
    written = write_rendered(build(config, run_uri(config)), tmp_path)
    golden = GOLDEN / name
    if os.environ.get(REGENERATE_ENV):
        golden.mkdir(parents=True, exist_ok=True)
        for path in written:
            shutil.copyfile(path, golden / path.name)
    assert sorted(p.name for p in golden.iterdir()) == sorted(FILES)
    for path in written:
        expected = (golden / path.name).read_text().splitlines(keepends=True)
        diff = list(difflib.unified_diff(expected, path.read_text().splitlines(keepends=True), str(golden / path.name), "render"))
        assert not diff, f"the render differs from {golden / path.name} (set {REGENERATE_ENV}=1 to accept):\n" + "".join(diff[:60])


def cli_cpu_seconds(*args: str, log: Path) -> tuple[int, float]:
    """`python -m workflows.cli ARGS` from the repo root, its output to log: its exit code and CPU seconds."""
    environment = {key: value for key, value in os.environ.items() if not key.startswith("ARGO_")}
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "workflows.cli", *args], cwd=REPO, env={**environment, "PYTHONPATH": str(REPO)},
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    return process.returncode, usage.ru_utime + usage.ru_stime


def test_ten_thousand_iterations_render_and_lint_in_under_two_seconds(tmp_path: Path) -> None:
    """The CLI as a user runs it, in fresh processes; measured in CPU seconds, which other jobs on the machine
    do not add to as they do to wall-clock time: each process's own (wait4), not RUSAGE_CHILDREN's, which also
    counts whatever earlier test's child the interpreter happens to reap meanwhile."""
    rendered, render_seconds = cli_cpu_seconds("render", "configs/tiny.yaml", "--iterations", "10000", "-o",
                                               str(tmp_path / "out"), log=tmp_path / "render.log")  # fmt: skip
    linted, lint_seconds = cli_cpu_seconds("lint", str(tmp_path / "out"), log=tmp_path / "lint.log")
    assert (rendered, linted) == (0, 0), (tmp_path / "render.log").read_text() + (tmp_path / "lint.log").read_text()
    seconds = render_seconds + lint_seconds
    print(f"render and lint took {seconds:.2f} CPU seconds")
    assert seconds < RENDER_SECONDS, f"render and lint took {seconds:.2f} CPU seconds"
