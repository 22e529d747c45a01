"""`moeloop resubmit`: Argo's resubmit endpoint, against a local stand-in for an Argo server."""

from __future__ import annotations

import pytest

from moeloop.steps.errors import MoeloopError
from tests.argo_stand_in import (
    NAMESPACE,
    TOKEN,
    RecordedRequest,
    argo_error,
    argo_stand_in,
    moeloop,
    request_errors,
)
from moeloop.workflows.argo import ArgoServer, ArgoSession

pytestmark = pytest.mark.filterwarnings("ignore:The `json` method is deprecated:DeprecationWarning")
NAME = "cluster-test-x7k2p"
RESUBMIT = f"/api/v1/workflows/{NAMESPACE}/{NAME}/resubmit"


def resubmitted(request: RecordedRequest) -> tuple[int, dict]:
    """Argo's answer: the new Workflow, named from the old one's generateName plus five characters."""
    return 200, {
        "metadata": {"name": "cluster-test-q8v4n", "generateName": "cluster-test-", "namespace": NAMESPACE},
        "spec": {"entrypoint": "loop"},
    }


def test_resubmit_command_prints_the_new_workflow() -> None:
    with argo_stand_in({("PUT", RESUBMIT): resubmitted}) as (host, recorded):
        result = moeloop(
            "resubmit", NAME, "--memoized", "--host", host, "--namespace", NAMESPACE, env={"ARGO_TOKEN": TOKEN}
        )

    assert (result.returncode, result.stdout) == (0, "cluster-test-q8v4n\n"), result.stderr
    [request] = recorded
    assert (request.method, request.path) == ("PUT", RESUBMIT)
    assert request.headers["Authorization"] == f"Bearer {TOKEN}"
    assert request_errors(request.body, "WorkflowResubmitRequest") == []
    assert request.body == {"name": NAME, "namespace": NAMESPACE, "memoized": True}


def test_resubmit_without_memoized_asks_for_a_fresh_run() -> None:
    with (
        argo_stand_in({("PUT", RESUBMIT): resubmitted}) as (host, recorded),
        ArgoSession(ArgoServer(host, NAMESPACE)) as argo,
    ):
        assert argo.resubmit(NAME, memoized=False) == "cluster-test-q8v4n"
    assert recorded[0].body == {"name": NAME, "namespace": NAMESPACE, "memoized": False}


def test_refused_resubmit_is_one_line_naming_server_and_workflow() -> None:
    # What Argo answers for --memoized on a workflow that has not failed.
    refusal = "workflow must be Failed/Error to resubmit in memoized mode"
    with argo_stand_in({("PUT", RESUBMIT): lambda request: argo_error(400, refusal)}) as (host, _):
        result = moeloop("resubmit", NAME, "--memoized", "--host", host, "--namespace", NAMESPACE)

    assert (result.returncode, result.stdout) == (2, "")
    expected = f"Argo server {host} could not resubmit Workflow {NAMESPACE}/{NAME}: HTTP 400 Bad Request: {refusal}"
    assert result.stderr == f"error: {expected}\n"


def test_resubmit_answered_without_a_name_is_an_error() -> None:
    nameless = {"metadata": {"generateName": "cluster-test-"}, "spec": {"entrypoint": "loop"}}
    with (
        argo_stand_in({("PUT", RESUBMIT): lambda request: (200, nameless)}) as (host, _),
        ArgoSession(ArgoServer(host, NAMESPACE)) as argo,
        pytest.raises(MoeloopError, match=f"^Argo server {host} resubmitted {NAME} but did not say its name$"),
    ):
        argo.resubmit(NAME, memoized=False)
