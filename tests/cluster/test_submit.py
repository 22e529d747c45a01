"""`moeloop submit`, and what every cluster command shares (one session, one error translation, the
server from flags or the argo CLI's environment), against a local stand-in for an Argo server."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import yaml

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
from moeloop.workflows.argo import ArgoServer, ArgoSession, argo_server
from moeloop.workflows.lint.documents import lint_document
from moeloop.workflows.render.loop import build, render

WORKFLOWS = f"/api/v1/workflows/{NAMESPACE}"
# Hera 7.1.0's WorkflowsService serialises with pydantic's deprecated `.json()`; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:The `json` method is deprecated:DeprecationWarning")


def created(request: RecordedRequest) -> tuple[int, dict]:
    """What Argo answers on success: the workflow, named from its generateName."""
    workflow = request.body["workflow"]
    metadata = {**workflow["metadata"], "name": workflow["metadata"]["generateName"] + "x7k2p", "uid": "1b7e"}
    return 200, {**workflow, "metadata": metadata}


def submit(host: str, token: str | None = TOKEN) -> str:
    with ArgoSession(ArgoServer(host, NAMESPACE, token)) as argo:
        return argo.submit(build(cluster_config(), RUN_URI).workflow)


def test_submit_sends_the_rendered_workflow() -> None:
    with argo_stand_in({("POST", WORKFLOWS): created}) as (host, recorded):
        name = submit(host)

    assert name == "cluster-test-x7k2p"
    [request] = recorded
    assert (request.method, request.path) == ("POST", WORKFLOWS)
    assert request.headers["Authorization"] == f"Bearer {TOKEN}"
    assert request_errors(request.body, "WorkflowCreateRequest") == []
    assert request.body["namespace"] == NAMESPACE
    workflow = request.body["workflow"]
    assert lint_document(workflow) == []
    # Exactly the rendered Workflow, in the namespace asked for rather than the config's.
    rendered = render(cluster_config(), RUN_URI)["workflow.yaml"]
    assert workflow == {**rendered, "metadata": {**rendered["metadata"], "namespace": NAMESPACE}}
    # The run's chunk lives in its registered WorkflowTemplate; the Workflow refers to it.
    assert workflow["spec"]["workflowTemplateRef"] == {"name": "moeloop-cluster-test"}


def test_submit_command_prints_the_workflow_name(tmp_path: Path) -> None:
    with argo_stand_in({("POST", WORKFLOWS): created}) as (host, recorded):
        result = moeloop(
            "submit",
            str(write_config(tmp_path)),
            "--host",
            host,
            "--namespace",
            NAMESPACE,
            "--root",
            "s3://moeloop-runs/runs",
            "--iterations",
            "3",
        )

    assert (result.returncode, result.stdout) == (0, "cluster-test-x7k2p\n"), result.stderr
    [request] = recorded
    assert "Authorization" not in request.headers
    parameters = {p["name"]: p["value"] for p in request.body["workflow"]["spec"]["arguments"]["parameters"]}
    assert parameters["run"] == "s3://moeloop-runs/runs/cluster-test"
    assert parameters["iterations"] == "3" and yaml.safe_load(parameters["config"])["iterations"] == 3


def test_server_and_token_from_the_argo_cli_environment(tmp_path: Path) -> None:
    with argo_stand_in({("POST", f"/argo{WORKFLOWS}"): created}) as (host, recorded):
        environment = {
            "ARGO_SERVER": host.removeprefix("http://"),  # host:port, as the argo CLI takes it
            "ARGO_SECURE": "false",
            "ARGO_BASE_HREF": "/argo/",
            "ARGO_NAMESPACE": NAMESPACE,
            "ARGO_TOKEN": f"Bearer {TOKEN}",
        }
        result = moeloop("submit", str(write_config(tmp_path)), env=environment)

    assert (result.returncode, result.stdout) == (0, "cluster-test-x7k2p\n"), result.stderr
    [request] = recorded
    assert request.headers["Authorization"] == f"Bearer {TOKEN}"


def test_argo_server_resolution() -> None:
    environment = {"ARGO_SERVER": "argo.example.com:2746", "ARGO_NAMESPACE": "env-ns", "ARGO_TOKEN": "env-token"}
    assert argo_server(None, None, None, False, environment) == ArgoServer(
        "https://argo.example.com:2746", "env-ns", "env-token", verify_ssl=True
    )
    # Flags win over the environment; ARGO_INSECURE_SKIP_VERIFY is --insecure.
    flags = argo_server("http://other:80/base", "flag-ns", "flag-token", False, environment)
    assert flags == ArgoServer("http://other:80/base", "flag-ns", "flag-token", verify_ssl=True)
    skip_verify = argo_server(None, None, None, False, {**environment, "ARGO_INSECURE_SKIP_VERIFY": "true"})
    assert skip_verify.verify_ssl is False
    assert argo_server("https://h", "ns", None, True, {}).verify_ssl is False
    assert argo_server("https://h", "ns", None, False, {"ARGO_TOKEN": ""}).token is None
    with pytest.raises(MoeloopError, match=r"^no Argo server: give --host URL or set \$ARGO_SERVER$"):
        argo_server(None, "ns", None, False, {})
    with pytest.raises(MoeloopError, match=r"^no namespace: give --namespace NS or set \$ARGO_NAMESPACE$"):
        argo_server("https://h", None, None, False, {})
    with pytest.raises(MoeloopError, match="must start with http:// or https://"):
        argo_server("argo.example.com", "ns", None, False, {})


def test_host_with_a_base_path_keeps_it() -> None:
    with argo_stand_in({("POST", f"/argo{WORKFLOWS}"): created}) as (host, recorded):
        submit(f"{host}/argo", token=None)
    assert [r.path for r in recorded] == [f"/argo{WORKFLOWS}"]
    assert "Authorization" not in recorded[0].headers


# What an Argo server answers in each case; each message echoes the token, which must not leak.
REFUSALS = {
    401: f"token not valid: {TOKEN}",
    403: f'workflows.argoproj.io is forbidden: token "{TOKEN}" cannot create\nresource "workflows" in "rl"',
    404: f'namespaces "{NAMESPACE}" not found (token {TOKEN})',
    409: f'workflows.argoproj.io "cluster-test-x7k2p" already exists (token {TOKEN})',
    500: f"etcdserver: request timed out (token {TOKEN})",
}


@pytest.mark.parametrize("status", sorted(REFUSALS))
def test_refusal_is_one_line_naming_server_object_and_status(status: int) -> None:
    with (
        argo_stand_in({("POST", WORKFLOWS): lambda request: argo_error(status, REFUSALS[status])}) as (host, _),
        pytest.raises(MoeloopError) as raised,
    ):
        submit(host)

    message = str(raised.value)
    assert message.startswith(f"Argo server {host} could not create Workflow {NAMESPACE}/cluster-test-: HTTP {status} ")
    assert " ".join(REFUSALS[status].split()).replace(TOKEN, "<token>") in message
    assert TOKEN not in message and "\n" not in message
    assert message.endswith("(check --token or $ARGO_TOKEN)") == (status == 401)


def test_refusal_from_the_command_is_one_error_line_with_exit_2(tmp_path: Path) -> None:
    with argo_stand_in({("POST", WORKFLOWS): lambda request: argo_error(403, REFUSALS[403])}) as (host, _):
        result = moeloop(
            "submit", str(write_config(tmp_path)), "--host", host, "--namespace", NAMESPACE, env={"ARGO_TOKEN": TOKEN}
        )

    assert result.returncode == 2
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith(f"error: Argo server {host} could not create Workflow {NAMESPACE}/cluster-test-: HTTP 403")
    assert TOKEN not in result.stderr


def test_refusal_without_a_json_message_still_names_the_status() -> None:
    with (
        argo_stand_in({("POST", WORKFLOWS): lambda request: (502, {"error": "bad gateway"})}) as (host, _),
        pytest.raises(MoeloopError, match=r"HTTP 502 Bad Gateway"),
    ):
        submit(host)


def test_success_without_a_workflow_is_an_error() -> None:
    with (
        argo_stand_in({("POST", WORKFLOWS): lambda request: (200, {"metadata": "not an object"})}) as (host, _),
        pytest.raises(MoeloopError) as raised,
    ):
        submit(host)
    expected = (
        f"Argo server {host} did not answer create Workflow {NAMESPACE}/cluster-test- with the expected object:"
        " metadata: Input should be a valid dictionary or instance of ObjectMeta; no spec"
    )
    assert str(raised.value) == expected


def test_connection_refused_is_one_line() -> None:
    with socket.socket() as probe:  # a port nothing listens on once the probe is closed
        probe.bind(("127.0.0.1", 0))
        host = f"http://127.0.0.1:{probe.getsockname()[1]}"
    with pytest.raises(MoeloopError) as raised:
        submit(host)
    expected = (
        f"cannot reach the Argo server at {host} to create Workflow {NAMESPACE}/cluster-test-: Connection refused"
    )
    assert str(raised.value) == expected


def test_the_token_stays_out_of_the_server_repr() -> None:
    assert TOKEN not in repr(ArgoServer("https://argo.example.com", NAMESPACE, TOKEN))
