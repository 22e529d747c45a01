"""The `moeloop` commands that talk to an Argo server: submit, register, schedule, status, resubmit, stop, and logs
of a Workflow's pods. Each is one session with the server (workflows/argo.py), its errors one line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from moeloop.steps.errors import MoeloopError
from moeloop.workflows.commands import config_of, print_data
from moeloop.workflows.dag import run_uri

if TYPE_CHECKING:
    from hera.workflows import Workflow
    from hera.workflows import models as m

    from moeloop.workflows.argo import ArgoServer, ArgoSession
    from moeloop.workflows.render.loop import Loop

EXIT_WORKFLOW_FAILED = 1  # status: the server answered, and the workflow failed (2 stays "could not ask")


def server(args: argparse.Namespace) -> ArgoServer:
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

    config = config_of(args)
    hera_object = pick(build(config, run_uri(config, args.root)))
    errors = lint_document(hera_object.to_dict())
    if errors:
        raise MoeloopError(f"refusing to send an invalid manifest: {errors[0]}")
    with ArgoSession(server(args)) as argo:
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


def _named_workflows(argo: ArgoSession, args: argparse.Namespace) -> list[m.Workflow]:
    """The workflow NAME (with its nodes), or the run's workflows (--run, oldest first, without them)."""
    from moeloop.workflows.argo import RUN_LABEL

    if args.name is not None:
        return [argo.workflow(args.name)]
    workflows = argo.run_workflows(args.run)
    if not workflows:
        server = argo.server
        labelled = f"{RUN_LABEL}={args.run}"
        raise MoeloopError(f"Argo server {server.host} has no Workflows labelled {labelled} in {server.namespace}")
    return workflows


def _check_name_or_run(args: argparse.Namespace) -> None:
    from moeloop.workflows.argo import check_object_name

    if (args.name is None) == (args.run is None):
        raise MoeloopError("give either a workflow NAME or --run RUN_NAME")
    check_object_name(args.name or args.run, "workflow" if args.name is not None else "--run")


def command_status(args: argparse.Namespace) -> None:
    from moeloop.workflows.argo import ArgoSession
    from moeloop.workflows.argo_status import has_failed, has_finished, run_table, status_lines, workflow_summary

    _check_name_or_run(args)
    if args.interval <= 0:
        raise MoeloopError(f"--interval must be positive, not {args.interval:g}")
    shown: Any = None
    with ArgoSession(server(args)) as argo:
        while True:
            workflows = _named_workflows(argo, args)
            summaries = [workflow_summary(w, with_steps=args.name is not None) for w in workflows]
            data = summaries[0] if args.name is not None else summaries
            if data != shown:
                if args.output == "table":
                    lines = status_lines(data) if args.name is not None else run_table(summaries)
                    print(("\n" if shown is not None else "") + "\n".join(lines), flush=True)
                elif args.watch and args.output == "json":  # JSON Lines: a document each time the status changes
                    print(json.dumps(data), flush=True)
                else:  # YAML under --watch: a stream of documents
                    print_data(data, args.output, document_start=args.watch)
                shown = data
            # The run's state is its newest workflow's: a failed chunk that was resubmitted no longer counts.
            if not args.watch or has_finished(workflows[-1]):
                break
            time.sleep(args.interval)
    if has_failed(workflows[-1]):
        sys.exit(EXIT_WORKFLOW_FAILED)


def command_resubmit(args: argparse.Namespace) -> None:
    from moeloop.workflows.argo import ArgoSession, check_object_name

    check_object_name(args.name, "workflow")
    with ArgoSession(server(args)) as argo:
        print(argo.resubmit(args.name, memoized=args.memoized))


def command_stop(args: argparse.Namespace) -> None:
    """Stop the workflow NAME, or every unfinished workflow of the run (--run)."""
    from moeloop.workflows.argo import ArgoSession
    from moeloop.workflows.argo_status import has_finished

    _check_name_or_run(args)
    with ArgoSession(server(args)) as argo:
        workflows = _named_workflows(argo, args)
        running = [w for w in workflows if not has_finished(w)]
        if not running:
            names = ", ".join(w.metadata.name for w in workflows)
            raise MoeloopError(f"nothing to stop: {names} finished already")
        for workflow in running:
            argo.stop(workflow.metadata.name, terminate=args.terminate)
            print(workflow.metadata.name, "terminated" if args.terminate else "stopped")


def server_logs(args: argparse.Namespace) -> None:
    """`moeloop logs WORKFLOW [TASK]`: the main container's log of each pod the task ran (every pod without TASK),
    through the Argo server's log API; lines prefixed by the step when several pods answer."""
    from moeloop.workflows.argo import ArgoSession, check_object_name
    from moeloop.workflows.argo_status import task_pods

    check_object_name(args.run, "workflow")
    with ArgoSession(server(args)) as argo:
        pods = task_pods(argo.workflow(args.run), args.task)
        if not pods:
            raise MoeloopError(f"Workflow {args.run} has run no pod{f' for task {args.task}' if args.task else ''} yet")
        for step, pod in pods:
            lines = argo.pod_log(args.run, pod)
            for line in lines:
                print(f"{step}: {line}" if len(pods) > 1 else line)
            if not lines:  # podGC deletes a pod that succeeded: its log is then only in the artifact repository
                print(f"{step}: pod {pod} gave no log lines (deleted once it succeeded? archiveLogs keeps them)",
                      file=sys.stderr)
