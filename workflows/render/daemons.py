"""The long-lived processes of `lifetime: chunk` on Argo: JobSets the chunk owns, which each iteration's steps ask
for their work through the run's storage (`moeloop.steps.storage.commands`).

- trainer.lifetime chunk: `trainer`, a task of the chunk after plan, applies the JobSet `<workflow>-trainer` (owned
  by the Workflow, so deleted with it) whose `cluster.train_nodes` pods run `python -m moeloop.steps.trainer --last
  <the chunk's last iteration>` under torchrun on the train nodes. When a pod fails the JobSet starts them all again
  (up to DAEMON_RESTARTS times): the trainer resumes from the run's storage and replays (steps/rl/held.py).
- rollout.lifetime chunk: `rollout-engines`, one task of K items, applies a JobSet `<workflow>-rollout-<k>` per
  shard, one pod on the rollout role's (Spot) GPUs running `python -m moeloop.steps.rollout_engine`. A reclaimed
  pod is started again up to cluster.spot_retry.limit times; the new engine serves the shard that was pending.
- each iteration's `train` and `rollout`: steps that apply the same JobSet (nothing changes while it exists; a
  chunk retried after its exit deleted it gets it again), then ask it from a CPU pod (`moeloop.steps.train`,
  `moeloop.steps.rollout`), whose figures are the template's outputs and gauges, as the working pod's would be.
- the chunk's exit handler deletes the JobSets, however the chunk ended: a failed chunk leaves nothing on GPUs. So a
  chunk with a trainer ends, and submits the next, only once `trainer-state` (render/chunk.py) has seen the trainer
  commit its last trainer state, which it does in the background after the last checkpoint.
"""

from __future__ import annotations

from hera.workflows import Container, Parameter, Resource, Steps
from hera.workflows import Step as HeraStep

from moeloop.steps.config import MoeloopConfig
from moeloop.workflows.dag import DAEMON_RESTARTS, ROLLOUT, ROLLOUT_ENGINE, TRAIN, TRAINER, Step
from moeloop.workflows.monitoring import template_metrics
from moeloop.workflows.render.jobset import render_jobset
from moeloop.workflows.render.parameters import manifest_text
from moeloop.workflows.render.placement import LABEL, orchestrator_pod
from moeloop.workflows.render.step_templates import MISSING_OUTPUT, container_template, template_io

ASKED = {TRAIN: TRAINER, ROLLOUT: ROLLOUT_ENGINE}  # the step that asks -> the process it asks
EXIT_STEPS = "delete-daemons"
WORKFLOW_LABEL = f"{LABEL}/workflow"


def held(step: Step, config: MoeloopConfig) -> bool:
    """Whether the config keeps the process alive for the chunk."""
    return (config.trainer if step is TRAINER else config.rollout).lifetime == "chunk"


def daemon_name(step: Step, shard: str) -> str:
    """The JobSet's name: <workflow>-trainer, <workflow>-rollout-<shard> (shard: its value where the name is made)."""
    return "{{workflow.name}}-trainer" if step is TRAINER else f"{{{{workflow.name}}}}-rollout-{shard}"


def daemon_jobset(step: Step, config: MoeloopConfig) -> dict:
    restarts = DAEMON_RESTARTS if step is TRAINER else config.cluster.spot_retry.limit
    jobset = render_jobset(config, step, "{{inputs.parameters.name}}", restarts)
    jobset["metadata"]["labels"][WORKFLOW_LABEL] = "{{workflow.name}}"  # what the exit handler deletes by
    return jobset


def apply_template(step: Step, config: MoeloopConfig) -> Resource:
    io = template_io(step, step.role)
    io["inputs"] = [Parameter(name="name"), *io["inputs"]]
    return Resource(
        name=step.name,
        **io,
        **orchestrator_pod(config),
        action="apply",
        set_owner_reference=True,  # deleted with the Workflow
        manifest=manifest_text(daemon_jobset(step, config)),
    )


def delete_template(config: MoeloopConfig) -> Resource:
    """The exit handler's: every JobSet of this Workflow's long-lived processes, by their label (none: no error)."""
    selector = f"{WORKFLOW_LABEL}={{{{workflow.name}}}}"
    return Resource(
        name=EXIT_STEPS,
        **orchestrator_pod(config),
        action="delete",
        flags=["jobsets.jobset.x-k8s.io", "--selector", selector],
    )


def asking_templates(step: Step, config: MoeloopConfig) -> list[Resource | Steps | Container]:
    """The step's template when it asks a long-lived process: steps that apply the process's JobSet (with the same
    arguments as the chunk's task that started it: the same spec changes nothing) and then ask; the asking pod's
    template; the process's apply and delete templates."""
    daemon = ASKED[step]
    ask = container_template(step, config)
    ask.name = f"{step.name}-ask"
    ask.metrics = template_metrics(step.name, step.params, step.outputs, config.run_name, MISSING_OUTPUT)
    inputs = [*step.params, "last"]
    passed = lambda names: [Parameter(name=n, value=f"{{{{inputs.parameters.{n}}}}}") for n in names]  # noqa: E731
    steps = Steps(
        name=step.name,
        inputs=[Parameter(name=name) for name in inputs],
        sub_steps=[
            HeraStep(
                name=daemon.name,
                template=daemon.name,
                arguments=[
                    Parameter(name="name", value=daemon_name(daemon, "{{inputs.parameters.shard}}")),
                    *passed(daemon.params),
                ],
            ),
            HeraStep(name="ask", template=ask.name, arguments=passed(step.params)),
        ],
    )
    return [steps, ask, apply_template(daemon, config)]


def exit_templates(config: MoeloopConfig) -> list[Resource]:
    """The exit handler's delete of the chunk's JobSets, where it has long-lived processes."""
    return [delete_template(config)] if held(TRAINER, config) or held(ROLLOUT_ENGINE, config) else []
