"""Submit the rendered Workflow to an Argo server through Hera's WorkflowsService."""

from __future__ import annotations

import requests
from hera.workflows import models as m
from hera.workflows.service import WorkflowsService
from pydantic import ValidationError

from steps.config import MoeloopConfig
from steps.errors import MoeloopError
from workflows.render import render_workflow

SERVER_MESSAGE_CHARS = 300


def submit_workflow(
    config: MoeloopConfig,
    run_uri: str,
    host: str,
    namespace: str,
    token: str | None = None,
    verify_ssl: bool = True,
    iterations: int | None = None,
) -> str:
    """Create the run's Workflow in `namespace`; returns the name the server gave it."""
    if not host.startswith(("http://", "https://")):
        raise MoeloopError(f"Argo server {host}: the host must start with http:// or https://")
    document = render_workflow(config, run_uri, iterations)
    document["metadata"]["namespace"] = namespace  # Kubernetes refuses a body whose namespace differs from the URL's
    request = m.WorkflowCreateRequest(namespace=namespace, workflow=m.Workflow.model_validate(document))
    # Hera joins "api/v1/..." onto the host: without a trailing slash a base path such as /argo would be dropped.
    service = WorkflowsService(
        host=host.rstrip("/") + "/", token=token, verify_ssl=verify_ssl, namespace=namespace, session=_session()
    )
    try:
        created = service.create_workflow(request)
    except requests.HTTPError as error:
        raise MoeloopError(_redact(_describe_refusal(host, error.response), token)) from None
    except (requests.JSONDecodeError, ValidationError):  # a 2xx body that is not JSON, or not a Workflow
        raise MoeloopError(f"Argo server {host} answered the submission with something other than a Workflow") from None
    except requests.RequestException as error:
        raise MoeloopError(_redact(f"cannot reach the Argo server at {host}: {_root_cause(error)}", token)) from None
    if created.metadata.name is None:
        raise MoeloopError(f"Argo server {host} created a workflow but did not say its name")
    return created.metadata.name


def _session() -> requests.Session:
    """A session that raises on an HTTP error status, before Hera reads the body (it assumes a `message` key)."""
    session = requests.Session()
    session.hooks["response"].append(lambda response, **_: response.raise_for_status())
    return session


def _describe_refusal(host: str, response: requests.Response) -> str:
    try:
        body = response.json()
        detail = body["message"] if isinstance(body, dict) and "message" in body else response.text
    except ValueError:
        detail = response.text
    detail = " ".join(str(detail).split())[:SERVER_MESSAGE_CHARS]
    return f"Argo server {host} refused the workflow: HTTP {response.status_code} {response.reason}" + (
        f": {detail}" if detail else ""
    )


def _root_cause(error: BaseException) -> str:
    """The innermost reason of a requests error (e.g. `Connection refused`), on one line."""
    while (inner := error.__cause__ or error.__context__) is not None:
        error = inner
    reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    return " ".join(reason.split()) or type(error).__name__


def _redact(message: str, token: str | None) -> str:
    """Never show the token, even if a server or proxy echoes it back; given as "Bearer X", X is the secret."""
    secret = token.split()[-1] if token and token.strip() else ""
    return message.replace(secret, "<token>") if secret else message
