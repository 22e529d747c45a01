"""The Argo render: derived from workflows/dag.py, placed by role, lint-clean, written only when valid."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from hera.workflows import Workflow, WorkflowTemplate

from steps.config import MoeloopConfig, parse_config
from steps.errors import MoeloopError
from workflows.dag import STEPS, loop_tasks
from workflows.lint import lint_document
from workflows.local import local_argv
from workflows.render import dag_tasks, render, step_placeholders, write_rendered

RUN_URI = "s3://moeloop-runs/runs/render-test"
SPOT = {"karpenter.sh/capacity-type": "spot"}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def make_config(tmp_path: Path, **task: str) -> MoeloopConfig:
    prompts = tmp_path / "data"
    return parse_config(
        {
            "run_name": "render-test",
            "iterations": 2,
            "task": {
                "train_prompts": str(prompts / "train.jsonl"),
                "eval_prompts": str(prompts / "eval.jsonl"),
                **task,
            },
            "reward": {"functions": [{"path": "steps.rewards:reverse_positions"}]},
            "cluster": {
                "namespace": "rl",
                "service_account": "moeloop-runner",
                "image": "ghcr.io/moeloop/moeloop-cpu:0.1.0",
                "rollout": {
                    "image": "ghcr.io/moeloop/moeloop-gpu:0.1.0",
                    "node_selector": SPOT,
                    "tolerations": [GPU_TOLERATION],
                    "resources": {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"nvidia.com/gpu": "1"}},
                },
                "train": {
                    "image": "ghcr.io/moeloop/moeloop-gpu:0.1.0",
                    "node_selector": {"karpenter.sh/capacity-type": "on-demand"},
                    "tolerations": [GPU_TOLERATION],
                    "resources": {"limits": {"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32"}},
                },
                "cpu": {"resources": {"requests": {"cpu": "1"}}},
            },
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


def run_parameters(document: dict) -> dict[str, dict]:
    return {p["name"]: p for p in document["spec"]["arguments"]["parameters"]}


def test_both_documents_pass_lint(documents: dict[str, dict]) -> None:
    assert set(documents) == {"workflow.yaml", "workflow-template.yaml"}
    for name, document in documents.items():
        assert lint_document(document, source=name) == []


def test_documents_round_trip_through_hera(documents: dict[str, dict]) -> None:
    assert Workflow.from_dict(documents["workflow.yaml"]).to_dict() == documents["workflow.yaml"]
    template = documents["workflow-template.yaml"]
    assert WorkflowTemplate.from_dict(template).to_dict() == template


def test_dag_is_loop_tasks(config: MoeloopConfig, documents: dict[str, dict]) -> None:
    expected = {task.name: tuple(sorted(task.dependencies)) for task in loop_tasks(config)}
    for document in documents.values():
        assert document["spec"]["entrypoint"] == "loop"
        assert dag_tasks(document) == expected
        rendered = {task["name"]: task for task in templates_by_name(document)["loop"]["dag"]["tasks"]}
        for task in loop_tasks(config):
            assert rendered[task.name]["template"] == task.step.name
            assert [(p["name"], p["value"]) for p in rendered[task.name]["arguments"]["parameters"]] == list(
                task.arguments
            )


def test_iterations_override_the_config(config: MoeloopConfig) -> None:
    documents = render(config, RUN_URI, iterations=5)
    assert "it5-eval" in dag_tasks(documents["workflow.yaml"])
    assert "it6-reward" not in dag_tasks(documents["workflow-template.yaml"])


def test_container_argv_is_the_steps_argv(documents: dict[str, dict]) -> None:
    for document in documents.values():
        templates = templates_by_name(document)
        for step in STEPS:
            container = templates[step.name]["container"]
            assert container["command"] + container["args"] == step.argv(step_placeholders(step))
            assert [p["name"] for p in templates[step.name].get("inputs", {}).get("parameters", [])] == list(
                step.params
            )


def test_train_runs_under_torchrun_at_the_configured_world_size(config: MoeloopConfig) -> None:
    """The rendered train template and the local runner start the same torchrun command; world_size 1 none."""
    distributed = config.model_copy(update={"trainer": config.trainer.model_copy(update={"world_size": 2})})
    templates = {t["name"]: t for t in render(distributed, RUN_URI)["workflow.yaml"]["spec"]["templates"]}
    container = templates["train"]["container"]
    assert container["command"] + container["args"] == [
        *("python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "steps.train", "--"),
        *("--run", "{{workflow.parameters.run}}", "--iteration", "{{inputs.parameters.iteration}}"),
    ]
    assert templates["publish"]["container"]["command"] == ["python", "-m", "steps.publish"]
    train = next(t for t in loop_tasks(distributed) if t.step.name == "train")
    filled = [
        a.replace("{{workflow.parameters.run}}", "/runs/x").replace("{{inputs.parameters.iteration}}", "1")
        for a in container["args"]
    ]
    assert local_argv(train, {"run": "/runs/x"}) == [sys.executable, *container["command"][1:], *filled]
    single = next(t for t in loop_tasks(config) if t.step.name == "train")
    assert local_argv(single, {"run": "/runs/x"}) == [
        sys.executable,
        "-m",
        "steps.train",
        "--run",
        "/runs/x",
        "--iteration",
        "1",
    ]


def test_placement_follows_the_steps_role(documents: dict[str, dict]) -> None:
    templates = templates_by_name(documents["workflow.yaml"])
    rollout = templates["rollout"]
    assert rollout["nodeSelector"] == SPOT
    assert rollout["tolerations"] == [GPU_TOLERATION]
    assert rollout["container"]["image"] == "ghcr.io/moeloop/moeloop-gpu:0.1.0"
    assert rollout["container"]["resources"] == {
        "requests": {"cpu": "8", "memory": "64Gi"},
        "limits": {"nvidia.com/gpu": "1"},
    }
    train_limits = templates["train"]["container"]["resources"]["limits"]
    assert train_limits == {"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32"}
    for step in STEPS:
        template = templates[step.name]
        assert template["metadata"]["labels"] == {"moeloop.dev/step": step.name, "moeloop.dev/role": step.role}
        assert template["container"]["imagePullPolicy"] == "IfNotPresent"
        if step.role == "cpu":
            assert "nodeSelector" not in template and "tolerations" not in template
            assert template["container"]["image"] == "ghcr.io/moeloop/moeloop-cpu:0.1.0"
            assert template["container"]["resources"] == {"requests": {"cpu": "1"}}
    # The reward role has no placement: the cluster image, nothing else.
    assert templates["reward"]["container"]["image"] == "ghcr.io/moeloop/moeloop-cpu:0.1.0"
    assert "resources" not in templates["reward"]["container"]


def test_only_rollout_shards_retry_spot_preemption(documents: dict[str, dict]) -> None:
    templates = templates_by_name(documents["workflow.yaml"])
    retry = templates["rollout"]["retryStrategy"]
    assert retry["retryPolicy"] == "Always" and retry["limit"] == 10
    assert retry["backoff"] == {"duration": "30s", "factor": 2, "cap": "1800s"}
    # Lost pods (Error) and signals (143 SIGTERM, 137 SIGKILL) are retried; a step's own error is not.
    assert retry["expression"] == 'lastRetry.status == "Error" || asInt(lastRetry.exitCode) in [137, 143]'
    assert all("retryStrategy" not in t for name, t in templates.items() if name != "rollout")


def test_workflow_metadata_and_run_parameters(config: MoeloopConfig, documents: dict[str, dict]) -> None:
    workflow, template = documents["workflow.yaml"], documents["workflow-template.yaml"]
    assert workflow["kind"] == "Workflow" and workflow["metadata"]["generateName"] == "render-test-"
    assert template["kind"] == "WorkflowTemplate" and template["metadata"]["name"] == "moeloop-render-test"
    for document in documents.values():
        assert document["metadata"]["namespace"] == "rl"
        assert document["metadata"]["labels"] == {"app.kubernetes.io/name": "moeloop", "moeloop.dev/run": "render-test"}
        assert document["spec"]["serviceAccountName"] == "moeloop-runner"
        assert run_parameters(document)["run"]["value"] == RUN_URI
    # The template's parameters carry defaults, which the UI's submit form shows.
    assert {name: p.get("default") for name, p in run_parameters(template).items()} == {
        name: p["value"] for name, p in run_parameters(workflow).items()
    }


def shipped_config(document: dict) -> MoeloopConfig:
    """The config the pods get, from the workflow's `config` parameter."""
    return parse_config(json.loads(run_parameters(document)["config"]["value"]), "rendered")


def test_prompt_paths_under_cwd_become_relative(documents: dict[str, dict]) -> None:
    shipped = shipped_config(documents["workflow.yaml"])
    assert (shipped.task.train_prompts, shipped.task.eval_prompts) == ("data/train.jsonl", "data/eval.jsonl")


def test_uris_and_relative_paths_pass_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = make_config(tmp_path, train_prompts="s3://bucket/train.jsonl", eval_prompts="data/eval.jsonl")
    shipped = shipped_config(render(config, RUN_URI)["workflow.yaml"])
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


def test_write_rendered_writes_valid_documents(documents: dict[str, dict], tmp_path: Path) -> None:
    out_dir = tmp_path / "out" / "manifests"
    paths = write_rendered(documents, out_dir)
    assert paths == [out_dir / "workflow.yaml", out_dir / "workflow-template.yaml"]
    assert sorted(p.name for p in out_dir.iterdir()) == ["workflow-template.yaml", "workflow.yaml"]
    for path in paths:
        assert yaml.safe_load(path.read_text()) == documents[path.name]


def test_write_rendered_refuses_an_invalid_document_and_writes_nothing(
    documents: dict[str, dict], tmp_path: Path
) -> None:
    templates_by_name(documents["workflow-template.yaml"])["rollout"]["container"]["imagePulPolicy"] = "Always"
    out_dir = tmp_path / "out"
    with pytest.raises(MoeloopError, match="^refusing to write an invalid manifest: .*imagePulPolicy"):
        write_rendered(documents, out_dir)
    assert not out_dir.exists()
