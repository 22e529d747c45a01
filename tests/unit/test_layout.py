"""The layout of steps/ (steps/README.md): the programs at the top, the libraries in rooms below them.

No module of steps/ imports a program (a pod CLI of the DAG, or another `python -m steps.<name>` entry point), so
every program can change without its neighbours noticing; no library (a room below the top) imports the programs'
helper either, nor does anything under steps/ import workflows/ (what the pods run needs nothing of what runs
them); and no file under steps/ is over 450 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO
from moeloop.workflows.dag import STEPS

STEPS_DIR = REPO / "steps"
MAX_LINES = 450
# Programs besides the DAG's steps: run by hand (README), never imported.
OTHER_PROGRAMS = ("reward_model", "demo_task")
PROGRAMS = {f"moeloop.steps.{step.name}" for step in STEPS} | {f"moeloop.steps.{name}" for name in OTHER_PROGRAMS}
PROGRAMS_HELPER = "moeloop.steps.common"  # what the pod CLIs share: their arguments, reports, opening an iteration


def module_name(path: Path) -> str:
    return ".".join(("moeloop", *path.relative_to(REPO).with_suffix("").parts))


def imported_modules(path: Path) -> set[str]:
    """Every module path imports, at the top or inside a function: `from moeloop.steps import x` counts as moeloop.steps.x."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_programs_exist_at_the_top() -> None:
    """Every rendered `python -m steps.<name>` and every other program is a module at the top of steps/."""
    for program in PROGRAMS:
        assert (REPO / (program.removeprefix("moeloop.").replace(".", "/") + ".py")).is_file(), program


def test_no_module_of_steps_imports_a_program() -> None:
    offenders = {
        module_name(path): sorted(imported_modules(path) & PROGRAMS)
        for path in sorted(STEPS_DIR.rglob("*.py"))
        if imported_modules(path) & PROGRAMS
    }
    assert offenders == {}


def test_no_library_imports_the_programs_helper() -> None:
    libraries = [path for path in sorted(STEPS_DIR.rglob("*.py")) if path.parent != STEPS_DIR]
    assert libraries, "no libraries found under steps/"
    assert [module_name(path) for path in libraries if PROGRAMS_HELPER in imported_modules(path)] == []


def test_nothing_under_steps_imports_workflows() -> None:
    offenders = {
        module_name(path): sorted(m for m in imported_modules(path) if m.split(".")[:2] == ["moeloop", "workflows"])
        for path in sorted(STEPS_DIR.rglob("*.py"))
    }
    assert {name: modules for name, modules in offenders.items() if modules} == {}


def test_the_import_scan_sees_imports_inside_functions(tmp_path: Path) -> None:
    source = tmp_path / "lazy.py"
    source.write_text("def f():\n    from moeloop.steps import reward\n    import moeloop.steps.train\n")
    assert {"moeloop.steps.reward", "moeloop.steps.train"} <= imported_modules(source) & PROGRAMS


def test_no_file_under_steps_is_over_450_lines() -> None:
    files = [p for p in STEPS_DIR.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    lengths = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in files}
    assert lengths, "no files found under steps/"
    assert {name: n for name, n in lengths.items() if n > MAX_LINES} == {}
