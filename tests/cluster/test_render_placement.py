"""Placement by role, the trainer's pod, the multi-node trainer's JobSet (checked against its CRD), and the
Pod Security Standard `restricted` on every rendered pod."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft4Validator

from moeloop.steps.config import MoeloopConfig, load_config, parse_config
from moeloop.steps.errors import MoeloopError
from tests.argo_substitution import read_back
from tests.upstream import upstream
from moeloop.workflows.dag import STEPS
from moeloop.workflows.lint.documents import lint_documents, lint_paths
from moeloop.workflows.render.files import write_rendered
from moeloop.workflows.render.jobset import render_jobset
from moeloop.workflows.render.loop import build, render
from moeloop.workflows.render.placement import EFA_ENV

from tests.conftest import REPO
RUN_URI = "s3://moeloop-runs/runs/placed"
ROLE = "moeloop.dev/role"
ROLE_IMAGES = {
    "rollout": "ghcr.io/moeloop/moeloop-rollout:0.2.0",
    "train": "ghcr.io/moeloop/moeloop-trainer:0.2.0",
    "cpu": "ghcr.io/moeloop/moeloop-cpu:0.2.0",
    "memory": "ghcr.io/moeloop/moeloop-cpu:0.2.0",
}
EXPECTED_ROLES = {
    "start": "cpu",
    "plan": "cpu",
    "rollout": "rollout",
    "reward": "cpu",
    "train": "train",
    "publish": "memory",
    "evaluate": "cpu",
}


def make_config(tmp_path: Path, cluster: dict | None = None, trainer: dict | None = None) -> MoeloopConfig:
    return parse_config(
        {
            "run_name": "placed",
            "iterations": 3,
            "task": {"train_prompts": "s3://b/train.jsonl", "eval_prompts": "s3://b/eval.jsonl"},
            "reward": {"functions": [{"path": "moeloop.steps.rewards:reverse_positions"}]},
            "rollout": {"prompts_per_iteration": 64, "samples_per_prompt": 8},
            "trainer": {"minibatch_size": 64, **(trainer or {})},
            "cluster": {"image_tag": "0.2.0", "chunk_iterations": 2, **(cluster or {})},
        },
        "test",
    )


def templates(config: MoeloopConfig) -> dict[str, dict]:
    return {t["name"]: t for t in render(config, RUN_URI)["workflow-template.yaml"]["spec"]["templates"]}


@pytest.fixture
def config(tmp_path: Path) -> MoeloopConfig:
    return make_config(tmp_path, trainer={"world_size": 8})


def test_each_step_runs_on_its_roles_nodes_as_its_roles_account(config: MoeloopConfig) -> None:
    rendered = templates(config)
    assert {step.name: step.role for step in STEPS} == EXPECTED_ROLES
    for step in STEPS:
        template, role = rendered[step.name], step.role
        assert template["nodeSelector"] == {ROLE: role}
        taints = [{"key": ROLE, "operator": "Equal", "value": role, "effect": "NoSchedule"}]
        if role in ("rollout", "train"):
            taints.append({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
        assert template["tolerations"] == taints
        assert template["serviceAccountName"] == f"moeloop-{role}"
        assert template["container"]["image"] == ROLE_IMAGES[role]
        assert template["metadata"]["labels"][ROLE] == role
    # Resource templates (creating Workflows, patching labels) run as the orchestrator, on CPU nodes.
    for name in ("label", "next-chunk"):
        assert rendered[name]["serviceAccountName"] == "moeloop-orchestrator"
        assert rendered[name]["nodeSelector"] == {ROLE: "cpu"}


def test_reward_models_move_the_reward_step_onto_the_reward_roles_gpus(tmp_path: Path) -> None:
    data = make_config(tmp_path).model_dump(mode="json")
    data["reward"]["models"] = [{"path": "s3://b/reward-models/rm", "weight": 0.5}]
    reward = templates(parse_config(data, "test"))["reward"]
    assert reward["nodeSelector"] == {ROLE: "reward"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in reward["tolerations"]
    assert reward["serviceAccountName"] == "moeloop-reward"
    assert reward["container"]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert reward["metadata"]["labels"][ROLE] == "reward"
    # A local reward model folder outside the repo cannot reach the pods.
    data["reward"]["models"][0]["path"] = str(tmp_path / "rm")
    with pytest.raises(MoeloopError, match=r"^reward\.models\[0\]\.path: local path .* is not reachable"):
        render(parse_config(data, "test"), RUN_URI)


def test_config_overrides_a_roles_fields_and_keeps_the_other_defaults(tmp_path: Path) -> None:
    config = make_config(
        tmp_path,
        cluster={
            "rollout": {"image": "example.com/my-vllm:1", "resources": {"limits": {"nvidia.com/gpu": "2"}}},
            "memory": {
                "service_account": "cache-writer",
                "node_selector": {"node.kubernetes.io/instance-type": "r7i.8xlarge"},
            },
        },
    )
    rendered = templates(config)
    rollout, publish = rendered["rollout"], rendered["publish"]
    assert rollout["container"]["image"] == "example.com/my-vllm:1"
    assert rollout["container"]["resources"] == {"limits": {"nvidia.com/gpu": "2"}}
    assert rollout["nodeSelector"] == {ROLE: "rollout"} and rollout["serviceAccountName"] == "moeloop-rollout"
    assert publish["serviceAccountName"] == "cache-writer"
    assert publish["nodeSelector"] == {"node.kubernetes.io/instance-type": "r7i.8xlarge"}
    assert publish["container"]["image"] == ROLE_IMAGES["memory"]


def test_rollout_gpus_follow_the_engines_tensor_parallel_size(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    config = config.model_copy(
        update={
            "rollout": config.rollout.model_copy(
                update={"vllm": config.rollout.vllm.model_copy(update={"tensor_parallel_size": 4})}
            )
        }
    )
    assert templates(config)["rollout"]["container"]["resources"]["limits"]["nvidia.com/gpu"] == "4"


def test_trainer_pod_has_efa_hugepages_shared_memory_and_ipc_lock(config: MoeloopConfig) -> None:
    train = templates(config)["train"]
    container = train["container"]
    resources = container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == "8"  # trainer.world_size processes on one node
    assert resources["limits"]["vpc.amazonaws.com/efa"] == "32"
    # Huge pages: requests equal limits, and a memory request beside them (Kubernetes requires both).
    assert resources["requests"]["hugepages-2Mi"] == resources["limits"]["hugepages-2Mi"] == "5120Mi"
    assert "memory" in resources["requests"]
    volumes = {v["name"]: v for v in train["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory" and volumes["dshm"]["emptyDir"]["sizeLimit"]
    assert volumes["hugepages"]["emptyDir"] == {"medium": "HugePages"}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts == {"/tmp": "tmp", "/home/moeloop": "home", "/dev/shm": "dshm", "/dev/hugepages": "hugepages"}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert {key: env[key] for key in EFA_ENV} == EFA_ENV
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1" and env["NCCL_NVLS_ENABLE"] == "0"
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert container["command"] + container["args"][:3] == [
        *("python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=8", "-m"),
    ]


# ---------------------------------------------------------------------------------------------
# Multi-node training: a JobSet


def crd_validator(path: Path, version: str) -> Draft4Validator:
    """The CRD's schema with objects closed where properties are declared, so a misspelled key fails."""
    crd = yaml.safe_load(path.read_text())
    schema = next(v for v in crd["spec"]["versions"] if v["name"] == version)["schema"]["openAPIV3Schema"]

    def close(node: Any) -> None:
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            if node.get("x-kubernetes-int-or-string"):
                node.pop("type", None)
                node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(schema)
    return Draft4Validator(schema)


@pytest.fixture
def multi_node(tmp_path: Path) -> MoeloopConfig:
    return make_config(tmp_path, cluster={"train_nodes": 2}, trainer={"world_size": 16})


def test_multi_node_train_is_a_jobset_argo_waits_on(multi_node: MoeloopConfig) -> None:
    documents = render(multi_node, RUN_URI)
    assert lint_documents(documents.values()) == []
    train = {t["name"]: t for t in documents["workflow-template.yaml"]["spec"]["templates"]}["train-jobset"]
    resource = train["resource"]
    assert resource["action"] == "create" and resource["setOwnerReference"] is True
    assert resource["successCondition"] == "status.terminalState == Completed"
    assert resource["failureCondition"] == "status.terminalState == Failed"
    assert train["serviceAccountName"] == "moeloop-orchestrator"
    jobset = read_back(resource["manifest"])
    assert jobset == render_jobset(multi_node)
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and jobset["kind"] == "JobSet"


def test_jobset_validates_against_its_crd(multi_node: MoeloopConfig) -> None:
    jobset = render_jobset(multi_node)
    validator = crd_validator(upstream("schemas", "k8s-crds", "jobset.x-k8s.io_jobsets.yaml"), "v1alpha2")
    assert [error.message for error in validator.iter_errors(jobset)] == []
    broken = copy.deepcopy(jobset)
    broken["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["imagePulPolicy"] = "x"
    assert any("imagePulPolicy" in error.message for error in validator.iter_errors(broken))


def test_jobset_runs_torchrun_rendezvous_over_its_nodes(multi_node: MoeloopConfig) -> None:
    jobset = render_jobset(multi_node)
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert (job["parallelism"], job["completions"], job["completionMode"]) == (2, 2, "Indexed")
    pod = job["template"]["spec"]
    container = pod["containers"][0]
    argv = container["command"] + container["args"]
    assert argv[:3] == ["python", "-m", "torch.distributed.run"]
    assert "--nnodes=2" in argv and "--nproc-per-node=8" in argv and "--standalone" not in argv
    assert "--rdzv-backend=c10d" in argv and "--node-rank=$(NODE_RANK)" in argv
    # Node 0 of the JobSet hosts the rendezvous, by its hostname under the JobSet's headless service.
    assert "--rdzv-endpoint=$(JOBSET_NAME)-node-0-0.$(JOBSET_NAME):29500" in argv
    assert argv[argv.index("-m", 3) :] == [
        *("-m", "moeloop.steps.train", "--", "--run", "{{workflow.parameters.run}}"),
        *("--iteration", "{{inputs.parameters.iteration}}"),
    ]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    assert (
        env["JOBSET_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['jobset.sigs.k8s.io/jobset-name']"
    )
    assert env["FI_PROVIDER"]["value"] == "efa"
    # Each node's pod is the single-node trainer's pod: same placement, resources, volumes and security.
    assert pod["nodeSelector"] == {ROLE: "train"} and pod["serviceAccountName"] == "moeloop-train"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert {v["name"] for v in pod["volumes"]} == {"tmp", "home", "dshm", "hugepages"}
    assert pod["restartPolicy"] == "Never"
    assert job["template"]["metadata"]["labels"]["moeloop.dev/iteration"] == "{{inputs.parameters.iteration}}"


def test_world_size_must_split_over_the_nodes(tmp_path: Path) -> None:
    with pytest.raises(MoeloopError, match="trainer.world_size 8 does not split over cluster.train_nodes 3 nodes"):
        make_config(tmp_path, cluster={"train_nodes": 3}, trainer={"world_size": 8})


# ---------------------------------------------------------------------------------------------
# Pod Security Standard `restricted` (the rules that can be checked on a spec)

ALLOWED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def restricted_violations(pod: dict, containers: list[dict]) -> set[str]:
    """Which rules of the `restricted` profile (Kubernetes Pod Security Standards) a pod breaks."""
    broken = set()
    if any(pod.get(key) for key in ("hostNetwork", "hostPID", "hostIPC")):
        broken.add("hostNamespaces")
    for volume in pod.get("volumes", []):
        if not set(volume) - {"name"} <= ALLOWED_VOLUMES:
            broken.add("volumeTypes")
    pod_security = pod.get("securityContext", {})
    for container in containers:
        security = container.get("securityContext", {})
        if security.get("privileged"):
            broken.add("privileged")
        if security.get("allowPrivilegeEscalation") is not False:
            broken.add("allowPrivilegeEscalation")
        capabilities = security.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []) or set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            broken.add("capabilities")
        non_root = security.get("runAsNonRoot", pod_security.get("runAsNonRoot"))
        user = security.get("runAsUser", pod_security.get("runAsUser"))
        if non_root is not True or user == 0:
            broken.add("runAsNonRoot")
        seccomp = security.get("seccompProfile", pod_security.get("seccompProfile", {}))
        if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
            broken.add("seccompProfile")
        if any(port.get("hostPort") for port in container.get("ports", [])):
            broken.add("hostPorts")
    if pod_security.get("sysctls"):
        broken.add("sysctls")
    return broken


def rendered_pods(config: MoeloopConfig) -> dict[str, tuple[dict, list[dict]]]:
    """Every pod the render describes: Argo templates (a resource template's pod runs Argo's executor,
    whose container the controller configures) and the JobSet's pod."""
    documents = render(config, RUN_URI)
    assert not any(key in documents["workflow-template.yaml"]["spec"] for key in ("hostNetwork", "securityContext"))
    pods = {}
    for template in documents["workflow-template.yaml"]["spec"]["templates"]:
        if "container" in template:
            pods[template["name"]] = (template, [template["container"]])
        elif "resource" in template:
            pods[template["name"]] = (
                template,
                [{"securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}],
            )
    if config.cluster.train_nodes > 1:
        pod = render_jobset(config)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        pods["jobset"] = (pod, pod["containers"])
    return pods


@pytest.mark.parametrize("nodes", [1, 2])
def test_every_pod_but_the_trainer_is_restricted(tmp_path: Path, nodes: int) -> None:
    config = make_config(tmp_path, cluster={"train_nodes": nodes}, trainer={"world_size": 16})
    pods = rendered_pods(config)
    trainers = {"train"} if nodes == 1 else {"jobset"}
    assert trainers <= set(pods) and {"start", "plan", "rollout", "publish", "label", "next-chunk"} <= set(pods)
    for name, (pod, containers) in pods.items():
        # The trainer adds only what EFA needs: IPC_LOCK, which Kubernetes gives to root processes only.
        expected = {"capabilities", "runAsNonRoot"} if name in trainers else set()
        assert restricted_violations(pod, containers) == expected, name
        if name not in trainers:
            assert pod["securityContext"]["runAsUser"] == 1000 and pod["securityContext"]["runAsGroup"] == 1000
    trainer_pod, trainer_containers = pods[trainers.pop()]
    assert trainer_containers[0]["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]},
        "readOnlyRootFilesystem": True,
    }
    assert trainer_pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


def test_restricted_check_catches_what_it_checks(config: MoeloopConfig) -> None:
    pod, containers = copy.deepcopy(rendered_pods(config)["publish"])
    assert restricted_violations(pod, containers) == set()
    pod.setdefault("volumes", []).append({"name": "host", "hostPath": {"path": "/"}})
    pod["hostNetwork"] = True
    containers[0]["securityContext"]["capabilities"]["add"] = ["SYS_ADMIN"]
    containers[0]["securityContext"]["allowPrivilegeEscalation"] = True
    del pod["securityContext"]["seccompProfile"]
    pod["securityContext"]["runAsNonRoot"] = False
    assert restricted_violations(pod, containers) == {
        "volumeTypes",
        "hostNamespaces",
        "capabilities",
        "allowPrivilegeEscalation",
        "seccompProfile",
        "runAsNonRoot",
    }


SECRET_WORDS = {"secret", "password", "passwd", "token", "credential", "credentials", "apikey"}


def named_like_a_secret(name: str) -> bool:
    words = set(re.split(r"[^a-z0-9]+", name.lower()))
    return bool(words & SECRET_WORDS) or "access_key" in name.lower()


def test_no_secret_in_any_rendered_object(tmp_path: Path) -> None:
    """No credential is rendered: no env or parameter named like one, no secret reference, no key material."""
    config = make_config(tmp_path, cluster={"train_nodes": 2}, trainer={"world_size": 16})
    documents = render(config, RUN_URI)
    objects = [*documents.values(), render_jobset(config)]

    def walk(node: Any, path: str) -> list[str]:
        found = []
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("secretKeyRef", "secret", "secretRef"):
                    found.append(f"{path}.{key}")
                if key == "name" and isinstance(value, str) and named_like_a_secret(value):
                    found.append(f"{path}.name={value}")
                found += walk(value, f"{path}.{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                found += walk(value, f"{path}[{i}]")
        elif isinstance(node, str) and ("AKIA" in node or "BEGIN PRIVATE KEY" in node or "aws_secret" in node.lower()):
            found.append(path)
        return found

    assert [hit for document in objects for hit in walk(document, document["kind"])] == []
    leaked = copy.deepcopy(documents["workflow-template.yaml"])
    leaked["spec"]["templates"][1]["container"]["env"].append({"name": "AWS_SECRET_ACCESS_KEY", "value": "x"})
    assert walk(leaked, "WorkflowTemplate")


@pytest.mark.parametrize("name", ["tiny.yaml", "tiny-ppo.yaml", "tiny-ppo-rm.yaml", "eks.yaml"])
def test_shipped_configs_render_and_lint(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # the prompts lie in the repo, which is the images' WORKDIR
    config = load_config(REPO / "configs" / name)
    paths = write_rendered(build(config, "s3://moeloop-runs/runs/" + config.run_name), tmp_path)
    assert lint_paths(paths) == []


# ---------------------------------------------------------------------------------------------
# Read-only root filesystems: what the images and the steps write lies on the pod's emptyDirs

# The images' variables that name where their programs write (images/*/Dockerfile): $HOME holds the caches of
# Hugging Face, vLLM and Triton (~/.cache) and W&B's and matplotlib's settings.
WRITTEN_BY_THE_IMAGES = ("HOME", "MOELOOP_CACHE", "EP_JIT_CACHE_DIR")


def image_paths() -> dict[str, set[str]]:
    """Each image's writable paths, by Dockerfile, from its ENV lines."""
    found = {}
    for dockerfile in sorted((REPO / "images").glob("*/Dockerfile")):
        text = dockerfile.read_text().replace("\\\n", " ")
        settings = dict(re.findall(r"\b([A-Z_]+)=(\S+)", "\n".join(re.findall(r"^ENV (.*)$", text, re.MULTILINE))))
        found[dockerfile.parent.name] = {settings[name] for name in WRITTEN_BY_THE_IMAGES if name in settings}
    return found


@pytest.mark.parametrize("nodes", [1, 2])
def test_every_container_has_a_read_only_root_and_volumes_where_the_images_write(tmp_path: Path, nodes: int) -> None:
    config = make_config(tmp_path, cluster={"train_nodes": nodes}, trainer={"world_size": 16})
    images = image_paths()
    assert images["trainer"] == {"/home/moeloop", "/tmp/moeloop-cache", "/tmp/deep_ep-jit"}
    assert images["cpu"] == images["rollout"] == {"/home/moeloop", "/tmp/moeloop-cache"}
    checked = 0
    for name, (pod, containers) in rendered_pods(config).items():
        if "resource" in pod:
            continue  # Argo's executor runs these: the controller's settings (test_admission_policy.py)
        for container in containers:
            assert container["securityContext"]["readOnlyRootFilesystem"] is True, name
            mounted = [mount["mountPath"] for mount in container["volumeMounts"]]
            volumes = {volume["name"]: volume for volume in pod["volumes"]}
            assert all("emptyDir" in volumes[mount["name"]] for mount in container["volumeMounts"]), name
            image = next(kind for kind in images if f"moeloop-{kind}:" in container["image"])
            outputs = {env["value"] for env in container["env"] if env["name"] == "MOELOOP_OUTPUTS"}
            for path in images[image] | outputs:
                assert any(Path(path).is_relative_to(base) for base in mounted), (name, path, mounted)
            checked += 1
    # With 2 nodes the JobSet's pod is the trainer's, and train-report's pod gives Argo the trainer's figures.
    assert checked == len(STEPS) + (nodes > 1)
