"""A reward worker process (`python -m moeloop.steps.rewards.worker FD PARENT_PID`), started by the pool of
steps/rewards/pool.py: it imports the reward functions once, then calls them on sample after sample.

Over the connection on file descriptor FD it receives {"sys_path", "functions": [(path, args), ...]} and answers
("ready", None) or ("failed", why); then for each task (task_id, record, response, [function index, ...]) it sends,
function by function, (task_id, index, ("value", float) or ("failed", why)). Whatever a function does short of ending
the process (raise, sys.exit, return no finite number) is one such answer; the pool tells a process that ended, or
hangs past its time limit, from the outside.
"""

from __future__ import annotations

import ctypes
import math
import numbers
import os
import signal
import sys
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

from moeloop.steps.errors import MoeloopError
from moeloop.steps.rewards.functions import RewardFunction, import_reward_function

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def end_with(parent: int) -> None:
    """Have the kernel kill this process when the step that started it ends, however it ends (a step killed by
    SIGKILL leaves no one to close its pool, and a hung function would run on)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it ended before the line above
        os._exit(1)


def load(path: str, args: dict[str, Any]) -> tuple[RewardFunction | None, str | None]:
    """(the function with its args bound, None), or (None, why it cannot be used)."""
    try:
        return partial(import_reward_function(path, args), **args), None
    except MoeloopError as error:
        return None, str(error)
    except SystemExit as exit_:
        return None, f"reward function {path!r} does not import: it called sys.exit({exit_.code!r})"
    except BaseException as error:  # noqa: BLE001 - a KeyboardInterrupt or other BaseException raised as it loads
        return None, f"reward function {path!r} does not import: {type(error).__name__}: {error}"


def call(function: RewardFunction, record: dict, response: str) -> tuple[str, Any]:
    try:
        value = function(record, response)
    except SystemExit as exit_:  # a clean exit is a failure too: the function gave no reward
        return "failed", f"called sys.exit({exit_.code!r})"
    except BaseException as error:  # noqa: BLE001 - the user's function: its failure, one line, named by the pool
        return "failed", f"raised {type(error).__name__}: {error}"
    if not isinstance(value, numbers.Real) or not math.isfinite(value):  # a bool counts as 0 or 1
        return "failed", f"returned {value!r} ({type(value).__name__}): a reward must be a finite number"
    return "value", float(value)


def main() -> None:
    channel = Connection(int(sys.argv[1]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the step's: it ends its workers
    end_with(int(sys.argv[2]))
    setup = channel.recv()
    sys.path[:] = setup["sys_path"]  # the step's: its reward modules import here as they would there
    functions = []
    for path, args in setup["functions"]:
        function, problem = load(path, args)
        if function is None:
            channel.send(("failed", problem))
            return
        functions.append(function)
    channel.send(("ready", None))
    while True:
        try:
            task_id, record, response, indices = channel.recv()
        except EOFError:  # the pool closed: done
            return
        for index in indices:
            channel.send((task_id, index, call(functions[index], record, response)))


if __name__ == "__main__":
    main()
