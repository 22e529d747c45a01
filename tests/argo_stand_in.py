"""A local HTTP server standing in for an Argo server, which cannot run here (it needs a Kubernetes API).

It records every request (method, path, query, headers, JSON body) and answers from the test's routes as
the Argo server's gateway does: the object on success, `{"code": <gRPC code>, "message": ...}` on an error.
Also: the check of a request body, and `moeloop` run as a subprocess.

A request body is checked against the Argo server's own Swagger where the upstream files are there
($MOELOOP_SHARED, tests/upstream.py). Without them it is checked against what the package carries: the request's
fields (written here from that Swagger, closed) and the object in it with moeloop's lint, whose schema is Hera's
models with the CRDs' facts. So the tests that talk to this server run on a fresh clone too.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from jsonschema import Draft4Validator

from moeloop.steps.config import MoeloopConfig, parse_config
from tests.processes import moeloop_cli
from tests.upstream import available, upstream
from moeloop.workflows.lint.documents import lint_document

NAMESPACE = "rl"
TOKEN = "s3cr3t-token-value"
RUN_URI = "s3://moeloop-runs/runs/cluster-test"
# The gRPC code behind each HTTP status the Argo server answers with (grpc-gateway's mapping; Argo turns a
# Kubernetes NotFound into NotFound, AlreadyExists into AlreadyExists, and so on; anything else is Unknown).
GRPC_CODES = {400: 3, 401: 16, 403: 7, 404: 5, 409: 6, 500: 2, 502: 14}

Answer = tuple[int, object]  # (HTTP status, JSON body)


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str  # without the query
    query: dict[str, str]
    headers: dict[str, str]
    body: dict | None


Route = Callable[[RecordedRequest], Answer]


def argo_error(status: int, message: str) -> Answer:
    return status, {"code": GRPC_CODES[status], "message": message}


def cluster_config() -> MoeloopConfig:
    return parse_config(
        {
            "run_name": "cluster-test",
            "iterations": 2,
            "task": {"train_prompts": "s3://bucket/train.jsonl", "eval_prompts": "s3://bucket/eval.jsonl"},
            "reward": {"functions": [{"path": "moeloop.steps.rewards:reverse_positions"}]},
            "cluster": {"namespace": "from-config"},
        },
        "test",
    )


def write_config(folder: Path) -> Path:
    """`cluster_config` as a file for the CLI (JSON is YAML)."""
    path = folder / "cluster-test.yaml"
    path.write_text(cluster_config().to_json())
    return path


@contextmanager
def argo_stand_in(routes: Mapping[tuple[str, str], Route]) -> Iterator[tuple[str, list[RecordedRequest]]]:
    """Serve `routes`, keyed by (method, path); any other request gets the gateway's 404. Yields the URL
    and the list of requests received so far."""
    recorded: list[RecordedRequest] = []

    class Handler(BaseHTTPRequestHandler):
        def _handle(self) -> None:
            url = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            query = {key: values[-1] for key, values in parse_qs(url.query).items()}
            request = RecordedRequest(self.command, url.path, query, dict(self.headers), body)
            recorded.append(request)
            route = routes.get((self.command, url.path))
            status, answer = route(request) if route else argo_error(404, "Not Found")
            payload = answer if isinstance(answer, bytes) else json.dumps(answer).encode()  # bytes: a stream, as is
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = do_PUT = _handle

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


# The requests' fields in the Argo server's Swagger (v4.1): field -> JSON type, or the Argo kind of the object it holds.
REQUEST_FIELDS: dict[str, dict[str, str]] = {
    "WorkflowCreateRequest": {
        "createOptions": "object", "instanceID": "string", "namespace": "string", "serverDryRun": "boolean",
        "workflow": "Workflow",
    },
    "WorkflowTemplateCreateRequest": {"createOptions": "object", "namespace": "string", "template": "WorkflowTemplate"},
    "WorkflowTemplateUpdateRequest": {"name": "string", "namespace": "string", "template": "WorkflowTemplate"},
    "CreateCronWorkflowRequest": {"createOptions": "object", "cronWorkflow": "CronWorkflow", "namespace": "string"},
    "UpdateCronWorkflowRequest": {"cronWorkflow": "CronWorkflow", "name": "string", "namespace": "string"},
    "WorkflowResubmitRequest": {"memoized": "boolean", "name": "string", "namespace": "string", "parameters": "array"},
    "WorkflowStopRequest": {
        "message": "string", "name": "string", "namespace": "string", "nodeFieldSelector": "string",
    },
    "WorkflowTerminateRequest": {"name": "string", "namespace": "string"},
}  # fmt: skip
JSON_TYPES = {"object": dict, "string": str, "boolean": bool, "array": list}


@cache
def _swagger_definitions() -> dict:
    definitions = json.loads(upstream("schemas", "argo-server-swagger.json").read_text())["definitions"]
    # The upstream definition says string only; Kubernetes and Argo take integers too.
    definitions["io.k8s.apimachinery.pkg.util.intstr.IntOrString"] = {"type": ["integer", "string"]}
    return definitions


def request_errors(body: object, definition: str) -> list[str]:
    """Where `body` breaks the Argo server's definition of the request, e.g. `WorkflowTemplateUpdateRequest`: its
    Swagger (2.0, draft 4) where the upstream files are there, else the packaged checks (see the module's doc)."""
    if not available():
        return _packaged_request_errors(body, definition)
    schema = {
        "$ref": f"#/definitions/io.argoproj.workflow.v1alpha1.{definition}",
        "definitions": _swagger_definitions(),
    }
    return [f"{list(e.absolute_path)}: {e.message}" for e in Draft4Validator(schema).iter_errors(body)]


def _packaged_request_errors(body: object, definition: str) -> list[str]:
    if not isinstance(body, dict):
        return [f"[]: {body!r:.80} is not a JSON object"]
    fields, errors = REQUEST_FIELDS[definition], []
    for name, value in body.items():
        expected = fields.get(name)
        if expected is None:
            errors.append(f"[]: unknown field {name!r} of {definition}")
        elif expected in JSON_TYPES:
            if not isinstance(value, JSON_TYPES[expected]):
                errors.append(f"[{name!r}]: {value!r:.80} is not of type {expected!r}")
        elif not isinstance(value, dict) or value.get("kind", expected) != expected:
            errors.append(f"[{name!r}]: not a {expected}")
        else:  # the object as Argo reads it: apiVersion and kind may be left out, the URL says them
            whole = {"apiVersion": "argoproj.io/v1alpha1", "kind": expected, **value}
            errors += [f"[{name!r}]: {error}" for error in lint_document(whole)]
    return errors


def log_stream(pod: str, lines: list[str]) -> bytes:
    """The Argo server's answer to its log API (a server-streaming call through grpc-gateway): one JSON object a
    line, each LogEntry under `result`."""
    return b"".join(json.dumps({"result": {"content": line, "podName": pod}}).encode() + b"\n" for line in lines)


def moeloop(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`moeloop ARGS` from the repo root, with no ARGO_* variables but those in `env`."""
    unset = {name: None for name in os.environ if name.startswith("ARGO_")}
    return moeloop_cli(*args, env={**unset, **(env or {})}, timeout=120)
