"""The `moeloop` command: run the loop locally, render it for Argo, lint manifests, and drive an Argo server."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from moeloop.steps.config import MoeloopConfig, load_config
from moeloop.steps.errors import ArgumentParser, MoeloopError, run_cli
from moeloop.steps.inputs import check_location
from moeloop.workflows.dag import run_uri

if TYPE_CHECKING:
    from hera.workflows import Workflow

    from moeloop.workflows.argo import ArgoServer, ArgoSession
    from moeloop.workflows.render.loop import Loop

EXIT_WORKFLOW_FAILED = 1  # status: the server answered, and the workflow failed (2 stays "could not ask")


def _config(args: argparse.Namespace) -> MoeloopConfig:
    if getattr(args, "root", None) is not None:
        try:
            check_location(args.root, "--root")
        except ValueError as error:
            raise MoeloopError(f"--root: {error}") from None
    config = load_config(args.config)
    if getattr(args, "iterations", None) is not None:
        if args.iterations < 1:
            raise MoeloopError(f"--iterations must be at least 1, not {args.iterations}")
        config = config.model_copy(update={"iterations": args.iterations})
    return config


def command_run(args: argparse.Namespace) -> None:
    from moeloop.workflows.local.runner import run_local

    # A stop (kill, the end of a CI job) unwinds like Ctrl-C: the steps are stopped and the run's lease freed.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    config = _config(args)
    uri = run_uri(config, args.root)
    log_dir = Path(".moeloop") / "logs" / config.run_name
    print(f"run {uri}: {config.iterations} iterations, step logs in {log_dir}/", file=sys.stderr)
    executed = run_local(config, uri, log_dir, progress=not args.no_progress)
    print(f"done: {len(executed)} steps ran; metrics in {uri}/metrics/", file=sys.stderr)


def command_render(args: argparse.Namespace) -> None:
    from moeloop.workflows.render.files import write_rendered
    from moeloop.workflows.render.loop import build

    config = _config(args)
    for path in write_rendered(build(config, run_uri(config, args.root)), args.output):
        print(path)


def command_lint(args: argparse.Namespace) -> None:
    from moeloop.workflows.lint.documents import lint_paths

    errors = lint_paths(args.paths)
    for error in errors:
        print(error)
    if errors:
        raise MoeloopError(f"{len(errors)} lint error(s)")
    print(f"ok: {', '.join(str(p) for p in args.paths)}")


def _server(args: argparse.Namespace) -> ArgoServer:
    from moeloop.workflows.argo import argo_server

    return argo_server(args.host, args.namespace, args.token, args.insecure)


def _build_and_send(
    args: argparse.Namespace, pick: Callable[[Loop], Workflow], send: Callable[[ArgoSession, Workflow], str]
) -> tuple[Workflow, str]:
    """Build the config's loop, lint the object `pick` takes from it, and send that object; returns it and what
    `send` returned. Only an object that lints clean goes to the server, as only one does to disk (render)."""
    from moeloop.workflows.argo import ArgoSession
    from moeloop.workflows.lint.documents import lint_document
    from moeloop.workflows.render.loop import build

    config = _config(args)
    hera_object = pick(build(config, run_uri(config, args.root)))
    errors = lint_document(hera_object.to_dict())
    if errors:
        raise MoeloopError(f"refusing to send an invalid manifest: {errors[0]}")
    with ArgoSession(_server(args)) as argo:
        return hera_object, send(argo, hera_object)


def command_submit(args: argparse.Namespace) -> None:
    from moeloop.workflows.argo import ArgoSession

    _, name = _build_and_send(args, lambda loop: loop.workflow, ArgoSession.submit)
    print(name)


def command_register(args: argparse.Namespace) -> None:
    from moeloop.workflows.argo import ArgoSession

    template, outcome = _build_and_send(args, lambda loop: loop.template, ArgoSession.register)
    print(template.name, outcome)


def command_schedule(args: argparse.Namespace) -> None:
    from moeloop.workflows.argo import ArgoSession

    cron_workflow, outcome = _build_and_send(args, lambda loop: loop.cron_workflow, ArgoSession.schedule)
    print(cron_workflow.name, outcome)


def command_status(args: argparse.Namespace) -> None:
    from moeloop.workflows.argo import RUN_LABEL, ArgoSession, check_object_name, has_failed, run_table, status_lines

    if (args.name is None) == (args.run is None):
        raise MoeloopError("give either a workflow NAME or --run RUN_NAME")
    check_object_name(args.name or args.run, "workflow" if args.name is not None else "--run")
    server = _server(args)
    with ArgoSession(server) as argo:
        if args.name is not None:
            workflows = [argo.workflow(args.name)]
            lines = status_lines(workflows[0])
        else:
            workflows = argo.run_workflows(args.run)
            if not workflows:
                raise MoeloopError(
                    f"Argo server {server.host} has no Workflows labelled {RUN_LABEL}={args.run} in {server.namespace}"
                )
            lines = run_table(workflows)
    print("\n".join(lines))
    # The run's state is its newest workflow's: a failed chunk that was resubmitted no longer counts.
    if has_failed(workflows[-1]):
        sys.exit(EXIT_WORKFLOW_FAILED)


def command_resubmit(args: argparse.Namespace) -> None:
    from moeloop.workflows.argo import ArgoSession, check_object_name

    check_object_name(args.name, "workflow")
    with ArgoSession(_server(args)) as argo:
        print(argo.resubmit(args.name, memoized=args.memoized))


def command_report(args: argparse.Namespace) -> None:
    from moeloop.workflows.report import print_report

    print_report(args.run, args.plot)


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
    print(json.dumps(plan_json(plan), indent=2) if args.format == "json" else plan_table(plan))


def parser() -> argparse.ArgumentParser:
    root = ArgumentParser(prog="moeloop", description=__doc__)
    commands = root.add_subparsers(dest="command", required=True)

    def with_config(name: str, help_text: str) -> argparse.ArgumentParser:
        command = commands.add_parser(name, help=help_text)
        command.add_argument("config", type=Path, help="the run's YAML config")
        command.add_argument("--root", help="storage root URI (default: the config's storage_root)")
        command.add_argument("--iterations", type=int, help="number of RL iterations (default: the config's)")
        return command

    run = with_config("run", "run the loop on this machine (the embedded default)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.set_defaults(handler=command_run)

    render = with_config("render", "write the WorkflowTemplate, Workflow and CronWorkflow as YAML")
    render.add_argument("-o", "--output", type=Path, required=True, help="folder to write into")
    render.set_defaults(handler=command_render)

    lint = commands.add_parser("lint", help="validate Argo manifests offline")
    lint.add_argument("paths", nargs="+", type=Path)
    lint.set_defaults(handler=command_lint)

    def with_server(command: argparse.ArgumentParser) -> argparse.ArgumentParser:
        command.add_argument(
            "--host", help="Argo server URL, e.g. https://argo.example.com (default: $ARGO_SERVER, as the argo CLI)"
        )
        command.add_argument("--namespace", help="Kubernetes namespace (default: $ARGO_NAMESPACE)")
        command.add_argument("--token", help="bearer token (default: $ARGO_TOKEN)")
        command.add_argument(
            "--insecure",
            action="store_true",
            help="do not verify the server's TLS certificate (default: $ARGO_INSECURE_SKIP_VERIFY)",
        )
        return command

    submit = with_server(with_config("submit", "create the loop's Workflow on an Argo server; prints its name"))
    submit.set_defaults(handler=command_submit)

    register = with_server(with_config("register", "create or update the loop's WorkflowTemplate"))
    register.set_defaults(handler=command_register)

    schedule = with_server(with_config("schedule", "create or update the loop's CronWorkflow"))
    schedule.set_defaults(handler=command_schedule)

    status = with_server(
        commands.add_parser(
            "status",
            help="phase, progress and failed steps of a workflow, or the workflows of a run",
            description="Exit status: 0, 1 when the workflow (with --run: the run's newest) Failed or Errored, "
            "2 when the server could not be asked.",
        )
    )
    status.add_argument("name", nargs="?", help="the workflow's name")
    status.add_argument(
        "--run", metavar="RUN_NAME", help="list the workflows labelled moeloop.dev/run=RUN_NAME instead"
    )
    status.set_defaults(handler=command_status)

    resubmit = with_server(commands.add_parser("resubmit", help="Argo's resubmit of a workflow; prints the new name"))
    resubmit.add_argument("name", help="the workflow's name")
    resubmit.add_argument("--memoized", action="store_true", help="reuse the steps that succeeded (failed workflows)")
    resubmit.set_defaults(handler=command_resubmit)

    report = commands.add_parser("report", help="print each iteration's staleness, step times and waits")
    report.add_argument("run", help="the run's URI: its folder, or s3://bucket/prefix/<run_name>")
    report.add_argument("--plot", type=Path, metavar="DIR", help="also draw the run's curves as PNGs into DIR")
    report.set_defaults(handler=command_report)

    sync = commands.add_parser("sync", help="copy a run's TensorBoard event files (e.g. from S3) into a local folder")
    sync.add_argument("run", help="the run's URI: its folder, or s3://bucket/prefix/<run_name>")
    sync.add_argument("output", type=Path, help="local folder for `tensorboard --logdir`")
    sync.set_defaults(handler=command_sync)

    plan = commands.add_parser(
        "plan",
        help="rollout and train pool sizes, staleness and cost per iteration, from a run's measured rates",
        description="Options for the loop's pools, each played out on its DAG; see workflows/capacity/README.md.",
    )
    plan.add_argument("source", help="a run's URI (its measured rates), or a config YAML (rates stated in --target)")
    plan.add_argument("--target", help="a target YAML: model, GPU, prices, batch, stated rates, options to weigh")
    plan.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="RUN",
        help="another run of the same model on the same machine, its measurements pooled with RUN's (repeatable)",
    )
    plan.add_argument("--budget", type=float, help="dollars for the run's iterations: the fastest option within it")
    plan.add_argument("--deadline", type=float, help="hours for the run's iterations: the cheapest option within it")
    plan.add_argument("--format", choices=["table", "json"], default="table")
    plan.set_defaults(handler=command_plan)
    return root


def main() -> None:
    args = parser().parse_args()
    run_cli(lambda: args.handler(args))


if __name__ == "__main__":
    main()
