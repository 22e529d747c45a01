"""moeloop's programs as processes, as a user and a pod run them: `moeloop ARGS` (`python -m moeloop.workflows.cli`)
and a step's `python -m moeloop.steps.NAME --run RUN --iteration I ...`. The one place tests build those commands.

A test that starts a step many times to kill it or to run it again as a new pod forks it instead
(`start_forked_step`): from a process that has imported the steps, as the local runner's warmed workers run them,
so that the step's work starts at once rather than after the seconds a fresh interpreter spends importing torch.
So do the ranks of the distributed tests (`spawn_ranks`).

Every process gets this one's environment with one torch thread (as the local runner gives each step on this
machine: more only contend for a test worker's core), the repository on PYTHONPATH (a reward path such as
`tests.faulty_rewards:nan_on_train` imports from any folder), then `env`'s entries (None removes a variable).
It runs in the repository root unless `cwd` says otherwise, and is stopped after `timeout` seconds.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from moeloop.workflows.local import workers
from tests.conftest import REPO

# A hang guard, not a speed limit: a loaded machine may take many times a process's usual time.
TIMEOUT = 1800

Environment = Mapping[str, str | None]


def environment(env: Environment | None = None) -> dict[str, str]:
    python_path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    merged = {**os.environ, "PYTHONPATH": python_path, "OMP_NUM_THREADS": "1"}
    for name, value in (env or {}).items():
        if value is None:
            merged.pop(name, None)
        else:
            merged[name] = value
    return merged


def cli_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "moeloop.workflows.cli", *args]


def step_command(name: str, run: str | Path, iteration: int | str | None, *args: str) -> list[str]:
    """A step's pod command (iteration None for chunk, which has none)."""
    at = [] if iteration is None else ["--iteration", str(iteration)]
    return [sys.executable, "-m", f"moeloop.steps.{name}", "--run", str(run), *at, *args]


def run_command(
    command: list[str],
    cwd: str | Path = REPO,
    env: Environment | None = None,
    timeout: float = TIMEOUT,
    check: bool = False,
) -> subprocess.CompletedProcess[str]:
    """The command to its end, its output captured as text; with check, a failure fails the test showing stderr's
    end."""
    done = subprocess.run(command, cwd=cwd, env=environment(env), capture_output=True, text=True, timeout=timeout)
    if check:
        assert done.returncode == 0, f"{shlex.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done


def moeloop_cli(*args: str, **options) -> subprocess.CompletedProcess[str]:
    """`moeloop ARGS` to its end (options: run_command's)."""
    return run_command(cli_command(*args), **options)


def run_step(
    name: str, run: str | Path, iteration: int | str | None, *args: str, **options
) -> subprocess.CompletedProcess[str]:
    """A step's pod command to its end (options: run_command's)."""
    return run_command(step_command(name, run, iteration, *args), **options)


def start_process(
    command: list[str], cwd: str | Path = REPO, env: Environment | None = None, **popen: object
) -> subprocess.Popen:
    """The command started and left running, for a test that signals or races it (popen: Popen's other options)."""
    return subprocess.Popen(command, cwd=cwd, env=environment(env), **popen)


@functools.cache
def fork_server() -> multiprocessing.context.ForkServerContext:
    """The local runner's fork server (moeloop.workflows.local.workers: the steps imported), started by the test
    process's first call, which returns once the imports are done (a test that times a forked step calls it first,
    to leave them out)."""
    context = workers.fork_server()
    first = context.Process(target=int)  # forked once the server has imported the steps
    first.start()
    first.join()
    return context


def start_forked_step(command: list[str], output: Path, env: Environment | None = None) -> multiprocessing.Process:
    """A step command (step_command's) started in a process forked from the fork server, with this module's
    environment; its stdout and stderr go to the file `output`. Its exitcode is the command's exit code, -9 when
    SIGKILLed."""
    arguments = (command, environment(env), str(output))
    process = fork_server().Process(target=run_forked_step, args=arguments, daemon=True)
    process.start()
    return process


def run_forked_step(command: list[str], env: dict[str, str], output: str) -> None:
    """In the forked process: the command run as the local runner's workers run it, in this process."""
    import torch

    from moeloop.workflows.local.worker import run_command as run_step_command

    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))  # torch read it as the server imported it
    with open(output, "wb") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    sys.exit(run_step_command(command))


def run_forked(command: list[str], output: Path, env: Environment | None = None, timeout: float = TIMEOUT) -> int:
    """start_forked_step's step to its end: its exit code."""
    process = start_forked_step(command, output, env)
    process.join(timeout)
    if process.exitcode is None:
        process.kill()
        raise TimeoutError(f"{shlex.join(command)} still running after {timeout} s")
    return process.exitcode


def spawn_ranks(function: Callable[..., None], args: tuple, processes: int) -> None:
    """torch.multiprocessing.spawn(function, args, nprocs=processes, join=True), its processes forked from the fork
    server rather than each a fresh interpreter (seconds of imports a rank); with this process's environment as it
    is now. A failure in any fails the caller."""
    import torch.multiprocessing

    fork_server()
    torch.multiprocessing.start_processes(
        run_rank, args=(dict(os.environ), function, args), nprocs=processes, join=True, start_method="forkserver"
    )


def run_rank(rank: int, env: dict[str, str], function: Callable[..., None], args: tuple) -> None:
    os.environ.clear()
    os.environ.update(env)
    function(rank, *args)
