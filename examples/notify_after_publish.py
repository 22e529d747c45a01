"""Extend moeloop's loop as a Hera user would: take its Argo objects as Hera objects, add a task of your own after
each publish (here a notification of the published iteration), and submit them with Hera's WorkflowsService.

    python examples/notify_after_publish.py configs/my-run.yaml --root s3://acme-rl/runs \\
        --host https://argo.example.com --namespace moeloop --token "$ARGO_TOKEN" --webhook https://hooks.example.com/moeloop

The objects are built with room for the added task (a chunk holds at most 200 tasks, so one more task an iteration
can mean fewer iterations a chunk) and linted before anything is sent. The WorkflowTemplate is created, or replaced
if it exists, and a Workflow is started from it. Every later chunk of the run is created from the same template, so
each notifies too.
"""

from __future__ import annotations

import argparse
import sys

from hera.workflows import Container, Parameter, Task, WorkflowsService
from hera.workflows import models as m

from moeloop import workflows
from moeloop.steps.config import load_config
from moeloop.steps.errors import MoeloopError, run_cli
from moeloop.workflows.dag import run_uri
from moeloop.workflows.lint import lint_documents


def with_notifications(loop: workflows.Loop, webhook: str) -> workflows.Loop:
    """A `notify` task after every publish task of the chunk, for that task's iteration."""
    cpu_step = next(t for t in loop.template.templates if t.name == "plan")  # a CPU step: its nodes and account
    notify = Container(
        name="notify",
        image="curlimages/curl:8.11.1",
        command=["curl", "-fsS", "--data", "moeloop published iteration {{inputs.parameters.iteration}}", webhook],
        inputs=[Parameter(name="iteration")],
        node_selector=cpu_step.node_selector,
        tolerations=cpu_step.tolerations,
        service_account_name=cpu_step.service_account_name,
        pod_security_context=cpu_step.pod_security_context,
        security_context=m.SecurityContext(allow_privilege_escalation=False, capabilities=m.Capabilities(drop=["ALL"])),
    )
    loop.template.templates.append(notify)
    publishes = [task for task in loop.chunk.tasks if task.template == "publish"]
    for publish in publishes:
        loop.chunk.tasks.append(
            Task(
                name=publish.name.replace("-publish", "-notify"),
                template=notify,
                arguments=publish.arguments,  # the iteration, as the chunk computes it
                dependencies=[publish.name],
                when=publish.when,  # a slot the chunk skips notifies nothing
            )
        )
    return loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="the run's moeloop config")
    parser.add_argument("--host", required=True, help="the Argo server's URL")
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--token", help="a bearer token for the Argo server")
    parser.add_argument("--root", help="the storage root, e.g. s3://bucket/runs (default: the config's storage_root)")
    parser.add_argument("--webhook", default="https://hooks.example.com/moeloop", help="where to post notifications")
    args = parser.parse_args()

    config = load_config(args.config)
    # One notify task per iteration: the chunk leaves room for it.
    loop = workflows.build(config, run_uri(config, args.root), own_tasks_per_iteration=1)
    loop = with_notifications(loop, args.webhook)
    errors = lint_documents([loop.template.to_dict(), loop.workflow.to_dict()])
    if errors:  # what the server would refuse, or accept and fail later: nothing is sent
        print("\n".join(str(error) for error in errors), file=sys.stderr)
        raise MoeloopError(f"{len(errors)} lint error(s): nothing sent")
    service = WorkflowsService(host=args.host, token=args.token, namespace=args.namespace)
    for hera_object in (loop.template, loop.workflow):
        hera_object.namespace = args.namespace
        hera_object.workflows_service = service
    loop.template.update()  # creates it, or replaces the one of that name
    print(loop.workflow.create().metadata.name)


if __name__ == "__main__":
    run_cli(main)
