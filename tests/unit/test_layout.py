"""The layout of steps/ (steps/README.md): the programs at the top, the libraries in rooms below them.

No module of steps/ imports a program (a pod CLI of the DAG, or another `python -m moeloop.steps.<name>` entry
point), so every program can change without its neighbours noticing; no library (a room below the top) imports
the programs' helper either; imports run one way, rl -> model and workflows/ -> steps/, never back up (what the
pods run needs nothing of what runs them); and no file under steps/ or workflows/ is over 450 lines.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import REPO
from moeloop.workflows.dag import FINISH, STEPS, TRAIN_REPORT, TRAINER

STEPS_DIR = REPO / "steps"
MAX_LINES = 450
# Programs besides the DAG's steps: run by hand (README), never imported.
OTHER_PROGRAMS = ("reward_model", "demo_task")
# The DAG's steps, the chunk's trainer, and the two pods Argo runs beside them (workflows/dag.py)
DAG_PROGRAMS = {step.module for step in (*STEPS, TRAINER, TRAIN_REPORT, FINISH)}
PROGRAMS = DAG_PROGRAMS | {f"moeloop.steps.{name}" for name in OTHER_PROGRAMS}
PROGRAMS_HELPER = "moeloop.steps.common"  # what the pod CLIs share: their arguments, reports, opening an iteration


def module_name(path: Path) -> str:
    return ".".join(("moeloop", *path.relative_to(REPO).with_suffix("").parts))


def imported_modules(path: Path) -> set[str]:
    """Every module path imports, at the top or inside a function: `from moeloop.steps import x` counts as
    moeloop.steps.x."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


def offenders(folder: Path, forbidden: Callable[[str], bool]) -> dict[str, list[str]]:
    """Each module under folder that imports a module `forbidden` says yes to, with those imports."""
    found = {module_name(path): sorted(filter(forbidden, imported_modules(path))) for path in folder.rglob("*.py")}
    return {module: imports for module, imports in sorted(found.items()) if imports}


def test_programs_exist_at_the_top() -> None:
    """Every rendered `python -m moeloop.steps.<module>` and every other program is a module at the top of steps/."""
    for program in PROGRAMS:
        assert (REPO / (program.removeprefix("moeloop.").replace(".", "/") + ".py")).is_file(), program


def test_no_module_of_steps_imports_a_program() -> None:
    assert offenders(STEPS_DIR, PROGRAMS.__contains__) == {}


def test_the_model_imports_nothing_of_rl() -> None:
    """The trainer (rl/) is made of the model (model/), never the other way round."""
    assert offenders(STEPS_DIR / "model", lambda module: within(module, "moeloop.steps.rl")) == {}


def test_nothing_under_steps_imports_workflows() -> None:
    """The pods' package runs without the orchestration's: workflows/ drives steps/, never the other way round."""
    assert offenders(STEPS_DIR, lambda module: within(module, "moeloop.workflows")) == {}


def test_no_library_imports_the_programs_helper() -> None:
    libraries = [path for path in sorted(STEPS_DIR.rglob("*.py")) if path.parent != STEPS_DIR]
    assert libraries, "no libraries found under steps/"
    assert [module_name(path) for path in libraries if PROGRAMS_HELPER in imported_modules(path)] == []


def test_the_import_scan_sees_imports_inside_functions(tmp_path: Path) -> None:
    source = tmp_path / "lazy.py"
    source.write_text("def f():\n    from moeloop.steps import reward\n    import moeloop.steps.train\n")
    assert {"moeloop.steps.reward", "moeloop.steps.train"} <= imported_modules(source) & PROGRAMS


@pytest.mark.parametrize("folder", ["steps", "workflows"])
def test_no_product_file_is_over_450_lines(folder: str) -> None:
    files = [p for p in (REPO / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    lengths = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in files}
    assert lengths, f"no files found under {folder}/"
    assert {name: n for name, n in lengths.items() if n > MAX_LINES} == {}
