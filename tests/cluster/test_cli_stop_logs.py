"""`moeloop stop`, `moeloop logs WORKFLOW`, `moeloop status -o json|yaml` and `--watch`, and `-n`, against the
stand-in Argo server answering as Argo's gateway does (the request bodies checked against the server's Swagger)."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.argo_stand_in import (
    NAMESPACE,
    TOKEN,
    RecordedRequest,
    argo_error,
    argo_stand_in,
    log_stream,
    moeloop,
    request_errors,
)
from moeloop.workflows.argo_status import fnv32a, pod_name
from hera.workflows import models as m

pytestmark = pytest.mark.filterwarnings("ignore:The `json` method is deprecated:DeprecationWarning")
WORKFLOWS = f"/api/v1/workflows/{NAMESPACE}"
NAME = "cluster-test-x7k2p"


def workflow(name: str, phase: str, nodes: list[dict] | None = None, created: str = "2026-11-29T12:00:00Z") -> dict:
    status = {"phase": phase, "progress": "3/14", "startedAt": "2026-11-29T12:00:00Z"}
    if phase in ("Succeeded", "Failed"):
        status["finishedAt"] = "2026-11-29T13:00:00Z"
    if nodes:
        status["nodes"] = {node["id"]: node for node in nodes}
    return {
        "metadata": {"name": name, "namespace": NAMESPACE, "creationTimestamp": created,
                     "labels": {"moeloop.dev/run": "cluster-test"}},
        "spec": {"entrypoint": "chunk"},
        "status": status,
    }  # fmt: skip


def answered_with(document: dict):
    return lambda request: (200, document)


def test_stop_and_terminate_use_argos_endpoints() -> None:
    for flag, endpoint, definition, printed in (
        ((), "stop", "WorkflowStopRequest", "stopped"),
        (("--terminate",), "terminate", "WorkflowTerminateRequest", "terminated"),
    ):
        routes = {
            ("GET", f"{WORKFLOWS}/{NAME}"): answered_with(workflow(NAME, "Running")),
            ("PUT", f"{WORKFLOWS}/{NAME}/{endpoint}"): answered_with(workflow(NAME, "Running")),
        }
        with argo_stand_in(routes) as (host, recorded):
            result = moeloop("stop", NAME, *flag, "--host", host, "-n", NAMESPACE, env={"ARGO_TOKEN": TOKEN})
        assert (result.returncode, result.stdout) == (0, f"{NAME} {printed}\n"), result.stderr
        request = recorded[-1]
        assert (request.method, request.path) == ("PUT", f"{WORKFLOWS}/{NAME}/{endpoint}")
        assert request.body == {"name": NAME, "namespace": NAMESPACE}
        assert request_errors(request.body, definition) == []
        assert request.headers["Authorization"] == f"Bearer {TOKEN}"


def test_stop_of_a_run_stops_only_its_unfinished_workflows() -> None:
    chunks = [
        workflow("cluster-test-aaaaa", "Succeeded"),
        workflow("cluster-test-bbbbb", "Running", created="2026-11-30T12:00:00Z"),
    ]
    routes = {
        ("GET", WORKFLOWS): answered_with({"metadata": {}, "items": chunks}),
        ("PUT", f"{WORKFLOWS}/cluster-test-bbbbb/stop"): answered_with(chunks[1]),
    }
    with argo_stand_in(routes) as (host, recorded):
        result = moeloop("stop", "--run", "cluster-test", "--host", host, "--namespace", NAMESPACE)
    assert (result.returncode, result.stdout) == (0, "cluster-test-bbbbb stopped\n"), result.stderr
    stopped = ("PUT", f"{WORKFLOWS}/cluster-test-bbbbb/stop")
    assert [(r.method, r.path) for r in recorded] == [("GET", WORKFLOWS), stopped]
    assert recorded[0].query["listOptions.labelSelector"] == "moeloop.dev/run=cluster-test"


def test_stop_of_a_finished_workflow_is_one_error_line() -> None:
    finished = {("GET", f"{WORKFLOWS}/{NAME}"): answered_with(workflow(NAME, "Succeeded"))}
    with argo_stand_in(finished) as (host, recorded):
        result = moeloop("stop", NAME, "--host", host, "--namespace", NAMESPACE)
    assert (result.returncode, result.stderr) == (2, f"error: nothing to stop: {NAME} finished already\n")
    assert [r.method for r in recorded] == ["GET"]


def test_pod_names_are_argos() -> None:
    """FNV-1a as Argo's UI tests it (ui/src/shared/pod-name.test.ts), and GeneratePodName's v2 and v1 names."""
    assert (fnv32a("hello"), fnv32a("world"), fnv32a("こんにちは")) == (1335831723, 933488787, 486186189)
    node = m.NodeStatus(id="wfname-1", name="nodename", type="Pod", template_name="templatename")
    named = m.Workflow(metadata=m.ObjectMeta(name="wfname"), spec=m.WorkflowSpec())
    assert pod_name(named, node) == f"wfname-templatename-{fnv32a('nodename')}"
    long_name = m.Workflow(metadata=m.ObjectMeta(name="w" * 200), spec=m.WorkflowSpec())
    assert pod_name(long_name, node) == f"{('w' * 200 + '-templatename')[:242]}-{fnv32a('nodename')}"
    v1 = m.Workflow(metadata=m.ObjectMeta(name="wfname", annotations={"workflows.argoproj.io/pod-name-format": "v1"}),
                    spec=m.WorkflowSpec())  # fmt: skip
    assert pod_name(v1, node) == "wfname-1"


def chunk_nodes() -> list[dict]:
    """A chunk whose slot1-rollout ran 2 shards, as Argo records a task of items (workflow/controller/dag.go): the
    task's TaskGroup node, and an item node slot1-rollout(k:k) a shard, whose retries are its children; shard 1's
    pod was lost on Spot once and retried. And its train step ran."""
    def node(node_id: str, display: str, kind: str, template: str | None, started: str, **more: object) -> dict:
        return {"id": node_id, "name": f"{NAME}.{display}", "displayName": display, "type": kind, "phase": "Succeeded",
                "startedAt": started, **({"templateName": template} if template else {}), **more}  # fmt: skip

    return [
        node(NAME, NAME, "DAG", "chunk", "2026-11-29T12:00:00Z", children=[f"{NAME}-1", f"{NAME}-2"]),
        node(f"{NAME}-1", "slot1-rollout", "TaskGroup", "rollout", "2026-11-29T12:01:00Z",
             children=[f"{NAME}-5", f"{NAME}-6"]),
        node(f"{NAME}-5", "slot1-rollout(0:0)", "Retry", "rollout", "2026-11-29T12:01:00Z", children=[f"{NAME}-7"],
             inputs={"parameters": [{"name": "shard", "value": "0"}]}),
        node(f"{NAME}-7", "slot1-rollout(0:0)(0)", "Pod", "rollout", "2026-11-29T12:01:01Z"),
        node(f"{NAME}-6", "slot1-rollout(1:1)", "Retry", "rollout", "2026-11-29T12:01:00Z",
             children=[f"{NAME}-3", f"{NAME}-4"], inputs={"parameters": [{"name": "shard", "value": "1"}]}),
        node(f"{NAME}-3", "slot1-rollout(1:1)(0)", "Pod", "rollout", "2026-11-29T12:01:00Z"),
        node(f"{NAME}-4", "slot1-rollout(1:1)(1)", "Pod", "rollout", "2026-11-29T12:03:00Z"),
        node(f"{NAME}-2", "slot1-train", "Pod", "train", "2026-11-29T12:05:00Z"),
    ]  # fmt: skip


def expected_pod(display: str, template: str) -> str:
    return f"{NAME}-{template}-{fnv32a(f'{NAME}.{display}')}"


def pod_logs(request: RecordedRequest) -> tuple[int, bytes]:
    pod = request.query["podName"]
    return 200, log_stream(pod, [f"line 1 of {pod}", f"line 2 of {pod}"])


def test_logs_of_a_task_come_from_the_server_log_api_for_each_of_its_pods() -> None:
    routes = {
        ("GET", f"{WORKFLOWS}/{NAME}"): answered_with(workflow(NAME, "Running", chunk_nodes())),
        ("GET", f"{WORKFLOWS}/{NAME}/log"): pod_logs,
    }
    with argo_stand_in(routes) as (host, recorded):
        train = moeloop("logs", NAME, "slot1-train", "--host", host, "-n", NAMESPACE, env={"ARGO_TOKEN": TOKEN})
        shard = {name: moeloop("logs", NAME, name, "--host", host, "-n", NAMESPACE)
                 for name in ("slot1-rollout(1:1)", "slot1-rollout-1", "slot1-rollout")}  # fmt: skip
    pod = expected_pod("slot1-train", "train")
    assert (train.returncode, train.stdout) == (0, f"line 1 of {pod}\nline 2 of {pod}\n"), train.stderr
    log_request = recorded[1]
    assert log_request.query == {"podName": pod, "logOptions.container": "main"}
    assert log_request.headers["Authorization"] == f"Bearer {TOKEN}"
    # Shard 1, by its item node's name or by dag.py's name for it: each attempt of its retried pod, in the order
    # they ran, its lines named by the attempt.
    first, second = expected_pod("slot1-rollout(1:1)(0)", "rollout"), expected_pod("slot1-rollout(1:1)(1)", "rollout")
    for name in ("slot1-rollout(1:1)", "slot1-rollout-1"):
        assert shard[name].returncode == 0, shard[name].stderr
        assert shard[name].stdout.splitlines() == [
            f"slot1-rollout(1:1)(0): line 1 of {first}", f"slot1-rollout(1:1)(0): line 2 of {first}",
            f"slot1-rollout(1:1)(1): line 1 of {second}", f"slot1-rollout(1:1)(1): line 2 of {second}",
        ]  # fmt: skip
    # The chunk's task: every shard's pods.
    zero = expected_pod("slot1-rollout(0:0)(0)", "rollout")
    assert [line.split(": ")[0] for line in shard["slot1-rollout"].stdout.splitlines()[::2]] == [
        "slot1-rollout(1:1)(0)", "slot1-rollout(0:0)(0)", "slot1-rollout(1:1)(1)"
    ]  # fmt: skip
    assert f"line 1 of {zero}" in shard["slot1-rollout"].stdout


def test_logs_refusals_are_one_line() -> None:
    routes = {
        ("GET", f"{WORKFLOWS}/{NAME}"): answered_with(workflow(NAME, "Running", chunk_nodes())),
        ("GET", f"{WORKFLOWS}/{NAME}/log"): lambda request: (
            200,
            json.dumps({"error": {"grpc_code": 5, "http_code": 404, "message": 'pods "x" not found'}}).encode() + b"\n",
        ),
    }
    with argo_stand_in(routes) as (host, _):
        missing_task = moeloop("logs", NAME, "slot9-train", "--host", host, "-n", NAMESPACE)
        gone = moeloop("logs", NAME, "slot1-train", "--host", host, "-n", NAMESPACE)
    assert missing_task.returncode == 2
    assert missing_task.stderr == f"error: Workflow {NAME} has no task 'slot9-train' (yet)\n"
    pod = expected_pod("slot1-train", "train")
    assert gone.returncode == 2 and gone.stderr.count("\n") == 1
    assert f"could not get the log of pod {pod} of Workflow {NAMESPACE}/{NAME}: pods \"x\" not found" in gone.stderr


def test_status_as_json_and_yaml_is_the_tables_data() -> None:
    document = workflow(NAME, "Running")
    with argo_stand_in({("GET", f"{WORKFLOWS}/{NAME}"): answered_with(document)}) as (host, _):
        as_json = moeloop("status", NAME, "-o", "json", "--host", host, "-n", NAMESPACE)
        as_yaml = moeloop("status", NAME, "--output", "yaml", "--host", host, "-n", NAMESPACE)
    expected = {"name": NAME, "phase": "Running", "progress": "3/14", "started": "2026-11-29T12:00:00Z",
                "finished": None, "message": None, "failed": []}  # fmt: skip
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout) == expected
    assert yaml.safe_load(as_yaml.stdout) == expected


def test_status_watch_prints_each_change_until_the_workflow_finishes() -> None:
    answers = iter([workflow(NAME, "Running"), workflow(NAME, "Running"), workflow(NAME, "Failed")])
    with argo_stand_in({("GET", f"{WORKFLOWS}/{NAME}"): lambda request: (200, next(answers))}) as (host, recorded):
        result = moeloop("status", NAME, "--watch", "--interval", "0.05", "-o", "json", "--host", host, "-n", NAMESPACE)
    assert result.returncode == 1, result.stderr  # it ended Failed
    assert [json.loads(line)["phase"] for line in result.stdout.splitlines()] == ["Running", "Failed"]
    assert len(recorded) == 3


def test_watch_interval_must_be_positive() -> None:
    result = moeloop("status", NAME, "--watch", "--interval", "0", "--host", "http://127.0.0.1:9", "-n", NAMESPACE)
    assert (result.returncode, result.stderr) == (2, "error: --interval must be positive, not 0\n")


def test_a_reply_without_a_field_names_it() -> None:
    lacking = {"metadata": {"name": NAME}}  # no spec: Hera's Workflow needs one
    with argo_stand_in({("GET", f"{WORKFLOWS}/{NAME}"): answered_with(lacking)}) as (host, _):
        result = moeloop("status", NAME, "--host", host, "-n", NAMESPACE)
    assert result.returncode == 2
    assert result.stderr == (
        f"error: Argo server {host} did not answer get Workflow {NAMESPACE}/{NAME} with the expected object: no spec\n"
    )


def test_refused_stop_is_one_line() -> None:
    routes = {
        ("GET", f"{WORKFLOWS}/{NAME}"): answered_with(workflow(NAME, "Running")),
        ("PUT", f"{WORKFLOWS}/{NAME}/stop"): lambda request: argo_error(403, "forbidden: cannot update workflows"),
    }
    with argo_stand_in(routes) as (host, _):
        result = moeloop("stop", NAME, "--host", host, "-n", NAMESPACE)
    assert result.returncode == 2
    assert result.stderr == (
        f"error: Argo server {host} could not stop Workflow {NAMESPACE}/{NAME}: HTTP 403 Forbidden:"
        " forbidden: cannot update workflows\n"
    )
