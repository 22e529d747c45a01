"""The Argo render: a chunk template derived from workflows/dag.py, the Workflow and CronWorkflow that run it,
placed by role, lint-clean, written only when valid and small."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import yaml
from hera.workflows import CronWorkflow, Workflow, WorkflowTemplate

from moeloop.steps.config import MoeloopConfig, parse_config
from moeloop.steps.errors import MoeloopError
from moeloop.steps.start import load_config_argument
from tests.argo_stand_in import moeloop
from tests.argo_substitution import expanded_tasks, read_back
from tests.conftest import REPO
from moeloop.workflows.dag import PLAN, START, STEPS, TRAIN, loop_tasks, run_values
from moeloop.workflows.lint.documents import lint_documents
from moeloop.workflows.local.launch import local_argv
from moeloop.workflows.render import files as render_files
from moeloop.workflows.render.chunk import MAX_CHUNK_TASKS, chunk_size, dag_tasks, node_name
from moeloop.workflows.render.files import MAX_OBJECT_BYTES, object_bytes, write_rendered
from moeloop.workflows.render.loop import build, render
from moeloop.workflows.render.portable_paths import portable_config
from moeloop.workflows.render.step_templates import SPOT_RETRY_EXPRESSION, step_placeholders

RUN_URI = "s3://moeloop-runs/runs/render-test"
FILES = ("workflow-template.yaml", "workflow.yaml", "cron-workflow.yaml")
ROLE_TAINT = "moeloop.dev/role"


def make_config(tmp_path: Path, cluster: dict | None = None, **task: str) -> MoeloopConfig:
    prompts = tmp_path / "data"
    return parse_config(
        {
            "run_name": "render-test",
            "iterations": 7,
            "task": {
                "train_prompts": str(prompts / "train.jsonl"),
                "eval_prompts": str(prompts / "eval.jsonl"),
                **task,
            },
            "reward": {"functions": [{"path": "moeloop.steps.rewards:reverse_positions"}]},
            "cluster": {"namespace": "rl", "chunk_iterations": 3, **(cluster or {})},
        },
        "test",
    )


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> MoeloopConfig:
    monkeypatch.chdir(tmp_path)  # the prompts lie under cwd, as they do under the repo root
    return make_config(tmp_path)


@pytest.fixture
def documents(config: MoeloopConfig) -> dict[str, dict]:
    return render(config, RUN_URI)


def templates_by_name(document: dict) -> dict[str, dict]:
    return {template["name"]: template for template in document["spec"]["templates"]}


def chunk_tasks_by_name(document: dict) -> dict[str, dict]:
    return {task["name"]: task for task in templates_by_name(document)["chunk"]["dag"]["tasks"]}


def parameters(spec: dict) -> dict[str, dict]:
    return {p["name"]: p for p in spec["arguments"]["parameters"]}


def test_every_object_passes_lint(documents: dict[str, dict]) -> None:
    assert tuple(documents) == FILES
    assert [d["kind"] for d in documents.values()] == ["WorkflowTemplate", "Workflow", "CronWorkflow"]
    assert lint_documents(documents.values()) == []


def test_objects_round_trip_through_hera(documents: dict[str, dict]) -> None:
    for kind, name in ((WorkflowTemplate, "workflow-template.yaml"), (Workflow, "workflow.yaml")):
        assert kind.from_dict(documents[name]).to_dict() == documents[name]
    assert CronWorkflow.from_dict(documents["cron-workflow.yaml"]).to_dict() == documents["cron-workflow.yaml"]


# ---------------------------------------------------------------------------------------------
# One definition: the chunk's slots are dag.py's iterations


def fill(text: str, values: dict[str, str]) -> str:
    """Argo's substitution of {{name}} and {{=toJson(name)}} tags, for the names given (others stay)."""

    def value(match: re.Match) -> str:
        name = match.group(2)
        if name not in values:
            return match.group(0)
        return json.dumps(values[name]) if match.group(1) else values[name]

    return re.sub(r"\{\{\s*(=toJson\()?([^}()]+?)\)?\s*\}\}", value, text)


def slot_iteration(value: str, first: int) -> int:
    """The value of a slot's iteration argument when plan says `first` (the two forms the render writes)."""
    plain = "{{tasks.plan.outputs.parameters.first}}"
    if value == plain:
        return first
    match = re.fullmatch(r"\{\{=asInt\(tasks\.plan\.outputs\.parameters\.first\) \+ (\d+)\}\}", value)
    assert match, value
    return first + int(match[1])


@pytest.mark.parametrize("first", [1, 4])
def test_chunk_slots_are_the_local_runners_tasks(config: MoeloopConfig, documents: dict[str, dict], first: int) -> None:
    """Slot j of a chunk whose plan says `first` is iteration first+j-1: the same tasks, edges and pod argv as
    the local runner's loop_tasks for those iterations (the chunk's root, plan, stands for what came before)."""
    template = documents["workflow-template.yaml"]
    k = chunk_size(config)
    local = {t.name: t for t in loop_tasks(config, first + k - 1) if t.iteration >= first}
    templates = templates_by_name(template)
    values = {f"workflow.parameters.{n}": v for n, v in run_values(config, RUN_URI).items()}

    def node(local_task: str) -> str:
        """The Argo node of the chunk that runs the local task: slot3-train, a shard's item slot3-rollout(0:0)."""
        iteration, rest = re.fullmatch(r"it(\d+)-(.*)", local_task).groups()
        return node_name(f"slot{int(iteration) - first + 1}-{rest}")

    by_node = {node(name): task for name, task in local.items()}
    # Each iteration's rollout shards are one task of K items, which Argo expands into a node a shard.
    chunk = chunk_tasks_by_name(template)
    shards = config.rollout.num_shards
    sequences = [chunk[f"slot{j}-rollout"]["withSequence"] for j in range(1, k + 1)]
    assert shards > 1 and sequences == [{"count": shards}] * k
    rendered = {name: task for name, task in expanded_tasks(list(chunk.values())).items() if name.startswith("slot")}
    assert sorted(rendered) == sorted(by_node)
    for name, task in rendered.items():
        expected = by_node[name]
        dependencies = set(task["dependencies"])
        before = {d for d in expected.dependencies if d not in local}  # outside the chunk: plan's side
        inside = {node(d) for d in expected.dependencies if d in local}
        assert dependencies == inside | ({PLAN.name} if before else set())
        assert task["template"] == expected.step.name
        arguments = {p["name"]: p["value"] for p in task["arguments"]["parameters"]}
        arguments["iteration"] = str(slot_iteration(arguments["iteration"], first))
        assert arguments == dict(expected.arguments)
        slot = int(re.match(r"slot(\d+)", name)[1])
        assert task["when"] == f"{{{{tasks.plan.outputs.parameters.count}}}} >= {slot}"
        container = templates[task["template"]]["container"]
        argv = [
            fill(a, values | {f"inputs.parameters.{n}": v for n, v in arguments.items()}) for a in container["args"]
        ]
        assert local_argv(expected, run_values(config, RUN_URI)) == [sys.executable, *container["command"][1:], *argv]


def test_chunk_starts_with_start_and_plan_and_ends_with_the_next_chunk(
    config: MoeloopConfig, documents: dict[str, dict]
) -> None:
    template = documents["workflow-template.yaml"]
    tasks = chunk_tasks_by_name(template)
    deps = dag_tasks(template)
    assert deps["start"] == () and deps["plan"] == ("start",)
    # LATEST's evaluation (eval-0 on a new run), only when plan found its metrics missing.
    assert tasks["eval-latest"]["template"] == "evaluate" and deps["eval-latest"] == ("plan",)
    assert tasks["eval-latest"]["when"] == "{{tasks.plan.outputs.parameters.evaluate}} == true"
    assert tasks["eval-latest"]["arguments"]["parameters"] == [
        {"name": "iteration", "value": "{{tasks.plan.outputs.parameters.latest}}"}
    ]
    assert tasks["plan"]["arguments"]["parameters"] == [{"name": "chunk", "value": "3"}]
    assert deps["next-chunk"] == ("slot3-eval",)
    assert tasks["next-chunk"]["when"] == (
        "{{tasks.plan.outputs.parameters.more}} == true && {{=workflow.parameters.chain == 'true'}}"
    )
    assert len(tasks) == 4 + 3 * 5 + 1  # 5 tasks an iteration: its K rollout shards are one


def test_the_chunk_does_not_grow_with_the_run(config: MoeloopConfig) -> None:
    short, long = render(config, RUN_URI, iterations=2), render(config, RUN_URI, iterations=10_000)
    for name in FILES:
        assert long[name] != short[name]  # the target differs ...
        assert abs(object_bytes(long[name]) - object_bytes(short[name])) < 100  # ... and nothing else grows
    assert parameters(long["workflow-template.yaml"]["spec"])["iterations"]["default"] == "10000"


@pytest.mark.parametrize("shards", [2, 64])
def test_ten_thousand_iterations_stay_well_under_a_megabyte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shards: int
) -> None:
    """The largest chunk the render allows, for a narrow and a wide run of 10,000 iterations."""
    monkeypatch.chdir(tmp_path)
    config = make_config(tmp_path, cluster={"chunk_iterations": None})
    config = config.model_copy(update={"rollout": config.rollout.model_copy(update={"num_shards": shards})})
    documents = render(config, RUN_URI, iterations=10_000)
    assert chunk_size(config) == 20  # by default, at any shard count: an iteration is 5 tasks
    assert len(dag_tasks(documents["workflow-template.yaml"])) <= MAX_CHUNK_TASKS
    largest = max(object_bytes(document) for document in documents.values())
    assert largest < MAX_OBJECT_BYTES // 2, largest


def test_a_chunk_over_the_task_bound_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = make_config(tmp_path, cluster={"chunk_iterations": 100})
    with pytest.raises(MoeloopError, match=r"^cluster.chunk_iterations 100 makes a Workflow of more than 200 tasks"):
        render(config, RUN_URI)


@pytest.mark.parametrize("shards", [1, 8, 16])
def test_an_iteration_is_five_tasks_at_any_shard_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shards: int
) -> None:
    """The K rollout shards of an iteration are one task of K items (Argo's withSequence), so a chunk holds 20
    iterations by default, and up to (200 - 5) // 5 = 39 asked for, at 1, 8 or 16 shards alike."""
    monkeypatch.chdir(tmp_path)
    for iterations, size in ((None, 20), (39, 39)):
        config = make_config(tmp_path, cluster={"chunk_iterations": iterations})
        config = config.model_copy(update={"rollout": config.rollout.model_copy(update={"num_shards": shards})})
        document = render(config, RUN_URI)["workflow-template.yaml"]
        tasks = dag_tasks(document)
        assert chunk_size(config) == size and len(tasks) == 5 + 5 * size <= MAX_CHUNK_TASKS
        assert tasks[f"slot{size}-reward"] == (f"slot{size}-rollout",)
    # Argo runs the task once a shard, each item retried on its own by the template's Spot retries.
    rollout = chunk_tasks_by_name(document)["slot2-rollout"]
    assert rollout["withSequence"] == {"count": shards} and rollout["template"] == "rollout"
    assert {p["name"]: p["value"] for p in rollout["arguments"]["parameters"]}["shard"] == "{{item}}"
    retry = templates_by_name(document)["rollout"]["retryStrategy"]
    assert (retry["expression"], retry["limit"]) == (SPOT_RETRY_EXPRESSION, config.cluster.spot_retry.limit)
    over = config.model_copy(update={"cluster": config.cluster.model_copy(update={"chunk_iterations": 40})})
    with pytest.raises(MoeloopError, match=r"^cluster.chunk_iterations 40 makes a Workflow of more than 200 tasks at 5"
                       r" tasks per iteration; at most 39$"):  # fmt: skip
        chunk_size(over)


def test_write_rendered_refuses_an_object_over_the_size_limit(
    config: MoeloopConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(render_files, "MAX_OBJECT_BYTES", 10_000)
    with pytest.raises(MoeloopError, match=r"^workflow-template.yaml: \d+ bytes is over the 10000-byte object limit"):
        write_rendered(build(config, RUN_URI), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_container_argv_is_the_steps_argv(documents: dict[str, dict]) -> None:
    templates = templates_by_name(documents["workflow-template.yaml"])
    for step in STEPS:
        container = templates[step.name]["container"]
        assert container["command"] + container["args"] == step.argv(step_placeholders(step))
        assert [p["name"] for p in templates[step.name].get("inputs", {}).get("parameters", [])] == list(step.params)


def test_train_runs_under_torchrun_at_the_configured_world_size(tmp_path: Path, config: MoeloopConfig) -> None:
    """The rendered train template and the local runner start the same torchrun command; world_size 1 none."""
    distributed = config.model_copy(update={"trainer": config.trainer.model_copy(update={"world_size": 2})})
    templates = templates_by_name(render(distributed, RUN_URI)["workflow-template.yaml"])
    container = templates["train"]["container"]
    assert container["command"] + container["args"] == [
        *("python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "moeloop.steps.train", "--"),
        *("--run", "{{workflow.parameters.run}}", "--iteration", "{{inputs.parameters.iteration}}"),
    ]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert templates["publish"]["container"]["command"] == ["python", "-m", "moeloop.steps.publish"]
    train = next(t for t in loop_tasks(distributed) if t.step is TRAIN)
    filled = [
        fill(a, {"workflow.parameters.run": "/runs/x", "inputs.parameters.iteration": "1"}) for a in container["args"]
    ]
    assert local_argv(train, {"run": "/runs/x"}) == [sys.executable, *container["command"][1:], *filled]
    single = next(t for t in loop_tasks(config) if t.step is TRAIN)
    assert local_argv(single, {"run": "/runs/x"}) == [sys.executable, "-m", "moeloop.steps.train", "--run", "/runs/x"] + [
        "--iteration",
        "1",
    ]


# ---------------------------------------------------------------------------------------------
# The objects: parameters, labels, chaining, schedule


def test_template_parameters_fill_the_submit_form(config: MoeloopConfig, documents: dict[str, dict]) -> None:
    template = parameters(documents["workflow-template.yaml"]["spec"])
    assert list(template) == ["run", "iterations", "model", "chain", "config"]
    for parameter in template.values():
        assert parameter["default"] == parameter["value"] and parameter["description"]
    assert template["run"]["default"] == RUN_URI
    assert template["iterations"]["default"] == "7"
    assert template["model"]["default"] == ""  # the tiny model
    assert template["chain"]["enum"] == ["true", "false"] and template["chain"]["default"] == "true"
    # The config as YAML, which the UI's form shows line by line; moeloop.steps.start reads it back to the same config.
    assert template["config"]["default"].startswith("# The run's config (steps/config.py).")
    shipped = portable_config(config)
    assert load_config_argument(template["config"]["default"]) == load_config_argument(shipped.to_json())
    # start applies iterations and model over the config; plan reads the stored config start adopted.
    templates = templates_by_name(documents["workflow-template.yaml"])
    assert templates["start"]["container"]["args"] == [
        *("--run", "{{workflow.parameters.run}}", "--config", "{{workflow.parameters.config}}"),
        *("--iterations", "{{workflow.parameters.iterations}}", "--model", "{{workflow.parameters.model}}"),
        *("--iteration", "{{inputs.parameters.iteration}}"),
    ]


def test_workflow_and_cron_workflow_refer_to_the_template(config: MoeloopConfig, documents: dict[str, dict]) -> None:
    template, workflow, cron = (documents[name] for name in FILES)
    assert template["metadata"]["name"] == "moeloop-render-test"
    assert workflow["metadata"]["generateName"] == "render-test-"
    for spec in (workflow["spec"], cron["spec"]["workflowSpec"]):
        assert spec["workflowTemplateRef"] == {"name": "moeloop-render-test"}
        assert "templates" not in spec  # the DAG exists once, in the template
        values = {name: p["value"] for name, p in parameters(spec).items()}
        assert values == {name: p["default"] for name, p in parameters(template["spec"]).items()} | {
            "chain": values["chain"]
        }
    assert parameters(workflow["spec"])["chain"]["value"] == "true"
    # The schedule is the chain: each tick one chunk from LATEST; none while the last one runs.
    assert parameters(cron["spec"]["workflowSpec"])["chain"]["value"] == "false"
    assert cron["spec"]["schedules"] == ["0 * * * *"] and cron["spec"]["timezone"] == "UTC"
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    for document in documents.values():
        assert document["metadata"]["namespace"] == "rl"
        assert document["metadata"]["labels"] == {"app.kubernetes.io/name": "moeloop", "moeloop.dev/run": "render-test"}
    # Workflows made from the template, whoever submits them, carry the run label; so do their pods.
    spec = template["spec"]
    assert spec["workflowMetadata"]["labels"]["moeloop.dev/run"] == "render-test"
    assert spec["podMetadata"]["labels"] == {"moeloop.dev/run": "render-test"}
    # One chunk of a run at a time: a chained chunk waits for the one that created it.
    assert spec["synchronization"] == {"mutexes": [{"name": "moeloop-run-render-test"}]}
    assert spec["serviceAccountName"] == "moeloop-orchestrator"


def test_schedule_comes_from_the_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    scheduled = make_config(
        tmp_path, cluster={"schedule": {"schedules": ["0 2 * * *", "0 14 * * *"], "timezone": "Europe/Paris"}}
    )
    cron = render(scheduled, RUN_URI)["cron-workflow.yaml"]["spec"]
    assert (cron["schedules"], cron["timezone"]) == (["0 2 * * *", "0 14 * * *"], "Europe/Paris")


def test_next_chunk_is_this_workflows_parameters_on_the_same_template(
    config: MoeloopConfig, documents: dict[str, dict]
) -> None:
    template = documents["workflow-template.yaml"]
    next_chunk = templates_by_name(template)["next-chunk"]
    assert next_chunk["resource"]["action"] == "create" and "setOwnerReference" not in next_chunk["resource"]
    assert next_chunk["serviceAccountName"] == "moeloop-orchestrator"
    # Values Argo substitutes into the manifest's text: quotes, colons, hashes and JSON must survive.
    tricky = {
        "run": "s3://bucket/runs/render-test",
        "iterations": "10000",
        "model": "",
        "chain": "true",
        "config": "# a YAML config\nrun_name: it's: #1 \"quoted\" <b> & \\\\ back\nlist: [1, {c: null}]\n",
    }
    substituted = fill(
        next_chunk["resource"]["manifest"],
        {f"workflow.parameters.{n}": v for n, v in tricky.items()} | {"workflow.name": "render-test-abcde"},
    )
    created = yaml.safe_load(substituted)
    assert created["kind"] == "Workflow" and created["metadata"]["generateName"] == "render-test-"
    assert created["metadata"]["labels"] == {
        "app.kubernetes.io/name": "moeloop",
        "moeloop.dev/run": "render-test",
        "moeloop.dev/chained-from": "render-test-abcde",
    }
    assert created["spec"]["workflowTemplateRef"] == {"name": "moeloop-render-test"}
    assert {name: p["value"] for name, p in parameters(created["spec"]).items()} == tricky
    assert lint_documents([template, created]) == []


def test_label_task_marks_the_workflow_with_its_iterations(documents: dict[str, dict]) -> None:
    template = documents["workflow-template.yaml"]
    label = templates_by_name(template)["label"]
    assert (label["resource"]["action"], label["resource"]["mergeStrategy"]) == ("patch", "merge")
    patch = read_back(label["resource"]["manifest"])
    assert patch["metadata"]["name"] == "{{workflow.name}}"
    assert patch["metadata"]["labels"] == {
        "moeloop.dev/first-iteration": "{{inputs.parameters.first}}",
        "moeloop.dev/last-iteration": "{{inputs.parameters.last}}",
    }
    # plan's outputs reach the template as arguments: a template cannot see the DAG's tasks.
    task = chunk_tasks_by_name(template)["label"]
    assert task["arguments"]["parameters"] == [
        {"name": "first", "value": "{{tasks.plan.outputs.parameters.first}}"},
        {
            "name": "last",
            "value": "{{=asInt(tasks.plan.outputs.parameters.first) + asInt(tasks.plan.outputs.parameters.count) - 1}}",
        },
    ]
    assert task["when"] == "{{tasks.plan.outputs.parameters.count}} >= 1"
    # Pods carry their iteration.
    for step in STEPS:
        labels = templates_by_name(template)[step.name]["metadata"]["labels"]
        assert labels["moeloop.dev/step"] == step.name
        assert labels.get("moeloop.dev/iteration") == (
            "{{inputs.parameters.iteration}}" if step not in (PLAN,) else None
        )


def test_steps_expose_their_figures_as_output_parameters(documents: dict[str, dict]) -> None:
    templates = templates_by_name(documents["workflow-template.yaml"])
    for step in STEPS:
        outputs = templates[step.name]["outputs"]["parameters"]
        assert [p["name"] for p in outputs] == list(step.outputs) and step.outputs
        for parameter in outputs:
            assert parameter["valueFrom"]["path"] == f"/tmp/outputs/{parameter['name']}"
            # A step that skipped its work reports no figures: not a failure. Plan's outputs steer the DAG.
            assert parameter["valueFrom"].get("default") == (None if step is PLAN else "none")
        assert {"name": "MOELOOP_OUTPUTS", "value": "/tmp/outputs"} in templates[step.name]["container"]["env"]
    assert {"first", "count", "more", "latest", "evaluate"} <= set(PLAN.outputs)
    assert "eval_reward_mean" in [p["name"] for p in templates["evaluate"]["outputs"]["parameters"]]


# ---------------------------------------------------------------------------------------------
# Paths the pods read, writing


def shipped_config(document: dict) -> MoeloopConfig:
    """The config the pods get, from the template's `config` parameter."""
    return load_config_argument(parameters(document["spec"])["config"]["value"])


def test_prompt_paths_under_cwd_become_relative(documents: dict[str, dict]) -> None:
    shipped = shipped_config(documents["workflow-template.yaml"])
    assert (shipped.task.train_prompts, shipped.task.eval_prompts) == ("data/train.jsonl", "data/eval.jsonl")


def test_uris_and_relative_paths_pass_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = make_config(tmp_path, train_prompts="s3://bucket/train.jsonl", eval_prompts="data/eval.jsonl")
    shipped = shipped_config(render(config, RUN_URI)["workflow-template.yaml"])
    assert (shipped.task.train_prompts, shipped.task.eval_prompts) == ("s3://bucket/train.jsonl", "data/eval.jsonl")


def test_local_path_outside_cwd_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "repo").mkdir()
    monkeypatch.chdir(tmp_path / "repo")
    with pytest.raises(MoeloopError, match=r"^task.train_prompts: local path .*train.jsonl is not reachable"):
        render(make_config(tmp_path), RUN_URI)


def test_local_checkpoint_outside_cwd_is_refused(config: MoeloopConfig) -> None:
    outside = config.model_copy(update={"model": config.model.model_copy(update={"checkpoint": "/opt/ckpt"})})
    with pytest.raises(MoeloopError, match=r"^model.checkpoint: local path /opt/ckpt is not reachable"):
        render(outside, RUN_URI)


def test_write_rendered_writes_heras_yaml_of_the_objects(
    config: MoeloopConfig, documents: dict[str, dict], tmp_path: Path
) -> None:
    out_dir = tmp_path / "out" / "manifests"
    loop = build(config, RUN_URI)
    paths = write_rendered(loop, out_dir)
    assert paths == [out_dir / name for name in FILES]
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(FILES)
    for path, hera_object in zip(paths, loop.objects().values()):
        assert yaml.safe_load(path.read_text()) == documents[path.name] == hera_object.to_dict()
    # Rendering again replaces the files (and leaves no temporary behind).
    paths[0].write_text("stale")
    assert write_rendered(loop, out_dir) == paths
    assert yaml.safe_load(paths[0].read_text()) == documents[paths[0].name]
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(FILES)


def test_write_rendered_refuses_an_invalid_object_and_writes_nothing(config: MoeloopConfig, tmp_path: Path) -> None:
    loop = build(config, RUN_URI)
    rollout = next(t for t in loop.template.templates if t.name == "rollout")
    rollout.retry_strategy.retry_policy = "Allways"
    out_dir = tmp_path / "out"
    with pytest.raises(MoeloopError, match="^refusing to write an invalid manifest: .*retryPolicy: 'Allways'"):
        write_rendered(loop, out_dir)
    assert not out_dir.exists()


def unwritable_folder(tmp_path: Path) -> Path:
    """A folder this process cannot create files in: a read-only one of its own, or, as root (who may write in
    any other), sysfs, where nobody can."""
    if os.geteuid() == 0:
        return Path("/sys/kernel")
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    return folder


def test_render_onto_a_file_or_into_an_unwritable_folder_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    config_file = tmp_path / "tiny.yaml"
    data = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    data["task"] = {"train_prompts": "s3://b/train.jsonl", "eval_prompts": "s3://b/eval.jsonl"}
    config_file.write_text(yaml.safe_dump(data))
    existing = tmp_path / "rendered.yaml"
    existing.write_text("mine\n")
    result = moeloop("render", str(config_file), "-o", str(existing))
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"error: {existing}: not a folder; -o names the folder to write into\n"
    assert existing.read_text() == "mine\n"

    folder = unwritable_folder(tmp_path)
    result = moeloop("render", str(config_file), "-o", str(folder))
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"error: {folder}: cannot write there: Permission denied\n"
    assert not [name for name in FILES if (folder / name).exists()]
    if folder.is_relative_to(tmp_path):
        assert list(folder.iterdir()) == []


def test_start_is_a_plain_cpu_step(documents: dict[str, dict]) -> None:
    start = templates_by_name(documents["workflow-template.yaml"])[START.name]
    assert start["container"]["command"] == ["python", "-m", "moeloop.steps.start"]
    assert start["nodeSelector"] == {ROLE_TAINT: "cpu"}
