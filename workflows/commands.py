"""The `moeloop` commands that need no Argo server: run, render, lint, report, sync, plan, and logs of a local run
(workflows/server_commands.py has the others); `print_data` writes what `-o json|yaml` asks for."""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

from moeloop.steps.config import MoeloopConfig, load_config
from moeloop.steps.errors import MoeloopError
from moeloop.steps.inputs import check_location
from moeloop.workflows.dag import PUBLISH, run_uri


def config_of(args: argparse.Namespace) -> MoeloopConfig:
    """The config the command names, with its --root checked and --iterations applied."""
    if getattr(args, "root", None) is not None:
        try:
            check_location(args.root, "--root", run=True)
        except ValueError as error:
            raise MoeloopError(f"--root: {error}") from None
    config = load_config(args.config)
    if getattr(args, "iterations", None) is not None:
        if args.iterations < 1:
            raise MoeloopError(f"--iterations must be at least 1, not {args.iterations}")
        config = config.model_copy(update={"iterations": args.iterations})
    return config


def print_data(data: Any, output: str, document_start: bool = False) -> None:
    """`-o json` (indented) or `-o yaml` (keys in their order; with document_start, a `---` line first)."""
    if output == "json":
        print(json.dumps(data, indent=2), flush=True)
        return
    import yaml

    print(yaml.safe_dump(data, sort_keys=False, explicit_start=document_start), end="", flush=True)


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def command_run(args: argparse.Namespace) -> None:
    from moeloop.workflows.local.logs import log_folder
    from moeloop.workflows.local.progress import hms
    from moeloop.workflows.local.runner import run_local

    # A stop (kill, the end of a CI job) unwinds like Ctrl-C: the steps are stopped and the run's lease freed.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    config = config_of(args)
    uri = run_uri(config, args.root)
    log_dir = log_folder(uri)
    print(f"run {uri}: {plural(config.iterations, 'iteration')}, step logs in {log_dir}/", file=sys.stderr)
    started = time.monotonic()
    try:
        executed = run_local(config, uri, log_dir, progress=not args.no_progress)
    except KeyboardInterrupt:
        again = shlex.join(["moeloop", *sys.argv[1:]])
        raise KeyboardInterrupt(f"interrupted; `{again}` resumes the run after its last published iteration") from None
    published = sorted(task.iteration for task in executed if task.step == PUBLISH.name)
    if published:
        done = "iteration " if len(published) == 1 else f"iterations {published[0]}-"
        print(f"done: {done}{published[-1]} in {hms(time.monotonic() - started)}; metrics in {uri}/metrics/",
              file=sys.stderr)
    else:
        reached = max(task.iteration for task in executed)
        print(f"done: nothing to run, the run had reached iteration {reached} already; metrics in {uri}/metrics/",
              file=sys.stderr)


def command_render(args: argparse.Namespace) -> None:
    from moeloop.workflows.render.files import write_rendered
    from moeloop.workflows.render.loop import build

    config = config_of(args)
    for path in write_rendered(build(config, run_uri(config, args.root)), args.output):
        print(path)


def command_images(args: argparse.Namespace) -> None:
    """The images the render names, as `docker build` commands to run from the repository root (images/README.md)."""
    from moeloop.workflows.render.images import build_commands

    for command in build_commands(config_of(args)):
        print(command)


def command_lint(args: argparse.Namespace) -> None:
    """Lint files and folders; `-` reads the documents from standard input (e.g. `moeloop render ... | moeloop lint -`
    or `kubectl get wf x -o yaml | moeloop lint -`)."""
    from moeloop.workflows.lint.documents import STDIN, lint_paths

    if args.paths.count(STDIN) > 1:
        raise MoeloopError("lint reads standard input once: give `-` at most once")
    errors = lint_paths(args.paths)
    for error in errors:
        print(error)
    if errors:
        raise MoeloopError(f"{len(errors)} lint error(s)")
    print(f"ok: {', '.join(args.paths)}")


def command_report(args: argparse.Namespace) -> None:
    from moeloop.workflows.report import print_report, run_metrics

    if args.output == "table":
        print_report(args.run, args.plot)
        return
    all_metrics = run_metrics(args.run, args.plot)
    print_data(all_metrics, args.output)
    if all_metrics and args.plot is not None:
        from moeloop.steps.observe.plots import write_plots

        for path in write_plots(all_metrics, args.plot):
            print(path, file=sys.stderr)  # stdout holds the data


def command_sync(args: argparse.Namespace) -> None:
    from moeloop.steps.observe.trackers import sync_tensorboard

    copied = sync_tensorboard(args.run, args.output)
    print(f"{len(copied)} new event file(s) in {args.output}; view with: tensorboard --logdir {args.output}")


def command_plan(args: argparse.Namespace) -> None:
    from moeloop.workflows.capacity.explain import plan_json, plan_table
    from moeloop.workflows.capacity.inputs import plan_inputs
    from moeloop.workflows.capacity.options import make_plan

    for flag, value in (("--budget", args.budget), ("--deadline", args.deadline)):
        if value is not None and value <= 0:
            raise MoeloopError(f"{flag} must be positive, not {value:g}")
    setup, own, measured_period = plan_inputs(args.source, args.target, tuple(args.also))
    plan = make_plan(setup, args.budget, args.deadline, own, measured_period)
    if args.output == "table":
        print(plan_table(plan))
    else:
        print_data(plan_json(plan), args.output)


def command_logs(args: argparse.Namespace) -> None:
    """A local run's step logs (RUN is its folder or URI), or a Workflow's pods' logs through the Argo server (RUN
    is the Workflow's name: a Kubernetes name, never a path or a URI)."""
    from moeloop.workflows.local.logs import step_logs

    if "/" not in args.run and not Path(args.run).is_dir():
        from moeloop.workflows.server_commands import server_logs

        server_logs(args)
        return
    logs = step_logs(args.run, args.task)
    for log in logs:
        text = log.read_text(errors="replace")
        if len(logs) == 1:
            print(text, end="")
        else:
            print("".join(f"{log.stem}: {line}\n" for line in text.splitlines()), end="")
