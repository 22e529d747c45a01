"""The chunk's trainer on Argo (`trainer.lifetime: chunk`): a JobSet the chunk owns, which every iteration's train
task asks for its update.

- `trainer`, a task of the chunk after plan: applies the JobSet `<workflow>-trainer` (owned by the Workflow, so
  deleted with it) whose `cluster.train_nodes` pods run `python -m moeloop.steps.trainer --last <the chunk's last
  iteration>` under torchrun on the train nodes. When a pod fails, the JobSet starts them all again (up to
  TRAINER_RESTARTS times): the trainer resumes from the run's storage and replays (steps/rl/held.py).
- each iteration's `train`: steps that apply the same JobSet (nothing changes while it exists; a chunk retried after
  its exit deleted it gets it again), then ask it for the update from a CPU pod (`moeloop.steps.train`), whose
  figures are the train template's outputs and gauges, as a single-node train pod's are.
- the chunk's exit handler deletes the JobSet, however the chunk ended: a failed chunk leaves no trainer on GPUs.
"""

from __future__ import annotations

from hera.workflows import Container, Parameter, Resource, Steps
from hera.workflows import Step as HeraStep

from moeloop.steps.config import MoeloopConfig
from moeloop.workflows.dag import TRAIN, TRAINER
from moeloop.workflows.monitoring import template_metrics
from moeloop.workflows.render.jobset import JOBSET_API_VERSION, render_jobset
from moeloop.workflows.render.parameters import manifest_text
from moeloop.workflows.render.placement import orchestrator_pod
from moeloop.workflows.render.step_templates import MISSING_OUTPUT, container_template, template_io

TRAINER_RESTARTS = 3  # the local runner's too (workflows/local/runner.py DAEMON_RESTARTS)
TRAINER_NAME = "{{=workflow.name + '-trainer'}}"
ASK_TEMPLATE = f"{TRAIN.name}-ask"
DELETE_TEMPLATE = f"{TRAINER.name}-delete"


def trainer_jobset(config: MoeloopConfig) -> dict:
    return render_jobset(config, TRAINER, TRAINER_NAME, TRAINER_RESTARTS)


def trainer_templates(config: MoeloopConfig) -> list[Resource | Steps | Container]:
    """The trainer task's template (apply the JobSet), the train task's (apply it, then ask), the ask's pod, and the
    exit handler's delete."""
    trainer = Resource(
        name=TRAINER.name,
        **template_io(TRAINER, TRAINER.role),
        **orchestrator_pod(config),
        action="apply",
        set_owner_reference=True,  # deleted with the Workflow
        manifest=manifest_text(trainer_jobset(config)),
    )
    ask = container_template(TRAIN, config)
    ask.name = ASK_TEMPLATE
    ask.metrics = template_metrics(TRAIN.name, TRAIN.params, TRAIN.outputs, config.run_name, MISSING_OUTPUT)
    iteration, last = "{{inputs.parameters.iteration}}", "{{inputs.parameters.last}}"
    # `last`, the chunk's last iteration, makes the JobSet the trainer task applied: the same spec changes nothing.
    train = Steps(
        name=TRAIN.name,
        inputs=[Parameter(name="iteration"), Parameter(name="last")],
        sub_steps=[
            HeraStep(name="trainer", template=TRAINER.name, arguments=[Parameter(name="last", value=last)]),
            HeraStep(name="ask", template=ASK_TEMPLATE, arguments=[Parameter(name="iteration", value=iteration)]),
        ],
    )
    delete = Resource(
        name=DELETE_TEMPLATE,
        **orchestrator_pod(config),
        action="delete",
        manifest=manifest_text({"apiVersion": JOBSET_API_VERSION, "kind": "JobSet", "metadata": {"name": TRAINER_NAME}}),
    )
    return [trainer, train, ask, delete]
