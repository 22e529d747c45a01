"""The run's parameters: the WorkflowTemplate's submit form in the Argo UI (names, descriptions), their values from
the config, and the labels that find a run's Workflows."""

from __future__ import annotations

import json

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
