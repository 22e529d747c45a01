"""The one typed config: it drives the Argo render and the local run alike.

Loaded from YAML; unknown keys and wrong types are rejected with the key's dotted path.
"""

from __future__ import annotations

import hashlib

import json
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

from moeloop.steps.config_algorithm import AlgorithmConfig
from moeloop.steps.config_base import Strict
from moeloop.steps.config_cluster import ClusterConfig
from moeloop.steps.config_model import TINY_FAMILIES, TinyModelConfig, TinyQwen3Moe, TinyTokenizerConfig
from moeloop.steps.config_reward import RewardConfig
from moeloop.steps.config_task import EnvironmentConfig, TaskConfig
from moeloop.steps.errors import MoeloopError
from moeloop.steps.inputs import check_location, check_strings, load_yaml, read_limited

# A config is a few KB; a file much larger is not one (a checkpoint, a log, /dev/zero), and is not read whole.
MAX_CONFIG_BYTES = 1 << 20
# Iteration folders are iter-NNNNNN: six digits, which `moeloop report` and the sorted listings rely on.
MAX_ITERATIONS = 999_999
RUN_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
MAX_RUN_NAME = 42  # Argo names <run_name>-xxxxx and moeloop-run-<run_name> stay under Kubernetes' 63


class SFTConfig(Strict):
    """Supervised fine-tuning that turns the random model into the RL starting policy."""

    steps: int = Field(300, ge=0)
    batch_size: int = Field(64, gt=0)
    learning_rate: float = Field(3e-3, gt=0)


class ModelConfig(Strict):
    # An existing HF checkpoint (folder or URI) to start from; None builds and SFTs the tiny model.
    checkpoint: str | None = None
    tiny: TinyModelConfig = TinyQwen3Moe()
    tokenizer: TinyTokenizerConfig = TinyTokenizerConfig()  # the tiny model's
    sft: SFTConfig = SFTConfig()

    @field_validator("checkpoint")
    @classmethod
    def _location(cls, value: str | None) -> str | None:
        return None if value is None else check_location(value, "model.checkpoint")


class VLLMConfig(Strict):
    """vLLM's own memory and parallelism knobs (see the README's "Rollout engines")."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)  # GPU share for weights, activations, KV cache
    kv_cache_bytes: int | None = Field(None, gt=0)  # KV cache size in bytes; required on CPU, wins on GPU
    max_num_seqs: int = Field(256, gt=0)  # sequences decoded at once
    max_model_len: int | None = Field(None, gt=0)  # prompt + response tokens; None: the model's maximum
    enforce_eager: bool = False  # no CUDA graphs: less memory and a faster start, slower decoding
    tensor_parallel_size: int = Field(1, gt=0)
    enable_expert_parallel: bool = False  # shard the experts over the tensor-parallel ranks
    sleep_after_rollout: bool = False  # release weights and KV cache after generating (sleep mode level 1)


class RolloutConfig(Strict):
    # auto: vLLM where it imports, transformers `generate` elsewhere.
    engine: Literal["auto", "vllm", "transformers"] = "auto"
    vllm: VLLMConfig = VLLMConfig()
    # The transformers engine's precision, auto as vLLM's (the evaluation's greedy decoding keeps auto).
    transformers_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    prompts_per_iteration: int = Field(64, gt=0)
    samples_per_prompt: int = Field(8, gt=0)
    num_shards: int = Field(2, gt=0)
    # How long a shard's engine lives (steps/rollout_engine.py). iteration: each rollout step builds (or, in a local
    # runner's worker, keeps) its engine. chunk: one engine process per shard for the chunk (the whole run locally),
    # which takes each new policy by delta in place and each iteration's shard as a command.
    lifetime: Literal["iteration", "chunk"] = "iteration"
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(12, gt=0)
    # Strings that end a response besides the checkpoint's end tokens (its generation_config's eos_token_id).
    stop: list[Annotated[str, Field(min_length=1)]] = []
    # Passed to the checkpoint's chat template with every messages prompt, e.g. {enable_thinking: false}.
    chat_template_kwargs: dict[str, str | int | float | bool | None] = {}
    # Prompts longer than this (in tokens, as rendered) are dropped at start, and counted; None: none is dropped,
    # and one that does not fit the model with max_new_tokens is an error.
    max_prompt_tokens: int | None = Field(None, gt=0)
    # The asynchronous loop: rollouts run up to max_staleness iterations ahead of training (policy_version below).
    # 0 is the synchronous loop.
    max_staleness: int = Field(0, ge=0)
    # Store the engine's routed experts (`routing_agreement` in the metrics); algorithm.routing_replay rollout
    # records them whatever this says.
    record_routing: bool = False
    # Which prompt positions' routes are recorded (and replayed): all, the whole prefill's (as verl and slime replay);
    # last, the prompt's last position only (the forward that sampled the first response token), the others then
    # routing as the trainer does. Every response position's are recorded either way.
    prompt_routes: Literal["all", "last"] = "all"
    # Episodes instead of completions: each sample is an episode of this environment (steps/episodes/).
    environment: EnvironmentConfig | None = None

    def policy_version(self, iteration: int) -> int:
        return policy_version(iteration, self.max_staleness)


def policy_version(iteration: int, max_staleness: int) -> int:
    """The asynchronous loop's one rule: the rollouts of `iteration` sample with the checkpoint of
    iteration - 1 - max_staleness (0, the SFT start, while that is not above 0). The DAG's rollouts wait for its
    publish; the metrics' staleness is how far a rollout's version is behind policy_version(iteration, 0), the
    synchronous loop's."""
    return max(0, iteration - 1 - max_staleness)


class TrainerConfig(Strict):
    learning_rate: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.99)
    max_grad_norm: float = Field(1.0, gt=0)
    minibatch_size: int = Field(128, gt=0)
    epochs: int = Field(1, gt=0)
    # Processes of the train step (torchrun), one per GPU where there are GPUs; 1 runs it as one plain process.
    world_size: int = Field(1, gt=0)
    expert_parallel: int = Field(1, gt=0)  # EP ranks sharing one copy of the experts; dp = world_size / EP
    # auto: local at EP = 1, else DeepEP where it runs (CUDA), else all_to_all (see steps/model/dispatch.py).
    dispatcher: Literal["auto", "local", "all_to_all", "deepep"] = "auto"
    experts_impl: Literal["grouped_mm", "loop"] = "grouped_mm"
    # Keep the routers' weights as they are (no gradient step, no load-balancing loss, no correction-bias update):
    # routing changes only as the tokens' hidden states do.
    freeze_router: bool = False
    # Auxiliary-loss-free load balancing (the DeepSeek-V3 report, 2.1.2): after each optimizer step each MoE layer's
    # router correction bias moves by this much towards balanced load, down for each overloaded expert, up for each
    # underloaded one (steps/rl/router_bias.py). None: the family's default (0.001 for deepseek_v3; off for the
    # families without a correction bias, for which any other value than 0 is an error).
    router_bias_update_rate: float | None = Field(None, ge=0)
    # bf16: bf16 compute over fp32 master weights and fp32 AdamW moments, gradients reduced in fp32 (FSDP2's
    # mixed precision); fp32: everything fp32. auto: bf16 where CUDA is, else fp32 (steps/model/sharding.py).
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    # Recompute each decoder layer in the backward, keeping only its input: less memory, about a third more compute.
    activation_checkpointing: bool = False
    # The attention kernel over packed samples (steps/model/attention.py): flash4 (FlashAttention-4, the flash-attn-4
    # package, Hopper/Blackwell GPUs), flash2 (torch's FlashAttention-2), both CUDA in bf16; sdpa (the samples
    # padded, exact anywhere). auto: the fastest of them that runs.
    attention: Literal["auto", "flash4", "flash2", "sdpa"] = "auto"
    # Samples are bin-packed into microbatches of at most this many tokens (no padding); one optimizer step per
    # minibatch. A sample longer than this is a microbatch of its own.
    max_tokens_per_microbatch: int = Field(16384, gt=0)
    # AdamW's moments in host memory (steps/rl/offload.py): 8 bytes per parameter less on the GPU.
    offload_optimizer: bool = False
    # The GPU memory of one trainer process: start and train refuse a config whose predicted peak exceeds it
    # (steps/rl/memory.py), before loading any weight. None: no check.
    gpu_memory_bytes: int | None = Field(None, gt=0)
    # The largest safetensors file of a published checkpoint (model-0000k-of-0000n.safetensors, HF's layout); a
    # tensor larger than this is a file alone. Publish holds a block of the trainer state, not a file, whatever this is.
    checkpoint_shard_bytes: int = Field(4 << 30, gt=0)
    # How long a trainer process lives (steps/trainer.py). iteration: each iteration's train step is a new process
    # (a pod, a JobSet) that fetches the trainer state and commits it back. chunk: one trainer for the chunk (the
    # whole run locally) holds weights and optimizer state in memory, takes each iteration's update as a command,
    # writes each iteration's checkpoint and delta from memory, and commits its state every `state_every`
    # iterations and at the chunk's end, in the background; restarted, it replays the iterations since.
    lifetime: Literal["iteration", "chunk"] = "iteration"
    state_every: int = Field(1, gt=0)

    def compute_precision(self, cuda: bool) -> Literal["bf16", "fp32"]:
        if self.precision == "auto":
            return "bf16" if cuda else "fp32"
        return self.precision

    @model_validator(mode="after")
    def _mesh(self) -> TrainerConfig:
        if not all(0 <= beta < 1 for beta in self.betas):
            raise ValueError(f"betas {list(self.betas)}: each must be in [0, 1)")
        if self.precision == "fp32" and self.attention in ("flash4", "flash2"):
            raise ValueError(f"attention {self.attention} computes in bf16: it needs precision bf16 or auto, not fp32")
        if self.state_every > 1 and self.lifetime != "chunk":
            raise ValueError(
                f"state_every {self.state_every} needs lifetime chunk: a trainer per iteration commits every one"
            )
        if self.world_size % self.expert_parallel:
            raise ValueError(
                f"world_size {self.world_size} is not a multiple of expert_parallel {self.expert_parallel}"
            )
        return self


class EvalConfig(Strict):
    """What evaluate measures on the first max_prompts held-out prompts (steps/evaluate.py): the greedy response's
    reward and pass@1, and with samples > 0 pass@k over that many responses sampled as the rollouts sample."""

    max_prompts: int = Field(128, gt=0)
    samples: int = Field(0, ge=0)  # responses sampled per prompt for pass@k; 0: greedy only
    k: list[int] | None = None  # the k of pass@k, each 1..samples; None: 1 and samples
    pass_threshold: float = 1.0  # a response passes when its reward is at least this

    @model_validator(mode="after")
    def _k_within_samples(self) -> EvalConfig:
        if self.k is not None and not self.samples:
            raise ValueError("k needs samples > 0: pass@k is measured on sampled responses")
        if bad := [k for k in self.k or [] if not 1 <= k <= self.samples]:
            raise ValueError(f"k {bad}: each must be between 1 and samples {self.samples}")
        return self

    def pass_ks(self) -> list[int]:
        """The k of pass@k, ascending, once each (none without samples)."""
        if not self.samples:
            return []
        return sorted(set(self.k if self.k is not None else [1, self.samples]))


class LocalConfig(Strict):
    parallelism: int = Field(2, gt=0, le=256)  # steps the local runner runs at once
    # Run steps in long-lived worker processes (one per rollout shard, one per other step), as long-lived pods
    # would: no step pays its imports again, and a shard's engine loads new weights in place.
    workers: bool = True
    # Run each step on its own share of the cores (alone: all of them; side by side: disjoint equal shares; Linux),
    # as pods run on their own nodes: overlapping steps then do not slow each other down, and a step's helper
    # processes stay within its share.
    pin_cores: bool = True


class MLflowConfig(Strict):
    tracking_uri: str | None = None  # a folder (a local file store) or a server URL; None: $MLFLOW_TRACKING_URI
    experiment: str | None = None  # None: the run's name


class WandbConfig(Strict):
    project: str | None = None  # None: the run's name
    entity: str | None = None  # None: $WANDB_ENTITY, else the API key's default entity (files go to $WANDB_DIR)
    mode: Literal["online", "offline"] = "online"  # $WANDB_MODE wins where set (an offline node, a laptop)


class ObserveConfig(Strict):  # where each committed iteration's figures go besides metrics/ (observe/trackers.py)
    trackers: list[Literal["tensorboard", "mlflow", "wandb"]] = ["tensorboard"]
    mlflow: MLflowConfig = MLflowConfig()
    wandb: WandbConfig = WandbConfig()

    @field_validator("trackers")
    @classmethod
    def _once_each(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("names a tracker more than once")
        return value


class MoeloopConfig(Strict):
    run_name: str
    iterations: int = Field(gt=0, le=MAX_ITERATIONS)
    seed: int = Field(0, ge=-(2**63), lt=2**63)  # torch's generator takes 64 bits
    storage_root: str = "runs"
    model: ModelConfig = ModelConfig()
    task: TaskConfig
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()  # none with rollout.environment: its rubric rewards alone
    algorithm: AlgorithmConfig = AlgorithmConfig()
    trainer: TrainerConfig = TrainerConfig()
    eval: EvalConfig = EvalConfig()
    cluster: ClusterConfig = ClusterConfig()
    local: LocalConfig = LocalConfig()
    observe: ObserveConfig = ObserveConfig()

    @model_validator(mode="before")
    @classmethod
    def _text_for_manifests(cls, data: object) -> object:
        check_strings(data)  # before the fields are read: no error line may echo a credential
        return data

    @field_validator("run_name")
    @classmethod
    def _run_name(cls, value: str) -> str:
        if len(value) > MAX_RUN_NAME:
            raise ValueError(f"{value!r} is {len(value)} characters long, over the limit of {MAX_RUN_NAME}")
        if not RUN_NAME.match(value):
            raise ValueError(
                f"{value!r} is not a DNS label: lowercase letters, digits and '-', starting and ending with a"
                " letter or digit"
            )
        return value

    @field_validator("storage_root")
    @classmethod
    def _storage_root(cls, value: str) -> str:
        return check_location(value, "storage_root", run=True)

    @model_validator(mode="after")
    def _sizes_agree(self) -> MoeloopConfig:
        """What only the whole config can tell, checked before anything runs (else a step fails later)."""
        rollout, experts = self.rollout, self.model.tiny.num_experts
        if rollout.num_shards > rollout.prompts_per_iteration:
            raise ValueError(
                f"rollout.num_shards {rollout.num_shards} is more than rollout.prompts_per_iteration"
                f" {rollout.prompts_per_iteration}: some shards would have no prompts"
            )
        if self.algorithm.name == "grpo" and rollout.samples_per_prompt < 2:
            raise ValueError("GRPO compares the samples of a prompt: rollout.samples_per_prompt must be at least 2")
        if self.algorithm.overlong.mode == "penalty" and not self.algorithm.overlong.buffer_tokens:
            raise ValueError("algorithm.overlong mode penalty needs its buffer_tokens")
        if (self.algorithm.overlong.buffer_tokens or 0) > rollout.max_new_tokens:
            raise ValueError("algorithm.overlong.buffer_tokens is more than rollout.max_new_tokens")
        if not self.reward.any_reward() and rollout.environment is None:
            raise ValueError("reward: name at least one reward function or reward model")
        if (self.task.source == "environment") != (rollout.environment is not None):
            raise ValueError("task.source environment and rollout.environment go together: set both or neither")
        if rollout.environment is not None and self.model.checkpoint is None and self.model.tokenizer.kind != "bpe":
            raise ValueError(
                "rollout.environment's prompts are messages: the tiny model (model.checkpoint null) reads them with"
                " model.tokenizer.kind bpe (its chat template)"
            )
        if rollout.environment is not None and self.algorithm.overlong.mode == "penalty":
            raise ValueError(
                "algorithm.overlong mode penalty measures a completion against rollout.max_new_tokens;"
                " an episode's turns each have their own: use mode mask or off"
            )
        if rollout.environment is not None and self.records_routing and rollout.prompt_routes != "all":
            raise ValueError("episodes record every position's routes: rollout.prompt_routes must be all")
        # A model.checkpoint brings its own expert count: start checks it (check_expert_split) when it loads.
        if self.model.checkpoint is None:
            check_expert_split(experts, self.trainer.expert_parallel, "model.tiny.num_experts")
        return self

    @model_validator(mode="after")
    def _minibatches_split_over_ranks(self) -> MoeloopConfig:
        # Every rank takes a share of every minibatch's samples, and a model forward needs at least one.
        batch = self.rollout.prompts_per_iteration * self.rollout.samples_per_prompt
        smallest = min(self.trainer.minibatch_size, batch % self.trainer.minibatch_size or batch)
        if smallest < self.trainer.world_size:
            raise ValueError(
                f"a minibatch of {smallest} samples does not split over trainer.world_size {self.trainer.world_size}"
                " ranks; choose a minibatch_size (and a batch) whose every minibatch has at least world_size samples"
            )
        return self

    @property
    def records_routing(self) -> bool:
        return self.rollout.record_routing or self.algorithm.routing_replay == "rollout"

    @model_validator(mode="after")
    def _train_nodes_split_world(self) -> MoeloopConfig:
        if self.trainer.world_size % self.cluster.train_nodes:
            raise ValueError(
                f"trainer.world_size {self.trainer.world_size} does not split over cluster.train_nodes"
                f" {self.cluster.train_nodes} nodes"
            )
        return self

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def check_expert_split(num_experts: int, expert_parallel: int, where: str) -> None:
    if num_experts % expert_parallel:
        raise ValueError(
            f"{where} {num_experts} does not split over trainer.expert_parallel {expert_parallel} ranks"
            " (each EP rank holds num_experts / expert_parallel experts)"
        )


def describe_validation_error(error: ValidationError) -> str:
    """Every problem pydantic found, each at its dotted key path, on one line: one fix per run is one too few."""
    problems = [describe_problem(problem) for problem in error.errors()]
    return problems[0] if len(problems) == 1 else f"{len(problems)} problems: {'; '.join(problems)}"


def describe_problem(problem: ErrorDetails) -> str:
    where, family = error_location(problem["loc"])
    message = problem["msg"].removeprefix("Value error, ")
    if problem["type"] == "extra_forbidden":
        message = "unknown key"
    if problem["type"] == "union_tag_invalid":  # model.tiny.family
        where, message = f"{where}.family", f"{problem['ctx']['tag']!r} is none of {problem['ctx']['expected_tags']}"
    if family:
        message += f" (model.tiny.family {family})"
    return f"{where}: {message}" if where else message


def error_location(loc: tuple[int | str, ...]) -> tuple[str, str | None]:
    """An error's dotted key path as the YAML spells it, and the tiny model's family where the path is in its shape:
    pydantic puts the tag of `model.tiny`'s union (the family) after `model.tiny`, a key no config has."""
    parts = [str(part) for part in loc]
    if parts[:2] == ["model", "tiny"] and len(parts) > 2 and parts[2] in TINY_FAMILIES:
        return ".".join(parts[:2] + parts[3:]), parts[2]
    return ".".join(parts), None


def parse_config_text(data: bytes, source: str) -> MoeloopConfig:
    """A config from YAML (or JSON) bytes; every way it can be wrong is one line naming source."""
    return parse_config(load_yaml(data, f"config {source}"), source)


def parse_config(data: object, source: str) -> MoeloopConfig:
    if not isinstance(data, dict):
        raise MoeloopError(f"config {source}: expected a mapping at the top level")
    try:
        return MoeloopConfig.model_validate(data)
    except ValidationError as error:
        raise MoeloopError(f"config {source}: {describe_validation_error(error)}") from None


def load_config(path: str | Path) -> MoeloopConfig:
    """Read a YAML config; relative prompt paths are resolved against the config's folder."""
    path = Path(path)
    config = parse_config_text(read_limited(path, "config file", MAX_CONFIG_BYTES), str(path))
    task = config.task.model_copy(
        update={
            "train_prompts": _resolve(config.task.train_prompts, path.parent),
            "eval_prompts": _resolve(config.task.eval_prompts, path.parent),
        }
    )
    return config.model_copy(update={"task": task})


def _resolve(location: str | None, base: Path) -> str | None:
    if location is None or "://" in location or Path(location).is_absolute():
        return location
    return str((base / location).resolve())


def derive_seed(*parts: object) -> int:
    """A seed from names and numbers: the same inputs give the same samples."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF
