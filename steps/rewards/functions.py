"""Reward functions (rule or verifier rewards), named by import path `package.module:function` and called as
function(prompt_record, response_text) -> float. The reward step, evaluate and the local runner's checks share them.
"""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable

from moeloop.steps.config import RewardConfig
from moeloop.steps.errors import MoeloopError

RewardFunction = Callable[[dict, str], float]


def import_reward_function(path: str) -> RewardFunction:
    module_name, _, attribute = path.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise MoeloopError(f"reward function {path!r} does not import: {error}") from None
    except Exception as error:  # noqa: BLE001 - the user's module failed as it loaded: name it, one line
        raise MoeloopError(f"reward function {path!r} does not import: {type(error).__name__}: {error}") from None
    if not callable(function):
        raise MoeloopError(f"reward function {path!r} is not callable")
    return function


def reward_functions(settings: RewardConfig) -> list[tuple[RewardFunction, float]]:
    return [(import_reward_function(f.path), f.weight) for f in settings.functions]


def score(functions: list[tuple[RewardFunction, float]], record: dict, response: str, sample: str) -> float:
    """The weighted sum of the reward functions for one sample. A function that raises, or returns anything
    but a finite number, stops the step with an error naming it, the sample and what it returned: a NaN
    would otherwise train the policy and reach the checkpoints."""
    total = 0.0
    for function, weight in functions:
        name = f"{getattr(function, '__module__', '?')}:{getattr(function, '__qualname__', type(function).__name__)}"
        try:
            value = function(record, response)
        except Exception as error:  # noqa: BLE001 - the user's function: its failure, one line, named
            raise MoeloopError(
                f"reward function {name} raised {type(error).__name__}: {error} on {sample} (response {response!r})"
            ) from None
        if not isinstance(value, numbers.Real) or not math.isfinite(value):  # a bool counts as 0 or 1
            raise MoeloopError(
                f"reward function {name} returned {value!r} ({type(value).__name__}) on {sample} (response"
                f" {response!r}): a reward must be a finite number"
            )
        total += weight * float(value)
    return total
