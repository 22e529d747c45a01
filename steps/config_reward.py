"""The config's `reward` section: the reward functions (by data_source), the reward models, and how the functions
run (worker processes, a time limit per sample, what a failure does). Part of the one typed config
(steps/config.py), kept apart for its size."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from moeloop.steps.config_base import Strict
from moeloop.steps.inputs import check_location


class RewardFunction(Strict):
    # "package.module:function", called as function(record, response_text, **args) -> float
    path: str
    weight: float = 1.0
    args: dict[str, Any] = {}  # keyword arguments of the call, e.g. a format reward's tags

    @field_validator("path")
    @classmethod
    def _import_path(cls, value: str) -> str:
        module, _, function = value.partition(":")
        if not module or not function:
            raise ValueError(f"{value!r} is not of the form package.module:function")
        return value


class RewardModel(Strict):
    """An HF sequence-classification model (num_labels=1) that scores prompt + response."""

    path: str  # a local folder or a URI (s3://...); fetched through the storage module, verified and cached
    weight: float = 1.0
    batch_size: int = Field(32, gt=0)  # samples per forward pass

    @field_validator("path")
    @classmethod
    def _not_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must name a reward model folder or URI")
        return check_location(value, "a reward model")


class RewardConfig(Strict):
    # The reward is sum(weight * function) + sum(weight * model score): rule rewards, reward models, or both.
    # `functions` score every record whose data_source `by_source` does not name (and every record without one);
    # a data_source that `by_source` names is scored by its own list instead. The models score every record.
    functions: list[RewardFunction] = []
    by_source: dict[str, list[RewardFunction]] = {}
    models: list[RewardModel] = []
    # The functions run in worker processes (steps/rewards/pool.py), each call within timeout_s seconds.
    timeout_s: float = Field(30.0, gt=0)
    # A function that raises, exits, crashes, hangs past timeout_s or returns no finite number: fail stops the
    # step with one line naming it, the step and the sample; zero counts that call's value as 0 and counts it
    # (reward_failures in the reports and metrics).
    on_error: Literal["fail", "zero"] = "fail"
    workers: int | None = Field(None, gt=0)  # worker processes; None: one per core of the step, at most 8

    def any_reward(self) -> bool:
        """Whether it names a reward function or model (the config needs one, or an environment's rubric)."""
        return bool(self.functions or self.by_source or self.models)

    def functions_for(self, data_source: str | None) -> list[RewardFunction]:
        """The functions that score a record of this data_source."""
        return self.by_source.get(data_source, self.functions) if data_source is not None else self.functions

    def all_functions(self) -> list[RewardFunction]:
        """Every configured function, each path and args once: what a worker process imports."""
        found: dict[str, RewardFunction] = {}
        for function in [*self.functions, *(f for functions in self.by_source.values() for f in functions)]:
            found.setdefault(function_key(function), function)
        return list(found.values())


def function_key(function: RewardFunction) -> str:
    """A function's identity for the workers: its path and arguments (its weight applies in the step)."""
    return f"{function.path} {sorted(function.args.items())!r}"
