"""The `moeloop` command: run the loop locally, render it for Argo, lint manifests, submit to a cluster."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from steps.config import MoeloopConfig, load_config
from steps.errors import MoeloopError, run_cli
from workflows.dag import run_uri


def _config(args: argparse.Namespace) -> MoeloopConfig:
    config = load_config(args.config)
    if getattr(args, "iterations", None) is not None:
        if args.iterations < 1:
            raise MoeloopError(f"--iterations must be at least 1, not {args.iterations}")
        config = config.model_copy(update={"iterations": args.iterations})
    return config


def command_run(args: argparse.Namespace) -> None:
    from workflows.local import run_local

    config = _config(args)
    uri = run_uri(config, args.root)
    log_dir = Path(".moeloop") / "logs" / config.run_name
    print(f"run {uri}: {config.iterations} iterations, step logs in {log_dir}/", file=sys.stderr)
    executed = run_local(config, uri, log_dir, progress=not args.no_progress)
    print(f"done: {len(executed)} steps ran; metrics in {uri}/metrics/", file=sys.stderr)


def command_render(args: argparse.Namespace) -> None:
    from workflows.render import render, write_rendered

    config = _config(args)
    for path in write_rendered(render(config, run_uri(config, args.root)), args.output):
        print(path)


def command_lint(args: argparse.Namespace) -> None:
    from workflows.lint import lint_paths

    errors = lint_paths(args.paths)
    for error in errors:
        print(error)
    if errors:
        raise MoeloopError(f"{len(errors)} lint error(s)")
    print(f"ok: {', '.join(str(p) for p in args.paths)}")


def command_submit(args: argparse.Namespace) -> None:
    from workflows.submit import submit_workflow

    config = _config(args)
    token = args.token or os.environ.get("ARGO_TOKEN")
    name = submit_workflow(
        config, run_uri(config, args.root), args.host, args.namespace, token, verify_ssl=not args.insecure
    )
    print(name)


def command_report(args: argparse.Namespace) -> None:
    from workflows.report import print_report

    print_report(args.run)


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="moeloop", description=__doc__)
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

    render = with_config("render", "write the Argo Workflow and WorkflowTemplate as YAML")
    render.add_argument("-o", "--output", type=Path, required=True, help="folder to write into")
    render.set_defaults(handler=command_render)

    lint = commands.add_parser("lint", help="validate Argo manifests offline")
    lint.add_argument("paths", nargs="+", type=Path)
    lint.set_defaults(handler=command_lint)

    submit = with_config("submit", "submit the loop to an Argo server")
    submit.add_argument("--host", required=True, help="Argo server URL, e.g. https://argo.example.com")
    submit.add_argument("--namespace", required=True)
    submit.add_argument("--token", help="bearer token (default: $ARGO_TOKEN)")
    submit.add_argument("--insecure", action="store_true", help="do not verify the server's TLS certificate")
    submit.set_defaults(handler=command_submit)
    report = commands.add_parser("report", help="print each iteration's staleness, step times and waits")
    report.add_argument("run", help="the run's URI: its folder, or s3://bucket/prefix/<run_name>")
    report.set_defaults(handler=command_report)
    return root


def main() -> None:
    args = parser().parse_args()
    run_cli(lambda: args.handler(args))


if __name__ == "__main__":
    main()
