"""Submission through Hera's WorkflowsService, against a local HTTP server standing in for an Argo server."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from jsonschema import Draft4Validator

from steps.config import MoeloopConfig, parse_config
from steps.errors import MoeloopError
from workflows.submit import submit_workflow

SWAGGER = Path(__file__).resolve().parents[1].parent / "shared" / "schemas" / "argo-server-swagger.json"
NAMESPACE = "rl"
TOKEN = "s3cr3t-token-value"
RUN_URI = "s3://moeloop-runs/runs/submit-test"
# Hera 7.1.0's WorkflowsService serialises with pydantic's deprecated `.json()`; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:The `json` method is deprecated:DeprecationWarning")

# (status, JSON body) the stand-in answers for a recorded request.
Responder = Callable[["RecordedRequest"], tuple[int, dict]]


class RecordedRequest:
    def __init__(self, method: str, path: str, headers: dict[str, str], body: dict) -> None:
        self.method, self.path, self.headers, self.body = method, path, headers, body


@pytest.fixture
def config() -> MoeloopConfig:
    return parse_config(
        {
            "run_name": "submit-test",
            "iterations": 2,
            "task": {"train_prompts": "s3://bucket/train.jsonl", "eval_prompts": "s3://bucket/eval.jsonl"},
            "reward": {"functions": [{"path": "steps.rewards:reverse_positions"}]},
            "cluster": {"namespace": "from-config"},
        },
        "test",
    )


@contextmanager
def argo_stand_in(respond: Responder) -> Iterator[tuple[str, list[RecordedRequest]]]:
    """A local HTTP server standing in for an Argo server: records each POST and answers with `respond`."""
    recorded: list[RecordedRequest] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            request = RecordedRequest("POST", self.path, dict(self.headers), body)
            recorded.append(request)
            status, answer = respond(request)
            payload = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: object) -> None:  # keep pytest output clean
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", recorded
    finally:
        server.shutdown()
        server.server_close()


def create_request_errors(body: dict) -> list[str]:
    """Where the body breaks the Argo server's WorkflowCreateRequest definition (Swagger 2.0, draft 4)."""
    definitions = json.loads(SWAGGER.read_text())["definitions"]
    # The upstream definition says string only; Kubernetes and Argo take integers too.
    definitions["io.k8s.apimachinery.pkg.util.intstr.IntOrString"] = {"type": ["integer", "string"]}
    schema = {"$ref": "#/definitions/io.argoproj.workflow.v1alpha1.WorkflowCreateRequest", "definitions": definitions}
    return [f"{list(e.absolute_path)}: {e.message}" for e in Draft4Validator(schema).iter_errors(body)]


def created(request: RecordedRequest) -> tuple[int, dict]:
    """What Argo answers on success: the workflow, named from its generateName."""
    workflow = request.body["workflow"]
    metadata = {**workflow["metadata"], "name": workflow["metadata"]["generateName"] + "x7k2p"}
    return 200, {**workflow, "metadata": metadata}


def test_submit_against_local_stand_in_for_argo_server(config: MoeloopConfig) -> None:
    with argo_stand_in(created) as (host, recorded):
        name = submit_workflow(config, RUN_URI, host=host, namespace=NAMESPACE, token=TOKEN)

    assert name == "submit-test-x7k2p"
    [request] = recorded
    assert (request.method, request.path) == ("POST", f"/api/v1/workflows/{NAMESPACE}")
    assert request.headers["Authorization"] == f"Bearer {TOKEN}"
    assert create_request_errors(request.body) == []
    workflow = request.body["workflow"]
    assert workflow["metadata"]["namespace"] == NAMESPACE  # the namespace asked for, not the config's
    # The run's chunk lives in its registered WorkflowTemplate; the Workflow refers to it.
    assert workflow["spec"]["workflowTemplateRef"] == {"name": f"moeloop-{config.run_name}"}
    assert {p["name"]: p["value"] for p in workflow["spec"]["arguments"]["parameters"]}["run"] == RUN_URI


def test_host_with_a_base_path_keeps_it(config: MoeloopConfig) -> None:
    with argo_stand_in(created) as (host, recorded):
        submit_workflow(config, RUN_URI, host=f"{host}/argo", namespace=NAMESPACE)
    assert recorded[0].path == f"/argo/api/v1/workflows/{NAMESPACE}"
    assert "Authorization" not in recorded[0].headers


def test_server_refusal_is_one_line_naming_host_and_status_without_token(config: MoeloopConfig) -> None:
    def forbidden(request: RecordedRequest) -> tuple[int, dict]:
        # A server echoing the credential it rejected must not make it leak into the message.
        message = f'workflows.argoproj.io is forbidden: token "{TOKEN}" cannot create\nresource "workflows"'
        return 403, {"code": 7, "message": message}

    with argo_stand_in(forbidden) as (host, _):
        with pytest.raises(MoeloopError) as raised:
            submit_workflow(config, RUN_URI, host=host, namespace=NAMESPACE, token=TOKEN)

    message = str(raised.value)
    assert host in message and "403" in message and "forbidden" in message
    assert TOKEN not in message and "\n" not in message


def test_refusal_without_a_json_message_still_names_the_status(config: MoeloopConfig) -> None:
    with argo_stand_in(lambda request: (502, {"error": "bad gateway"})) as (host, _):
        with pytest.raises(MoeloopError, match=r"HTTP 502 Bad Gateway"):
            submit_workflow(config, RUN_URI, host=host, namespace=NAMESPACE, token=TOKEN)


def test_success_without_a_workflow_is_an_error(config: MoeloopConfig) -> None:
    with argo_stand_in(lambda request: (200, {"metadata": "not an object"})) as (host, _):
        with pytest.raises(MoeloopError, match="answered the submission with something other than a Workflow"):
            submit_workflow(config, RUN_URI, host=host, namespace=NAMESPACE)


def test_connection_refused_is_one_line(config: MoeloopConfig) -> None:
    with socket.socket() as probe:  # a port nothing listens on once the probe is closed
        probe.bind(("127.0.0.1", 0))
        host = f"http://127.0.0.1:{probe.getsockname()[1]}"
    with pytest.raises(MoeloopError) as raised:
        submit_workflow(config, RUN_URI, host=host, namespace=NAMESPACE, token=TOKEN)
    message = str(raised.value)
    assert message == f"cannot reach the Argo server at {host}: Connection refused"


def test_host_without_scheme_is_refused(config: MoeloopConfig) -> None:
    with pytest.raises(MoeloopError, match="must start with http:// or https://"):
        submit_workflow(config, RUN_URI, host="argo.example.com", namespace=NAMESPACE)
