"""Every file in manifests/ checked offline, and each check shown to reject a broken copy.

- core Kubernetes objects: `kubernetes-validate` (strict: unknown fields rejected) for Kubernetes 1.36, the
  newest minor version EKS runs (June 2026) and that kubernetes-validate 1.37 ships schemas for;
- Karpenter objects (and any JobSet / Kubeflow Trainer object): the CRDs' openAPIV3Schema in
  $MOELOOP_SHARED/schemas/k8s-crds (upstream files, see tests/upstream.py: without them these checks skip), with objects closed wherever the CRD declares properties and does not
  preserve unknown fields (a structural CRD prunes unknown fields, which would silently drop a typo), then
  the CRDs' CEL rules (x-kubernetes-validations) with cel-python;
- the Argo controller ConfigMap: each key against the controller's Config struct (CONTROLLER_CONFIG_KEYS),
  each value parsed and validated against lint's Argo schema (workflows/lint/argo_schema.py) where it has a definition;
- kustomize: every file a kustomization names exists and every object file is named; where `kubectl` is
  installed (it is on the development and CI machines), `kubectl kustomize` builds base and overlay and the
  built objects pass the same checks, with the overlay's replacements applied;
- the contracts the rendered workflows rely on: a NodePool per role with its label and taints, Spot for
  rollouts only, IMDSv2, a service account per role with an IRSA role, the executor's and orchestrator's RBAC,
  the priority order; and no key material anywhere.

Errors read `file: Kind/name: field.path: message`.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.argo_substitution import read_back
from tests.conftest import REPO
from tests.upstream import needs_upstream, upstream
from moeloop.workflows.lint.schema_checks import schema_validator

MANIFESTS = REPO / "manifests"
BASE, OVERLAY = MANIFESTS / "base", MANIFESTS / "overlays" / "example"
KUBERNETES_VERSION = "1.36"

ROLES = ("rollout", "reward", "train", "cpu", "memory")
GPU_ROLES = ("rollout", "reward", "train")
SERVICE_ACCOUNTS = tuple(f"moeloop-{role}" for role in (*ROLES, "orchestrator"))
NAMESPACE = "moeloop"
ROLE_LABEL = "moeloop.dev/role"
IRSA = "eks.amazonaws.com/role-arn"

# The top-level keys of Argo's controller Config (config/config.go, json tags) at commit f016ad89 (v4.1.2),
# the release the manifests target; `config` is the documented alternative that
# nests all of them under one key. A misspelled key is ignored by the controller, so it is an error here.
CONTROLLER_CONFIG_KEYS = frozenset(
    {
        "config", "nodeEvents", "workflowEvents", "executor", "mainContainer", "kubeConfig", "artifactRepository",
        "namespace", "instanceID", "metricsConfig", "telemetryConfig", "parallelism", "namespaceParallelism",
        "resourceRateLimit", "persistence", "links", "columns", "workflowDefaults", "podSpecLogStrategy",
        "podGCGracePeriodSeconds", "podGCDeleteDelayDuration", "workflowRestrictions", "initialDelay", "images",
        "retentionPolicy", "navColor", "sso", "synchronization", "artifactDrivers", "failedPodRestart",
        "disableAgentPodCreation", "initlessPod",
    }
)  # fmt: skip
# Values with a definition in lint's Argo schema; FailedPodRestartConfig has none: its fields are checked here.
CONTROLLER_CONFIG_DEFINITIONS = {
    "artifactRepository": "ArtifactRepository",
    "executor": "Container",
    "mainContainer": "Container",
}
PARTIAL_CONTAINERS = frozenset({"executor", "mainContainer"})
FAILED_POD_RESTART_FIELDS = {"enabled": bool, "maxRestarts": int}

# Key material that must never be in a manifest or an image definition.
SECRET_PATTERNS = {
    "an AWS access key id": re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),
    "a private key": re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    "an AWS secret key setting": re.compile(r"(?i)aws_secret_access_key|secretKeySecret|accessKeySecret"),
    # AWS secret access keys: 40 random base64 characters, so with digits, upper and lower case letters
    # (a git commit's 40 hex digits and a/b/c/d paths are not keys).
    "a 40-character secret-looking value": re.compile(
        r"(?<![A-Za-z0-9/+])(?=[A-Za-z/+]*[0-9])(?=[a-z0-9/+]*[A-Z])(?=[A-Z0-9/+]*[a-z])[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])"
    ),
}

Doc = dict[str, Any]
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


# ---------------------------------------------------------------------------------------------------------
# Loading


def object_files(root: Path = MANIFESTS) -> list[Path]:
    return sorted(p for p in root.rglob("*.y*ml") if p.suffix in (".yaml", ".yml"))


def load(path: Path) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def rel(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_absolute() and path.is_relative_to(REPO) else str(path)


def label(doc: Doc) -> str:
    return f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"


def sourced(paths: list[Path]) -> list[tuple[str, Doc]]:
    return [(rel(path), doc) for path in paths for doc in load(path)]


def is_kustomization(doc: Doc) -> bool:
    return doc.get("kind") == "Kustomization"


def cluster_objects(built: list[tuple[str, Doc]] | None = None) -> list[tuple[str, Doc]]:
    """The objects that reach the cluster: the base's files (or a kustomize build's output)."""
    if built is not None:
        return built
    return [(source, doc) for source, doc in sourced(object_files(BASE)) if not is_kustomization(doc)]


# ---------------------------------------------------------------------------------------------------------
# Schema validation


@cache
def crd_group_kinds() -> dict[tuple[str, str], dict[str, Any]]:
    """(group, kind) -> CRD, for every CRD in $MOELOOP_SHARED/schemas/k8s-crds (parsed once: they are megabytes)."""
    found = {}
    for path in upstream("schemas", "k8s-crds").glob("*.yaml"):
        crd = yaml.load(path.read_text(), Loader=YAML_LOADER)
        found[(crd["spec"]["group"], crd["spec"]["names"]["kind"])] = crd
    return found


def crd_schema(group: str, kind: str, version: str) -> dict[str, Any]:
    crd = crd_group_kinds()[(group, kind)]
    served = [v for v in crd["spec"]["versions"] if v["name"] == version and v.get("served")]
    if not served:
        raise LookupError(f"the {kind} CRD does not serve {group}/{version}")
    return served[0]["schema"]["openAPIV3Schema"]


@cache
def crd_validator(group: str, kind: str, version: str) -> jsonschema.Draft4Validator:
    schema = copy.deepcopy(crd_schema(group, kind, version))
    close_structural(schema)
    return jsonschema.Draft4Validator(schema)


# The CRDs' x-kubernetes-validations rules, in CEL, evaluated with cel-python. Kubernetes adds two string
# functions these rules use: `find` (first match of a regex) and `split` (the strings extension).
def cel_find(text: Any, pattern: Any) -> celpy.celtypes.StringType:
    match = re.search(str(pattern), str(text))
    return celpy.celtypes.StringType(match.group(0) if match else "")


def cel_split(text: Any, separator: Any) -> celpy.celtypes.ListType:
    return celpy.celtypes.ListType([celpy.celtypes.StringType(part) for part in str(text).split(str(separator))])


CEL_FUNCTIONS = {"find": cel_find, "split": cel_split}


@cache
def cel_program(rule: str) -> Any:
    environment = celpy.Environment()
    return environment.program(environment.compile(rule), functions=CEL_FUNCTIONS)


def cel_findings(schema: dict[str, Any], value: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, str]]:
    """(field path, message) for every rule that fails where the object has a value. Transition rules
    (those reading oldSelf) only apply to updates and are skipped; a rule that errors fails, as in Kubernetes."""
    for validation in schema.get("x-kubernetes-validations", []):
        if "oldSelf" in validation["rule"]:
            continue
        try:
            holds = bool(cel_program(validation["rule"]).evaluate({"self": celpy.json_to_cel(value)}))
        except celpy.CELEvalError as error:
            holds, validation = False, {"message": f"{validation['rule']}: {error.args[0]}"}
        if not holds:
            yield dotted(list(path)), validation.get("message", validation["rule"])
    if isinstance(value, dict):
        for key, item in value.items():
            sub = schema.get("properties", {}).get(key) or schema.get("additionalProperties")
            if isinstance(sub, dict):
                yield from cel_findings(sub, item, (*path, key))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            yield from cel_findings(schema["items"], item, (*path, str(index)))


def close_structural(schema: dict[str, Any]) -> None:
    """Forbid undeclared fields wherever a structural schema declares properties and keeps no unknown fields."""
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        schema["additionalProperties"] = False
    for sub in schema.get("properties", {}).values():
        close_structural(sub)
    for keyword in ("items", "additionalProperties"):
        if isinstance(schema.get(keyword), dict):
            close_structural(schema[keyword])
    for keyword in ("allOf", "anyOf", "oneOf"):
        for sub in schema.get(keyword, []):
            close_structural(sub)


def dotted(path: Iterator[Any] | list[Any]) -> str:
    return ".".join(str(part) for part in path) or "(top)"


def is_custom(doc: Doc) -> bool:
    """An object of an operator's CRD (Karpenter, JobSet, ...), not of Kubernetes itself."""
    group = str(doc.get("apiVersion", "")).rpartition("/")[0]
    return "." in group and not group.endswith(".k8s.io")


def schema_errors(source: str, doc: Doc) -> list[str]:
    """Validate one object: custom kinds against their CRDs (upstream files), core kinds with kubernetes-validate."""
    where = f"{source}: {label(doc)}"
    group, _, version = str(doc.get("apiVersion", "")).rpartition("/")
    if is_custom(doc):
        if (group, doc.get("kind")) not in crd_group_kinds():
            return [f"{where}: no CRD for {doc.get('apiVersion')} {doc.get('kind')} in $MOELOOP_SHARED/schemas/k8s-crds"]
        validator = crd_validator(group, doc["kind"], version)
        errors = [f"{where}: {dotted(e.absolute_path)}: {e.message}" for e in validator.iter_errors(doc)]
        return errors or [
            f"{where}: {path}: {message}"
            for path, message in cel_findings(crd_schema(group, doc["kind"], version), doc)
        ]
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        return [f"{where}: {dotted(error.absolute_path)}: {error.message}"]
    except kubernetes_validate.SchemaNotFoundError as error:
        return [f"{where}: {error.message}"]
    return []


# ---------------------------------------------------------------------------------------------------------
# The Argo controller ConfigMap


def argo_validator(definition: str) -> Any:
    return schema_validator(definition)  # lint's own: Hera's models with the CRDs' facts, closed


def as_the_controller_reads_it(data: dict[str, str]) -> Any:
    """The controller's parseConfigMap (config/controller.go) without a `config` key: each key's value
    appended as YAML, multi-line values indented by two spaces, then one strict unmarshal."""
    lines = []
    for name, value in data.items():
        if "\n" in value:
            lines.append(f"{name}:\n  " + "\n  ".join(value.strip("\n").split("\n")))
        else:
            lines.append(f"{name}: {value}")
    return yaml.safe_load("\n".join(lines) + "\n")


def controller_config_errors(source: str, doc: Doc) -> list[str]:
    where = f"{source}: {label(doc)}"
    data = doc.get("data") or {}
    if "config" in data:  # the other layout: everything nested under `config`, which must then be alone
        if len(data) != 1:
            return [f"{where}: data.config: must be the only key when present"]
        data = {key: yaml.safe_dump(value) for key, value in yaml.safe_load(data["config"]).items()}
    values, errors = {}, []
    for key, text in data.items():
        try:
            values[key] = yaml.safe_load(text)
        except yaml.YAMLError as error:
            errors.append(f"{where}: data.{key}: not YAML: {str(error).splitlines()[0]}")
    if errors:
        return errors
    try:
        if as_the_controller_reads_it(data) != values:
            return [f"{where}: data: the controller reads these values differently from each value alone"]
    except yaml.YAMLError as error:
        return [f"{where}: data: the controller cannot parse it: {str(error).splitlines()[0]}"]
    for key, value in values.items():
        field = f"data.{key}"
        if key not in CONTROLLER_CONFIG_KEYS:
            errors.append(f"{where}: {field}: not a key of Argo's controller config")
            continue
        checks: list[tuple[str, Any, str]] = []
        if key in CONTROLLER_CONFIG_DEFINITIONS:
            checks.append((field, value, CONTROLLER_CONFIG_DEFINITIONS[key]))
        elif key == "workflowDefaults":
            extra = set(value) - {"metadata", "spec"}
            errors += [f"{where}: {field}.{name}: not a Workflow field" for name in sorted(extra)]
            checks.append((f"{field}.spec", value.get("spec", {}), "WorkflowSpec"))
        elif key == "failedPodRestart":
            for name, item in value.items():
                expected = FAILED_POD_RESTART_FIELDS.get(name)
                if expected is None or not isinstance(item, expected) or isinstance(item, bool) != (expected is bool):
                    errors.append(f"{where}: {field}.{name}: not a field of FailedPodRestartConfig or wrong type")
        for path, item, definition in checks:
            errors += [
                f"{where}: {dotted([path, *e.absolute_path])}: {e.message}"
                for e in argo_validator(definition).iter_errors(item)
                # executor/mainContainer are merged into each pod's containers: partial, `image` comes later
                if not (key in PARTIAL_CONTAINERS and e.validator == "required" and not e.absolute_path)
            ]
    return errors


def is_controller_config(doc: Doc) -> bool:
    return doc.get("kind") == "ConfigMap" and doc["metadata"]["name"] == "workflow-controller-configmap"


# ---------------------------------------------------------------------------------------------------------
# Contracts: placement, identities, permissions, priorities


def of_kind(objects: list[tuple[str, Doc]], kind: str) -> dict[str, tuple[str, Doc]]:
    return {doc["metadata"]["name"]: (source, doc) for source, doc in objects if doc.get("kind") == kind}


def requirement(pool: Doc, key: str) -> dict[str, Any] | None:
    for item in pool["spec"]["template"]["spec"].get("requirements", []):
        if item["key"] == key:
            return item
    return None


def placement_errors(objects: list[tuple[str, Doc]]) -> list[str]:
    errors = []
    pools, classes = of_kind(objects, "NodePool"), of_kind(objects, "EC2NodeClass")
    for role in ROLES:
        if f"moeloop-{role}" not in pools:
            errors.append(f"manifests: NodePool/moeloop-{role}: missing (one NodePool per role)")
            continue
        source, pool = pools[f"moeloop-{role}"]
        where, template = f"{source}: NodePool/moeloop-{role}", pool["spec"]["template"]
        if (template.get("metadata") or {}).get("labels", {}).get(ROLE_LABEL) != role:
            errors.append(f"{where}: spec.template.metadata.labels.{ROLE_LABEL}: must be {role}")
        taints = {(t["key"], t.get("value"), t["effect"]) for t in template["spec"].get("taints", [])}
        wanted = {(ROLE_LABEL, role, "NoSchedule")}
        if role in GPU_ROLES:
            wanted.add(("nvidia.com/gpu", "true", "NoSchedule"))
        for key, value, effect in sorted(wanted - taints):
            errors.append(f"{where}: spec.template.spec.taints: lacks {key}={value}:{effect}")
        capacity = requirement(pool, "karpenter.sh/capacity-type") or {}
        expected = ["spot"] if role == "rollout" else ["on-demand"]
        if capacity.get("operator") != "In" or capacity.get("values") != expected:
            errors.append(
                f"{where}: spec.template.spec.requirements[karpenter.sh/capacity-type]: must be In {expected}"
            )
        reference = template["spec"]["nodeClassRef"]
        if reference.get("kind") != "EC2NodeClass" or reference.get("name") not in classes:
            errors.append(f"{where}: spec.template.spec.nodeClassRef: names no EC2NodeClass of these manifests")
        elif role in GPU_ROLES:
            aliases = [t.get("alias", "") for t in classes[reference["name"]][1]["spec"]["amiSelectorTerms"]]
            if not any(a.startswith(("al2023@", "bottlerocket@")) and not a.endswith("@latest") for a in aliases):
                errors.append(f"{where}: its EC2NodeClass needs a pinned EKS GPU AMI alias (al2023@vYYYYMMDD)")
    for name, (source, node_class) in classes.items():
        options = node_class["spec"].get("metadataOptions", {})
        if options.get("httpTokens") != "required" or options.get("httpPutResponseHopLimit") != 1:
            errors.append(f"{source}: EC2NodeClass/{name}: spec.metadataOptions: IMDSv2 only, hop limit 1")
    if "moeloop-train" in pools:
        source, pool = pools["moeloop-train"]
        train_class = classes.get(pool["spec"]["template"]["spec"]["nodeClassRef"]["name"], ("", {}))[1]
        if not train_class.get("spec", {}).get("placementGroupSelector"):
            errors.append(f"{source}: NodePool/moeloop-train: its EC2NodeClass needs a placementGroupSelector (EFA)")
    return errors


def rules_of(objects: list[tuple[str, Doc]], account: str) -> dict[tuple[str, str], set[str]]:
    """(apiGroup/resource) -> verbs granted to one service account through Roles and RoleBindings."""
    roles = of_kind(objects, "Role")
    granted: dict[tuple[str, str], set[str]] = {}
    for _, binding in of_kind(objects, "RoleBinding").values():
        subjects = binding.get("subjects", [])
        if not any(s["kind"] == "ServiceAccount" and s["name"] == account for s in subjects):
            continue
        role = roles.get(binding["roleRef"]["name"], ("", {"rules": []}))[1]
        for rule in role.get("rules", []):
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    granted.setdefault((group, resource), set()).update(rule["verbs"])
    return granted


ORCHESTRATOR_NEEDS = {
    ("argoproj.io", "workflows"): {"create", "get"},
    ("argoproj.io", "workflowtemplates"): {"get"},
    # create and watch a multi-node train's; apply (get, create, patch) and delete by label (list, delete) the
    # long-lived processes' of `lifetime: chunk`
    ("jobset.x-k8s.io", "jobsets"): {"create", "get", "watch", "patch", "list", "delete"},
}


def identity_errors(objects: list[tuple[str, Doc]]) -> list[str]:
    errors = []
    accounts = of_kind(objects, "ServiceAccount")
    for name in SERVICE_ACCOUNTS:
        if name not in accounts:
            errors.append(f"manifests: ServiceAccount/{name}: missing")
            continue
        source, account = accounts[name]
        where = f"{source}: ServiceAccount/{name}"
        if account["metadata"].get("namespace") != NAMESPACE:
            errors.append(f"{where}: metadata.namespace: must be {NAMESPACE}")
        arn = (account["metadata"].get("annotations") or {}).get(IRSA, "")
        if not re.fullmatch(rf"arn:aws:iam::\d{{12}}:role/{name}", arn):
            errors.append(f"{where}: metadata.annotations.{IRSA}: must be arn:aws:iam::<account>:role/{name}")
        granted = rules_of(objects, name)
        missing = {"create", "patch"} - granted.get(("argoproj.io", "workflowtaskresults"), set())
        if missing:
            errors.append(f"{where}: RBAC: lacks {sorted(missing)} on argoproj.io/workflowtaskresults (the executor)")
        if name == "moeloop-orchestrator":
            for (group, resource), verbs in ORCHESTRATOR_NEEDS.items():
                if verbs - granted.get((group, resource), set()):
                    errors.append(
                        f"{where}: RBAC: lacks {sorted(verbs - granted.get((group, resource), set()))} on {group}/{resource}"
                    )
    return errors


def priority_errors(objects: list[tuple[str, Doc]]) -> list[str]:
    classes = {name: doc for name, (_, doc) in of_kind(objects, "PriorityClass").items()}
    missing = [f"moeloop-{role}" for role in ROLES if f"moeloop-{role}" not in classes]
    if missing:
        return [f"manifests: PriorityClass: missing {missing}"]
    value = {role: classes[f"moeloop-{role}"]["value"] for role in ROLES}
    errors = []
    if not value["train"] > max(value["reward"], value["cpu"], value["memory"]) >= value["reward"] > value["rollout"]:
        errors.append(f"manifests: PriorityClass: order must be train > reward, cpu, memory > rollout, not {value}")
    if classes["moeloop-rollout"].get("preemptionPolicy") != "Never":
        errors.append("manifests: PriorityClass/moeloop-rollout: preemptionPolicy: must be Never (rollouts yield)")
    return errors


def contract_errors(objects: list[tuple[str, Doc]]) -> list[str]:
    return placement_errors(objects) + identity_errors(objects) + priority_errors(objects)


# ---------------------------------------------------------------------------------------------------------
# kustomize


def kustomization_errors(directory: Path) -> list[str]:
    """Every file the kustomization names exists; in a base, every object file is named."""
    path = directory / "kustomization.yaml"
    kustomization = yaml.safe_load(path.read_text())
    errors = []
    named = list(kustomization.get("resources", [])) + [p["path"] for p in kustomization.get("patches", [])]
    for entry in named:
        if not (directory / entry).exists():
            errors.append(f"{rel(path)}: resources/patches: {entry} does not exist")
    listed = {(directory / entry).resolve() for entry in named}
    for file in object_files(directory):
        if file.name != "kustomization.yaml" and file.resolve() not in listed:
            errors.append(f"{rel(path)}: resources: {rel(file)} is not listed")
    return errors


def kustomize_build(directory: Path) -> list[tuple[str, Doc]]:
    result = subprocess.run(
        ["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, f"kubectl kustomize {rel(directory)}: {result.stderr.strip()}"
    return [(f"{rel(directory)} (built)", doc) for doc in yaml.safe_load_all(result.stdout) if doc]


needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with kustomize) not installed")


# ---------------------------------------------------------------------------------------------------------
# The checks on the repository's files


def validation_errors(objects: list[tuple[str, Doc]], custom: bool) -> list[str]:
    """Schema errors of the core objects (and the controller settings), or of the custom ones."""
    errors = []
    for source, doc in objects:
        if is_kustomization(doc) or is_custom(doc) != custom:
            continue
        errors += schema_errors(source, doc)
        if is_controller_config(doc):
            errors += controller_config_errors(source, doc)
    return errors


def test_every_core_object_file_validates_against_its_schema() -> None:
    objects = sourced(object_files())
    assert not (errors := validation_errors(objects, custom=False)), "\n".join(errors)
    kinds = {doc["kind"] for _, doc in objects if not is_custom(doc)}
    assert {"DaemonSet", "ServiceAccount", "Role", "PriorityClass", "ConfigMap"} <= kinds


@needs_upstream
def test_every_custom_object_file_validates_against_its_crd() -> None:
    objects = sourced(object_files())
    assert not (errors := validation_errors(objects, custom=True)), "\n".join(errors)
    assert {"NodePool", "EC2NodeClass"} <= {doc["kind"] for _, doc in objects if is_custom(doc)}


def test_the_cluster_contracts_hold() -> None:
    errors = contract_errors(cluster_objects())
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("directory", [BASE, OVERLAY], ids=["base", "overlay"])
def test_kustomizations_name_existing_files_and_every_object_file(directory: Path) -> None:
    errors = kustomization_errors(directory)
    assert not errors, "\n".join(errors)


@needs_kubectl
def test_kustomize_builds_base_and_overlay_and_the_builds_validate() -> None:
    base, overlay = kustomize_build(BASE), kustomize_build(OVERLAY)
    assert len(base) == len(cluster_objects()) == len(overlay), "the overlay adds or loses objects"
    for objects in (base, overlay):
        errors = validation_errors(objects, custom=False) + contract_errors(objects)
        assert not errors, "\n".join(errors)
    settings = yaml.safe_load((OVERLAY / "settings.yaml").read_text())["data"]
    accounts = of_kind(overlay, "ServiceAccount")
    for name in SERVICE_ACCOUNTS:
        assert accounts[name][1]["metadata"]["annotations"][IRSA] == (
            f"arn:aws:iam::{settings['awsAccountId']}:role/{name}"
        )
    for _, node_class in of_kind(overlay, "EC2NodeClass").values():
        assert node_class["spec"]["role"] == f"KarpenterNodeRole-{settings['clusterName']}"
        for term in node_class["spec"]["subnetSelectorTerms"] + node_class["spec"]["securityGroupSelectorTerms"]:
            assert term["tags"]["karpenter.sh/discovery"] == settings["clusterName"]
    built_text = yaml.safe_dump_all([doc for _, doc in overlay])
    assert "111122223333" not in built_text and "moeloop-settings" not in built_text
    controller = next(doc for _, doc in overlay if is_controller_config(doc))
    patch = yaml.safe_load((OVERLAY / "artifact-repository.yaml").read_text())
    assert controller["data"]["artifactRepository"] == patch["data"]["artifactRepository"]
    assert {"failedPodRestart", "workflowDefaults", "executor"} <= set(controller["data"])


@needs_upstream
@needs_kubectl
def test_kustomize_builds_custom_objects_that_validate_against_their_crds() -> None:
    for objects in (kustomize_build(BASE), kustomize_build(OVERLAY)):
        assert not (errors := validation_errors(objects, custom=True)), "\n".join(errors)


def test_controller_settings_are_the_ones_moeloop_relies_on() -> None:
    controller = next(doc for _, doc in cluster_objects() if is_controller_config(doc))
    data = {key: yaml.safe_load(text) for key, text in controller["data"].items()}
    assert controller["metadata"]["namespace"] == "argo"
    s3 = data["artifactRepository"]["s3"]
    assert s3["useSDKCreds"] is True and not {"accessKeySecret", "secretKeySecret"} & set(s3)
    spec = data["workflowDefaults"]["spec"]
    assert spec["serviceAccountName"] == "moeloop-orchestrator"
    assert spec["podGC"]["strategy"] and spec["ttlStrategy"] and spec["activeDeadlineSeconds"] > 0
    assert data["failedPodRestart"] == {"enabled": True, "maxRestarts": 3}


def test_no_key_material_in_manifests_or_images() -> None:
    found = []
    for path in sorted(p for p in [*MANIFESTS.rglob("*"), *(REPO / "images").rglob("*")] if p.is_file()):
        found += secret_findings(rel(path), path.read_text())
        if path.suffix in (".yaml", ".yml"):
            found += [f"{rel(path)}: {label(doc)}: a Secret" for doc in load(path) if doc.get("kind") == "Secret"]
    assert not found, "\n".join(found)


def secret_findings(source: str, text: str) -> list[str]:
    return [
        f"{source}:{text.count(chr(10), 0, match.start()) + 1}: {what}"
        for what, pattern in SECRET_PATTERNS.items()
        for match in pattern.finditer(text)
    ]


def test_every_service_account_maps_to_existing_iam_policies() -> None:
    mapping = json.loads((MANIFESTS / "iam" / "roles.json").read_text())
    assert sorted(mapping) == sorted(SERVICE_ACCOUNTS)
    for account, policies in mapping.items():
        for policy in policies:
            assert (MANIFESTS / "iam" / f"{policy}.json").is_file(), f"{account}: no manifests/iam/{policy}.json"


# ---------------------------------------------------------------------------------------------------------
# Mutations: each check rejects a broken copy, naming the file and the field


def mutated(kind: str, name: str, change: Any) -> list[tuple[str, Doc]]:
    objects = copy.deepcopy(cluster_objects())
    targets = [doc for _, doc in objects if doc.get("kind") == kind and doc["metadata"]["name"] == name]
    assert len(targets) == 1, f"no single {kind}/{name}"
    change(targets[0])
    return objects


def only(objects: list[tuple[str, Doc]], kind: str, name: str) -> tuple[str, Doc]:
    return next((s, d) for s, d in objects if d.get("kind") == kind and d["metadata"]["name"] == name)


@needs_upstream
def test_a_misspelled_nodepool_field_is_rejected_with_file_and_field() -> None:
    objects = mutated("NodePool", "moeloop-train", lambda d: d["spec"]["template"]["spec"].update(taintz=[]))
    errors = schema_errors(*only(objects, "NodePool", "moeloop-train"))
    assert len(errors) == 1
    assert errors[0].startswith("manifests/base/karpenter/nodepools.yaml: NodePool/moeloop-train: spec.template.spec:")
    assert "'taintz' was unexpected" in errors[0]


@needs_upstream
def test_a_bad_enum_in_an_ec2nodeclass_is_rejected() -> None:
    objects = mutated("EC2NodeClass", "moeloop-train", lambda d: d["spec"].update(instanceStorePolicy="RAID5"))
    (error,) = schema_errors(*only(objects, "EC2NodeClass", "moeloop-train"))
    assert "ec2nodeclasses.yaml: EC2NodeClass/moeloop-train: spec.instanceStorePolicy:" in error and "RAID5" in error


def test_an_unknown_field_in_a_core_object_is_rejected() -> None:
    def typo(doc: Doc) -> None:
        doc["spec"]["template"]["spec"]["containers"][0]["securityContex"] = {}

    objects = mutated("DaemonSet", "nvidia-device-plugin", typo)
    (error,) = schema_errors(*only(objects, "DaemonSet", "nvidia-device-plugin"))
    assert error.startswith("manifests/base/device-plugins/nvidia-device-plugin.yaml: DaemonSet/nvidia-device-plugin:")
    assert "spec.template.spec.containers.0:" in error and "securityContex" in error


def test_a_missing_rbac_verb_is_rejected() -> None:
    def drop_patch(doc: Doc) -> None:
        doc["rules"][0]["verbs"].remove("patch")

    errors = identity_errors(mutated("Role", "moeloop-executor", drop_patch))
    assert len(errors) == len(SERVICE_ACCOUNTS)
    assert errors[0].startswith("manifests/base/service-accounts.yaml: ServiceAccount/moeloop-")
    assert "lacks ['patch'] on argoproj.io/workflowtaskresults" in errors[0]
    orchestrator = mutated("Role", "moeloop-orchestrator", lambda d: d["rules"][2]["verbs"].remove("watch"))
    assert identity_errors(orchestrator) == [
        (
            "manifests/base/service-accounts.yaml: ServiceAccount/moeloop-orchestrator: RBAC: lacks ['watch'] on "
            "jobset.x-k8s.io/jobsets"
        )
    ]


def test_placement_mistakes_are_rejected() -> None:
    def on_demand(doc: Doc) -> None:
        requirement(doc, "karpenter.sh/capacity-type")["values"] = ["spot", "on-demand"]

    def no_gpu_taint(doc: Doc) -> None:
        doc["spec"]["template"]["spec"]["taints"] = doc["spec"]["template"]["spec"]["taints"][:1]

    where = "manifests/base/karpenter/nodepools.yaml: NodePool/moeloop-"
    assert placement_errors(mutated("NodePool", "moeloop-rollout", on_demand)) == [
        f"{where}rollout: spec.template.spec.requirements[karpenter.sh/capacity-type]: must be In ['spot']"
    ]
    assert placement_errors(mutated("NodePool", "moeloop-reward", no_gpu_taint)) == [
        f"{where}reward: spec.template.spec.taints: lacks nvidia.com/gpu=true:NoSchedule"
    ]
    imds = mutated("EC2NodeClass", "moeloop-gpu", lambda d: d["spec"]["metadataOptions"].update(httpTokens="optional"))
    assert placement_errors(imds) == [
        (
            "manifests/base/karpenter/ec2nodeclasses.yaml: EC2NodeClass/moeloop-gpu: spec.metadataOptions: "
            "IMDSv2 only, hop limit 1"
        )
    ]


def test_a_wrong_irsa_annotation_and_a_priority_inversion_are_rejected() -> None:
    def wrong_role(doc: Doc) -> None:
        doc["metadata"]["annotations"][IRSA] = "arn:aws:iam::111122223333:role/admin"

    (error,) = identity_errors(mutated("ServiceAccount", "moeloop-train", wrong_role))
    assert error.startswith(
        f"manifests/base/service-accounts.yaml: ServiceAccount/moeloop-train: metadata.annotations.{IRSA}"
    )
    inverted = mutated("PriorityClass", "moeloop-rollout", lambda d: d.update(value=200000))
    assert priority_errors(inverted)[0].startswith("manifests: PriorityClass: order must be")


def test_a_misspelled_controller_setting_is_rejected() -> None:
    def break_settings(doc: Doc) -> None:
        doc["data"]["failedPodRestarts"] = doc["data"].pop("failedPodRestart")
        doc["data"]["artifactRepository"] = doc["data"]["artifactRepository"].replace("useSDKCreds", "useSdkCreds")
        doc["data"]["workflowDefaults"] = doc["data"]["workflowDefaults"].replace("ttlStrategy", "ttlStrategey")

    source, doc = only(mutated("ConfigMap", "workflow-controller-configmap", break_settings), "ConfigMap",
                       "workflow-controller-configmap")  # fmt: skip
    errors = controller_config_errors(source, doc)
    where = "manifests/base/argo/workflow-controller-configmap.yaml: ConfigMap/workflow-controller-configmap"
    assert f"{where}: data.failedPodRestarts: not a key of Argo's controller config" in errors
    assert any(e.startswith(f"{where}: data.artifactRepository.s3:") and "useSdkCreds" in e for e in errors)
    assert any(e.startswith(f"{where}: data.workflowDefaults.spec:") and "ttlStrategey" in e for e in errors)
    assert len(errors) == 3
    doc["data"] = {"executor": "resources: [unclosed"}
    (error,) = controller_config_errors(source, doc)
    assert error.startswith(f"{where}: data.executor: not YAML:")


def test_kustomization_problems_are_rejected(tmp_path: Path) -> None:
    shutil.copytree(BASE, tmp_path / "base")
    (tmp_path / "base" / "stray.yaml").write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: stray}\n")
    (tmp_path / "base" / "rbac.yaml").unlink()
    errors = kustomization_errors(tmp_path / "base")
    assert any(e.endswith("resources/patches: rbac.yaml does not exist") for e in errors)
    assert any(e.endswith("stray.yaml is not listed") for e in errors)
    assert len(errors) == 2


def test_key_material_is_found() -> None:
    fake_id, fake_secret = "AKIA" + "ABCDEFGHIJKLMNOP", "wJalrXUtnFEMI/K7MDENG/bPxRfiCY" + "EXAMPLEKEY"
    text = f"a: 1\naws_access_key_id: {fake_id}\nkey: {fake_secret}\n"
    assert secret_findings("f.yaml", text) == [
        "f.yaml:2: an AWS access key id",
        "f.yaml:3: a 40-character secret-looking value",
    ]


@needs_upstream
def test_crd_cel_rules_are_enforced() -> None:
    both = mutated("EC2NodeClass", "moeloop-cpu", lambda d: d["spec"].update(instanceProfile="moeloop-nodes"))
    assert schema_errors(*only(both, "EC2NodeClass", "moeloop-cpu")) == [
        (
            "manifests/base/karpenter/ec2nodeclasses.yaml: EC2NodeClass/moeloop-cpu: spec: "
            "must specify exactly one of ['role', 'instanceProfile']"
        )
    ]

    def restricted_label(doc: Doc) -> None:
        doc["spec"]["template"]["spec"]["requirements"].append({"key": "karpenter.sh/gpu", "operator": "Exists"})

    (error,) = schema_errors(
        *only(mutated("NodePool", "moeloop-reward", restricted_label), "NodePool", "moeloop-reward")
    )
    assert error == (
        "manifests/base/karpenter/nodepools.yaml: NodePool/moeloop-reward: spec.template.spec.requirements.3.key: "
        'label domain "karpenter.sh" is restricted'
    )
    empty_in = mutated("NodePool", "moeloop-cpu", lambda d: requirement(d, "kubernetes.io/arch").update(values=[]))
    (error,) = schema_errors(*only(empty_in, "NodePool", "moeloop-cpu"))
    assert error.endswith("spec.template.spec.requirements: requirements with operator 'In' must have a value defined")


# ---------------------------------------------------------------------------------------------------------
# The rendered workflows against these manifests: every pod lands on a NodePool of its role and runs as its
# role's service account; every JobSet the workflow creates validates against its CRD.


def tolerates(tolerations: list[Doc], taint: Doc) -> bool:
    return any(
        (t.get("key") == taint["key"] or (not t.get("key") and t.get("operator") == "Exists"))
        and (t.get("operator") == "Exists" or t.get("value") == taint.get("value"))
        and t.get("effect") in (None, "", taint["effect"])
        for t in tolerations
    )


def pools_for(objects: list[tuple[str, Doc]], node_selector: dict[str, str], tolerations: list[Doc]) -> list[str]:
    """The NodePools a pod with this nodeSelector and these tolerations can be placed on."""
    fitting = []
    for name, (_, pool) in of_kind(objects, "NodePool").items():
        template = pool["spec"]["template"]
        offered = {key: {value} for key, value in (template.get("metadata") or {}).get("labels", {}).items()}
        for item in template["spec"].get("requirements", []):
            if item["operator"] == "In":
                offered.setdefault(item["key"], set()).update(item["values"])
        labels_fit = all(value in offered.get(key, set()) for key, value in node_selector.items())
        if labels_fit and all(tolerates(tolerations, taint) for taint in template["spec"].get("taints", [])):
            fitting.append(name)
    return fitting


JOBSET_API_VERSION = "jobset.x-k8s.io/v1alpha2"


def pod_specs(document: Doc) -> Iterator[tuple[str, str, Doc]]:
    """(where, role, pod-level fields) for every pod the document makes: Argo templates and JobSet pods."""
    spec = document["spec"].get("workflowSpec", document["spec"])
    for template in spec.get("templates", []):
        where = f"{document['kind']}/{document['metadata'].get('name') or document['metadata'].get('generateName')}"
        where += f" template {template['name']}"
        role = (template.get("metadata") or {}).get("labels", {}).get(ROLE_LABEL, "")
        if "container" in template or "script" in template:
            yield (
                where,
                role,
                {
                    "nodeSelector": template.get("nodeSelector", spec.get("nodeSelector", {})),
                    "tolerations": template.get("tolerations", []) + spec.get("tolerations", []),
                    "serviceAccountName": template.get("serviceAccountName", spec.get("serviceAccountName")),
                    "priorityClassName": template.get("priorityClassName", spec.get("podPriorityClassName")),
                },
            )
        manifest = (template.get("resource") or {}).get("manifest")
        if manifest and manifest.startswith(f"apiVersion: {JOBSET_API_VERSION}\n"):
            jobset = read_back(manifest)
            for job in jobset["spec"]["replicatedJobs"]:
                pod = job["template"]["spec"]["template"]["spec"]
                labels = job["template"]["spec"]["template"].get("metadata", {}).get("labels", {})
                yield f"{where} JobSet job {job['name']}", labels.get(ROLE_LABEL, "train"), pod


def test_every_rendered_pod_lands_on_its_roles_nodes_as_its_roles_service_account() -> None:
    from tests.conftest import small_config
    from moeloop.workflows.render.loop import render

    objects, errors, placed = cluster_objects(), [], 0
    priority_classes = set(of_kind(objects, "PriorityClass"))
    held = small_config(trainer={"lifetime": "chunk"}, rollout={"lifetime": "chunk"})  # their JobSets too
    rendered = [(f"{lifetime} {name}", document) for lifetime, config in (("", small_config()), ("chunk", held))
                for name, document in render(config, "s3://acme-rl/runs/tiny").items()]  # fmt: skip
    for name, document in rendered:
        for template in document["spec"].get("templates", []):
            text = (template.get("resource") or {}).get("manifest") or ""
            # Argo's own kinds (the next chunk's Workflow, YAML only once Argo substituted its {{...}}) are
            # `moeloop lint`'s; the rest must match their CRDs.
            if text and not text.startswith("apiVersion: argoproj.io/"):
                errors += schema_errors(f"rendered {name}", read_back(text))
        for where, role, pod in pod_specs(document):
            pools = pools_for(objects, pod.get("nodeSelector") or {}, pod.get("tolerations") or [])
            if pools != [f"moeloop-{role}"]:
                errors.append(f"rendered {name}: {where}: role {role!r} would land on {pools or 'no NodePool'}")
            if pod.get("serviceAccountName") != f"moeloop-{role}":
                errors.append(f"rendered {name}: {where}: runs as {pod.get('serviceAccountName')}, not moeloop-{role}")
            if pod.get("priorityClassName") not in priority_classes:
                errors.append(
                    f"rendered {name}: {where}: priority class {pod.get('priorityClassName')!r} not in manifests"
                )
            placed += 1
    assert placed and not errors, "\n".join(errors)


def test_the_placement_matcher_itself() -> None:
    objects = cluster_objects()
    gpu = [{"key": ROLE_LABEL, "operator": "Equal", "value": "rollout", "effect": "NoSchedule"}]
    gpu.append({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
    assert pools_for(objects, {ROLE_LABEL: "rollout"}, gpu) == ["moeloop-rollout"]
    assert pools_for(objects, {ROLE_LABEL: "rollout", "karpenter.sh/capacity-type": "on-demand"}, gpu) == []
    assert pools_for(objects, {ROLE_LABEL: "rollout"}, gpu[:1]) == []  # the GPU taint is not tolerated
    everything = [{"operator": "Exists"}]
    assert pools_for(objects, {}, everything) == [f"moeloop-{role}" for role in ROLES]
    assert pools_for(objects, {"karpenter.sh/capacity-type": "spot"}, everything) == ["moeloop-rollout"]
