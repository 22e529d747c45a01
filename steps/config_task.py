"""The config's `task` section: where the prompts come from. Part of the one typed config (steps/config.py), kept
apart for its size."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from moeloop.steps.config_base import Strict
from moeloop.steps.inputs import check_location


class ReasoningGymTask(Strict):
    """One reasoning-gym dataset (https://github.com/open-thought/reasoning-gym): its records' data_source is name."""

    name: str  # a reasoning-gym dataset name, e.g. leg_counting
    train_size: int = Field(1000, gt=0)
    eval_size: int = Field(100, gt=0)
    config: dict[str, Any] = {}  # the dataset's own settings (its config's fields), e.g. max_animals

    @field_validator("config")
    @classmethod
    def _not_seed_or_size(cls, value: dict[str, Any]) -> dict[str, Any]:
        if taken := sorted({"seed", "size"} & value.keys()):
            raise ValueError(f"{', '.join(taken)}: set by train_size, eval_size and task.reasoning_gym.seed")
        return value


class ReasoningGymConfig(Strict):
    tasks: list[ReasoningGymTask] = Field(min_length=1)
    seed: int = Field(0, ge=0, lt=2**31)  # the sets are a function of it (and of the tasks), whatever the run's seed


class TaskConfig(Strict):
    """The prompts: files of records (JSON lines with at least `prompt`; the verifier reads the other fields), or
    records that start generates from reasoning-gym's procedural tasks (steps/rewards/reasoning_gym.py)."""

    source: Literal["files", "reasoning_gym"] = "files"
    train_prompts: str | None = None
    eval_prompts: str | None = None
    reasoning_gym: ReasoningGymConfig | None = None

    @field_validator("train_prompts", "eval_prompts")
    @classmethod
    def _not_empty(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.strip():
            raise ValueError("must name a prompt file")
        return check_location(value, "a prompt file")

    @model_validator(mode="after")
    def _one_source(self) -> TaskConfig:
        files = self.train_prompts is not None or self.eval_prompts is not None
        if self.source == "files" and (self.train_prompts is None or self.eval_prompts is None):
            raise ValueError("source files needs train_prompts and eval_prompts")
        if self.source == "files" and self.reasoning_gym is not None:
            raise ValueError("reasoning_gym is set but source is files: set source reasoning_gym")
        if self.source == "reasoning_gym" and (self.reasoning_gym is None or files):
            raise ValueError("source reasoning_gym needs reasoning_gym.tasks, and no train_prompts or eval_prompts")
        return self
