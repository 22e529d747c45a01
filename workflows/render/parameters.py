"""The run's parameters: the WorkflowTemplate's submit form in the Argo UI (names, descriptions), their values from
the config, and the labels that find a run's Workflows."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import yaml

from moeloop.steps.config import MoeloopConfig
from moeloop.workflows.dag import run_values
from moeloop.workflows.render.placement import LABEL
from moeloop.workflows.render.portable_paths import portable_config

# Run parameters: the submit form of the Argo UI. `chain` is Argo-only (the local runner runs everything).
PARAMETERS = ("run", "iterations", "model", "chain", "config")
PARAMETER_DESCRIPTIONS = {
    "run": "The run's folder: <storage root>/<run name>, e.g. s3://bucket/runs/tiny. Pods read and write only here.",
    "iterations": "Target: the run's last iteration. A chunk runs from LATEST + 1 and stops at the target.",
    "model": "HF checkpoint URI to start a new run from; empty: the config's model.checkpoint (or the tiny model).",
    "chain": "Create the next chunk's Workflow when this one ends short of the target (the CronWorkflow sets false).",
    "config": "The run's config as YAML (steps/config.py). A started run refuses changes but to cluster/local/storage_root.",
}
CONFIG_HEADER = (
    "# The run's config (steps/config.py). The parameters `iterations` and `model` override its own; a started\n"
    "# run refuses changes to anything but cluster, local and storage_root.\n"
)


def run_labels(config: MoeloopConfig) -> dict[str, str]:
    return {"app.kubernetes.io/name": "moeloop", f"{LABEL}/run": config.run_name}


def run_arguments(config: MoeloopConfig, run_uri: str, chain: bool) -> dict[str, str]:
    """The run parameters' values; the config as YAML, which the Argo UI's forms show line by line."""
    shipped = portable_config(config)
    config_text = CONFIG_HEADER + yaml.safe_dump(shipped.model_dump(mode="json"), sort_keys=False)
    return {**run_values(shipped, run_uri), "config": config_text, "chain": json.dumps(chain)}


# An Argo variable standing alone as a string value of a resource manifest: {{workflow.parameters.run}}.
PLACEHOLDER = re.compile(r"\{\{([A-Za-z0-9_.-]+)\}\}")


def manifest_text(document: dict[str, Any]) -> str:
    """A resource template's manifest: YAML whose every Argo variable, a whole string value, is written as
    {{=toJson(variable)}}. Argo pastes values into a manifest's text before parsing it, so a value with a quote and
    a newline would be YAML of its own (a pod's securityContext, an init container); toJson's JSON string is read
    back as the very value, whatever it holds."""
    expressions: dict[str, str] = {}
    stamp = uuid.uuid4().hex  # stands for an expression in the YAML, then replaced: never in the output

    def as_data(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: as_data(item) for key, item in value.items()}
        if isinstance(value, list):
            return [as_data(item) for item in value]
        if isinstance(value, str) and "{{" in value:
            variable = PLACEHOLDER.fullmatch(value)
            if variable is None:
                raise ValueError(f"an Argo variable in a manifest must be a whole value, not part of {value!r}")
            token = f"argo-{stamp}-{len(expressions)}-end"
            expressions[token] = f"{{{{=toJson({variable[1]})}}}}"
            return token
        return value

    text = yaml.safe_dump(as_data(document), sort_keys=False, width=1 << 16)
    for token, expression in expressions.items():
        text = text.replace(token, expression)
    return text
