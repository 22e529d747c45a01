"""`moeloop status`: one workflow (phase, progress, times, failed steps) or a run's workflows by label,
against a local stand-in for an Argo server answering with Workflows as Argo reports them."""

from __future__ import annotations

import pytest

from tests.argo_stand_in import NAMESPACE, TOKEN, argo_error, argo_stand_in, moeloop

pytestmark = pytest.mark.filterwarnings("ignore:The `json` method is deprecated:DeprecationWarning")
WORKFLOWS = f"/api/v1/workflows/{NAMESPACE}"
NAME = "cluster-test-x7k2p"


def node(node_id: str, display_name: str, kind: str, phase: str, started: str, **fields: object) -> dict:
    return {
        "id": node_id,
        "name": f"{NAME}.{display_name}",
        "displayName": display_name,
        "type": kind,
        "phase": phase,
        "startedAt": started,
        **fields,
    }


def failed_workflow() -> dict:
    """Slot 1's train step failed; a rollout shard's first pod was lost on Spot and its retry succeeded. The shards
    are the items of one task, as Argo records them: a TaskGroup node, an item node slot1-rollout(k:k) a shard,
    its retries that item's children."""
    nodes = [
        node(
            NAME,
            NAME,
            "DAG",
            "Failed",
            "2026-11-29T12:00:00Z",
            message=f"child '{NAME}-3196' failed",
            children=[f"{NAME}-1001", f"{NAME}-2000", f"{NAME}-3196"],
        ),
        node(f"{NAME}-1001", "start", "Pod", "Succeeded", "2026-11-29T12:00:01Z"),
        node(
            f"{NAME}-2000",
            "slot1-rollout",
            "TaskGroup",
            "Succeeded",
            "2026-11-29T12:01:00Z",
            children=[f"{NAME}-2001", f"{NAME}-2011"],
        ),
        node(
            f"{NAME}-2001",
            "slot1-rollout(0:0)",
            "Retry",
            "Succeeded",
            "2026-11-29T12:01:00Z",
            children=[f"{NAME}-2002", f"{NAME}-2003"],
        ),
        node(
            f"{NAME}-2002",
            "slot1-rollout(0:0)(0)",
            "Pod",
            "Failed",
            "2026-11-29T12:01:00Z",
            message="Error (exit code 143)",
        ),
        node(f"{NAME}-2003", "slot1-rollout(0:0)(1)", "Pod", "Succeeded", "2026-11-29T12:03:00Z"),
        node(
            f"{NAME}-2011",
            "slot1-rollout(1:1)",
            "Retry",
            "Succeeded",
            "2026-11-29T12:01:00Z",
            children=[f"{NAME}-2012"],
        ),
        node(f"{NAME}-2012", "slot1-rollout(1:1)(0)", "Pod", "Succeeded", "2026-11-29T12:01:00Z"),
        node(
            f"{NAME}-3196",
            "slot1-train",
            "Pod",
            "Failed",
            "2026-11-29T12:05:00Z",
            message="Error (exit code 1):\n  CUDA out of memory",
        ),
    ]
    return {
        "metadata": {"name": NAME, "namespace": NAMESPACE, "labels": {"moeloop.dev/run": "cluster-test"}},
        "spec": {"entrypoint": "chunk"},
        "status": {
            "phase": "Failed",
            "progress": "3/4",
            "startedAt": "2026-11-29T12:00:00Z",
            "finishedAt": "2026-11-29T12:09:30Z",
            "message": f"child '{NAME}-3196' failed",
            "nodes": {n["id"]: n for n in nodes},
        },
    }


def status(*args: str, host: str) -> tuple[int, list[str], str]:
    result = moeloop("status", *args, "--host", host, "--namespace", NAMESPACE, env={"ARGO_TOKEN": TOKEN})
    return result.returncode, result.stdout.splitlines(), result.stderr


def test_status_of_a_failed_workflow_names_the_failed_step_and_exits_1() -> None:
    with argo_stand_in({("GET", f"{WORKFLOWS}/{NAME}"): lambda request: (200, failed_workflow())}) as (host, recorded):
        returncode, lines, stderr = status(NAME, host=host)

    assert returncode == 1, stderr
    assert lines == [
        f"name      {NAME}",
        "phase     Failed",
        "progress  3/4",
        "started   2026-11-29T12:00:00Z",
        "finished  2026-11-29T12:09:30Z",
        f"message   child '{NAME}-3196' failed",
        # Only the step that failed the run: its DAG parent says nothing more, and the rollout recovered.
        "failed    slot1-train: Failed: Error (exit code 1): CUDA out of memory",
    ]
    [request] = recorded
    assert (request.method, request.path) == ("GET", f"{WORKFLOWS}/{NAME}")
    assert request.headers["Authorization"] == f"Bearer {TOKEN}"


def test_status_of_a_running_workflow_exits_0() -> None:
    running = failed_workflow()
    running["status"] = {"phase": "Running", "progress": "1/4", "startedAt": "2026-11-29T12:00:00Z"}
    with argo_stand_in({("GET", f"{WORKFLOWS}/{NAME}"): lambda request: (200, running)}) as (host, _):
        returncode, lines, stderr = status(NAME, host=host)

    assert returncode == 0, stderr
    assert lines == [
        f"name      {NAME}",
        "phase     Running",
        "progress  1/4",
        "started   2026-11-29T12:00:00Z",
        "finished  -",
    ]


def test_status_of_a_missing_workflow_is_one_error_line_with_exit_2() -> None:
    not_found = f'workflows.argoproj.io "{NAME}" not found'
    with argo_stand_in({("GET", f"{WORKFLOWS}/{NAME}"): lambda request: argo_error(404, not_found)}) as (host, _):
        returncode, lines, stderr = status(NAME, host=host)

    assert (returncode, lines) == (2, [])
    expected = f"Argo server {host} could not get Workflow {NAMESPACE}/{NAME}: HTTP 404 Not Found: {not_found}"
    assert stderr.splitlines() == [f"error: {expected}"]


def chunk(name: str, created: str, phase: str, progress: str, finished: str | None, message: str = "") -> dict:
    workflow_status = {"phase": phase, "progress": progress, "startedAt": created, "message": message}
    if finished:
        workflow_status["finishedAt"] = finished
    return {
        "metadata": {"name": name, "namespace": NAMESPACE, "creationTimestamp": created},
        "spec": {"entrypoint": "chunk"},
        "status": {key: value for key, value in workflow_status.items() if value},
    }


def test_status_of_a_run_lists_its_workflows_oldest_first_and_exits_by_the_newest() -> None:
    # Listed in the server's order (not creation order): a failed chunk, its resubmission, the next chunk.
    workflows = [
        chunk("cluster-test-b2", "2026-11-29T13:00:00Z", "Succeeded", "6/6", "2026-11-29T13:40:00Z"),
        chunk("cluster-test-a1", "2026-11-29T12:00:00Z", "Failed", "3/6", "2026-11-29T12:20:00Z", "child failed"),
        chunk("cluster-test-c3", "2026-11-29T14:00:00Z", "Running", "2/6", None),
    ]
    answer = {"metadata": {"resourceVersion": "77"}, "items": workflows}
    with argo_stand_in({("GET", WORKFLOWS): lambda request: (200, answer)}) as (host, recorded):
        returncode, lines, stderr = status("--run", "cluster-test", host=host)

    assert returncode == 0, stderr
    assert lines == [
        "NAME             PHASE      PROGRESS  STARTED               FINISHED              MESSAGE",
        "cluster-test-a1  Failed     3/6       2026-11-29T12:00:00Z  2026-11-29T12:20:00Z  child failed",
        "cluster-test-b2  Succeeded  6/6       2026-11-29T13:00:00Z  2026-11-29T13:40:00Z",
        "cluster-test-c3  Running    2/6       2026-11-29T14:00:00Z  -",
    ]
    [request] = recorded
    assert request.query == {
        "listOptions.labelSelector": "moeloop.dev/run=cluster-test",
        "fields": "-items.status.nodes,-items.status.storedTemplates",
    }

    workflows[2]["status"]["phase"] = "Error"  # the newest failing fails the run
    with argo_stand_in({("GET", WORKFLOWS): lambda request: (200, answer)}) as (host, _):
        assert status("--run", "cluster-test", host=host)[0] == 1


def test_status_of_a_run_without_workflows_is_an_error() -> None:
    empty = {"metadata": {"resourceVersion": "77"}}  # Argo leaves out an empty `items`
    with argo_stand_in({("GET", WORKFLOWS): lambda request: (200, empty)}) as (host, _):
        returncode, lines, stderr = status("--run", "cluster-test", host=host)
    assert (returncode, lines) == (2, [])
    assert stderr == (
        f"error: Argo server {host} has no Workflows labelled moeloop.dev/run=cluster-test in {NAMESPACE}\n"
    )


@pytest.mark.parametrize("args", [(), (NAME, "--run", "cluster-test")], ids=["neither", "both"])
def test_status_takes_a_name_or_a_run(args: tuple[str, ...]) -> None:
    returncode, lines, stderr = status(*args, host="http://127.0.0.1:9")
    assert (returncode, lines, stderr) == (2, [], "error: give either a workflow NAME or --run RUN_NAME\n")
