"""The run's `verifiers` environment (rollout.environment), loaded as the library loads it, and what moeloop reads off
it: its datasets' records and its tools' schemas."""

from __future__ import annotations

import importlib.util
from functools import cache
from typing import Any

from moeloop.steps.config_task import EnvironmentConfig
from moeloop.steps.errors import MoeloopError

VERIFIERS_MISSING = "rollout.environment needs the verifiers library: pip install 'moeloop[environments]'"


def load_environment(settings: EnvironmentConfig) -> Any:
    """The environment `verifiers.load_environment(name, **args)` builds (a `vf.Environment`); a one-line error where
    verifiers or the environment's module is not installed, or it does not load."""
    if importlib.util.find_spec("verifiers") is None:
        raise MoeloopError(VERIFIERS_MISSING)
    module = settings.name.replace("-", "_").split("/")[-1]  # as verifiers finds it
    if importlib.util.find_spec(module) is None:
        raise MoeloopError(
            f"rollout.environment: no environment {settings.name!r} is installed (its module {module} does not"
            f" import): install {settings.package!r}; on Argo, build the images as `moeloop images` prints"
        )
    import verifiers as vf

    try:
        environment = vf.load_environment(settings.name, **settings.args)
    except Exception as error:  # the environment's own code: any failure is the config's environment's
        raise MoeloopError(f"rollout.environment {settings.name!r} does not load: {error}".splitlines()[0]) from error
    if not isinstance(environment, vf.Environment):
        raise MoeloopError(f"rollout.environment {settings.name!r}: load_environment returned no verifiers Environment")
    if settings.max_turns is not None:
        environment.max_turns = settings.max_turns
    return environment


@cache
def cached_environment(settings_json: str) -> Any:
    """One environment per process and settings (a rollout engine serves every iteration of its chunk with it)."""
    return load_environment(EnvironmentConfig.model_validate_json(settings_json))


def tool_schemas(environment: Any) -> list[dict[str, Any]] | None:
    """The environment's tools as the chat template takes them (OpenAI's function schemas); None: it has none."""
    return [tool_schema(tool) for tool in getattr(environment, "tool_defs", None) or []] or None


def tool_schema(tool: Any) -> dict[str, Any]:
    """A verifiers `Tool` as chat templates take it."""
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
    }


def dataset_records(environment: Any, split: str) -> list[dict[str, Any]]:
    """The records of the environment's train ("train") or eval ("eval") dataset, as moeloop's prompt sets hold them:
    `prompt` (its messages), and `answer`, `info`, `task` and `completion` (a reference episode's messages, which the
    tiny model's SFT trains on) where it has them. Its eval dataset falls back to its train
    dataset where it has none, as verifiers' own evaluation does."""
    dataset = environment.get_dataset() if split == "train" else environment.get_eval_dataset()
    records = []
    for row in dataset:
        record = {"prompt": [dict(m) for m in row["prompt"]]}
        for key in ("answer", "info", "task", "completion"):  # completion: a reference episode, for the SFT
            if row.get(key) not in (None, "", {}):
                record[key] = row[key]
        records.append(record)
    return records
