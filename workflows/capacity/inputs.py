"""The plan's inputs: a run's measurements (or a config), the target and the prices, resolved into one set of
figures, each with its source.

Each rate is, in this order:
1. stated in the target's `rates:`;
2. measured by the run, where the target's GPU is the one the run was measured on (`measured_on`). On another
   model the two throughputs are projected: the update's tokens/s by the ratio of training FLOPs per token (its
   MFU carries over), decoding's by the ratio of active parameters (each decoding step reads them once);
   overheads and per-GB rates are carried over as measured, and the source says so;
3. for a few figures of a GPU target, a stated assumption (pod start-up, the Spot restart);
4. otherwise missing: a one-line error names every missing figure.
Rule rewards run on CPU pods wherever the GPUs are, so their measured seconds per sample always carry over;
so do the response lengths, which belong to the task and the policy, not to the hardware.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from moeloop.steps.config import MoeloopConfig, load_config
from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.shape import ModelShape, parameter_counts, shape_from_hf_config
from moeloop.steps.rl.memory import GIB
from moeloop.workflows.capacity.hardware import GPU, gpu
from moeloop.workflows.capacity.lifetime import rollout_lifetime, shape_figures, trainer_lifetime
from moeloop.workflows.capacity.models import model_config, read_hf_config, train_flops_per_token
from moeloop.workflows.capacity.options import Option, Setup, pick_expert_parallel
from moeloop.workflows.capacity.rates import STEPS, Figure, Measured, measure_run
from moeloop.workflows.capacity.target import LOCAL, Instance, Target, load_prices, load_target
from moeloop.workflows.local.cores import available_cores

# The rates every step time uses, with their units; then those that add a term only when known.
RATES = {
    "rollout_tokens_per_second_per_gpu": "tokens/s",
    "rollout_overhead_seconds": "s",
    "fetch_seconds_per_gb": "s/GB",
    "reward_seconds_per_sample": "s",
    "train_tokens_per_second_per_gpu": "tokens/s",
    "train_overhead_seconds": "s",
    "publish_seconds_per_gb": "s/GB",
    "evaluate_seconds": "s",
}
OPTIONAL_RATES = {
    "rollout_sequence_tokens_per_second": "tokens/s",
    "trainer_state_seconds_per_gb": "s/GB",
    "trainer_commit_seconds_per_gb": "s/GB",  # trainer.lifetime chunk
    "delta_write_seconds_per_gb": "s/GB",  # trainer.lifetime chunk
    "train_iteration_overhead_seconds": "s",  # trainer.lifetime chunk
    "delta_changed_fraction": "fraction",  # rollout.lifetime chunk
    "delta_apply_seconds_per_gb": "s/GB",  # rollout.lifetime chunk
    "delta_check_seconds_per_gb": "s/GB",  # rollout.lifetime chunk
}
ASSUMED_POD_START_SECONDS = 30.0  # a pod on a warm node, its image cached: scheduling, container start, imports
ASSUMED_NEW_NODE_SECONDS = 300.0  # a reclaimed Spot node's replacement: provisioning and joining the cluster


@dataclass(frozen=True)
class Sources:
    """What the figures are resolved from."""

    target: Target
    where: str  # the target file, for "stated" sources
    config: MoeloopConfig
    measured: Measured | None
    shape: ModelShape
    run_shape: ModelShape | None

    @property
    def same_hardware(self) -> bool:
        return self.measured is not None and self.target.gpu == self.target.measured_on

    @property
    def same_model(self) -> bool:
        return self.shape == self.run_shape


def is_config_file(source: str) -> bool:
    return Path(source).suffix in (".yaml", ".yml") and Path(source).is_file()


def plan_inputs(
    source: str, target_path: str | None, also: tuple[str, ...] = ()
) -> tuple[Setup, Option | None, Figure | None]:
    """The setup the options share; and, when the target is the run's own (model, hardware and batch), the run's
    own option with its measured period, to hold the plan against. `also`: more runs to pool with the source's
    measurements (`measure_run`)."""
    target = load_target(target_path)
    cores = Figure(target.cores, "cores", f"stated: {target_path} cores") if target.cores else None
    cores = cores or Figure(len(available_cores()), "cores", "this machine: the cores this process may use")
    measured = None
    if is_config_file(source):
        if also:
            raise MoeloopError(f"{source} is a config, not a run: runs to pool with it (--also) need a run to plan")
        config = load_config(source)
    else:
        measured = measure_run(source, int(cores.value) if target.measured_on == LOCAL else None, also)
        config = measured.config
    shape, model = _model(target, config, measured, source)
    run_shape = shape_from_hf_config(measured.model_config, f"{source}/checkpoints/iter-000000") if measured else None
    sources = Sources(target, target_path or "the target", config, measured, shape, run_shape)
    device = None if target.gpu == LOCAL else gpu(target.gpu)
    figures = _batch_figures(sources) | _size_figures(sources)
    if device is None:
        figures |= {"local_cores": cores} | _core_scaling(sources)
    figures |= _rate_figures(sources, device, figures["prompt_tokens"].value + figures["response_tokens"].value)
    instance = prices = prices_source = None
    if device is not None:
        instance, prices = _instance(target, device.name)
        prices_source = f"{target.prices} ({load_prices(target.prices).source})"
        figures |= _cluster_figures(sources, device, instance, prices)
    missing = [name for name in [*RATES, *(f"start_seconds.{step}" for step in STEPS)] if name not in figures]
    if missing:
        origin = f"measured on {target.measured_on}" if measured else "a config, not a run"
        raise MoeloopError(
            f"neither measured for this target nor stated: {', '.join(missing)} ({origin}; target GPU {target.gpu});"
            " state them in the target's rates:"
        )
    planned = "the run" if measured else source
    lifetime, lifetime_source, every = trainer_lifetime(target.trainer, config.trainer, sources.where, planned)
    engines, engines_source = rollout_lifetime(target.rollout, config.rollout, sources.where, planned)
    iterations = target.iterations or config.iterations
    chunk = config.cluster.chunk_iterations
    shard_bytes = config.trainer.checkpoint_shard_bytes
    figures = shape_figures(figures, lifetime, every, engines, device is None, iterations, chunk, shard_bytes)
    setup = Setup(
        config,
        model,
        shape,
        figures,
        device,
        instance,
        prices,
        prices_source,
        _gpus_per_shard(target, config, parameter_counts(shape).total, device),
        target.trainer,
        iterations,
        target.search,
        lifetime,
        lifetime_source,
        engines,
        engines_source,
    )
    untouched = all(value is None for value in target.batch.model_dump().values())
    if not (sources.same_model and sources.same_hardware and untouched):
        return setup, None, None
    return setup, _own_option(setup), measured.iteration_seconds


def _stated(s: Sources, section: str, name: str, value: float | None, unit: str) -> dict[str, Figure]:
    return {} if value is None else {name: Figure(float(value), unit, f"stated: {s.where} {section}.{name}")}


def _batch_figures(s: Sources) -> dict[str, Figure]:
    batch, config = s.target.batch, s.config
    figures = {}
    for name, unit, value, key in (
        ("prompts_per_iteration", "prompts", config.rollout.prompts_per_iteration, "rollout.prompts_per_iteration"),
        ("samples_per_prompt", "samples", config.rollout.samples_per_prompt, "rollout.samples_per_prompt"),
        ("epochs", "epochs", config.trainer.epochs, "trainer.epochs"),
        ("max_response_tokens", "tokens", config.rollout.max_new_tokens, "rollout.max_new_tokens"),
    ):
        figures |= _stated(s, "batch", name, getattr(batch, name), unit) or {
            name: Figure(value, unit, f"config: {'the run' if s.measured else 'the config'}'s {key}")
        }
    for name in ("prompt_tokens", "response_tokens"):
        stated = _stated(s, "batch", name, getattr(batch, name), "tokens")
        if not stated and s.measured is None:
            raise MoeloopError(
                f"a plan from a config needs the mean {name} per sample: state batch.{name} in the target"
            )
        figures |= stated or {name: s.measured.figures[name]}
    return figures


def _core_scaling(s: Sources) -> dict[str, Figure]:
    """How each step's speed grows with its cores on the local runner: fitted from the runs measured here, else
    assumed linear."""
    if s.measured is not None and s.target.measured_on == LOCAL:
        return {name: f for name, f in s.measured.figures.items() if name.startswith("core_scaling.")}
    assumed = Figure(1.0, "exponent", "assumed: linear in cores (no run measured)")
    return {f"core_scaling.{step}": assumed for step in STEPS}


def _size_figures(s: Sources) -> dict[str, Figure]:
    """The checkpoint and the trainer state: as the run committed them, or from the target model's parameters."""
    if s.measured and s.same_model:
        return {name: s.measured.figures[name] for name in ("checkpoint_gb", "trainer_state_gb")}
    total = parameter_counts(s.shape).total
    # What train commits at either precision (steps/rl/checkpoint.py): fp32 weights (bf16's master copy) and AdamW's
    # two fp32 moments; the bf16 compute copy is not saved.
    return {
        "checkpoint_gb": Figure(total * 2 / 1e9, "GB", f"derived: {total:,} parameters x 2 bytes (bf16)"),
        "trainer_state_gb": Figure(
            total * 12 / 1e9, "GB", f"derived: {total:,} parameters x 12 bytes (fp32 weights and AdamW's two moments)"
        ),
    }


def _rate_figures(s: Sources, device: GPU | None, sample_tokens: float) -> dict[str, Figure]:
    figures: dict[str, Figure] = {}
    for name, unit in {**RATES, **OPTIONAL_RATES}.items():
        figures |= _stated(s, "rates", name, getattr(s.target.rates, name), unit)
        m = s.measured.figures.get(name) if s.measured and name not in figures else None
        if m is None:
            continue
        if name == "reward_seconds_per_sample" and not s.config.reward.models and not s.same_hardware:
            figures[name] = Figure(m.value, unit, f"{m.source}; rule rewards run on CPU pods with any GPU")
        elif s.same_hardware and s.same_model:
            figures[name] = m
        elif s.same_hardware and name == "train_tokens_per_second_per_gpu":
            ratio = train_flops_per_token(s.run_shape, sample_tokens) / train_flops_per_token(s.shape, sample_tokens)
            figures[name] = Figure(m.value * ratio, unit, f"projected: {m.source} x {ratio:.3g} (FLOPs per token)")
        elif s.same_hardware and name == "rollout_tokens_per_second_per_gpu":
            ratio = parameter_counts(s.run_shape).matmul_active / parameter_counts(s.shape).matmul_active
            figures[name] = Figure(m.value * ratio, unit, f"projected: {m.source} x {ratio:.3g} (active parameters)")
        elif s.same_hardware:
            figures[name] = Figure(m.value, unit, f"{m.source}; carried over from the run's model as measured")
    mfu = s.target.rates.train_mfu
    if "train_tokens_per_second_per_gpu" not in figures and mfu is not None and device is not None:
        flops = train_flops_per_token(s.shape, sample_tokens)
        figures["train_tokens_per_second_per_gpu"] = Figure(
            mfu * device.matmul_flops / flops,
            "tokens/s",
            f"derived: stated train_mfu {mfu} x {device.name}'s matmul roof {device.matmul_flops / 1e12:.0f} TFLOP/s"
            f" / {flops:.3g} FLOPs per token of {sample_tokens:.0f}-token samples",
        )
    for step in STEPS:
        name = f"start_seconds.{step}"
        stated = s.target.rates.start_seconds
        if stated is not None:
            figures[name] = Figure(stated, "s", f"stated: {s.where} rates.start_seconds")
        elif s.same_hardware and name in s.measured.figures:
            figures[name] = s.measured.figures[name]
        elif device is not None:
            figures[name] = Figure(ASSUMED_POD_START_SECONDS, "s", "assumed: a pod on a warm node, its image cached")
    return figures


def _cluster_figures(s: Sources, device: GPU, instance: str, prices: Instance) -> dict[str, Figure]:
    """Prices, the GPU's memory, the Spot restart; evaluate, which nothing waits for, is left out."""
    table = f"prices: {s.target.prices}, {instance}"
    figures = {name: Figure(getattr(prices, name), unit, table) for name, unit in (
        ("on_demand_per_hour", "$/h"), ("spot_per_hour", "$/h"), ("spot_interruptions_per_hour", "/h")
    )}  # fmt: skip
    figures["gpu_memory_gib"] = Figure(device.memory_bytes / GIB, "GiB", f"GPU table: {device.name}")
    backoff = s.config.cluster.spot_retry.backoff_seconds
    figures |= _stated(s, "rates", "spot_restart_seconds", s.target.rates.spot_restart_seconds, "s") or {
        "spot_restart_seconds": Figure(
            backoff + ASSUMED_NEW_NODE_SECONDS,
            "s",
            f"assumed: the retry's first backoff {backoff} s (cluster.spot_retry) + {ASSUMED_NEW_NODE_SECONDS:.0f} s"
            " for a new node",
        )
    }
    if s.target.rates.evaluate_seconds is None:
        figures["evaluate_seconds"] = Figure(0.0, "s", "not modelled: evaluate hangs off publish, nothing waits for it")
    return figures


def _model(target: Target, config: MoeloopConfig, measured: Measured | None, source: str) -> tuple[ModelShape, str]:
    if target.model is not None:
        values, origin = model_config(target.model)
    elif measured is not None:
        values, origin = measured.model_config, f"{source}/checkpoints/iter-000000/config.json"
    elif config.model.checkpoint and Path(config.model.checkpoint).is_dir():
        values, origin = read_hf_config(config.model.checkpoint), f"{config.model.checkpoint}/config.json"
    else:
        raise MoeloopError(f"config {source} names no local checkpoint to read the model from: give the target a model")
    return shape_from_hf_config(values, origin), origin


def _instance(target: Target, gpu_name: str) -> tuple[str, Instance]:
    if target.prices is None:
        raise MoeloopError(f"a plan for {gpu_name} needs prices: name a prices table in the target (prices: FILE)")
    table = load_prices(target.prices)
    name = target.instance or next((n for n, i in table.instances.items() if i.gpu == gpu_name), None)
    if name not in table.instances:
        raise MoeloopError(f"prices {target.prices} have no instance {name or f'with {gpu_name} GPUs'}")
    if table.instances[name].gpu != gpu_name:
        raise MoeloopError(f"instance {name} has {table.instances[name].gpu} GPUs, not the target's {gpu_name}")
    return name, table.instances[name]


def _gpus_per_shard(target: Target, config: MoeloopConfig, parameters: int, device: GPU | None) -> int:
    """vLLM's tensor parallelism: stated, the config's locally, else the fewest GPUs (a power of two) whose share
    of vLLM's memory holds the bf16 weights in its one half, the other half left for the KV cache."""
    if device is None:
        return target.rollout_gpus_per_shard or config.rollout.vllm.tensor_parallel_size
    room = config.rollout.vllm.gpu_memory_utilization * device.memory_bytes
    gpus = target.rollout_gpus_per_shard or 2 ** max(0, math.ceil(math.log2(2 * parameters / (room / 2))))
    if 2 * parameters / gpus > room:
        raise MoeloopError(
            f"the bf16 weights ({2 * parameters / 1e9:.0f} GB) do not fit {gpus} {device.name} GPU(s) a rollout shard:"
            " raise rollout_gpus_per_shard in the target"
        )
    return gpus


def _own_option(setup: Setup) -> Option:
    """The run's own pools and staleness, as an option."""
    config = setup.config
    world, ep, shards, staleness = (
        config.trainer.world_size,
        config.trainer.expert_parallel,
        config.rollout.num_shards,
        config.rollout.max_staleness,
    )
    if setup.local:
        return Option(shards, 0, 0, world, ep, 0, staleness)
    rollout_nodes = math.ceil(shards * setup.gpus_per_shard / setup.prices.gpus)
    fit = pick_expert_parallel(setup, world)
    reward_nodes = 1 if config.reward.models else 0
    return Option(
        shards, rollout_nodes, config.cluster.train_nodes, world, fit[0] if fit else ep, reward_nodes, staleness
    )
