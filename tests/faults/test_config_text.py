"""What reaches the manifests and the logs from the files a user hands moeloop (issue 36): no config string, at any
key, may hold an Argo expression (`{{`, which Argo evaluates wherever it finds it and has no escape for) or
credentials in a URI (the config is the `config` parameter of every rendered object, the run's config.yaml and its
error lines; refused, never echoed). Every YAML file moeloop reads (a config, a manifest for lint, the planner's
target and prices) goes through one loader: a key given twice, an alias bomb, an alias to its own holder, nesting
past libyaml's bound, a date that is no date: one line naming the file, quickly."""

from __future__ import annotations

import copy
import resource
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from moeloop.steps.config import load_config, parse_config
from moeloop.steps.errors import MoeloopError
from moeloop.workflows.capacity.target import load_prices, load_target
from moeloop.workflows.lint.documents import lint_paths
from tests.conftest import REPO
from tests.processes import cli_command, moeloop_cli, run_command, step_command

SECRET = "hunter2-not-for-logs"
# A config with every section that holds strings filled in: the sweep's ground.
FULL_CONFIG = {
    **yaml.safe_load((REPO / "configs" / "eks.yaml").read_text()),
    "model": {"checkpoint": "s3://acme-rl/models/base"},
    "reward": {
        "functions": [{"path": "moeloop.steps.rewards:reverse_positions"}],
        "models": [{"path": "s3://acme-rl/reward-models/rm"}],
    },
    "observe": {
        "trackers": ["tensorboard", "mlflow", "wandb"],
        "mlflow": {"tracking_uri": "https://mlflow.example.com", "experiment": "e"},
        "wandb": {"project": "p", "entity": "team"},
    },
}
FULL_CONFIG["cluster"] = {
    **FULL_CONFIG["cluster"],
    "train": {
        "image": "registry.example.com/trainer:1",
        "service_account": "sa",
        "node_selector": {"pool": "p5"},
        "tolerations": [{"key": "k", "value": "v", "effect": "NoSchedule"}],
        "resources": {"requests": {"cpu": "8"}, "limits": {"memory": "1Gi"}},
        "env": {"NAME": "value"},
        "shm_size": "1Gi",
        "priority_class": "high",
    },
}


def leaves(node: Any, path: tuple = ()) -> list[tuple]:
    """The path of every value, and of every mapping key (ending in a `KEY` marker), of a parsed YAML document."""
    if isinstance(node, dict):
        return [p for key, value in node.items() for p in [(*path, key, KEY), *leaves(value, (*path, key))]]
    if isinstance(node, list):
        return [p for index, item in enumerate(node) for p in leaves(item, (*path, index))]
    return [path]


KEY = object()


def with_string(document: Any, path: tuple, text: str) -> Any:
    """A copy of document with the value at path (or the key, for a KEY path) replaced by text."""
    changed = copy.deepcopy(document)
    *parents, last = path
    holder = changed
    for step in parents[:-1] if last is KEY else parents:
        holder = holder[step]
    if last is KEY:
        holder[text] = holder.pop(parents[-1])
    else:
        holder[last] = text
    return changed


def dotted(path: tuple) -> str:
    return ".".join(str(step) for step in path if step is not KEY)


PATHS = leaves(FULL_CONFIG)


def test_the_full_config_is_one_and_the_sweep_reaches_every_section() -> None:
    config = parse_config(FULL_CONFIG, "full")
    assert config.cluster.train.env == {"NAME": "value"} and config.observe.mlflow.tracking_uri
    sections = {dotted(path).split(".")[0] for path in PATHS}
    assert sections >= {"run_name", "model", "task", "reward", "cluster", "observe"}
    assert len(PATHS) >= 98


@pytest.mark.parametrize(
    ("text", "refusal"),
    [
        ("{{workflow.serviceAccountName}}", "holds '{{', which Argo would evaluate as an expression"),
        (f"https://admin:{SECRET}@mlflow.example.com", "credentials in a URI are refused"),
        (f"s3://{SECRET}@bucket/runs", "credentials in a URI are refused"),
    ],
    ids=["argo-expression", "user-and-password", "token"],
)
def test_every_config_string_and_key_refuses_an_argo_expression_and_credentials(text: str, refusal: str) -> None:
    for path in PATHS:
        with pytest.raises(MoeloopError) as refused:
            parse_config(with_string(FULL_CONFIG, path, text), "swept")
        message = str(refused.value)
        where = dotted(path[:-2]) or "the top level" if path[-1] is KEY else dotted(path)
        assert message.startswith(f"config swept: {where}: ") and refusal in message, (path, message)
        assert SECRET not in message and "\n" not in message


def test_a_tracking_uri_with_a_password_is_refused_before_anything_and_never_echoed(tmp_path: Path) -> None:
    config = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    config["observe"] = {"trackers": ["mlflow"], "mlflow": {"tracking_uri": f"https://admin:{SECRET}@mlflow.example"}}
    for name in ("train", "eval"):
        config["task"][f"{name}_prompts"] = str(REPO / "configs" / config["task"][f"{name}_prompts"])
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    root = tmp_path / "root"
    commands = [
        cli_command("run", str(path), "--root", str(root)),
        cli_command("render", str(path), "-o", str(tmp_path / "out"), "--root", "s3://acme-rl/runs"),
        step_command("start", root / "tiny", 0, "--config", yaml.safe_dump(config)),
    ]
    for command in commands:
        result = run_command(command, cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr
        assert "observe.mlflow.tracking_uri: credentials in a URI are refused" in result.stderr
        assert SECRET not in result.stdout + result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]  # no run, no log, no render


# ---------------------------------------------------------------------------------------------------------
# One YAML loader for every file a user hands in

BOMB = "".join(
    f"{name}: &{name} [{', '.join([f'*{previous}'] * 9 if previous else ['lol'] * 9)}]\n"
    for previous, name in zip([None, *"abcdefgh"], "abcdefghi")
)
BAD_YAML = {
    "alias-bomb": (BOMB, "refused YAML: its aliases expand it by more than 100000 nodes"),
    "alias-to-its-holder": ("a: &a [1, *a]\n", "refused YAML: an alias refers to a node that holds it"),
    "duplicate-key": ("spec: {entrypoint: other, entrypoint: main}\n", "key 'entrypoint' appears twice in one mapping"),
    "deep-nesting": ("a: " + "[" * 20_000 + "]" * 20_000 + "\n", "not valid YAML (exceeded maximum nesting depth"),
    "no-such-date": ("a: 2026-02-30\n", "not valid YAML (day is out of range for month)"),
}


def readers(path: Path) -> dict[str, Any]:
    """Each reader of a user's YAML file, on path: its one-line refusal."""

    def refusal(read: Any) -> str:
        try:
            read(path)
        except MoeloopError as error:
            return str(error)
        raise AssertionError(f"{read} accepted {path}")

    return {
        "config": refusal(load_config),
        "lint": str(lint_paths([path])[0]),
        "plan target": refusal(load_target),
        "plan prices": refusal(load_prices),
    }


@pytest.mark.parametrize("kind", sorted(BAD_YAML))
def test_every_yaml_file_a_user_hands_in_is_read_by_the_one_loader(tmp_path: Path, kind: str) -> None:
    text, expected = BAD_YAML[kind]
    path = tmp_path / f"{kind}.yaml"
    path.write_text(text)
    started = time.perf_counter()
    for reader, message in readers(path).items():
        assert str(path) in message and expected in message and "\n" not in message, (reader, message)
    assert time.perf_counter() - started < 5


def test_lint_refuses_the_alias_bomb_in_one_line_quickly_in_bounded_memory(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.yaml"
    header = "apiVersion: argoproj.io/v1alpha1\nkind: Workflow\nmetadata: {name: bomb}\nspec:\n  entrypoint: main\n"
    bomb.write_text(header + "".join(f"  {line}\n" for line in BOMB.splitlines()) + "  templates: *i\n")
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    started = time.perf_counter()
    result = moeloop_cli("lint", str(bomb), cwd=tmp_path)
    seconds = time.perf_counter() - started
    assert result.returncode == 2
    assert result.stdout.splitlines() == [f"{bomb}: refused YAML: its aliases expand it by more than 100000 nodes"]
    assert result.stderr == "error: 1 lint error(s)\n"
    assert seconds < 30
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    assert peak == before or peak < 1 << 20  # KiB: the child (if the largest yet) stayed under 1 GiB
