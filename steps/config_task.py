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


class EnvironmentConfig(Strict):
    """A `verifiers` environment (https://github.com/PrimeIntellect-ai/verifiers, the `[environments]` extra) that
    the rollouts run as episodes against the policy: single-turn, multi-turn or with tools, rewarded by its rubric
    (steps/episodes/). Its dataset is the task's prompts where task.source is environment."""

    # The pip requirement that provides the environment (`my-env==0.2.0`, a wheel's URL): built into the cpu and
    # rollout images (`moeloop images`, images/README.md); for a local run, install it beside moeloop.
    package: str = Field(min_length=1)
    # The id `verifiers.load_environment` takes: the package's module (`my-env`, `my_env`), or a Hub id
    # (`owner/my-env`).
    name: str = Field(min_length=1)
    args: dict[str, Any] = {}  # its load_environment's arguments
    max_turns: int | None = Field(None, gt=0)  # the policy's turns per episode; None: the environment's own
    # Tokens an episode may add after its prompt, the policy's and the environment's together; None: as many as the
    # engine's context holds. Each turn samples at most rollout.max_new_tokens of them.
    max_episode_tokens: int | None = Field(None, gt=0)
    tool_timeout_s: float = Field(30.0, gt=0)  # a tool call past it is killed; its result says it timed out
    reward_weight: float = 1.0  # the rubric's reward in the sample's reward, beside reward.functions'

    @field_validator("name")
    @classmethod
    def _module_name(cls, value: str) -> str:
        if not all(part.isidentifier() for part in value.replace("-", "_").split("/")[-1].split(".")):
            raise ValueError(f"{value!r} is not an environment id (a module's name, e.g. my-env or owner/my-env)")
        return value


class TaskConfig(Strict):
    """The prompts: prompt sets (steps/storage/prompts.py), or records that start generates from reasoning-gym's
    procedural tasks (steps/rewards/reasoning_gym.py). Each prompt set is JSON Lines, Parquet (a file, a folder of
    shards or a glob) or a `datasets` save_to_disk folder, local or s3://. A record's `prompt` is a string (sent as it
    is) or a list of {role, content} messages (rendered by the checkpoint's chat template); the reward functions read
    the whole record."""

    # environment: the train and eval prompts are rollout.environment's dataset and eval dataset.
    source: Literal["files", "reasoning_gym", "environment"] = "files"
    train_prompts: str | None = None
    eval_prompts: str | None = None
    reasoning_gym: ReasoningGymConfig | None = None
    # A record field -> the column that holds it, where they differ (e.g. {prompt: question}): that column is read
    # under the field's name; every other column keeps its own.
    columns: dict[str, str] = {}
    # A system message put first in every messages prompt that has none of its own.
    system_prompt: str | None = None

    @field_validator("train_prompts", "eval_prompts")
    @classmethod
    def _not_empty(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.strip():
            raise ValueError("must name a prompt set")
        return check_location(value, "a prompt set")

    @field_validator("columns")
    @classmethod
    def _renames(cls, value: dict[str, str]) -> dict[str, str]:
        if any(not field.strip() or not column.strip() for field, column in value.items()):
            raise ValueError("names an empty field or column")
        if len(set(value.values())) != len(value):
            raise ValueError("reads one column as two fields")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> TaskConfig:
        files = self.train_prompts is not None or self.eval_prompts is not None
        if self.source == "files" and (self.train_prompts is None or self.eval_prompts is None):
            raise ValueError("source files needs train_prompts and eval_prompts")
        if self.source == "files" and self.reasoning_gym is not None:
            raise ValueError("reasoning_gym is set but source is files: set source reasoning_gym")
        if self.source == "environment" and (self.reasoning_gym is not None or files):
            raise ValueError("source environment reads rollout.environment's datasets: no train_prompts, eval_prompts"
                             " or reasoning_gym")
        if self.source == "reasoning_gym" and (self.reasoning_gym is None or files or self.columns):
            raise ValueError(
                "source reasoning_gym needs reasoning_gym.tasks, and no train_prompts, eval_prompts or columns"
            )
        return self
