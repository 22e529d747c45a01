"""The installed project adds one top-level name, `moeloop`: its wheel, built from the tracked files as `pip install .`
builds it, holds nothing outside `moeloop/` and its metadata, and installed into a fresh environment beside a user's
own `workflows` package both import, each from its own place, with no `steps` or `workflows` of ours to shadow them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

from tests.conftest import REPO
from tests.processes import run_command

PROBE = """
import importlib.util, json, moeloop.steps, moeloop.workflows, workflows
print(json.dumps({
    "workflows": workflows.__file__,
    "moeloop.workflows": moeloop.workflows.__file__,
    "moeloop.steps": moeloop.steps.__file__,
    "steps": importlib.util.find_spec("steps") is not None,
}))
"""


def build_wheel(folder: Path) -> Path:
    """The wheel of the tracked files (a copy: a build writes its build/ and egg-info beside the sources)."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    source = folder / "source"
    for name in filter(None, tracked.decode().split("\0")):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    wheels = folder / "wheels"
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels)]
    run_command([*command, str(source)], check=True)
    [wheel] = wheels.glob("moeloop-*.whl")
    return wheel


def test_the_wheel_installs_one_top_level_name_beside_a_users_own_workflows_package(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        tops = {name.split("/")[0] for name in archive.namelist()}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"moeloop"}, tops

    fresh = tmp_path / "fresh"
    venv.create(fresh, with_pip=False)
    python = fresh / "bin" / "python"
    # Without the checkout on the path: its egg-info (an editable install's) would say moeloop is installed already.
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)]
    run_command(install, cwd=tmp_path, env={"PYTHONPATH": None}, check=True)
    user = tmp_path / "project"
    (user / "workflows").mkdir(parents=True)
    (user / "workflows" / "__init__.py").write_text('NAME = "the user\'s own"\n')
    # The dependencies from this environment's site-packages, put on the path without running its .pth files (one of
    # them maps moeloop onto this checkout: the editable install the test must not see).
    dependencies = sysconfig.get_paths()["purelib"]
    done = run_command([str(python), "-c", PROBE], cwd=user, env={"PYTHONPATH": dependencies}, check=True)
    found = json.loads(done.stdout)
    installed = fresh.resolve()
    assert Path(found["workflows"]).resolve() == (user / "workflows" / "__init__.py").resolve()
    for name in ("moeloop.workflows", "moeloop.steps"):
        assert Path(found[name]).resolve().is_relative_to(installed), (name, found[name])
    assert found["steps"] is False
