"""A long-lived step process for the local runner: it runs step commands one after another, in-process.

A rollout shard's engine then stays loaded between iterations and only its weights are swapped
(`steps.engines.engine.engine_for`), as a long-lived rollout pod would do. The commands are exactly the pods'
commands (`python -m steps.<name> ...`); each request is one JSON line on stdin,
{"argv": [...], "log": PATH}, and each reply one JSON line on stdout, {"returncode": N}. While a command
runs, its output goes to its log file.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback

from steps.errors import run_cli


def run_command(argv: list[str]) -> int:
    """Run `python -m steps.<name> ARGS...` in this process; returns what its exit code would be."""
    if argv[1:2] != ["-m"] or not argv[2].startswith("steps."):
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


def main() -> None:
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    for line in sys.stdin:
        request = json.loads(line)
        with open(request["log"], "ab") as log:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(log.fileno(), sys.stdout.fileno())
            os.dup2(log.fileno(), sys.stderr.fileno())
            returncode = run_command(request["argv"])
            sys.stdout.flush()
            sys.stderr.flush()
        replies.write(json.dumps({"returncode": returncode}) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
