"""examples/notify_after_publish.py, run as a user runs it, against the stand-in Argo server: it adds a notify task
after every publish of moeloop's chunk and submits the template and a Workflow through Hera's WorkflowsService."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from tests.argo_stand_in import (
    NAMESPACE,
    RUN_URI,
    RecordedRequest,
    argo_error,
    argo_stand_in,
    cluster_config,
    request_errors,
    write_config,
)
from tests.conftest import REPO
from tests.processes import run_command
from moeloop.workflows.lint.documents import lint_document
from moeloop.workflows.render.loop import render

TEMPLATES, WORKFLOWS = f"/api/v1/workflow-templates/{NAMESPACE}", f"/api/v1/workflows/{NAMESPACE}"
TEMPLATE_NAME = "moeloop-cluster-test"


def stored(key: str) -> object:
    def answer(request: RecordedRequest) -> tuple[int, dict]:
        document = request.body[key]
        metadata = {**document["metadata"], "uid": "1b7e", "resourceVersion": "1"}
        if "generateName" in metadata:
            metadata["name"] = metadata["generateName"] + "x7k2p"
        return 200, {**document, "metadata": metadata}

    return answer


def test_the_example_adds_a_task_after_each_publish_and_submits_with_hera(tmp_path: Path) -> None:
    routes = {
        ("GET", f"{TEMPLATES}/{TEMPLATE_NAME}"): lambda request: argo_error(404, "not found"),
        ("POST", TEMPLATES): stored("template"),
        ("POST", WORKFLOWS): stored("workflow"),
    }
    with argo_stand_in(routes) as (host, recorded):
        result = run_command(
            [sys.executable, "examples/notify_after_publish.py", str(write_config(tmp_path)), "--host", host,
             "--namespace", NAMESPACE, "--root", RUN_URI.rsplit("/", 1)[0], "--webhook", "https://hooks.example.com/rl"],
            timeout=120,
        )  # fmt: skip
    assert (result.returncode, result.stdout) == (0, "cluster-test-x7k2p\n"), result.stderr
    assert [(r.method, r.path) for r in recorded] == [
        ("GET", f"{TEMPLATES}/{TEMPLATE_NAME}"),  # Hera's update(): it does not exist yet, so ...
        ("POST", TEMPLATES),  # ... create it
        ("POST", WORKFLOWS),
    ]
    _, template_request, workflow_request = recorded
    assert request_errors(template_request.body, "WorkflowTemplateCreateRequest") == []
    assert request_errors(workflow_request.body, "WorkflowCreateRequest") == []
    template, workflow = template_request.body["template"], workflow_request.body["workflow"]
    assert lint_document(template) == [] and lint_document(workflow) == []

    rendered = render(cluster_config(), RUN_URI)
    plain = rendered["workflow-template.yaml"]
    chunk = template["spec"]["templates"][0]["dag"]["tasks"]
    added = [task for task in chunk if task["name"].endswith("-notify")]
    publishes = [task for task in chunk if task["template"] == "publish"]
    assert len(added) == len(publishes) == 20  # every slot of the chunk
    for publish, notify in zip(publishes, added):
        assert notify == {
            "name": publish["name"].replace("-publish", "-notify"),
            "template": "notify",
            "arguments": publish["arguments"],
            "dependencies": [publish["name"]],
            "when": publish["when"],
        }
    notify_template = template["spec"]["templates"][-1]
    assert notify_template["name"] == "notify" and notify_template["container"]["command"][-1] == "https://hooks.example.com/rl"
    assert notify_template["nodeSelector"] == {"moeloop.dev/role": "cpu"}
    # Apart from the additions, what was sent is moeloop's render, in the namespace asked for.
    template["spec"]["templates"] = template["spec"]["templates"][:-1]
    template["spec"]["templates"][0]["dag"]["tasks"] = [task for task in chunk if task not in added]
    assert template == {**plain, "metadata": {**plain["metadata"], "namespace": NAMESPACE}}
    assert workflow == {**rendered["workflow.yaml"], "metadata": {**rendered["workflow.yaml"]["metadata"], "namespace": NAMESPACE}}


pytestmark = pytest.mark.filterwarnings("ignore:The `json` method is deprecated:DeprecationWarning")


EKS = REPO / "configs" / "eks.yaml"


def run_example(config: Path, host: str, *more: str) -> subprocess.CompletedProcess[str]:
    return run_command(
        [sys.executable, "examples/notify_after_publish.py", str(config), "--host", host, "--namespace", NAMESPACE,
         "--root", "s3://moeloop-runs/runs", *more],
        timeout=120,
    )  # fmt: skip


def eks_with(tmp_path: Path, chunk_iterations: int) -> Path:
    """configs/eks.yaml (8 shards, a JobSet) with cluster.chunk_iterations set, beside its data."""
    path = tmp_path / "eks.yaml"
    chunk = f"  train_nodes: 2\n  chunk_iterations: {chunk_iterations}"
    path.write_text(EKS.read_text().replace("  train_nodes: 2", chunk))
    if not (tmp_path / "data").exists():
        (tmp_path / "data").symlink_to(REPO / "configs" / "data")
    return path


def test_the_example_on_the_8_shard_jobset_config_fits_argos_200_tasks(tmp_path: Path) -> None:
    """configs/eks.yaml's 8 shards are one task of 8 items, so an iteration is 5 tasks and a notify task makes it 6:
    32 iterations fill a chunk to 197 tasks, and what is sent lints clean, as moeloop render's objects do."""
    routes = {
        ("GET", f"{TEMPLATES}/moeloop-tiny-eks"): lambda request: argo_error(404, "not found"),
        ("POST", TEMPLATES): stored("template"),
        ("POST", WORKFLOWS): stored("workflow"),
    }
    with argo_stand_in(routes) as (host, recorded):
        result = run_example(eks_with(tmp_path, 32), host)
    assert (result.returncode, result.stdout) == (0, "tiny-eks-x7k2p\n"), result.stderr
    template = recorded[1].body["template"]
    assert request_errors(recorded[1].body, "WorkflowTemplateCreateRequest") == []
    assert lint_document(template) == [] and lint_document(recorded[2].body["workflow"]) == []
    chunk = template["spec"]["templates"][0]["dag"]["tasks"]
    assert len(chunk) == 5 + 32 * 6 == 197
    assert len([task for task in chunk if task["name"].endswith("-notify")]) == 32
    plan = next(task for task in chunk if task["name"] == "plan")
    assert {"name": "chunk", "value": "32"} in plan["arguments"]["parameters"]


def test_the_example_sends_nothing_that_does_not_lint(tmp_path: Path) -> None:
    """Without the room, a chunk full at 39 iterations of 5 tasks is over Argo's limit with the notify tasks, and
    lint says so; the example asks for the room, so what it refuses is anything else that does not lint, e.g. a
    webhook with an Argo expression in it, and a chunk_iterations set too large for the added task."""
    from moeloop.steps.config import load_config
    from moeloop.workflows.dag import run_uri
    from moeloop.workflows.render.loop import build

    example = runpy.run_path(str(REPO / "examples" / "notify_after_publish.py"))
    config = load_config(eks_with(tmp_path, 39))
    plain = build(config, run_uri(config, "s3://moeloop-runs/runs"))
    assert len(plain.chunk.tasks) == 5 + 39 * 5 == 200
    crowded = example["with_notifications"](plain, "https://h.example.com")
    assert any("dag.tasks" in str(error) and "200" in str(error) for error in lint_document(crowded.template.to_dict()))

    with argo_stand_in({}) as (host, recorded):
        expression = run_example(EKS, host, "--webhook", "https://h.example.com/{{inputs.parameters.token}}")
        too_many = run_example(eks_with(tmp_path, 33), host)
    assert recorded == []
    assert expression.returncode == 2 and "inputs.parameters.token" in expression.stderr
    assert expression.stderr.splitlines()[-1] == "error: 1 lint error(s): nothing sent"
    assert (too_many.returncode, too_many.stderr) == (
        2,
        "error: cluster.chunk_iterations 33 makes a Workflow of more than 200 tasks at 6 tasks per iteration"
        " (1 of your own); at most 32\n",
    )
