"""The files `moeloop plan` reads besides the run: the target (what to plan for) and the prices table.

Both are YAML, typed like the run's config: unknown keys and wrong types are one-line errors naming the key.
Every key of the target is optional; what it leaves out comes from the run (or the config), and where neither
has it, the plan says which figure is missing. Paths inside a file are relative to that file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, TypeVar

from pydantic import BaseModel, Field, NonNegativeInt, PositiveInt, ValidationError, field_validator

from moeloop.steps.config import TrainerConfig, describe_validation_error
from moeloop.steps.config_base import Strict
from moeloop.steps.errors import MoeloopError
from moeloop.steps.inputs import load_yaml as read_yaml
from moeloop.steps.inputs import read_limited
from moeloop.workflows.capacity.hardware import GPUS

MAX_FILE_BYTES = 1 << 20  # a target or a prices table is a few KB
LOCAL = "local"  # the local runner on this machine: steps share local.parallelism slots of its cores


class Batch(Strict):
    prompts_per_iteration: int | None = Field(None, gt=0)
    samples_per_prompt: int | None = Field(None, gt=0)
    prompt_tokens: float | None = Field(None, gt=0)  # mean per sample
    response_tokens: float | None = Field(None, gt=0)  # mean per sample
    max_response_tokens: int | None = Field(None, gt=0)  # the longest answer (rollout.max_new_tokens)
    epochs: int | None = Field(None, gt=0)


class Trainer(Strict):
    """The train step's settings, as the memory model (`moeloop.steps.rl.memory`) takes them.
    max_tokens_per_microbatch and offload_optimizer are the run config's trainer keys, defined there once
    (TrainerConfig); precision and activation_checkpointing default to a GPU trainer of a large MoE (bf16, what the
    run's `auto` takes on CUDA; checkpointing on), not to the run config's `auto` and off."""

    precision: Literal["bf16", "fp32"] = "bf16"
    activation_checkpointing: bool = True
    max_tokens_per_microbatch: int = TrainerConfig.model_fields["max_tokens_per_microbatch"]
    offload_optimizer: bool = TrainerConfig.model_fields["offload_optimizer"]
    reference: Literal["sharded", "precomputed", "none"] = "sharded"
    routing_imbalance: float = Field(1.0, ge=1)
    workspace_gib: float = Field(4.0, ge=0)
    # How long a trainer process lives, and how often it commits its state (the run config's trainer keys, same
    # meaning): None takes the planned run's or config's.
    lifetime: Literal["iteration", "chunk"] | None = None
    state_every: int | None = Field(None, gt=0)


class Rollout(Strict):
    """The rollout engines' shape: how long a shard's engine lives (the run config's rollout.lifetime, same meaning;
    None takes the planned run's or config's)."""

    lifetime: Literal["iteration", "chunk"] | None = None


class StatedRates(Strict):
    """Rates for the target's model on the target's GPU, stated by the user. Each one replaces the run's. For the
    local runner, per core: "per GPU" is per core, and seconds are core-seconds (`moeloop.workflows.capacity.rates`)."""

    rollout_tokens_per_second_per_gpu: float | None = Field(None, gt=0)  # all of a shard's sequences together
    rollout_sequence_tokens_per_second: float | None = Field(None, gt=0)  # one sequence's decoding speed
    rollout_overhead_seconds: float | None = Field(None, ge=0)  # per shard: engine start or reload, writing
    fetch_seconds_per_gb: float | None = Field(None, ge=0)  # one rollout pod's verified checkpoint fetch
    reward_seconds_per_sample: float | None = Field(None, ge=0)  # per reward GPU with reward models
    train_tokens_per_second_per_gpu: float | None = Field(None, gt=0)
    train_mfu: float | None = Field(None, gt=0, le=1)  # instead of tokens/s: model FLOPs / the GPU's matmul roof
    train_overhead_seconds: float | None = Field(None, ge=0)  # start-up, reading experience, the reference model
    trainer_state_seconds_per_gb: float | None = Field(None, ge=0)  # loading and saving the state, per train node
    # A train node's commit alone (its ranks' uploads and the COMMIT), per GB: the commit half of the above. With
    # trainer.lifetime chunk, the trainer commits each iteration's checkpoint and its state in the background at it.
    trainer_commit_seconds_per_gb: float | None = Field(None, ge=0)
    # trainer.lifetime chunk: a train node's ranks writing the delta of their shares of the checkpoint (comparing,
    # digesting both versions, writing the files), per GB of checkpoint.
    delta_write_seconds_per_gb: float | None = Field(None, ge=0)
    # trainer.lifetime chunk: the overhead that stays every iteration (reading the experience, the reference
    # model's pass); the rest of train_overhead_seconds is start-up, paid once a chunk.
    train_iteration_overhead_seconds: float | None = Field(None, ge=0)
    # rollout.lifetime chunk: the share of the checkpoint's elements an update changes (its delta is 2 x that share of
    # the checkpoint's bytes), an engine's in-place write of a delta and the digest check of its weights after (which
    # runs beside the shard's generating), per GB of checkpoint.
    delta_changed_fraction: float | None = Field(None, gt=0, le=1)
    delta_apply_seconds_per_gb: float | None = Field(None, ge=0)
    delta_check_seconds_per_gb: float | None = Field(None, ge=0)
    publish_seconds_per_gb: float | None = Field(None, ge=0)
    evaluate_seconds: float | None = Field(None, ge=0)
    start_seconds: float | None = Field(None, ge=0)  # every step: pod start and the predecessor's commit
    spot_restart_seconds: float | None = Field(None, ge=0)  # a reclaimed shard: retry backoff, a new node


class Search(Strict):
    """The options to weigh; each list replaces the default candidates."""

    rollout_shards: list[PositiveInt] | None = Field(None, min_length=1)
    train_nodes: list[PositiveInt] | None = Field(None, min_length=1)
    staleness: list[NonNegativeInt] | None = Field(None, min_length=1)
    reward_nodes: list[PositiveInt] | None = Field(None, min_length=1)


class Target(Strict):
    model: str | None = None  # a family name (workflows/capacity/models.py) or an HF config.json path
    gpu: str = LOCAL  # H100, H200, or local
    measured_on: str = LOCAL  # where the run's rates were measured
    prices: str | None = None  # the prices table (required for a GPU target)
    instance: str | None = None  # of the prices table; None: its first instance of the target's GPU
    iterations: int | None = Field(None, gt=0)  # the run's length, for --budget and --deadline
    rollout_gpus_per_shard: int | None = Field(None, gt=0)  # vLLM's tensor_parallel_size
    cores: int | None = Field(None, gt=0)  # the local runner's cores, where measured and planned; None: this machine's
    batch: Batch = Batch()
    trainer: Trainer = Trainer()
    rollout: Rollout = Rollout()
    rates: StatedRates = StatedRates()
    search: Search = Search()

    @field_validator("gpu", "measured_on")
    @classmethod
    def _known_gpu(cls, value: str) -> str:
        if value not in (LOCAL, *GPUS):
            raise ValueError(f"GPU type {value!r} is not in the table ({', '.join(GPUS)}, or {LOCAL})")
        return value


class Instance(Strict):
    gpu: str
    gpus: int = Field(gt=0)
    on_demand_per_hour: float = Field(ge=0)
    spot_per_hour: float = Field(ge=0)
    spot_interruptions_per_hour: float = Field(ge=0)  # reclaims per instance-hour (not Spot Advisor's monthly %)

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, value: str) -> str:
        if value not in GPUS:
            raise ValueError(f"GPU type {value!r} is not in the table ({', '.join(GPUS)})")
        return value


class Prices(Strict):
    source: str  # where the figures come from and when
    instances: dict[str, Instance] = Field(min_length=1)


Model = TypeVar("Model", bound=BaseModel)


def load_yaml(path: Path, model: type[Model], what: str) -> Model:
    data = read_yaml(read_limited(path, f"{what} file", MAX_FILE_BYTES), f"{what} {path}")
    try:
        return model.model_validate(data or {})
    except ValidationError as error:
        raise MoeloopError(f"{what} {path}: {describe_validation_error(error)}") from None


def _beside(location: str | None, base: Path) -> str | None:
    return location if location is None or Path(location).is_absolute() else str(base / location)


def load_target(path: str | Path | None) -> Target:
    """The target file, its paths made relative to it; no file: the run as it is, on this machine."""
    if path is None:
        return Target()
    path = Path(path)
    target = load_yaml(path, Target, "target")
    model = target.model
    if model is not None and ("/" in model or model.endswith(".json")):
        model = _beside(model, path.parent)
    return target.model_copy(update={"model": model, "prices": _beside(target.prices, path.parent)})


def load_prices(path: str | Path) -> Prices:
    return load_yaml(Path(path), Prices, "prices")
