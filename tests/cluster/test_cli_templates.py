"""`moeloop register` (WorkflowTemplate) and `moeloop schedule` (CronWorkflow): create, or on 409 read the
resourceVersion and update, against a local stand-in for an Argo server."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from moeloop.steps.errors import MoeloopError
from tests.argo_stand_in import (
    NAMESPACE,
    RUN_URI,
    TOKEN,
    RecordedRequest,
    argo_error,
    argo_stand_in,
    cluster_config,
    moeloop,
    request_errors,
    write_config,
)
from moeloop.workflows.argo import ArgoServer, ArgoSession
from moeloop.workflows.lint.documents import lint_document
from hera.workflows import Workflow

from moeloop.workflows.render.loop import Loop, build

pytestmark = pytest.mark.filterwarnings("ignore:The `json` method is deprecated:DeprecationWarning")
STORED_VERSION = "4821"


@dataclass(frozen=True)
class Kind:
    command: str
    kind: str
    resource: str  # the Kubernetes resource, as Argo's messages name it
    collection: str  # the Argo server's path, under /api/v1/
    body_key: str  # where the create/update request carries the object
    create_request: str
    update_request: str
    pick: Callable[[Loop], Workflow]  # the Hera object the command sends

    def hera_object(self) -> Workflow:
        return self.pick(build(cluster_config(), RUN_URI))

    def rendered(self) -> dict:
        document = self.hera_object().to_dict()
        return {**document, "metadata": {**document["metadata"], "namespace": NAMESPACE}}

    @property
    def name(self) -> str:
        return self.rendered()["metadata"]["name"]

    @property
    def collection_path(self) -> str:
        return f"/api/v1/{self.collection}/{NAMESPACE}"

    @property
    def object_path(self) -> str:
        return f"{self.collection_path}/{self.name}"


KINDS = [
    Kind(
        "register",
        "WorkflowTemplate",
        "workflowtemplates.argoproj.io",
        "workflow-templates",
        "template",
        "WorkflowTemplateCreateRequest",
        "WorkflowTemplateUpdateRequest",
        lambda loop: loop.template,
    ),
    Kind(
        "schedule",
        "CronWorkflow",
        "cronworkflows.argoproj.io",
        "cron-workflows",
        "cronWorkflow",
        "CreateCronWorkflowRequest",
        "UpdateCronWorkflowRequest",
        lambda loop: loop.cron_workflow,
    ),
]


def stored(kind: Kind) -> dict:
    """The object as the server holds it: the rendered one plus the server's metadata."""
    document = kind.rendered()
    server_metadata = {"uid": "9f1c", "resourceVersion": STORED_VERSION, "creationTimestamp": "2026-11-28T09:00:00Z"}
    return {**document, "metadata": {**document["metadata"], **server_metadata}}


def echo(kind: Kind, version: str) -> Callable[[RecordedRequest], tuple[int, dict]]:
    """Argo's answer to a create or update: the object as stored, at its new resourceVersion."""

    def answer(request: RecordedRequest) -> tuple[int, dict]:
        document = request.body[kind.body_key]
        return 200, {**document, "metadata": {**document["metadata"], "uid": "9f1c", "resourceVersion": version}}

    return answer


def already_exists(kind: Kind) -> Callable[[RecordedRequest], tuple[int, dict]]:
    return lambda request: argo_error(409, f'{kind.resource} "{kind.name}" already exists')


def send(kind: Kind, host: str) -> str:
    with ArgoSession(ArgoServer(host, NAMESPACE, TOKEN)) as argo:
        return getattr(argo, kind.command)(kind.hera_object())


def check_body(kind: Kind, request: RecordedRequest, definition: str) -> dict:
    """The request is the server's definition, for our namespace, carrying a clean object; returns it."""
    assert request_errors(request.body, definition) == []
    assert request.body["namespace"] == NAMESPACE
    assert request.headers["Authorization"] == f"Bearer {TOKEN}"
    document = request.body[kind.body_key]
    assert (document["kind"], document["metadata"]["namespace"]) == (kind.kind, NAMESPACE)
    assert lint_document(document) == []
    return document


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.command)
def test_creates_the_object_when_it_is_new(kind: Kind) -> None:
    with argo_stand_in({("POST", kind.collection_path): echo(kind, "1")}) as (host, recorded):
        assert send(kind, host) == "created"

    [request] = recorded
    assert (request.method, request.path) == ("POST", kind.collection_path)
    assert check_body(kind, request, kind.create_request) == kind.rendered()


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.command)
def test_command_updates_the_object_when_it_exists(kind: Kind, tmp_path: Path) -> None:
    routes = {
        ("POST", kind.collection_path): already_exists(kind),
        ("GET", kind.object_path): lambda request: (200, stored(kind)),
        ("PUT", kind.object_path): echo(kind, str(int(STORED_VERSION) + 1)),
    }
    with argo_stand_in(routes) as (host, recorded):
        result = moeloop(
            kind.command,
            str(write_config(tmp_path)),
            "--host",
            host,
            "--namespace",
            NAMESPACE,
            "--root",
            "s3://moeloop-runs/runs",
            env={"ARGO_TOKEN": TOKEN},
        )

    assert (result.returncode, result.stdout) == (0, f"{kind.name} updated\n"), result.stderr
    assert [(r.method, r.path) for r in recorded] == [
        ("POST", kind.collection_path),
        ("GET", kind.object_path),
        ("PUT", kind.object_path),
    ]
    create, _, update = recorded
    assert check_body(kind, create, kind.create_request) == kind.rendered()
    # The update replaces the object with the rendered one, at the resourceVersion the server holds.
    replacement = check_body(kind, update, kind.update_request)
    rendered = kind.rendered()
    assert replacement == {**rendered, "metadata": {**rendered["metadata"], "resourceVersion": STORED_VERSION}}


# The step that fails and its answer; the object exists for the get and the update to be reached.
FAILURES = {
    "create": (403, '{resource} is forbidden: User "system:serviceaccount:argo:ci" cannot create resource'),
    "get": (404, '{resource} "{name}" not found'),
    # Someone updated it between our get and update: Kubernetes' Conflict, which Argo answers with 409 too.
    "update": (409, 'Operation cannot be fulfilled on {resource} "{name}": the object has been modified'),
}


@pytest.mark.parametrize("step", sorted(FAILURES))
@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.command)
def test_a_refused_step_is_one_line_naming_server_step_and_object(kind: Kind, step: str) -> None:
    status, template = FAILURES[step]
    message = template.format(resource=kind.resource, name=kind.name)
    answers = {
        "create": already_exists(kind),
        "get": lambda request: (200, stored(kind)),
        "update": echo(kind, "1"),
    }
    answers[step] = lambda request: argo_error(status, message)
    routes = {
        ("POST", kind.collection_path): answers["create"],
        ("GET", kind.object_path): answers["get"],
        ("PUT", kind.object_path): answers["update"],
    }
    with argo_stand_in(routes) as (host, recorded), pytest.raises(MoeloopError) as raised:
        send(kind, host)

    reason = {403: "Forbidden", 404: "Not Found", 409: "Conflict"}[status]
    expected = (
        f"Argo server {host} could not {step} {kind.kind} {NAMESPACE}/{kind.name}: HTTP {status} {reason}: {message}"
    )
    assert str(raised.value) == expected
    assert [r.method for r in recorded] == ["POST", "GET", "PUT"][: ["create", "get", "update"].index(step) + 1]


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.command)
def test_existing_object_without_a_resource_version_is_an_error(kind: Kind) -> None:
    without_version = stored(kind)
    del without_version["metadata"]["resourceVersion"]
    routes = {
        ("POST", kind.collection_path): already_exists(kind),
        ("GET", kind.object_path): lambda request: (200, without_version),
    }
    with argo_stand_in(routes) as (host, recorded), pytest.raises(MoeloopError, match="without a resourceVersion"):
        send(kind, host)
    assert [r.method for r in recorded] == ["POST", "GET"]  # nothing sent that could overwrite blindly


def test_an_invalid_manifest_is_not_sent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moeloop.workflows import cli
    from moeloop.workflows.render import loop as loop_module

    def invalid(*args: object) -> Loop:
        loop = build(*args)
        loop.cron_workflow.concurrency_policy = "Forbidden"
        return loop

    monkeypatch.setattr(loop_module, "build", invalid)
    arguments = cli.parser().parse_args(["schedule", str(write_config(tmp_path)), "--namespace", NAMESPACE])
    with argo_stand_in({}) as (host, recorded):
        arguments.host = host
        with pytest.raises(MoeloopError, match=r"^refusing to send an invalid manifest: .*concurrencyPolicy: 'Forbidden'"):
            arguments.handler(arguments)
    assert recorded == []
