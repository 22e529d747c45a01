"""Reward functions (rule or verifier rewards), named by import path `package.module:function` and called as
function(prompt_record, response_text, **args) -> float; which ones score a record depends on its data_source
(`reward.by_source`, else `reward.functions`). They run in worker processes (steps/rewards/pool.py), never in a step's
own process: a function that hangs, exits or crashes costs its worker, not the step.
"""

from __future__ import annotations

import importlib
import inspect
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from moeloop.steps.errors import MoeloopError

if TYPE_CHECKING:  # the worker process imports this module, and not pydantic's models
    from moeloop.steps.config_reward import RewardConfig

RewardFunction = Callable[..., float]
DEFAULT_SOURCE = "default"  # how the metrics name the records that have no data_source


def import_reward_function(path: str, args: dict[str, Any]) -> RewardFunction:
    """The function at path, checked to take (record, response, **args)."""
    module_name, _, attribute = path.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise MoeloopError(f"reward function {path!r} does not import: {error}") from None
    except Exception as error:  # noqa: BLE001 - the user's module failed as it loaded: name it, one line
        raise MoeloopError(f"reward function {path!r} does not import: {type(error).__name__}: {error}") from None
    if not callable(function):
        raise MoeloopError(f"reward function {path!r} is not callable")
    try:
        inspect.signature(function).bind({}, "", **args)
    except TypeError as error:
        raise MoeloopError(f"reward function {path!r} does not take (record, response, **{args}): {error}") from None
    except ValueError:
        pass  # no signature to read (a builtin): the call will tell
    return function


def data_source(record: dict[str, Any]) -> str | None:
    value = record.get("data_source")
    return value if isinstance(value, str) else None


def by_source(records: list[dict[str, Any]]) -> dict[str, list[int]]:
    """The records' indices by data_source, sorted by name (DEFAULT_SOURCE: the records without one)."""
    groups: dict[str, list[int]] = {}
    for index, record in enumerate(records):
        groups.setdefault(data_source(record) or DEFAULT_SOURCE, []).append(index)
    return dict(sorted(groups.items()))


def check_reward_routes(settings: RewardConfig, records: list[dict[str, Any]], source: str, rubric: bool) -> None:
    """Every record is scored by some function or model: a data_source that reward.by_source does not name, with no
    default reward.functions and no reward model, would score 0 whatever the response. An environment's rubric
    (rubric: rollout.environment is set) scores every record. Checked at start."""
    if settings.models or rubric:
        return
    unscored = Counter(data_source(r) or DEFAULT_SOURCE for r in records if not settings.functions_for(data_source(r)))
    if unscored:
        named = ", ".join(f"{name!r} ({count} records)" for name, count in sorted(unscored.items()))
        raise MoeloopError(
            f"{source}: no reward function scores data_source {named}: name it in reward.by_source, or give"
            " reward.functions as the default"
        )
