"""The render and lint of a long run as a user runs them: `moeloop render configs/tiny.yaml --iterations N -o DIR`,
then `moeloop lint DIR`, each in a fresh process (imports included).

    .venv/bin/python -m benchmarks.render_lint [--iterations 10000] [--repeats 3] [--smoke]

Prints each command's CPU seconds (its own process's, from wait4: other jobs on a shared machine add less to
them than to wall time, though a loaded machine still adds some) and wall seconds, the best of `repeats`.
Target: render and lint of 10,000 iterations in under 2 CPU seconds together.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import smoke

REPO = Path(__file__).resolve().parents[1]
TARGET_CPU_SECONDS = 2.0


def cli_seconds(*args: str, log: Path) -> tuple[int, float, float]:
    """`python -m moeloop.workflows.cli ARGS` from the repo root, its output to log: its exit code, CPU and wall seconds."""
    environment = {key: value for key, value in os.environ.items() if not key.startswith("ARGO_")}
    started = time.perf_counter()
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "moeloop.workflows.cli", *args], cwd=REPO, env={**environment, "PYTHONPATH": str(REPO)},
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        _, status, usage = os.wait4(process.pid, 0)
    return os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime, time.perf_counter() - started


def render_and_lint(iterations: int, folder: Path) -> dict[str, tuple[float, float]]:
    """Both commands once into `folder`; their (CPU, wall) seconds. Raises with the log if either fails."""
    out = folder / "out"
    commands = {
        "render": ("render", "configs/tiny.yaml", "--iterations", str(iterations), "-o", str(out)),
        "lint": ("lint", str(out)),
    }
    seconds = {}
    for name, args in commands.items():
        code, cpu, wall = cli_seconds(*args, log=folder / f"{name}.log")
        if code != 0:
            raise RuntimeError(f"moeloop {name} exited {code}: {(folder / f'{name}.log').read_text()[-2000:]}")
        seconds[name] = (cpu, wall)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    options = smoke.parse_args(parser, iterations=10, repeats=1)
    runs = []
    for _ in range(options.repeats):
        with tempfile.TemporaryDirectory() as folder:
            runs.append(render_and_lint(options.iterations, Path(folder)))
    print(f"render and lint of {options.iterations} iterations, best of {options.repeats}; "
          f"1-minute load {os.getloadavg()[0]:.2f}")  # fmt: skip
    print("| command | CPU s | wall s |\n|---|---|---|")
    for name in ("render", "lint"):
        print(f"| {name} | {min(r[name][0] for r in runs):.2f} | {min(r[name][1] for r in runs):.2f} |")
    total = min(sum(cpu for cpu, _ in r.values()) for r in runs)
    print(f"| both | {total:.2f} | {min(sum(wall for _, wall in r.values()) for r in runs):.2f} |")
    print(f"target: under {TARGET_CPU_SECONDS:.1f} CPU s together: {'met' if total < TARGET_CPU_SECONDS else 'not met'}")


if __name__ == "__main__":
    main()
