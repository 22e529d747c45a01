"""Who may run what in namespace moeloop (issue 36): the controller runs only registered templates
(`templateReferencing: Strict`), and the ValidatingAdmissionPolicy of manifests/base/pod-security.yaml holds every pod
to Pod Security `restricted`, but moeloop-train's IPC_LOCK (and the root user it implies). The policy and its binding
validate against Kubernetes' schema; their CEL runs here with cel-python on every pod the render makes, as Argo's
controller and the JobSet controller make them, all admitted, and on hostile pods, each refused by its rule."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import celpy
import kubernetes_validate
import pytest
import yaml

from moeloop.workflows.render.loop import render
from tests.argo_substitution import read_back
from tests.cluster.test_render_injection import config
from tests.conftest import REPO

MANIFESTS = REPO / "manifests" / "base"
POLICY_FILE = MANIFESTS / "pod-security.yaml"
CONTROLLER_CONFIG = MANIFESTS / "argo" / "workflow-controller-configmap.yaml"
KUBERNETES_VERSION = "1.36"

Pod = dict[str, Any]


def policy_documents() -> list[dict[str, Any]]:
    return list(yaml.safe_load_all(POLICY_FILE.read_text()))


def controller_setting(key: str) -> Any:
    return yaml.safe_load(yaml.safe_load(CONTROLLER_CONFIG.read_text())["data"][key])


def test_the_policy_and_its_binding_validate_against_kubernetes_schema() -> None:
    policy, binding = policy_documents()
    for document in (policy, binding):
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    assert (policy["kind"], binding["kind"]) == ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"] and policy["spec"]["failurePolicy"] == "Fail"
    selector = binding["spec"]["matchResources"]["namespaceSelector"]["matchLabels"]
    assert selector == {"kubernetes.io/metadata.name": "moeloop"}
    assert "pod-security.yaml" in yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())["resources"]
    broken = copy.deepcopy(policy)
    broken["spec"]["validations"][0]["expresion"] = "true"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_controller_runs_only_registered_templates_with_read_only_executors() -> None:
    assert controller_setting("workflowRestrictions") == {"templateReferencing": "Strict"}
    assert controller_setting("executor")["securityContext"]["readOnlyRootFilesystem"] is True


# ---------------------------------------------------------------------------------------------------------
# The policy's CEL, run with cel-python as the API server runs it: variables in order, then each validation.


def compiled(expression: str) -> Any:
    environment = celpy.Environment()
    return environment.program(environment.compile(expression))


POLICY = policy_documents()[0]["spec"]
VARIABLES = [(v["name"], compiled(v["expression"])) for v in POLICY["variables"]]
VALIDATIONS = [(v["message"], compiled(v["expression"])) for v in POLICY["validations"]]


def refusals(pod: Pod) -> list[str]:
    """The messages of the validations the pod fails."""
    activation: dict[str, Any] = {"object": celpy.json_to_cel(pod), "variables": celpy.celtypes.MapType({})}
    for name, program in VARIABLES:
        activation["variables"][celpy.celtypes.StringType(name)] = program.evaluate(activation)
    return [message for message, program in VALIDATIONS if not holds(program.evaluate(activation))]


def holds(result: Any) -> bool:
    if isinstance(result, celpy.CELEvalError):
        raise result
    return bool(result)


# Argo's executor containers, configured by the controller's settings (manifests/), and the pod the controller makes
# of a template: main, wait and init, Argo's volumes and the service account token.
EXECUTOR = controller_setting("executor")


def executor(name: str) -> dict[str, Any]:
    return {"name": name, "image": "quay.io/argoproj/argoexec:v4.1.2", **copy.deepcopy(EXECUTOR)}


def argo_pod(template: dict[str, Any]) -> Pod:
    main = {"name": "main", **(template.get("container") or executor("main"))}
    volumes = [{"name": name, "emptyDir": {}} for name in ("var-run-argo", "tmp-dir-argo")]
    volumes.append({"name": "kube-api-access", "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]}})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": template["name"], "namespace": "moeloop", "annotations": {}},
        "spec": {
            "serviceAccountName": template["serviceAccountName"],
            "securityContext": template.get("securityContext", {}),
            "initContainers": [executor("init")],
            "containers": [main, executor("wait")],
            "volumes": [*template.get("volumes", []), *volumes],
        },
    }


def rendered_pods(nodes: int) -> dict[str, Pod]:
    """Every pod a run makes: each template's (a resource template's runs Argo's executor as main) and the JobSet's."""
    pods = {}
    for template in render(config(nodes), "s3://bucket/runs/admitted")["workflow-template.yaml"]["spec"]["templates"]:
        if "container" in template or "resource" in template:
            pods[template["name"]] = argo_pod(template)
        manifest = (template.get("resource") or {}).get("manifest", "")
        if manifest.startswith("apiVersion: jobset"):
            spec = read_back(manifest)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
            pods["jobset"] = {"metadata": {"name": "jobset-node-0-0", "namespace": "moeloop"}, "spec": spec}
    return pods


PODS = {**{f"{name} (1 node)": pod for name, pod in rendered_pods(1).items()}, **rendered_pods(2)}


@pytest.mark.parametrize("name", sorted(PODS))
def test_every_rendered_pod_is_admitted(name: str) -> None:
    assert refusals(PODS[name]) == []


def test_the_trainer_pods_are_the_ones_the_exception_admits() -> None:
    trainers = {name for name, pod in PODS.items() if pod["spec"]["serviceAccountName"] == "moeloop-train"}
    assert trainers == {"train (1 node)", "jobset"}
    for name in trainers:
        elsewhere = copy.deepcopy(PODS[name])
        elsewhere["spec"]["serviceAccountName"] = "moeloop-cpu"
        assert len(refusals(elsewhere)) == 3, name  # IPC_LOCK, runAsNonRoot, runAsUser 0


def the_probes_jobset_pod() -> Pod:
    """The JobSet pod the `run` injection made (issue 36): host namespaces, an attacker's init container as root, the
    main container without its securityContext, under the trainer's service account."""
    pod = copy.deepcopy(PODS["jobset"])
    pod["spec"].update(hostPID=True, hostNetwork=True)
    pod["spec"]["initContainers"] = [{"name": "x", "image": "busybox", "command": ["sh", "-c", "id"]}]
    del pod["spec"]["containers"][0]["securityContext"]
    return pod


def container(pod: Pod, index: int = 0) -> dict[str, Any]:
    return pod["spec"]["containers"][index].setdefault("securityContext", {})


def volume(pod: Pod, source: dict[str, Any]) -> None:
    pod["spec"]["volumes"].append({"name": "extra", **source})


def annotate(pod: Pod, key: str, value: str) -> None:
    pod["metadata"]["annotations"][key] = value


APPARMOR = "container.apparmor.security.beta.kubernetes.io/main"
DEBUG = {"name": "debug", "image": "busybox", "securityContext": {"privileged": True}}
DROP, SYSCTL = "every container must drop ALL capabilities", "only the safe sysctls"

# (what, the rendered pod changed, the change, the refusal's start)
HOSTILE: list[tuple[str, str, Callable[[Pod], Any], str]] = [
    ("hostPID", "rollout", lambda p: p["spec"].update(hostPID=True), "host namespaces"),
    ("hostNetwork", "rollout", lambda p: p["spec"].update(hostNetwork=True), "host namespaces"),
    ("hostIPC", "train (1 node)", lambda p: p["spec"].update(hostIPC=True), "host namespaces"),
    ("privileged", "train (1 node)", lambda p: container(p).update(privileged=True), "privileged"),
    ("hostPath", "rollout", lambda p: volume(p, {"hostPath": {"path": "/"}}), "only configMap"),
    ("hostPort", "rollout", lambda p: p["spec"]["containers"][0].update(ports=[{"hostPort": 1}]), "host ports"),
    ("SYS_ADMIN", "train (1 node)", lambda p: container(p)["capabilities"]["add"].append("SYS_ADMIN"), DROP),
    ("IPC_LOCK", "rollout", lambda p: container(p)["capabilities"].update(add=["IPC_LOCK"]), DROP),
    ("no drop", "rollout", lambda p: container(p)["capabilities"].pop("drop"), DROP),
    ("escalation", "rollout", lambda p: container(p).update(allowPrivilegeEscalation=True), "every container must set"),
    ("root", "rollout", lambda p: container(p).update(runAsUser=0), "runAsUser"),
    ("non-root off", "publish", lambda p: container(p).update(runAsNonRoot=False), "runAsNonRoot"),
    ("unconfined", "rollout", lambda p: container(p).update(seccompProfile={"type": "Unconfined"}), "a seccomp"),
    ("no seccomp", "start", lambda p: p["spec"]["securityContext"].pop("seccompProfile"), "a seccomp"),
    ("procMount", "rollout", lambda p: container(p).update(procMount="Unmasked"), "procMount"),
    ("sysctl", "rollout", lambda p: p["spec"]["securityContext"].update(sysctls=[{"name": "kernel.msg"}]), SYSCTL),
    ("SELinux", "rollout", lambda p: container(p).update(seLinuxOptions={"type": "spc_t"}), "SELinux"),
    ("AppArmor", "rollout", lambda p: container(p).update(appArmorProfile={"type": "Unconfined"}), "an AppArmor"),
    ("AppArmor annotation", "rollout", lambda p: annotate(p, APPARMOR, "unconfined"), "an AppArmor"),
    ("hostProcess", "rollout", lambda p: container(p).update(windowsOptions={"hostProcess": True}), "Windows"),
    ("debug container", "rollout", lambda p: p["spec"].update(ephemeralContainers=[DEBUG]), "privileged"),
]


@pytest.mark.parametrize(("what", "base", "change", "message"), HOSTILE, ids=[case[0] for case in HOSTILE])
def test_a_hostile_pod_is_refused_by_its_rule(what: str, base: str, change: Callable[[Pod], Any], message: str) -> None:
    pod = copy.deepcopy(PODS[base])
    change(pod)
    assert any(refusal.startswith(message) for refusal in refusals(pod)), refusals(pod)


def test_the_probes_injected_jobset_pod_is_refused() -> None:
    found = refusals(the_probes_jobset_pod())
    assert found[0].startswith("host namespaces") and any("allowPrivilegeEscalation" in m for m in found)
