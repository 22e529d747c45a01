"""A long-lived step process for the local runner: it runs step commands one after another, in-process.

A rollout shard's engine then stays loaded between iterations and only its weights are swapped
(`moeloop.steps.engines.engine.engine_for`), as a long-lived rollout pod would do. The runner forks it from its fork
server (`moeloop.workflows.local.workers`) with `serve` as its target. The commands are exactly the pods' commands
(`python -m moeloop.steps.<name> ...`); each request is one message on the worker's connection, {"argv": [...],
"log": PATH, "threads": N or null}, and each reply one message, {"returncode": N}. While a command runs, its output
goes to its log file. A request {"warm": [MODULE, ...], "log": PATH} imports the modules (all but vLLM, for a rollout
on it, are the fork server's already) and has no reply: the runner sends it as it starts the worker, long before the worker's
first command, so a step's imports are done while the steps before it run.
The runner moves the worker onto the command's cores before it sends it; the worker sizes torch's threads to
them (what the command starts inherits that size too).
When a step starting beside it takes some of those cores mid-command, the runner moves the worker onto the rest
and sends it SIGWINCH (ignored by default, so one that comes early harms nothing), and the worker fits torch's
threads to its cores again: two OpenMP threads of one step on one core would spin against each other.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection

from moeloop.steps.errors import run_cli


def run_command(argv: list[str]) -> int:
    """Run `python -m moeloop.steps.<name> ARGS...` in this process; returns what its exit code would be."""
    if argv[1:2] != ["-m"] or not argv[2].startswith("moeloop.steps."):
        print(f"worker: not a step command: {argv}", file=sys.stderr)
        return 2
    module = importlib.import_module(argv[2])
    sys.argv = [argv[2], *argv[3:]]
    try:
        run_cli(module.main)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    except Exception:  # noqa: BLE001 - a step's crash is its exit code 1, as a fresh process's; the worker lives on
        traceback.print_exc()
        return 1
    return 0


refit_pending = False  # a SIGWINCH that came while torch was still being imported


def use_threads(threads: int) -> None:
    """torch's intra-op threads for the next command, and OMP_NUM_THREADS for the processes it starts (a rollout
    engine built by it; one kept from an earlier command keeps the threads it was built with). No more than the
    worker's cores: a step that started meanwhile may have taken some; as many as them if the share changed while
    torch was being imported."""
    global refit_pending
    import torch

    if hasattr(os, "sched_getaffinity"):
        held = len(os.sched_getaffinity(0))
        threads = held if refit_pending else min(threads, held)
    refit_pending = False
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "all"
    print(f"worker: {torch.get_num_threads()} torch threads, cores {cores}", flush=True)


def fit_threads_to_cores(signum: int, frame: object) -> None:
    """SIGWINCH from the runner, which has moved this worker onto fewer cores: as many torch threads as it has
    cores now (run between two bytecodes of the command, never inside one of torch's parallel regions). While
    torch is still being imported (partly initialised), `use_threads` does it once the import is done."""
    global refit_pending
    if not hasattr(os, "sched_getaffinity"):
        return
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "set_num_threads") or not hasattr(torch, "get_num_threads"):
        refit_pending = True
        return
    cores = sorted(os.sched_getaffinity(0))
    torch.set_num_threads(len(cores))
    # os.write to the command's log, not print: the command may be inside a print of its own
    os.write(2, f"worker: {torch.get_num_threads()} torch threads, cores {cores} (share shrunk)\n".encode())


def warm(modules: list[str]) -> None:
    """Import modules ahead of the commands that need them. One that fails to import is left to the command, whose
    own import then fails with its exit code."""
    for module in modules:
        started = time.perf_counter()
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - the command reports it
            traceback.print_exc()
            continue
        print(f"worker {os.getpid()}: imported {module} in {time.perf_counter() - started:.1f} s", flush=True)


@contextmanager
def output_to(log_path: str) -> Iterator[None]:
    """This process's stdout and stderr into log_path (appended) for the duration."""
    with open(log_path, "ab") as log:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(log.fileno(), sys.stdout.fileno())
        os.dup2(log.fileno(), sys.stderr.fileno())
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()


def serve(requests: Connection, environment: dict[str, str]) -> None:
    """The worker: the runner's environment (the fork server's is the runner's as it started), then its requests
    until the runner closes its end."""
    # A session of its own: a Ctrl-C at the terminal reaches the runner alone, which ends its workers
    # (terminate_workers); sent to a worker mid-import, it printed a "Fatal Python error" into the terminal.
    os.setsid()
    os.environ.clear()
    os.environ.update(environment)
    signal.signal(signal.SIGWINCH, fit_threads_to_cores)
    while True:
        try:
            request = requests.recv()
        except EOFError:
            return
        with output_to(request["log"]):
            if "warm" in request:
                warm(request["warm"])
                continue
            print(f"worker {os.getpid()}: {' '.join(request['argv'][1:3])}", flush=True)
            if request.get("threads"):
                use_threads(request["threads"])
            returncode = run_command(request["argv"])
        requests.send({"returncode": returncode})
