"""Talk to an Argo server through Hera's WorkflowsService: submit, register, schedule, status, resubmit, stop, logs.

submit, register and schedule send Hera objects (moeloop.workflows.build's), in the session's namespace.

Every request goes through one session and one error translation (`ArgoSession._call`): a refusal, an
answer that is not the expected object, or an unreachable server becomes one `MoeloopError` line that
names the server and the object, and never shows the token.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC
from http import HTTPStatus
from typing import Self, TypeVar
from urllib.parse import urljoin, urlsplit

import requests
from hera.workflows import CronWorkflow, Workflow, WorkflowTemplate
from hera.workflows import models as m
from hera.workflows.service import WorkflowsService
from pydantic import BaseModel, ValidationError

from moeloop.steps.errors import MoeloopError

SERVER_MESSAGE_CHARS = 300
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
RUN_LABEL = "moeloop.dev/run"
# A run's listing leaves out the per-node status, the bulk of a finished Workflow (Argo's `fields` filter:
# a leading "-" excludes the comma-separated paths). Hera's model needs `spec`, so it stays.
RUN_LISTING_FIELDS = "-items.status.nodes,-items.status.storedTemplates"
# The argo CLI's environment: ARGO_SERVER is host:port, over TLS unless ARGO_SECURE=false.
HOST_ENV, SECURE_ENV, BASE_HREF_ENV = "ARGO_SERVER", "ARGO_SECURE", "ARGO_BASE_HREF"
TOKEN_ENV, NAMESPACE_ENV, SKIP_VERIFY_ENV = "ARGO_TOKEN", "ARGO_NAMESPACE", "ARGO_INSECURE_SKIP_VERIFY"

Answer = TypeVar("Answer", bound=BaseModel)


@dataclass(frozen=True)
class ArgoServer:
    host: str  # URL with scheme, and the base path if the server is behind one
    namespace: str
    token: str | None = field(default=None, repr=False)  # kept out of reprs, as out of messages
    verify_ssl: bool = True

    def __post_init__(self) -> None:
        if not self.host.startswith(("http://", "https://")):
            raise MoeloopError(f"Argo server {self.host}: the host must start with http:// or https://")
        try:
            valid = bool(urlsplit(self.host).hostname)
        except ValueError:
            valid = False
        if not valid:
            raise MoeloopError(f"Argo server {self.host}: not a valid URL")
        check_object_name(self.namespace, "namespace", DNS_LABEL)


def check_object_name(name: str, what: str, pattern: re.Pattern[str] | None = None) -> str:
    """A Kubernetes name (RFC 1123: a DNS subdomain; a namespace is a DNS label): it goes into the request's URL
    path, so anything else would address another object or none."""
    pattern = pattern or DNS_SUBDOMAIN
    if not pattern.fullmatch(name) or len(name) > (63 if pattern is DNS_LABEL else 253):
        raise MoeloopError(f"{what} {name!r} is not a Kubernetes name (lowercase letters, digits, '-')")
    return name


def argo_server(
    host: str | None,
    namespace: str | None,
    token: str | None,
    insecure: bool,
    environ: Mapping[str, str] = os.environ,
) -> ArgoServer:
    """The server from the flags, else from the argo CLI's environment variables."""
    if host is None:
        address = environ.get(HOST_ENV, "").strip()
        if not address:
            raise MoeloopError(f"no Argo server: give --host URL or set ${HOST_ENV}")
        if "://" not in address:
            plain = environ.get(SECURE_ENV, "").lower() in ("false", "0", "f")
            address = ("http://" if plain else "https://") + address
        base_path = environ.get(BASE_HREF_ENV, "").strip("/")
        host = address.rstrip("/") + (f"/{base_path}" if base_path else "")
    namespace = namespace or environ.get(NAMESPACE_ENV)
    if not namespace:
        raise MoeloopError(f"no namespace: give --namespace NS or set ${NAMESPACE_ENV}")
    skip_verify = insecure or environ.get(SKIP_VERIFY_ENV, "").lower() in ("true", "1", "t")
    return ArgoServer(host, namespace, token or environ.get(TOKEN_ENV) or None, verify_ssl=not skip_verify)


class ArgoRefusal(MoeloopError):
    """The server answered with an HTTP error status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class ArgoSession:
    """One HTTP session with one Argo server, in one namespace."""

    def __init__(self, server: ArgoServer) -> None:
        self.server = server
        session = requests.Session()
        # Raise on an HTTP error status before Hera reads the body (it assumes a `message` key).
        session.hooks["response"].append(lambda response, **_: response.raise_for_status())
        # Hera joins "api/v1/..." onto the host: without a trailing slash a base path such as /argo would be dropped.
        self._service = WorkflowsService(
            host=server.host.rstrip("/") + "/",
            token=server.token,
            verify_ssl=server.verify_ssl,
            namespace=server.namespace,
            session=session,
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self._service.close()

    def submit(self, workflow: Workflow) -> str:
        """Create the Workflow; returns the name the server gave it."""
        model = self._in_namespace(workflow)
        request = m.WorkflowCreateRequest(namespace=self.server.namespace, workflow=model)
        created = self._call(f"create {self._object(model)}", lambda: self._service.create_workflow(request))
        return self._name_of(created, "created a Workflow")

    def register(self, template: WorkflowTemplate) -> str:
        """Create the WorkflowTemplate, or replace the one of that name; returns "created" or "updated"."""
        namespace = self.server.namespace
        return self._create_or_update(
            self._in_namespace(template),
            create=lambda template: self._service.create_workflow_template(
                m.WorkflowTemplateCreateRequest(namespace=namespace, template=template)
            ),
            get=self._service.get_workflow_template,
            update=lambda name, template: self._service.update_workflow_template(
                name, m.WorkflowTemplateUpdateRequest(namespace=namespace, template=template)
            ),
        )

    def schedule(self, cron_workflow: CronWorkflow) -> str:
        """Create the CronWorkflow, or replace the one of that name; returns "created" or "updated"."""
        namespace = self.server.namespace
        return self._create_or_update(
            self._in_namespace(cron_workflow),
            create=lambda cron: self._service.create_cron_workflow(
                m.CreateCronWorkflowRequest(namespace=namespace, cron_workflow=cron)
            ),
            get=self._service.get_cron_workflow,
            update=lambda name, cron: self._service.update_cron_workflow(
                name, m.UpdateCronWorkflowRequest(namespace=namespace, cron_workflow=cron)
            ),
        )

    def workflow(self, name: str) -> m.Workflow:
        return self._call(f"get Workflow {self.server.namespace}/{name}", lambda: self._service.get_workflow(name))

    def run_workflows(self, run_name: str) -> list[m.Workflow]:
        """The Workflows labelled with the run, oldest first, without their per-node status."""
        listed = self._call(
            f"list the Workflows of run {run_name} in {self.server.namespace}",
            lambda: self._service.list_workflows(label_selector=f"{RUN_LABEL}={run_name}", fields=RUN_LISTING_FIELDS),
        )
        return sorted(listed.items or [], key=lambda workflow: timestamp(workflow.metadata.creation_timestamp))

    def resubmit(self, name: str, memoized: bool) -> str:
        """Argo's resubmit: a new Workflow from the old one's spec (with `memoized`, succeeded nodes are reused)."""
        namespace = self.server.namespace
        request = m.WorkflowResubmitRequest(name=name, namespace=namespace, memoized=memoized)
        created = self._call(
            f"resubmit Workflow {namespace}/{name}", lambda: self._service.resubmit_workflow(name, request)
        )
        return self._name_of(created, f"resubmitted {name}")

    def stop(self, name: str, terminate: bool) -> None:
        """Argo's stop (the workflow's exit handler still runs, as `argo stop`), or its terminate (it does not, as
        `argo terminate`)."""
        namespace, service = self.server.namespace, self._service
        if terminate:
            request = m.WorkflowTerminateRequest(name=name, namespace=namespace)
            self._call(f"terminate Workflow {namespace}/{name}", lambda: service.terminate_workflow(name, request))
        else:
            request = m.WorkflowStopRequest(name=name, namespace=namespace)
            self._call(f"stop Workflow {namespace}/{name}", lambda: service.stop_workflow(name, request))

    def pod_log(self, workflow: str, pod: str) -> list[str]:
        """The lines of the main container's log of one pod of the workflow, through the server's log API.

        The answer is a stream (grpc-gateway's): a JSON object a line, `{"result": LogEntry}` or `{"error": ...}`.
        Hera's `workflow_logs` reads it as one object, so the request goes through the session directly."""
        namespace, service = self.server.namespace, self._service
        what = f"get the log of pod {pod} of Workflow {namespace}/{workflow}"
        response = self._call(
            what,
            lambda: service.session.get(
                urljoin(service.host, f"api/v1/workflows/{namespace}/{workflow}/log"),
                params={"podName": pod, "logOptions.container": "main"},
                headers={"Authorization": service.token} if service.token else {},
                verify=self.server.verify_ssl,
            ),
        )
        lines = []
        for line in response.text.splitlines():
            try:
                message = json.loads(line) if line.strip() else {}
            except ValueError:
                raise MoeloopError(f"Argo server {self.server.host} did not answer {what} with JSON lines") from None
            if not isinstance(message, dict):
                raise MoeloopError(f"Argo server {self.server.host} did not answer {what} with JSON objects")
            if message.get("error"):
                detail = message["error"].get("message") if isinstance(message["error"], dict) else message["error"]
                refusal = f"Argo server {self.server.host} could not {what}: {one_line(str(detail))}"
                raise MoeloopError(self._redact(refusal))
            entry = message.get("result")
            if isinstance(entry, dict) and isinstance(entry.get("content"), str):
                lines.append(entry["content"])
        return lines

    def _create_or_update(
        self,
        new: Answer,
        create: Callable[[Answer], Answer],
        get: Callable[[str], Answer],
        update: Callable[[str, Answer], Answer],
    ) -> str:
        """Argo has no apply: create; on 409 AlreadyExists, replace it at the resourceVersion just read."""
        name, described = new.metadata.name, self._object(new)
        try:
            self._call(f"create {described}", lambda: create(new))
            return "created"
        except ArgoRefusal as refusal:
            if refusal.status != HTTPStatus.CONFLICT:
                raise
        existing = self._call(f"get {described}", lambda: get(name))
        if not existing.metadata.resource_version:
            raise MoeloopError(f"Argo server {self.server.host} returned {described} without a resourceVersion")
        replacement = new.model_copy(deep=True)
        replacement.metadata.resource_version = existing.metadata.resource_version
        self._call(f"update {described}", lambda: update(name, replacement))
        return "updated"

    def _call(self, what: str, request: Callable[[], Answer]) -> Answer:
        """Send one request: `what` ("create WorkflowTemplate ns/name") names it in any error."""
        host = self.server.host
        try:
            return request()
        except requests.HTTPError as error:
            refusal = _refusal(host, what, error.response)
            raise ArgoRefusal(self._redact(refusal), error.response.status_code) from None
        except requests.JSONDecodeError:  # a 2xx body that is not JSON
            raise MoeloopError(f"Argo server {host} did not answer {what} with JSON") from None
        except ValidationError as error:  # JSON, but not the object: say which fields
            problems = "; ".join(_field_problem(e) for e in error.errors()[:3])
            more = f" (and {error.error_count() - 3} more)" if error.error_count() > 3 else ""
            raise MoeloopError(
                f"Argo server {host} did not answer {what} with the expected object: {problems}{more}"
            ) from None
        except requests.RequestException as error:
            unreachable = f"cannot reach the Argo server at {host} to {what}: {_root_cause(error)}"
            raise MoeloopError(self._redact(unreachable)) from None

    def _in_namespace(self, hera_object: Workflow) -> Answer:
        """The object's model (Hera's build), in the session's namespace: Kubernetes refuses a body whose
        namespace differs from the URL's."""
        model = hera_object.build()
        model.metadata.namespace = self.server.namespace
        return model

    def _object(self, model: BaseModel) -> str:
        metadata = model.metadata
        return f"{model.kind} {self.server.namespace}/{metadata.name or metadata.generate_name}"

    def _name_of(self, created: m.Workflow, what: str) -> str:
        if not created.metadata.name:
            raise MoeloopError(f"Argo server {self.server.host} {what} but did not say its name")
        return created.metadata.name

    def _redact(self, message: str) -> str:
        """Never show the token, even if a server or proxy echoes it back; given as "Bearer X", X is the secret."""
        token = self.server.token
        secret = token.split()[-1] if token and token.strip() else ""
        return message.replace(secret, "<token>") if secret else message


def _refusal(host: str, what: str, response: requests.Response) -> str:
    try:
        body = response.json()
        detail = body["message"] if isinstance(body, dict) and "message" in body else response.text
    except ValueError:
        detail = response.text
    detail = " ".join(str(detail).split())[:SERVER_MESSAGE_CHARS]
    hint = f" (check --token or ${TOKEN_ENV})" if response.status_code == HTTPStatus.UNAUTHORIZED else ""
    status = f"HTTP {response.status_code} {response.reason}"
    return f"Argo server {host} could not {what}: {status}" + (f": {detail}" if detail else "") + hint


def _field_problem(error: Mapping) -> str:
    """One field of a reply that the object's model refused, e.g. `no metadata` or `status.phase: Input should be a
    valid string`."""
    where = ".".join(str(part) for part in error["loc"]) or "the object"
    return f"no {where}" if error["type"] == "missing" else f"{where}: {error['msg']}"


def _root_cause(error: BaseException) -> str:
    """The innermost reason of a requests error (e.g. `Connection refused`), on one line."""
    while (inner := error.__cause__ or error.__context__) is not None:
        error = inner
    reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    return " ".join(reason.split()) or type(error).__name__


def timestamp(time: m.Time | None) -> str:
    return time.root.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if time is not None else "-"


def one_line(text: str) -> str:
    return " ".join(text.split())
