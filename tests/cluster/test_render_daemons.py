"""The render with `lifetime: chunk` (workflows/render/daemons.py): the chunk applies a JobSet for its trainer and one
per rollout shard, owned by the Workflow, right after plan; every iteration's train and rollout task applies the same
JobSet again and asks it from a CPU pod; the exit handler deletes them by the Workflow's label; lint-clean, and the
local runner's DAG is the twin (the same long-lived processes, the same commands)."""

from __future__ import annotations

import pytest

from moeloop.steps.config import MoeloopConfig
from moeloop.steps.errors import MoeloopError
from moeloop.workflows.dag import ROLLOUT_ENGINE, TRAINER, loop_tasks, run_values
from moeloop.workflows.lint.documents import lint_documents
from moeloop.workflows.render.chunk import MAX_CHUNK_TASKS, chunk_size
from moeloop.workflows.render.loop import render
from tests.argo_substitution import expanded_tasks, read_back, substitute
from tests.conftest import small_config

RUN_URI = "s3://moeloop-runs/runs/daemons"


def config_with(trainer: str, rollout: str, **cluster: object) -> MoeloopConfig:
    return small_config(
        3,
        trainer={"lifetime": trainer, "state_every": 2 if trainer == "chunk" else 1, "world_size": 2},
        rollout={"lifetime": rollout, "num_shards": 3},
        cluster=cluster,
    )


def template(config: MoeloopConfig) -> dict:
    return render(config, RUN_URI)["workflow-template.yaml"]


def templates_of(document: dict) -> dict[str, dict]:
    return {t["name"]: t for t in document["spec"]["templates"]}


def chunk_tasks_of(document: dict) -> dict[str, dict]:
    return {task["name"]: task for task in templates_of(document)["chunk"]["dag"]["tasks"]}


def arguments(task_or_step: dict) -> dict[str, str]:
    return {p["name"]: p["value"] for p in task_or_step.get("arguments", {}).get("parameters", [])}


@pytest.mark.parametrize(("trainer", "rollout"), [("chunk", "iteration"), ("iteration", "chunk"), ("chunk", "chunk")])
def test_a_chunk_with_long_lived_processes_renders_lint_clean(trainer: str, rollout: str) -> None:
    documents = render(config_with(trainer, rollout), RUN_URI)
    assert lint_documents(list(documents.values())) == []
    templates = templates_of(documents["workflow-template.yaml"])
    assert ("trainer" in templates) == (trainer == "chunk")
    assert ("rollout-engine" in templates) == (rollout == "chunk")
    assert ("train-ask" in templates) == (trainer == "chunk")
    assert ("rollout-ask" in templates) == (rollout == "chunk")


def test_the_chunk_starts_its_trainer_and_engines_after_plan_and_every_asking_task_applies_them_again() -> None:
    document = template(config_with("chunk", "chunk"))
    tasks, templates = chunk_tasks_of(document), templates_of(document)
    last = "{{=asInt(tasks.plan.outputs.parameters.first) + asInt(tasks.plan.outputs.parameters.count) - 1}}"
    trainer, engines = tasks["trainer"], tasks["rollout-engines"]
    assert trainer["dependencies"] == engines["dependencies"] == ["plan"]
    assert trainer["when"] == engines["when"] == "{{tasks.plan.outputs.parameters.count}} >= 1"
    assert arguments(trainer) == {"name": "{{workflow.name}}-trainer", "last": last}
    assert engines["withSequence"] == {"count": 3}
    assert arguments(engines) == {
        "name": "{{workflow.name}}-rollout-{{item}}",
        "shard": "{{item}}",
        "num_shards": "3",
        "last": last,
    }
    for slot in (1, 2):
        train, rollout = tasks[f"slot{slot}-train"], tasks[f"slot{slot}-rollout"]
        assert "trainer" in train["dependencies"] and "rollout-engines" in rollout["dependencies"]
        assert arguments(train)["last"] == arguments(rollout)["last"] == last
        # The shards are the task's items, as the engines are the engines task's: shard k asks engine k.
        assert (rollout["withSequence"], arguments(rollout)["shard"]) == ({"count": 3}, "{{item}}")
    # The asking steps apply the JobSet the chunk's task applied: the same template, the same name and arguments.
    [[apply], [ask]] = templates["rollout"]["steps"]
    assert (apply["template"], ask["template"]) == ("rollout-engine", "rollout-ask")
    assert arguments(apply) == {
        "name": "{{workflow.name}}-rollout-{{inputs.parameters.shard}}",
        "shard": "{{inputs.parameters.shard}}",
        "num_shards": "{{inputs.parameters.num_shards}}",
        "last": "{{inputs.parameters.last}}",
    }
    # As Argo expands the two tasks, item k of a slot's rollout applies and asks the JobSet item k of the engines
    # task applied: its shard input is the item.
    expanded = expanded_tasks(list(tasks.values()))
    for k in range(3):
        engine, shard = expanded[f"rollout-engines({k}:{k})"], expanded[f"slot2-rollout({k}:{k})"]
        inputs = {f"inputs.parameters.{name}": value for name, value in arguments(shard).items()}
        applied = substitute(arguments(apply)["name"], {**inputs, "workflow.name": "wf"})
        assert applied == substitute(arguments(engine)["name"], {"workflow.name": "wf"}) == f"wf-rollout-{k}"
    [[apply], [ask]] = templates["train"]["steps"]
    assert (apply["template"], ask["template"]) == ("trainer", "train-ask")
    assert arguments(apply) == {"name": "{{workflow.name}}-trainer", "last": "{{inputs.parameters.last}}"}
    # Its three tasks count against Argo's 200 a DAG, beside 5 tasks a slot at any shard count (61 shards here):
    # (200 - 8) // 5 = 38 iterations fit with both long-lived processes, (200 - 6) // 5 with the engines alone.
    wide, unset = {"num_shards": 61, "prompts_per_iteration": 61}, {"chunk_iterations": None}
    held = small_config(rollout={**wide, "lifetime": "chunk"}, trainer={"lifetime": "chunk"}, cluster=unset)
    assert chunk_size(held) == 20 and len(chunk_tasks_of(template(held))) == 8 + 20 * 5
    for config, fixed in ((held, 8), (held.model_copy(update={"trainer": small_config().trainer}), 6)):
        assert chunk_size(with_chunk(config, 38)) == 38 == (MAX_CHUNK_TASKS - fixed) // 5
    with pytest.raises(MoeloopError, match="chunk_iterations 39 makes a Workflow of more than 200 tasks at 5 tasks"):
        chunk_size(with_chunk(held, 39))
    # Only tasks of your own fill a chunk now: at 193 a slot, 198 tasks fit beside 7 fixed, not beside 8.
    trainer_only = small_config(rollout=wide, trainer={"lifetime": "chunk"}, cluster=unset)
    assert chunk_size(trainer_only, own_tasks_per_iteration=188) == 1
    with pytest.raises(MoeloopError, match="does not fit a Workflow of 200 tasks beside the chunk's 8"):
        chunk_size(held, own_tasks_per_iteration=188)


def with_chunk(config: MoeloopConfig, iterations: int) -> MoeloopConfig:
    return config.model_copy(update={"cluster": config.cluster.model_copy(update={"chunk_iterations": iterations})})

def test_the_chunk_ends_and_the_next_is_submitted_only_once_its_trainer_has_committed_its_last_state() -> None:
    """The exit handler deletes the trainer's JobSet: trainer-state, a CPU pod, waits for the last iteration's trainer
    state (steps/trainer_state.py), and the DAG's end and next-chunk wait for it."""
    document = template(config_with("chunk", "iteration"))
    tasks, templates = chunk_tasks_of(document), templates_of(document)
    last = "{{=asInt(tasks.plan.outputs.parameters.first) + asInt(tasks.plan.outputs.parameters.count) - 1}}"
    waits = tasks["trainer-state"]
    assert (waits["template"], waits["dependencies"]) == ("trainer-state", ["trainer"])
    assert arguments(waits) == {"last": last}
    assert waits["when"] == tasks["trainer"]["when"]
    assert sorted(tasks["next-chunk"]["dependencies"]) == ["slot20-eval", "trainer-state"]
    pod = templates["trainer-state"]
    assert pod["nodeSelector"] == {"moeloop.dev/role": "cpu"}
    argv = pod["container"]["command"] + pod["container"]["args"]
    assert argv[:3] == ["python", "-m", "moeloop.steps.trainer_state"]
    assert argv[argv.index("--last") + 1] == "{{inputs.parameters.last}}"
    without = template(config_with("iteration", "chunk"))
    assert "trainer-state" not in chunk_tasks_of(without) and "trainer-state" not in templates_of(without)
    assert chunk_tasks_of(without)["next-chunk"]["dependencies"] == ["slot20-eval"]


def test_the_jobsets_are_owned_named_restarted_and_run_the_long_lived_processes() -> None:
    config = config_with("chunk", "chunk", spot_retry={"limit": 4})
    templates = templates_of(template(config))
    for name, role, command, restarts in (
        ("trainer", "train", "moeloop.steps.trainer", 3),
        ("rollout-engine", "rollout", "moeloop.steps.rollout_engine", 4),
    ):
        resource = templates[name]["resource"]
        assert (resource["action"], resource["setOwnerReference"]) == ("apply", True)
        jobset = read_back(resource["manifest"])
        assert jobset["metadata"]["name"] == "{{inputs.parameters.name}}"
        assert jobset["metadata"]["labels"]["moeloop.dev/workflow"] == "{{workflow.name}}"
        assert jobset["spec"]["failurePolicy"] == {"maxRestarts": restarts}
        pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"moeloop.dev/role": role}
        [container] = pod["containers"]
        argv = container["command"] + container["args"]
        assert command in argv and argv[argv.index("--last") + 1] == "{{inputs.parameters.last}}"
    trainer_argv = read_back(templates["trainer"]["resource"]["manifest"])["spec"]["replicatedJobs"][0]["template"]
    assert "--nproc-per-node=2" in trainer_argv["spec"]["template"]["spec"]["containers"][0]["args"]
    for ask, module in (("train-ask", "moeloop.steps.train"), ("rollout-ask", "moeloop.steps.rollout")):
        container = templates[ask]["container"]
        assert templates[ask]["nodeSelector"] == {"moeloop.dev/role": "cpu"} and "retryStrategy" not in templates[ask]
        assert (container["command"] + container["args"])[:4] == ["python", "-m", module, "--run"]
        assert "nvidia.com/gpu" not in container.get("resources", {}).get("limits", {})


def test_the_exit_handler_deletes_the_workflows_jobsets_by_label() -> None:
    document = template(config_with("chunk", "chunk"))
    assert document["spec"]["hooks"] == {"exit": {"template": "chunk-exit"}}
    templates = templates_of(document)
    assert templates["chunk-exit"]["steps"] == [[{"name": "delete-daemons", "template": "delete-daemons"}]]
    assert templates["delete-daemons"]["resource"] == {
        "action": "delete",
        "flags": ["jobsets.jobset.x-k8s.io", "--selector", "moeloop.dev/workflow={{workflow.name}}"],
    }
    assert "hooks" not in template(config_with("iteration", "iteration"))["spec"]


def test_the_local_runner_runs_the_same_long_lived_processes_with_the_same_commands() -> None:
    config = config_with("chunk", "chunk")
    tasks = loop_tasks(config)
    daemons = {t.name: t for t in tasks if t.step.daemon}
    assert sorted(daemons) == ["rollout-engine-0", "rollout-engine-1", "rollout-engine-2", "trainer"]
    assert all(t.dependencies == ("start",) for t in daemons.values())
    values = run_values(config, RUN_URI)
    assert daemons["trainer"].argv(values)[:6] == [
        "python",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
    ]
    assert daemons["trainer"].argv(values)[-4:] == ["--run", RUN_URI, "--last", "3"]
    engine = daemons["rollout-engine-1"].argv(values)
    assert engine == [
        "python",
        "-m",
        ROLLOUT_ENGINE.module,
        "--run",
        RUN_URI,
        "--shard",
        "1",
        "--num-shards",
        "3",
        "--last",
        "3",
    ]
    asking = [t for t in tasks if t.step.name in ("train", "rollout")]
    assert asking and all(t.processes == 1 and "torch.distributed.run" not in t.argv(values) for t in asking)
    assert TRAINER.module == "moeloop.steps.trainer"


@pytest.mark.parametrize(
    ("trainer", "rollout", "ready"),
    [("chunk", "chunk", "train"), ("chunk", "iteration", "publish"), ("iteration", "chunk", "publish")],
)
def test_the_next_rollouts_hang_off_train_where_the_engines_take_the_trainers_delta_else_off_publish(
    trainer: str, rollout: str, ready: str
) -> None:
    """Where the trainer and the engines both live for the chunk, the trainer answers train once the delta is
    committed and the engines take that (the checkpoint's commit follows, which publish waits for); otherwise the
    rollouts load the checkpoint publish commits or waits for. The render and the local DAG alike, at staleness 0
    and 1."""
    other = {"train": "publish", "publish": "train"}[ready]
    for staleness, slot, policy in ((0, 2, 1), (1, 3, 1)):
        config = config_with(trainer, rollout)
        config = config.model_copy(update={"rollout": config.rollout.model_copy(update={"max_staleness": staleness})})
        depends = chunk_tasks_of(template(config))[f"slot{slot}-rollout"]["dependencies"]
        assert f"slot{policy}-{ready}" in depends and f"slot{policy}-{other}" not in depends, depends
        local = {task.name: task for task in loop_tasks(config)}
        assert local[f"it{slot}-rollout-0"].dependencies == (f"it{policy}-{ready}",)
