"""examples/notify_after_publish.py, run as a user runs it, against the stand-in Argo server: it adds a notify task
after every publish of moeloop's chunk and submits the template and a Workflow through Hera's WorkflowsService."""

from __future__ import annotations

import os
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
        environment = {**os.environ, "PYTHONPATH": str(REPO)}
        result = subprocess.run(
            [sys.executable, "examples/notify_after_publish.py", str(write_config(tmp_path)), "--host", host,
             "--namespace", NAMESPACE, "--root", RUN_URI.rsplit("/", 1)[0], "--webhook", "https://hooks.example.com/rl"],
            cwd=REPO, env=environment, capture_output=True, text=True, timeout=120, check=False,
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
