"""The run's Argo objects as Hera objects: `build` makes the WorkflowTemplate holding one chunk, and the Workflow
and CronWorkflow that run it; `render` gives them as the dicts Argo reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hera.workflows import DAG, Container, CronWorkflow, Parameter, Resource, Steps, Workflow, WorkflowTemplate
from hera.workflows import Step as HeraStep
from hera.workflows import models as m

from moeloop.steps.config import MoeloopConfig
from moeloop.workflows.dag import FINISH, STEPS, TRAIN, TRAINER, TRAINER_STATE, Step
from moeloop.workflows.monitoring import run_annotations
from moeloop.workflows.render.chunk import ENTRYPOINT, chunk_dag, label_template, next_chunk_template, template_name
from moeloop.workflows.render.daemons import ASKED, EXIT_STEPS, asking_templates, exit_templates, held
from moeloop.workflows.render.jobset import jobset_train_templates
from moeloop.workflows.render.parameters import PARAMETER_DESCRIPTIONS, PARAMETERS, run_arguments, run_labels
from moeloop.workflows.render.placement import LABEL
from moeloop.workflows.render.step_templates import container_template


@dataclass(frozen=True)
class Loop:
    """The run's Argo objects, as Hera objects: a WorkflowTemplate holding one chunk, and the Workflow and
    CronWorkflow that run it. Change them as Hera objects (`chunk` is the template's DAG); `moeloop render`
    writes them with Hera's serialization, submit/register/schedule send them."""

    template: WorkflowTemplate
    workflow: Workflow
    cron_workflow: CronWorkflow

    @property
    def chunk(self) -> DAG:
        return next(t for t in self.template.templates if isinstance(t, DAG) and t.name == ENTRYPOINT)

    def objects(self) -> dict[str, Workflow]:
        """By the file name `moeloop render` writes each to."""
        return dict(zip(FILES, (self.template, self.workflow, self.cron_workflow)))


FILES = ("workflow-template.yaml", "workflow.yaml", "cron-workflow.yaml")
FINISHED_STATUS = m.Parameter(name="status", value="{{workflow.status}}")
EXIT_TEMPLATE = "chunk-exit"


def build(
    config: MoeloopConfig, run_uri: str, iterations: int | None = None, own_tasks_per_iteration: int = 0
) -> Loop:
    """Every Argo object of the run at `run_uri` (e.g. s3://bucket/runs/<run_name>). `iterations` sets the target;
    the chunks do not depend on it. A chunk holds as many iterations as fit Argo's 200 tasks a DAG: pass
    `own_tasks_per_iteration`, the tasks you will add to each iteration slot of `Loop.chunk`, to leave room for them
    (with `cluster.chunk_iterations` set, a chunk that would not fit them is refused)."""
    config = with_target(config, iterations)
    ends_tracker_runs = "mlflow" in config.observe.trackers
    exit_templates, hooks = exit_hook(config)
    metadata = {"namespace": config.cluster.namespace, "labels": run_labels(config)}
    values = run_arguments(config, run_uri, chain=True)
    template = WorkflowTemplate(
        name=template_name(config),
        **metadata,
        entrypoint=ENTRYPOINT,
        service_account_name=config.cluster.orchestrator_service_account,
        # `value` is what the controller substitutes; `default` is what the UI's submit form pre-fills.
        arguments=[
            Parameter(
                name=name,
                value=values[name],
                default=values[name],
                description=PARAMETER_DESCRIPTIONS[name],
                enum=["true", "false"] if name == "chain" else None,
            )
            for name in PARAMETERS
        ],
        # One chunk of a run at a time, whoever submitted it: a chained chunk waits for its predecessor.
        synchronization=m.Synchronization(mutexes=[m.Mutex(name=f"moeloop-run-{config.run_name}")]),
        workflow_metadata=m.WorkflowMetadata(labels=run_labels(config), annotations=run_annotations(run_uri)),
        pod_metadata=m.Metadata(labels={f"{LABEL}/run": config.run_name}),
        templates=[
            chunk_dag(config, own_tasks_per_iteration),
            *(template for step in STEPS for template in _step_templates(step, config)),
            label_template(config),
            next_chunk_template(config),
            *([container_template(FINISH, config)] if ends_tracker_runs else []),
            *([container_template(TRAINER_STATE, config)] if held(TRAINER, config) else []),
            *exit_templates,
        ],
        hooks=hooks,
    )
    return Loop(
        template=template,
        workflow=Workflow(generate_name=f"{config.run_name}-", **metadata, **_referring(config, run_uri, True)),
        # Each tick runs one chunk from LATEST (no chaining: the schedule is the chain); at the target a tick runs
        # start and plan only and succeeds. Forbid: no tick while the previous one runs.
        cron_workflow=CronWorkflow(
            name=template_name(config),
            **metadata,
            schedules=list(config.cluster.schedule.schedules),
            timezone=config.cluster.schedule.timezone,
            concurrency_policy="Forbid",
            starting_deadline_seconds=300,
            successful_jobs_history_limit=3,
            failed_jobs_history_limit=3,
            **_referring(config, run_uri, False),
        ),
    )


def _referring(config: MoeloopConfig, run_uri: str, chain: bool) -> dict[str, Any]:
    """A Workflow spec that runs the template (the template must be registered) with the run's arguments."""
    values = run_arguments(config, run_uri, chain)
    return {
        "workflow_template_ref": m.WorkflowTemplateRef(name=template_name(config)),
        "arguments": [Parameter(name=name, value=values[name]) for name in PARAMETERS],
    }


def with_target(config: MoeloopConfig, iterations: int | None) -> MoeloopConfig:
    return config if iterations is None else config.model_copy(update={"iterations": iterations})


def render(config: MoeloopConfig, run_uri: str, iterations: int | None = None) -> dict[str, dict]:
    """Every object of the run as the dict Argo reads, by file name."""
    return {name: hera_object.to_dict() for name, hera_object in build(config, run_uri, iterations).objects().items()}


def _step_templates(step: Step, config: MoeloopConfig) -> list[Container | Resource | Steps]:
    """The step's templates. A step that asks a long-lived process (`lifetime: chunk`): workflows/render/daemons.py's
    (the process's with them); else multi-node training is steps that create a JobSet and then report its figures."""
    if step in ASKED and held(ASKED[step], config):
        return asking_templates(step, config)
    if step is TRAIN and config.cluster.train_nodes > 1:
        return jobset_train_templates(config)
    return [container_template(step, config)]


def exit_hook(config: MoeloopConfig) -> tuple[list[Steps | Resource], dict[str, m.LifecycleHook] | None]:
    """The chunk's exit handler, however it ended: where observe.trackers has mlflow, `finish` ends the MLflow run
    FAILED if the chunk did not succeed; with lifetime chunk, the long-lived processes' JobSets are deleted."""
    finish = "mlflow" in config.observe.trackers
    deletes = exit_templates(config)
    if not deletes:
        hook = m.LifecycleHook(template=FINISH.name, arguments=m.Arguments(parameters=[FINISHED_STATUS]))
        return [], {"exit": hook} if finish else None
    parts = [HeraStep(name=EXIT_STEPS, template=EXIT_STEPS)]
    if finish:
        status = [Parameter(name="status", value=FINISHED_STATUS.value)]
        parts.append(HeraStep(name=FINISH.name, template=FINISH.name, arguments=status))
    return [Steps(name=EXIT_TEMPLATE, sub_steps=[parts]), *deletes], {"exit": m.LifecycleHook(template=EXIT_TEMPLATE)}
