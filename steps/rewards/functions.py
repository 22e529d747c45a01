"""Reward functions (rule or verifier rewards), named by import path `package.module:function` and called as
function(prompt_record, response_text) -> float. The reward step, evaluate and the local runner's checks share them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from steps.config import RewardConfig
from steps.errors import MoeloopError

RewardFunction = Callable[[dict, str], float]


def import_reward_function(path: str) -> RewardFunction:
    module_name, _, attribute = path.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise MoeloopError(f"reward function {path!r} does not import: {error}") from None
    if not callable(function):
        raise MoeloopError(f"reward function {path!r} is not callable")
    return function


def reward_functions(settings: RewardConfig) -> list[tuple[RewardFunction, float]]:
    return [(import_reward_function(f.path), f.weight) for f in settings.functions]


def score(functions: list[tuple[RewardFunction, float]], record: dict, response: str) -> float:
    return float(sum(weight * function(record, response) for function, weight in functions))
