"""Injection through the submit form (issue 36): every value Argo substitutes into a resource template's manifest
(the multi-node trainer's JobSet, the label patch, the next chunk's Workflow), substituted as Argo does it, text
pasted into the manifest, stays one string value, whatever it holds; a submit-form parameter reaches a pod only as
a whole argv value or as data inside an expression; a run location with whitespace, a quote or a control character
is refused by render, start and plan in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from moeloop.steps.config import MoeloopConfig, parse_config
from moeloop.steps.errors import MoeloopError
from moeloop.steps.storage.run import RunStorage
from moeloop.workflows.render.loop import render
from moeloop.workflows.render.parameters import PARAMETERS
from tests.argo_substitution import read_back, substitute, variables
from tests.conftest import REPO

RUN_URI = "s3://moeloop-runs/runs/injected"
# The probe's value of `run` (a quote and newlines that make YAML of their own in pasted text), and others of the
# class: YAML and JSON syntax, Argo tags, backslashes, tabs, non-ASCII and Go's HTML-escaped characters.
HOSTILE = [
    "s3://b/r'\n        hostPID: true\n        hostNetwork: true\n        initContainers:\n"
    "        - {name: x, image: busybox, command: [sh, -c, 'id']}\n      x: '",
    '"}, {"name": "x", "image": "busybox"}, {"a": "',
    "}}{{workflow.name}} {{=1+1}} ]]] --- \n...\n%YAML 1.2\n",
    "a\\b\\\\\"c\t\u2028<script>&amp;\u00e9\u4e2d\U0001f600",
    "",
]


def config(nodes: int) -> MoeloopConfig:
    return parse_config(
        {
            "run_name": "injected",
            "iterations": 3,
            "task": {"train_prompts": "s3://b/train.jsonl", "eval_prompts": "s3://b/eval.jsonl"},
            "reward": {"functions": [{"path": "moeloop.steps.rewards:reverse_positions"}]},
            "rollout": {"prompts_per_iteration": 64, "samples_per_prompt": 8},
            "trainer": {"minibatch_size": 64, "world_size": 16},
            "cluster": {"chunk_iterations": 2, "train_nodes": nodes},
        },
        "test",
    )


def resource_manifests() -> dict[str, str]:
    """Every resource template's manifest, single- and multi-node trainer, by template name."""
    found = {}
    for nodes in (1, 2):
        for document in render(config(nodes), RUN_URI).values():
            for template in document["spec"].get("templates", []):
                if "resource" in template:
                    found[f"{template['name']} ({nodes} node(s))"] = template["resource"]["manifest"]
    return found


def replaced(node: Any, marker: str, value: str) -> Any:
    """node with every string equal to marker replaced by value."""
    if isinstance(node, dict):
        return {replaced(k, marker, value): replaced(v, marker, value) for k, v in node.items()}
    if isinstance(node, list):
        return [replaced(item, marker, value) for item in node]
    return value if node == marker else node


MANIFESTS = resource_manifests()
CASES = [(name, variable) for name, text in MANIFESTS.items() for variable in sorted(variables(text))]


def test_the_sweep_covers_every_resource_manifest_and_the_submit_form() -> None:
    assert {name.split(" ")[0] for name in MANIFESTS} == {"label", "next-chunk", "train-jobset"}
    jobset = MANIFESTS["train-jobset (2 node(s))"]
    assert {"workflow.parameters.run", "inputs.parameters.iteration"} <= variables(jobset)
    assert {f"workflow.parameters.{name}" for name in PARAMETERS} <= variables(MANIFESTS["next-chunk (1 node(s))"])


@pytest.mark.parametrize(("manifest", "variable"), CASES, ids=[f"{m}:{v}" for m, v in CASES])
def test_a_value_argo_pastes_into_a_resource_manifest_is_one_string(manifest: str, variable: str) -> None:
    """Substituted as Argo does (a raw paste into the manifest's text), each hostile value of each variable reads
    back as exactly the object with that one string in the variable's places: no key, item or document of its own."""
    text = MANIFESTS[manifest]
    plain = read_back(text)  # every variable as its plain {{variable}} string
    for value in HOSTILE:
        others = {name: f"{{{{{name}}}}}" for name in variables(text)}
        created = yaml.safe_load(substitute(text, {**others, variable: value}))
        assert created == replaced(plain, f"{{{{{variable}}}}}", value), (variable, value)


def workflow_parameter_uses(node: Any, path: str = "") -> list[tuple[str, str]]:
    """(path, string) of every string outside resource manifests that names a workflow parameter."""
    if isinstance(node, dict):
        inside = (workflow_parameter_uses(value, f"{path}.{key}") for key, value in node.items() if key != "manifest")
        return [use for uses in inside for use in uses]
    if isinstance(node, list):
        return [use for i, item in enumerate(node) for use in workflow_parameter_uses(item, f"{path}[{i}]")]
    return [(path, node)] if isinstance(node, str) and "workflow.parameters." in node else []


@pytest.mark.parametrize("nodes", [1, 2])
def test_a_submit_form_parameter_reaches_a_pod_as_a_whole_value_or_inside_an_expression(nodes: int) -> None:
    """Outside resource manifests, Argo substitutes inside the template's JSON: a parameter that is a whole argv
    value stays one value. Pasted into a `when`, it would be part of the expression itself."""
    template = render(config(nodes), RUN_URI)["workflow-template.yaml"]
    uses = workflow_parameter_uses(template["spec"]["templates"])
    assert uses
    for path, text in uses:
        whole_argument = path.endswith("]") and ".container.args[" in path and text.count("{{") == 1
        whole_argument = whole_argument and text.startswith("{{workflow.parameters.") and text.endswith("}}")
        in_expressions = all(tag.startswith("=") for tag in text.split("{{")[1:] if "workflow.parameters." in tag)
        assert whole_argument or in_expressions, (path, text)


@pytest.mark.parametrize("value", HOSTILE[:3] + ["s3://bucket/runs dir/x", "s3://bucket/r\u202ex", "runs/it's"])
def test_a_run_location_that_is_not_one_token_is_refused(value: str) -> None:
    with pytest.raises(MoeloopError) as refused:
        RunStorage(value or " ")
    assert "\n" not in str(refused.value)


def entry_point(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=300, check=False
    )


@pytest.mark.slow
def test_render_start_and_plan_refuse_the_probes_run_uri_in_one_line(tmp_path: Path) -> None:
    hostile = HOSTILE[0]
    config = str(REPO / "configs" / "eks.yaml")
    commands = {
        "render": ["moeloop.workflows.cli", "render", config, "-o", "out", "--root", hostile],
        "start": ["moeloop.steps.start", "--run", hostile, "--iteration", "0", "--config", config],
        "plan": ["moeloop.steps.chunk", "--run", hostile, "--chunk", "20"],
    }
    for name, command in commands.items():
        result = entry_point(command, tmp_path)
        assert result.returncode == 2, (name, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "APOSTROPHE" in lines[0], (name, result.stderr)
    assert list(tmp_path.iterdir()) == []


def test_only_a_runs_location_must_be_one_token() -> None:
    """A space in a local folder's name (the prompts the local runner resolves under it) is no run location."""
    spaced = {"train_prompts": "/home/A User/train.jsonl", "eval_prompts": "/home/A User/eval.jsonl"}
    assert parse_config({**config(1).model_dump(mode="json"), "task": spaced}, "spaced").task.train_prompts
    with pytest.raises(MoeloopError, match="storage_root: '/home/A User/runs' holds SPACE"):
        parse_config({**config(1).model_dump(mode="json"), "storage_root": "/home/A User/runs"}, "spaced")
    with pytest.raises(MoeloopError, match=r"task.train_prompts: '/home/x\\n' holds a control character"):
        parse_config({**config(1).model_dump(mode="json"), "task": {**spaced, "train_prompts": "/home/x\n"}}, "bad")
