"""The `moeloop` command: run the loop locally, render it for Argo, lint manifests, print the image builds, and drive an
Argo server."""

from __future__ import annotations

import argparse
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from moeloop.steps.errors import ArgumentParser, run_cli
from moeloop.workflows import commands, server_commands

FORMATS = ("table", "json", "yaml")


def installed_version() -> str:
    """The installed distribution's version; a source tree put on PYTHONPATH (a pod or GPU machine running from a
    checkout) has none, and every command must still run there."""
    try:
        return version("moeloop")
    except PackageNotFoundError:
        return "(not installed: run from a source tree)"


def parser() -> argparse.ArgumentParser:
    root = ArgumentParser(prog="moeloop", description=__doc__)
    root.add_argument("--version", action="version", version=f"moeloop {installed_version()}")
    subcommands = root.add_subparsers(dest="command", required=True)

    def with_config(name: str, help_text: str) -> argparse.ArgumentParser:
        command = subcommands.add_parser(name, help=help_text)
        command.add_argument("config", type=Path, help="the run's YAML config")
        command.add_argument("--root", help="storage root URI (default: the config's storage_root)")
        command.add_argument("--iterations", type=int, help="number of RL iterations (default: the config's)")
        return command

    def with_output(command: argparse.ArgumentParser, what: str) -> argparse.ArgumentParser:
        command.add_argument("-o", "--output", choices=FORMATS, default="table", help=f"{what} as a table or as data")
        return command

    run = with_config("run", "run the loop on this machine (the embedded default)")
    run.add_argument("--no-progress", action="store_true", help="no progress display (the metrics lines stay)")
    run.set_defaults(handler=commands.command_run)

    render = with_config("render", "write the WorkflowTemplate, Workflow and CronWorkflow as YAML")
    render.add_argument("-o", "--output", type=Path, required=True, help="folder to write into")
    render.set_defaults(handler=commands.command_render)

    lint = subcommands.add_parser("lint", help="validate Argo manifests offline")
    lint.add_argument("paths", nargs="+", metavar="PATH", help="a YAML file, a folder of them, or - (standard input)")
    lint.set_defaults(handler=commands.command_lint)

    images = subcommands.add_parser(
        "images", help="print the docker build commands of the config's images, rollout.environment's package in them"
    )
    images.add_argument("config", type=Path, help="the run's YAML config")
    images.set_defaults(handler=commands.command_images)

    def with_server(command: argparse.ArgumentParser) -> argparse.ArgumentParser:
        command.add_argument(
            "--host", help="Argo server URL, e.g. https://argo.example.com (default: $ARGO_SERVER, as the argo CLI)"
        )
        command.add_argument("-n", "--namespace", help="Kubernetes namespace (default: $ARGO_NAMESPACE)")
        command.add_argument("--token", help="bearer token (default: $ARGO_TOKEN)")
        command.add_argument(
            "--insecure",
            action="store_true",
            help="do not verify the server's TLS certificate (default: $ARGO_INSECURE_SKIP_VERIFY)",
        )
        return command

    def with_workflow(command: argparse.ArgumentParser) -> argparse.ArgumentParser:
        command.add_argument("name", nargs="?", help="the workflow's name")
        command.add_argument(
            "--run", metavar="RUN_NAME", help="the workflows labelled moeloop.dev/run=RUN_NAME instead"
        )
        return with_server(command)

    submit = with_server(with_config("submit", "create the loop's Workflow on an Argo server; prints its name"))
    submit.set_defaults(handler=server_commands.command_submit)

    register = with_server(with_config("register", "create or update the loop's WorkflowTemplate"))
    register.set_defaults(handler=server_commands.command_register)

    schedule = with_server(with_config("schedule", "create or update the loop's CronWorkflow"))
    schedule.set_defaults(handler=server_commands.command_schedule)

    status = with_workflow(
        subcommands.add_parser(
            "status",
            help="phase, progress and failed steps of a workflow, or the workflows of a run",
            description="Exit status: 0, 1 when the workflow (with --run: the run's newest) Failed or Errored, "
            "2 when the server could not be asked.",
        )
    )
    with_output(status, "the status")
    status.add_argument("-w", "--watch", action="store_true", help="print again on each change, until it finishes")
    status.add_argument("--interval", type=float, default=10.0, help="seconds between --watch's requests (10)")
    status.set_defaults(handler=server_commands.command_status)

    resubmit = with_server(
        subcommands.add_parser("resubmit", help="Argo's resubmit of a workflow; prints the new name")
    )
    resubmit.add_argument("name", help="the workflow's name")
    resubmit.add_argument("--memoized", action="store_true", help="reuse the steps that succeeded (failed workflows)")
    resubmit.set_defaults(handler=server_commands.command_resubmit)

    stop = with_workflow(
        subcommands.add_parser(
            "stop",
            help="stop a workflow, or every running workflow of a run (Argo's stop: exit handlers still run)",
        )
    )
    stop.add_argument("--terminate", action="store_true", help="Argo's terminate instead: no exit handler runs")
    stop.set_defaults(handler=server_commands.command_stop)

    logs = with_server(
        subcommands.add_parser(
            "logs",
            help="a step's log: of a local run, or of a Workflow's pods through the Argo server",
            description="RUN is a local run's folder or URI (the logs `moeloop run` wrote), or a Workflow's name "
            "(its pods' logs through the Argo server's log API; --host etc. as for status).",
        )
    )
    logs.add_argument("run", metavar="RUN", help="the run's folder or URI, or the Workflow's name")
    logs.add_argument(
        "task",
        nargs="?",
        help="the DAG task, e.g. it3-train, slot3-train, slot3-rollout (its shards) or slot3-rollout-2 (shard 2, the"
        " node slot3-rollout(2:2)) (default: every task)",
    )
    logs.set_defaults(handler=commands.command_logs)

    report = with_output(
        subcommands.add_parser("report", help="print each iteration's staleness, step times and waits"), "the metrics"
    )
    report.add_argument("run", help="the run's URI: its folder, or s3://bucket/prefix/<run_name>")
    report.add_argument("--plot", type=Path, metavar="DIR", help="also draw the run's curves as PNGs into DIR")
    report.set_defaults(handler=commands.command_report)

    sync = subcommands.add_parser(
        "sync", help="copy a run's TensorBoard event files (e.g. from S3) into a local folder"
    )
    sync.add_argument("run", help="the run's URI: its folder, or s3://bucket/prefix/<run_name>")
    sync.add_argument("output", type=Path, help="local folder for `tensorboard --logdir`")
    sync.set_defaults(handler=commands.command_sync)

    plan = subcommands.add_parser(
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
    plan.add_argument(
        "-o", "--output", "--format", choices=FORMATS, default="table", help="a table, or the plan as data"
    )
    plan.set_defaults(handler=commands.command_plan)
    return root


def main() -> None:
    args = parser().parse_args()
    run_cli(lambda: args.handler(args))


if __name__ == "__main__":
    main()
