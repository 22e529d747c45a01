"""The render of the shipped configs against the golden renders committed in tests/golden/ (so a change to the
render shows in review as a YAML diff), and the render and lint of a 10,000-iteration target staying fast.

MOELOOP_REGENERATE_GOLDEN=1 rewrites the golden renders from the current code; review the diff, then commit."""

from __future__ import annotations

import difflib
import os
import shutil
from pathlib import Path

import pytest

from benchmarks.render_lint import render_and_lint
from moeloop.steps.config import load_config
from tests.conftest import REPO
from moeloop.workflows.dag import run_uri
from moeloop.workflows.render.files import write_rendered
from moeloop.workflows.render.loop import FILES, build

GOLDEN = REPO / "tests" / "golden"
REGENERATE_ENV = "MOELOOP_REGENERATE_GOLDEN"


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


def test_ten_thousand_iterations_render_and_lint(tmp_path: Path) -> None:
    """The CLI as a user runs it, in fresh processes, on a 10,000-iteration run: both succeed (their speed is
    benchmarks/render_lint.py's, where its target is measured: a timed test fails on a loaded machine)."""
    seconds = render_and_lint(10_000, tmp_path)
    assert set(seconds) == {"render", "lint"} and all(cpu > 0 for cpu, _ in seconds.values())
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == sorted(FILES)
