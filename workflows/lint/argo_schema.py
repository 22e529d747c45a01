"""The closed JSON Schema of Argo's kinds that `moeloop lint` checks manifests against, built from the installed Hera.

Hera 7.1's models are generated from Argo v4.0.5's OpenAPI definitions, and pydantic gives their JSON Schema. Onto
it go the facts of Argo v4.1's full CRDs (what an API server with them installed refuses when an object is
created), read from their openAPIV3Schema and written down here: the fields v4.1 added, every enum, pattern,
integer format and size bound, and the CEL rules (`RULES`, in Python). Kubernetes' own enums for the pod fields
Argo passes through (`POD_ENUMS`) are checked by the API server when Argo creates the pod, after it has
substituted {{...}}: there an expression is accepted as well.

Every object with declared properties is closed, so a misspelled key fails; maps stay open. A fact that names a
definition or field Hera does not have fails the build, so a Hera upgrade cannot drop one silently.

The built schema is cached as JSON under $MOELOOP_CACHE (the checkpoint cache's root), keyed by this file and the
versions of Hera and pydantic: `moeloop lint` then does not import Hera, which takes half a second.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

Schema = dict[str, Any]

KINDS = ("Workflow", "WorkflowTemplate", "ClusterWorkflowTemplate", "CronWorkflow", "WorkflowEventBinding")

QUANTITY = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
CRON = r"^(@(yearly|annually|monthly|weekly|daily|midnight|hourly)|@every\s+([0-9]+(ns|us|µs|ms|s|m|h))+|([A-Za-z0-9*,/?-]+\s+){4}[A-Za-z0-9*,/?-]+)$"
NODE_NAME = r"^[a-zA-Z0-9][-a-zA-Z0-9]*$"  # templates, DAG tasks, steps
PARAMETER_NAME = r"^[-a-zA-Z0-9_]+$"
ARTIFACT_NAME = r"^[-a-zA-Z0-9_{}.]+$"
METRIC_NAME = r"^[a-zA-Z_][a-zA-Z0-9_]*$"
# How lint's messages name a pattern.
PATTERN_NAMES = {
    QUANTITY: "a Kubernetes quantity (e.g. 500m, 8, 64Gi)",
    CRON: "a cron schedule (five fields, @hourly and the like, or @every <duration>)",
    NODE_NAME: "a name of letters, digits and '-' that starts with a letter or digit",
    PARAMETER_NAME: "a parameter name (letters, digits, '-' and '_')",
    ARTIFACT_NAME: "an artifact name (letters, digits, '-', '_', '.', '{' and '}')",
    METRIC_NAME: "a Prometheus name (letters, digits and '_', not starting with a digit)",
}

INT32, INT64 = (-(2**31), 2**31 - 1), (-(2**63), 2**63 - 1)
BASE64 = re.compile(r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?")
RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})")


def _is_integer(value: object) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())


def _in_range(bounds: tuple[int, int]) -> Callable[[object], bool]:
    return lambda value: not _is_integer(value) or bounds[0] <= value <= bounds[1]


# The CRDs' formats, as checks: True where the value conforms (or is of a type the format does not apply to).
FORMATS: Mapping[str, Callable[[object], bool]] = {
    "int32": _in_range(INT32),
    "int64": _in_range(INT64),
    "byte": lambda value: not isinstance(value, str) or BASE64.fullmatch(value) is not None,
    "date-time": lambda value: not isinstance(value, str) or RFC3339.fullmatch(value) is not None,
}


def _array(items: Schema) -> Schema:
    return {"type": "array", "items": items}


def _ref(name: str) -> Schema:
    return {"$ref": f"#/$defs/{name}"}


def _object(required: tuple[str, ...] = (), **properties: Schema) -> Schema:
    schema: Schema = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    return schema


STRING, BOOLEAN, INTEGER = {"type": "string"}, {"type": "boolean"}, {"type": "integer"}
STRING_MAP = {"type": "object", "additionalProperties": STRING}

# Definitions replaced whole: Hera reads these as strings only; Kubernetes and the CRDs take integers too.
REPLACED_DEFINITIONS: Mapping[str, Schema] = {
    "IntOrString": {"type": ["integer", "string"]},
    "Quantity": {"type": ["integer", "string"], "pattern": QUANTITY},
    "Time": {"type": "string", "format": "date-time"},
}

# Argo v4.1 over Hera's v4.0.5: new definitions, and the fields that are new (or that Hera reads too narrowly).
ADDED_DEFINITIONS: Mapping[str, Schema] = {
    "PodResourceClaim": _object(("name",), name=STRING, resourceClaimName=STRING, resourceClaimTemplateName=STRING),
    "ContainerRestartRule": _object(
        ("action",),
        action=STRING,
        exitCodes=_object(("operator",), operator=STRING, values=_array({**INTEGER, "format": "int32"})),
    ),
    "FileKeySelector": _object(
        ("key", "path", "volumeName"), key=STRING, optional=BOOLEAN, path=STRING, volumeName=STRING
    ),
    "PodCertificateProjection": _object(
        ("keyType", "signerName"),
        certificateChainPath=STRING,
        credentialBundlePath=STRING,
        keyPath=STRING,
        keyType=STRING,
        maxExpirationSeconds={**INTEGER, "format": "int32"},
        signerName=STRING,
        userAnnotations=STRING_MAP,
    ),
    "ExecutorPlugin": _object(
        ("metadata", "spec"),
        metadata=_object(
            annotations=STRING_MAP, finalizers=_array(STRING), labels=STRING_MAP, name=STRING, namespace=STRING
        ),
        spec=_object(
            ("sidecar",),
            sidecar=_object(
                ("container",), automountServiceAccountToken=BOOLEAN, container=_ref("Container") | {"required": ["name"]}
            ),
        ),
    ),
}
_RESTART_RULES = {"restartPolicyRules": _array(_ref("ContainerRestartRule"))}
ADDED_FIELDS: Mapping[str, Mapping[str, Schema]] = {
    "WorkflowSpec": {
        "executorPlugins": _array(_ref("ExecutorPlugin")),
        "podResources": _ref("ResourceRequirements"),
        "resourceClaims": _array(_ref("PodResourceClaim")),
    },
    "Template": {
        "pendingTimeout": STRING,
        "podResources": _ref("ResourceRequirements"),
        "resourceClaims": _array(_ref("PodResourceClaim")),
    },
    "Container": _RESTART_RULES,
    "ContainerNode": _RESTART_RULES,
    "ScriptTemplate": _RESTART_RULES,
    "UserContainer": _RESTART_RULES,
    "EnvVarSource": {"fileKeyRef": _ref("FileKeySelector")},
    "HTTPArtifact": {"saveStreamViaFile": BOOLEAN},
    "S3Artifact": {"addressingStyle": STRING},
    "S3ArtifactRepository": {"addressingStyle": STRING},
    "VolumeProjection": {"podCertificate": _ref("PodCertificateProjection")},
    "HTTPGetAction": {"port": _ref("IntOrString")},  # Hera: integer only
}


def _enum(*values: str) -> Schema:
    return {"enum": list(values)}


ARTIFACT_GC = _enum("", "OnWorkflowCompletion", "OnWorkflowDeletion", "Never")
ADDRESSING_STYLE = _enum("", "path", "virtual-hosted")
NODE_NAME_FACTS = {"pattern": NODE_NAME, "maxLength": 128}
ARTIFACT_MODE = {"minimum": 0, "maximum": 511}
METRIC_VALUE = {"minLength": 1}
# (definition, field) -> the CRDs' keywords for its value. A field ending in [] means the array's items.
CRD_FIELD_FACTS: Mapping[tuple[str, str], Schema] = {
    ("RetryStrategy", "retryPolicy"): _enum("Always", "OnFailure", "OnError", "OnTransientError"),
    ("CronWorkflowSpec", "concurrencyPolicy"): _enum("Allow", "Forbid", "Replace"),
    ("PodGC", "strategy"): _enum("", "OnPodCompletion", "OnPodSuccess", "OnWorkflowCompletion", "OnWorkflowSuccess"),
    ("ArtifactGC", "strategy"): ARTIFACT_GC,
    ("WorkflowLevelArtifactGC", "strategy"): ARTIFACT_GC,
    ("S3Artifact", "addressingStyle"): ADDRESSING_STYLE,
    ("S3ArtifactRepository", "addressingStyle"): ADDRESSING_STYLE,
    ("ResourceTemplate", "action"): _enum("get", "create", "apply", "delete", "replace", "patch"),
    ("ResourceTemplate", "mergeStrategy"): _enum("strategic", "merge", "json"),
    ("Gauge", "operation"): _enum("Set", "Add", "Sub"),
    ("Template", "name"): NODE_NAME_FACTS,
    ("DAGTask", "name"): NODE_NAME_FACTS,
    ("WorkflowStep", "name"): NODE_NAME_FACTS,
    ("Parameter", "name"): {"pattern": PARAMETER_NAME},
    ("Parameter", "enum"): {"minItems": 1},
    ("Artifact", "name"): {"pattern": ARTIFACT_NAME},
    ("ArtifactPaths", "name"): {"pattern": ARTIFACT_NAME},
    ("Artifact", "mode"): ARTIFACT_MODE,
    ("ArtifactPaths", "mode"): ARTIFACT_MODE,
    ("Prometheus", "name"): {"pattern": METRIC_NAME},
    ("Prometheus", "help"): {"minLength": 1},
    ("MetricLabel", "key"): {"pattern": METRIC_NAME},
    ("Metrics", "prometheus"): {"maxItems": 100},
    ("Counter", "value"): METRIC_VALUE,
    ("Histogram", "value"): METRIC_VALUE,
    ("Gauge", "value"): {"minLength": 1, "maxLength": 256},
    ("CronWorkflowSpec", "schedules"): {"minItems": 1},
    ("CronWorkflowSpec", "schedules[]"): {"pattern": CRON},
    ("CronWorkflowSpec", "startingDeadlineSeconds"): {"minimum": 0},
    ("WorkflowSpec", "templates"): {"maxItems": 200},
    ("WorkflowSpec", "parallelism"): {"minimum": 1},
    ("Template", "parallelism"): {"minimum": 1},
    ("Template", "steps"): {"minItems": 1},
    ("DAGTemplate", "tasks"): {"minItems": 1, "maxItems": 200},
    ("Inputs", "parameters"): {"maxItems": 500},
    ("HTTPBodySource", "bytes"): {"format": "byte"},
}
# Integer fields are int32 in the CRDs, except these (int64) and Argo's estimated durations (no format).
INT64_FIELDS = frozenset(
    {
        ("CronWorkflowSpec", "startingDeadlineSeconds"), ("CronWorkflowStatus", "failed"),
        ("CronWorkflowStatus", "succeeded"), ("GitArtifact", "depth"), ("HTTP", "timeoutSeconds"),
        ("NodeStatus", "resourcesDuration{}"), ("PodSecurityContext", "fsGroup"), ("PodSecurityContext", "runAsGroup"),
        ("PodSecurityContext", "runAsUser"), ("PodSecurityContext", "supplementalGroups[]"),
        ("Probe", "terminationGracePeriodSeconds"), ("SecurityContext", "runAsGroup"), ("SecurityContext", "runAsUser"),
        ("ServiceAccountTokenProjection", "expirationSeconds"), ("SleepAction", "seconds"), ("Template", "parallelism"),
        ("Toleration", "tolerationSeconds"), ("WorkflowSpec", "activeDeadlineSeconds"), ("WorkflowSpec", "parallelism"),
        ("WorkflowStatus", "resourcesDuration{}"),
    }
)  # fmt: skip
UNFORMATTED_INTEGERS = frozenset({("NodeStatus", "estimatedDuration"), ("WorkflowStatus", "estimatedDuration")})
# Required by the CRDs beyond what Hera's models require.
CRD_REQUIRED: Mapping[str, tuple[str, ...]] = {"Metrics": ("prometheus",)}

# Kubernetes' enums (core/v1) for pod fields that Argo copies into the pods it creates.
_PULL_POLICY = ("Always", "IfNotPresent", "Never")
_MESSAGE_POLICY = ("File", "FallbackToLogsOnError")
POD_ENUMS: Mapping[tuple[str, str], tuple[str, ...]] = {
    **{(container, "imagePullPolicy"): _PULL_POLICY for container in ("Container", "ContainerNode", "ScriptTemplate", "UserContainer")},
    **{(container, "terminationMessagePolicy"): _MESSAGE_POLICY for container in ("Container", "ContainerNode", "ScriptTemplate", "UserContainer")},
    ("ContainerPort", "protocol"): ("TCP", "UDP", "SCTP"),
    ("Toleration", "operator"): ("Exists", "Equal"),
    ("Toleration", "effect"): ("", "NoSchedule", "PreferNoSchedule", "NoExecute"),
    ("NodeSelectorRequirement", "operator"): ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"),
    ("LabelSelectorRequirement", "operator"): ("In", "NotIn", "Exists", "DoesNotExist"),
    ("SeccompProfile", "type"): ("RuntimeDefault", "Unconfined", "Localhost"),
    ("AppArmorProfile", "type"): ("RuntimeDefault", "Unconfined", "Localhost"),
    ("HTTPGetAction", "scheme"): ("HTTP", "HTTPS"),
    ("VolumeMount", "mountPropagation"): ("None", "HostToContainer", "Bidirectional"),
    ("PersistentVolumeClaimSpec", "volumeMode"): ("Filesystem", "Block"),
    ("PersistentVolumeClaimSpec", "accessModes[]"): ("ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"),
    ("HostPathVolumeSource", "type"): ("", "DirectoryOrCreate", "Directory", "FileOrCreate", "File", "Socket", "CharDevice", "BlockDevice"),
    ("PodSecurityContext", "fsGroupChangePolicy"): ("OnRootMismatch", "Always"),
    ("PodSecurityContext", "seLinuxChangePolicy"): ("Recursive", "MountOption"),
    ("SecurityContext", "procMount"): ("Default", "Unmasked"),
    ("WorkflowSpec", "dnsPolicy"): ("ClusterFirstWithHostNet", "ClusterFirst", "Default", "None"),
}  # fmt: skip
POD_ENUM_KEYWORD = "x-moeloop-pod-enum"  # value: the allowed values; a {{...}} expression passes too
RULES_KEYWORD = "x-moeloop-rules"  # value: messages, keys of RULES


def is_expression(value: object) -> bool:
    return isinstance(value, str) and "{{" in value


# ---------------------------------------------------------------------------------------------
# The CRDs' CEL rules (x-kubernetes-validations), by their message. Each check returns None when the object keeps
# the rule, else what lint says: the CRD's message, with what was found where that helps.

ONE_LOCATION = "at most one artifact location can be specified"
ONE_TEMPLATE_TYPE = "template must have at most one template type"
TIMEOUT_ON_LEAVES = "timeout cannot be applied to steps or dag templates"
DEADLINE_ON_LEAVES = "activeDeadlineSeconds is only valid for leaf templates"
DEPENDS_OR_DEPENDENCIES = "cannot use both 'depends' and 'dependencies'"
CONTINUE_ON_WITHOUT_DEPENDS = "cannot use 'continueOn' when using 'depends'"
TASK_NAME_WITH_DEPENDENCIES = "task name cannot begin with a digit when using 'depends' or 'dependencies'"
COUNT_OR_END = "only one of count or end can be defined"
MANIFEST_OR_MANIFEST_FROM = "only one of manifest or manifestFrom can be specified"
REALTIME_GAUGE = "'resourcesDuration.*' metrics cannot be used in real-time gauges"

ARTIFACT_LOCATIONS = ("s3", "git", "http", "artifactory", "hdfs", "raw", "oss", "gcs", "azure", "plugin")
TEMPLATE_TYPES = ("container", "script", "dag", "steps", "resource", "suspend", "containerSet", "data", "http", "plugin")


def _at_most_one(kinds: tuple[str, ...], message: str) -> Callable[[dict], str | None]:
    def rule(value: dict) -> str | None:
        found = [kind for kind in kinds if kind in value]
        return f"{message} (found {', '.join(found)})" if len(found) > 1 else None

    return rule


def _unless(breaks: Callable[[dict], bool], message: str) -> Callable[[dict], str | None]:
    return lambda value: message if breaks(value) else None


def _composite(template: dict) -> bool:
    return "steps" in template or "dag" in template


def _digit_name_with_dependencies(task: dict) -> bool:
    name = task.get("name")
    return ("depends" in task or "dependencies" in task) and isinstance(name, str) and name[:1].isdigit()


def _realtime_duration_gauge(gauge: dict) -> bool:
    value = gauge.get("value")
    return gauge.get("realtime") is True and isinstance(value, str) and "resourcesDuration." in value


RULES: Mapping[str, Callable[[dict], str | None]] = {
    ONE_LOCATION: _at_most_one(ARTIFACT_LOCATIONS, ONE_LOCATION),
    ONE_TEMPLATE_TYPE: _at_most_one(TEMPLATE_TYPES, ONE_TEMPLATE_TYPE),
    TIMEOUT_ON_LEAVES: _unless(lambda t: t.get("timeout") not in (None, "") and _composite(t), TIMEOUT_ON_LEAVES),
    DEADLINE_ON_LEAVES: _unless(lambda t: "activeDeadlineSeconds" in t and _composite(t), DEADLINE_ON_LEAVES),
    DEPENDS_OR_DEPENDENCIES: _unless(lambda t: "depends" in t and "dependencies" in t, DEPENDS_OR_DEPENDENCIES),
    CONTINUE_ON_WITHOUT_DEPENDS: _unless(lambda t: "depends" in t and "continueOn" in t, CONTINUE_ON_WITHOUT_DEPENDS),
    TASK_NAME_WITH_DEPENDENCIES: _unless(_digit_name_with_dependencies, TASK_NAME_WITH_DEPENDENCIES),
    COUNT_OR_END: _unless(lambda sequence: "count" in sequence and "end" in sequence, COUNT_OR_END),
    MANIFEST_OR_MANIFEST_FROM: _unless(lambda r: "manifest" in r and "manifestFrom" in r, MANIFEST_OR_MANIFEST_FROM),
    REALTIME_GAUGE: _unless(_realtime_duration_gauge, REALTIME_GAUGE),
}
# The definitions the CRDs attach each rule to (the template rules sit on `templates`, i.e. on each Template).
DEFINITION_RULES: Mapping[str, tuple[str, ...]] = {
    "Artifact": (ONE_LOCATION,),
    "ArtifactLocation": (ONE_LOCATION,),
    "ArtifactPaths": (ONE_LOCATION,),
    "Template": (ONE_TEMPLATE_TYPE, TIMEOUT_ON_LEAVES, DEADLINE_ON_LEAVES),
    "DAGTask": (DEPENDS_OR_DEPENDENCIES, CONTINUE_ON_WITHOUT_DEPENDS, TASK_NAME_WITH_DEPENDENCIES),
    "Sequence": (COUNT_OR_END,),
    "ResourceTemplate": (MANIFEST_OR_MANIFEST_FROM,),
    "Gauge": (REALTIME_GAUGE,),
}


# ---------------------------------------------------------------------------------------------
# Building the schema


@cache
def definitions() -> dict[str, Schema]:
    """Every definition the five kinds use, by name (`#/$defs/<name>`), closed and with the CRDs' facts."""
    path = cache_path()
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    built = _built()
    try:  # best effort: an unwritable cache only costs the next call the build
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(descriptor, "w") as stream:
            json.dump(built, stream)
        os.replace(temporary, path)
    except OSError:
        pass
    return built


def cache_path() -> Path:
    key = hashlib.sha256(Path(__file__).read_bytes())
    for package in ("hera", "pydantic"):
        key.update(f"{package}=={metadata.version(package)}".encode())
    root = Path(os.environ.get("MOELOOP_CACHE", Path(tempfile.gettempdir()) / "moeloop-cache"))
    return root / f"argo-schema-{key.hexdigest()[:16]}.json"


def _built() -> dict[str, Schema]:
    from hera.workflows import models
    from pydantic.json_schema import models_json_schema

    _, generated = models_json_schema([(getattr(models, kind), "validation") for kind in KINDS], by_alias=True)
    defs = {name: _without_nulls(schema) for name, schema in generated["$defs"].items()}
    for name, schema in REPLACED_DEFINITIONS.items():
        _known(defs, name)
        defs[name] = copy.deepcopy(schema)
    defs.update(copy.deepcopy(ADDED_DEFINITIONS))
    for name, fields in ADDED_FIELDS.items():
        _known(defs, name)["properties"].update(copy.deepcopy(fields))
    for name, required in CRD_REQUIRED.items():
        _known(defs, name)["required"] = sorted({*_known(defs, name).get("required", ()), *required})
    for name, rules in DEFINITION_RULES.items():
        _known(defs, name)[RULES_KEYWORD] = list(rules)
    for name, schema in defs.items():
        for field, value in schema.get("properties", {}).items():
            _add_integer_formats(defs, name, field, value)
    for (name, field), facts in CRD_FIELD_FACTS.items():
        _field(defs, name, field).update(facts)
    for (name, field), values in POD_ENUMS.items():
        _field(defs, name, field)[POD_ENUM_KEYWORD] = list(values)
    for schema in defs.values():
        _close(schema)
    return defs


def _without_nulls(schema: Any) -> Any:
    """Hera's schema without `null` alternatives (Argo omits an unset field) and without annotations."""
    if isinstance(schema, list):
        return [_without_nulls(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    alternatives = [alternative for alternative in schema.get("anyOf", ()) if alternative != {"type": "null"}]
    if len(alternatives) == 1:
        return _without_nulls(alternatives[0])
    kept: Schema = {}
    for key, value in schema.items():
        if key in ("title", "description", "default", "format"):
            continue
        if key == "properties":
            kept[key] = {name: _without_nulls(sub) for name, sub in value.items()}
        else:
            kept[key] = _without_nulls(value)
    return kept


def _known(defs: Mapping[str, Schema], name: str) -> Schema:
    if name not in defs:
        raise KeyError(f"workflows/lint/argo_schema.py: Hera has no definition {name!r}")
    return defs[name]


def _field(defs: Mapping[str, Schema], name: str, field: str) -> Schema:
    """The schema of a field's value; `field[]` is its items, `field{}` its map values."""
    base = field.rstrip("[]{}")
    properties = _known(defs, name).get("properties", {})
    if base not in properties:
        raise KeyError(f"workflows/lint/argo_schema.py: Hera's {name} has no field {base!r}")
    schema = properties[base]
    for suffix in re.findall(r"\[\]|\{\}", field[len(base) :]):
        schema = schema["items" if suffix == "[]" else "additionalProperties"]
    return schema


def _add_integer_formats(defs: Mapping[str, Schema], name: str, field: str, value: Schema) -> None:
    for suffix, schema in (("", value), ("[]", value.get("items")), ("{}", value.get("additionalProperties"))):
        if isinstance(schema, dict) and schema.get("type") == "integer":
            key = (name, field + suffix)
            if key not in UNFORMATTED_INTEGERS:
                schema["format"] = "int64" if key in INT64_FIELDS else "int32"


def _close(schema: Schema) -> None:
    """Forbid undeclared keys wherever properties are declared; objects without any (plugins, FieldsV1) and maps
    stay open."""
    if schema.get("properties") == {}:
        del schema["properties"]
    if "properties" in schema and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    for sub in schema.get("properties", {}).values():
        _close(sub)
    for keyword in ("items", "additionalProperties"):
        if isinstance(schema.get(keyword), dict):
            _close(schema[keyword])
