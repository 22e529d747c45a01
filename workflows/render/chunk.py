"""The chunk: the WorkflowTemplate's DAG, start -> plan -> K iteration slots -> next chunk, and the resource
templates that label the running Workflow and create the next chunk's.
"""

from __future__ import annotations

import re
from dataclasses import replace

from hera.workflows import DAG, Parameter, Resource, Workflow
from hera.workflows import Task as HeraTask
from hera.workflows import models as m

from moeloop.steps.config import MoeloopConfig
from moeloop.steps.errors import MoeloopError
from moeloop.workflows.dag import (
    EVALUATE,
    PLAN,
    ROLLOUT,
    ROLLOUT_ENGINE,
    START,
    TRAINER,
    TRAINER_STATE,
    Step,
    Task,
    iteration_tasks,
)
from moeloop.workflows.render.daemons import ASKED, daemon_name, held
from moeloop.workflows.render.parameters import PARAMETERS, manifest_text, run_labels
from moeloop.workflows.render.placement import LABEL, orchestrator_pod

API_VERSION = "argoproj.io/v1alpha1"
ENTRYPOINT = "chunk"
# Argo's CRDs allow at most 200 tasks in a DAG (dag.tasks maxItems). A running chunk's status holds a node (~0.5-1 KB
# with outputs) per task, rollout item and retry: at the default 20 iterations and 8 shards about 300; Argo compresses
# a status past 1 MB into status.compressedNodes (docs: "Offloading Large Workflows"), which the longest chunks of many
# shards may need.
MAX_CHUNK_TASKS = 200
DEFAULT_CHUNK_ITERATIONS = 20  # a Workflow per ~day of a large run: short enough to find, resubmit, archive
PLAN_OUTPUTS = "tasks.plan.outputs.parameters"
# The chunk's tasks besides its iteration slots.
# And with lifetime chunk, the task that starts the trainer and the one (of K items) that starts the rollout engines;
# with the trainer's, trainer-state.
FIXED_CHUNK_TASKS = ("start", "plan", "eval-latest", "label", "next-chunk")
# The label task's inputs: the iterations plan chose (a template cannot see the DAG's tasks).
LABEL_INPUTS = {
    "first": f"{{{{{PLAN_OUTPUTS}.first}}}}",
    "last": f"{{{{=asInt({PLAN_OUTPUTS}.first) + asInt({PLAN_OUTPUTS}.count) - 1}}}}",
}


def template_name(config: MoeloopConfig) -> str:
    return f"moeloop-{config.run_name}"


def fan_out(tasks: list[Task]) -> list[Task]:
    """dag.py's tasks as the chunk's DAG holds them: an iteration's K rollout shards (<slot>-rollout-<k>) are one task,
    <slot>-rollout, whose shard is Argo's `{{item}}` over a sequence of K (`fanned_out`); Argo expands it into a node
    per shard, <slot>-rollout(k:k) (`node_name`), each retried on its own. A task that depended on the shards depends
    on it, which waits for every item. Every other task is dag.py's."""
    groups: dict[str, str] = {}  # a shard's task -> its group's
    found: list[Task] = []
    for task in tasks:
        if fanned_out(task):
            shard = dict(task.arguments)["shard"]
            group = task.name.removesuffix(f"-{shard}")
            first = group not in groups.values()
            groups[task.name] = group
            if not first:
                continue
            assert shard == "0", f"{task.name}: a fan-out starts at shard 0"
            values = tuple((p, "{{item}}" if p == "shard" else v) for p, v in task.arguments)
            task = replace(task, name=group, arguments=values)
        dependencies = tuple(dict.fromkeys(groups.get(d, d) for d in task.dependencies))
        found.append(replace(task, dependencies=dependencies))
    return found


def fanned_out(task: Task) -> bool:
    """Whether the task is one of K items of a chunk task: a rollout shard."""
    return task.step is ROLLOUT


def node_name(task: str) -> str:
    """The display name of the Argo node that runs dag.py's task of that name: a rollout shard's, <slot>-rollout-<k>,
    is item k of the chunk's task <slot>-rollout, named <slot>-rollout(k:k) as Argo names an expanded task's items
    (workflow/controller/operator.go, generateNodeName: `task(index:item)`); any other task's node has its name."""
    shard = re.fullmatch(rf"(.+-{ROLLOUT.name})-(\d+)", task)
    return f"{shard[1]}({shard[2]}:{shard[2]})" if shard else task


def chunk_size(config: MoeloopConfig, own_tasks_per_iteration: int = 0) -> int:
    """Iterations per chunk: cluster.chunk_iterations, by default 20 or as many as MAX_CHUNK_TASKS allows, with room
    for `own_tasks_per_iteration` tasks a user adds to each iteration (workflows.build's argument). An iteration's
    tasks are the DAG's (`fan_out`): as many at any shard count."""
    per_iteration = len(fan_out(iteration_tasks(config, 1, PLAN.name))) + own_tasks_per_iteration
    fixed = len(FIXED_CHUNK_TASKS) + 2 * (config.trainer.lifetime == "chunk") + (config.rollout.lifetime == "chunk")
    fitting = (MAX_CHUNK_TASKS - fixed) // per_iteration
    if fitting < 1:
        raise MoeloopError(
            f"an iteration of {per_iteration} tasks ({own_tasks_per_iteration} of your own) does not fit a"
            f" Workflow of {MAX_CHUNK_TASKS} tasks beside the chunk's {fixed}"
        )
    if config.cluster.chunk_iterations is None:
        return min(DEFAULT_CHUNK_ITERATIONS, fitting)
    if config.cluster.chunk_iterations > fitting:
        own = f" ({own_tasks_per_iteration} of your own)" if own_tasks_per_iteration else ""
        raise MoeloopError(
            f"cluster.chunk_iterations {config.cluster.chunk_iterations} makes a Workflow of more than"
            f" {MAX_CHUNK_TASKS} tasks at {per_iteration} tasks per iteration{own}; at most {fitting}"
        )
    return config.cluster.chunk_iterations


def chunk_tasks(config: MoeloopConfig, own_tasks_per_iteration: int = 0) -> list[Task]:
    """The chunk's iteration slots: dag.py's iterations 1..C named slot<j>, rooted at plan, each iteration's rollout
    shards one task of K items (`fan_out`)."""
    return fan_out(iteration_tasks(config, chunk_size(config, own_tasks_per_iteration), PLAN.name, prefix="slot"))


def slot_iteration(slot: int) -> str:
    """The iteration slot j runs: LATEST + j, i.e. plan's `first` + j - 1."""
    first = f"{PLAN_OUTPUTS}.first"
    return f"{{{{{first}}}}}" if slot == 1 else f"{{{{=asInt({first}) + {slot - 1}}}}}"


def _counted(slot: int) -> str:
    """Slot j runs when plan's count reaches j: short chunks and the target skip the rest."""
    return f"{{{{{PLAN_OUTPUTS}.count}}}} >= {slot}"


def _dag_task(task: Task, when: str | None = None, items: int | None = None, **values: str) -> HeraTask:
    """dag.py's task as a Hera task; `values` replace its arguments' values; `items`: a task Argo runs once for each
    of 0..items-1, its `{{item}}`."""
    arguments = [Parameter(name=p, value=values.get(p, v)) for p, v in task.arguments]
    return HeraTask(
        name=task.name,
        template=task.step.name,
        arguments=arguments or None,
        dependencies=list(task.dependencies) or None,
        when=when,
        with_sequence=_items(items),
    )


def chunk_dag(config: MoeloopConfig, own_tasks_per_iteration: int = 0) -> DAG:
    slots = chunk_tasks(config, own_tasks_per_iteration)
    start = Task(START.name, START, 0, (("iteration", "0"),), ())
    plan = Task(PLAN.name, PLAN, 0, (("chunk", str(slots[-1].iteration)),), (START.name,))
    latest = Task("eval-latest", EVALUATE, 0, (("iteration", f"{{{{{PLAN_OUTPUTS}.latest}}}}"),), (PLAN.name,))
    # lifetime chunk: the chunk's long-lived processes, started as soon as plan knows the chunk's last iteration, so
    # that they start while slot 1 does; each asking task applies its process again, then asks it (render/daemons.py).
    last = LABEL_INPUTS["last"]
    daemons = [_daemon_task(step, config, last) for step in (TRAINER, ROLLOUT_ENGINE) if held(step, config)]
    # The trainer's last state committed before the exit handler deletes its JobSet (steps/trainer_state.py).
    trainer_state = []
    if held(TRAINER, config):
        trainer_state.append(
            HeraTask(
                name=TRAINER_STATE.name,
                template=TRAINER_STATE.name,
                arguments=[Parameter(name="last", value=last)],
                dependencies=[_daemon_task_name(TRAINER)],
                when=_counted(1),
            )
        )

    def slot_task(task: Task) -> HeraTask:
        items = config.rollout.num_shards if fanned_out(task) else None
        hera_task = _dag_task(task, _counted(task.iteration), items, iteration=slot_iteration(task.iteration))
        if task.step in ASKED and held(ASKED[task.step], config):
            hera_task.arguments.append(Parameter(name="last", value=last))
            hera_task.dependencies.append(_daemon_task_name(ASKED[task.step]))
        return hera_task

    return DAG(
        name=ENTRYPOINT,
        tasks=[
            _dag_task(start),
            _dag_task(plan),
            _dag_task(latest, when=f"{{{{{PLAN_OUTPUTS}.evaluate}}}} == true"),
            *daemons,
            *trainer_state,
            HeraTask(
                name="label",
                template="label",
                arguments=[Parameter(name=k, value=v) for k, v in LABEL_INPUTS.items()],
                dependencies=[PLAN.name],
                when=_counted(1),
            ),
            *(slot_task(task) for task in slots),
            HeraTask(
                name="next-chunk",
                template="next-chunk",
                dependencies=[f"slot{slots[-1].iteration}-eval", *(task.name for task in trainer_state)],
                # `chain` comes from the submit form: compared inside the expression, as data, not pasted into it.
                when=f"{{{{{PLAN_OUTPUTS}.more}}}} == true && {{{{=workflow.parameters.chain == 'true'}}}}",
            ),
        ],
    )


def _items(count: int | None) -> m.Sequence | None:
    """Argo's loop over 0..count-1 (each its `{{item}}`): a task of one node an item; None: a plain task."""
    return m.Sequence(count=m.IntOrString(count)) if count is not None else None


def _daemon_task_name(step: Step) -> str:
    return "rollout-engines" if step is ROLLOUT_ENGINE else step.name


def _daemon_task(step: Step, config: MoeloopConfig, last: str) -> HeraTask:
    """The chunk's task that applies the process's JobSet: the trainer's; the rollout engines', one item a shard."""
    values = {"last": last, "num_shards": str(config.rollout.num_shards), "shard": "{{item}}"}
    return HeraTask(
        name=_daemon_task_name(step),
        template=step.name,
        arguments=[
            Parameter(name="name", value=daemon_name(step, "{{item}}")),
            *(Parameter(name=p, value=values[p]) for p in step.params),
        ],
        dependencies=[PLAN.name],
        when=_counted(1),
        with_sequence=_items(config.rollout.num_shards if step is ROLLOUT_ENGINE else None),
    )


def label_template(config: MoeloopConfig) -> Resource:
    """Labels the running Workflow with the iterations plan chose, so the UI finds a run's chunk by iteration."""
    patch = {  # a merge patch, not a whole Workflow: a plain dict
        "apiVersion": API_VERSION,
        "kind": "Workflow",
        "metadata": {
            "name": "{{workflow.name}}",
            "labels": {f"{LABEL}/{name}-iteration": f"{{{{inputs.parameters.{name}}}}}" for name in LABEL_INPUTS},
        },
    }
    return Resource(
        name="label",
        inputs=[Parameter(name=name) for name in LABEL_INPUTS],
        **orchestrator_pod(config),
        action="patch",
        merge_strategy="merge",
        manifest=manifest_text(patch),
    )


def next_chunk_workflow(config: MoeloopConfig) -> Workflow:
    """The Workflow the last task creates: the next chunk, with this Workflow's parameters (manifest_text passes
    each as data)."""
    return Workflow(
        generate_name=f"{config.run_name}-",
        labels={**run_labels(config), f"{LABEL}/chained-from": "{{workflow.name}}"},
        workflow_template_ref=m.WorkflowTemplateRef(name=template_name(config)),
        arguments=[Parameter(name=name, value=f"{{{{workflow.parameters.{name}}}}}") for name in PARAMETERS],
    )


def next_chunk_template(config: MoeloopConfig) -> Resource:
    return Resource(
        name="next-chunk",
        **orchestrator_pod(config),
        # No owner reference: the next chunk outlives this Workflow (and its garbage collection).
        action="create",
        manifest=manifest_text(next_chunk_workflow(config).to_dict()),
    )


def dag_tasks(document: dict) -> dict[str, tuple[str, ...]]:
    """Task name -> sorted dependencies of the entrypoint DAG of a rendered WorkflowTemplate."""
    spec = document["spec"]
    dag = next(template["dag"] for template in spec["templates"] if template["name"] == spec["entrypoint"])
    return {task["name"]: tuple(sorted(task.get("dependencies", ()))) for task in dag["tasks"]}
