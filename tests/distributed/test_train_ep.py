"""The train step's update with expert parallelism on CPU (gloo, processes spawned here) against one process
running transformers' own model of the family (EP = 2: every family; the larger meshes: Qwen3-MoE) with the same
weights: logits, loss, gradients, parameters and optimizer state after one optimizer step; and the checkpoint an
EP = 4 run writes loads in transformers. Also: the trainer's
forward shares compiled decoder layers across layers."""

from __future__ import annotations

import copy
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

from moeloop.steps.config import MoeloopConfig, TrainerConfig
from moeloop.steps.model.attention import PACKED_ATTENTION
from moeloop.steps.model.dispatch import make_dispatcher
from moeloop.steps.model.families import num_experts
from moeloop.steps.model.logprobs import body_forward, use_logprob_head
from moeloop.steps.model.moe import gather_over, hf_state_dict, replace_moe_blocks
from moeloop.steps.model.policy import build_tokenizer, save_policy, token_logprobs
from moeloop.steps.model.sharding import reshard
from moeloop.steps.rl.batch import ExperienceBatch, experience_batch, frozen_logprobs, rank_microbatches
from moeloop.steps.rl.parallel import Parallel, expert_parameters, init_parallel, mesh_parallel
from moeloop.steps.rl.router_loss import load_balancing_loss, router_aux_loss
from moeloop.steps.rl.checkpoint import OPTIMIZER_DIR, read_whole, write_hf_checkpoint
from moeloop.steps.rl.state import load_trainer_model, make_optimizer, save_trainer_state
from moeloop.steps.rl.update import policy_update
from tests.conftest import small_config
from tests.processes import spawn_ranks
from tests.unit.test_moe import FAMILY_NAMES, NUM_EXPERTS, tiny_config

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
SEED = 7


def whole(value: torch.Tensor, parameter: torch.nn.Parameter, experts: set, parallel: Parallel) -> torch.Tensor:
    """A parameter's (or its state's or gradient's) whole tensor: its DTensor made full (or the local shard of one,
    as `OffloadedAdamW` keeps it), the experts gathered over EP. Collective."""
    if isinstance(parameter, DTensor):
        if not isinstance(value, DTensor):
            value = DTensor.from_local(value.to(parameter.device), parameter.device_mesh, parameter.placements,
                                       shape=parameter.shape, stride=parameter.stride())  # fmt: skip
        value = value.full_tensor()
    value = value.detach().clone()
    return gather_over(value, parallel.ep_group) if parameter in experts else value


def optimizer_state_by_name(model: torch.nn.Module, optimizer: torch.optim.Optimizer, parallel: Parallel) -> dict:
    """AdamW's state by HF parameter name, whole. Collective."""
    experts = expert_parameters(model)
    return {
        name: {key: whole(v, p, experts, parallel) if v.dim() else v.clone() for key, v in optimizer.state[p].items()}
        for name, p in model.named_parameters()
    }


def experience() -> ExperienceBatch:
    """12 samples in 3 groups of 4 (the last with equal rewards), of varied prompt and response lengths."""
    generator = torch.Generator().manual_seed(0)
    prompts, responses, logprobs = [], [], []
    for sample in range(12):
        prompt_length, response_length = 3 + sample % 3, 2 + sample % 5
        prompts.append(torch.randint(2, 64, (prompt_length,), generator=generator).tolist())
        responses.append(torch.randint(2, 64, (response_length,), generator=generator).tolist())
        logprobs.append((-3 * torch.rand(response_length, generator=generator)).tolist())
    rollouts = {
        "prompt_token_ids": prompts,
        "response_token_ids": responses,
        "behavior_logprobs": logprobs,
        "sample_id": [f"s{i}" for i in range(12)],
        "prompt_id": [i // 4 for i in range(12)],
    }
    rewards = [0.0, 0.5, 1.0, 0.25, 1.0, 0.0, 0.0, 0.75, 0.5, 0.5, 0.5, 0.5]
    return experience_batch(rollouts, {f"s{i}": r for i, r in enumerate(rewards)})


def tiny_policy(folder: Path) -> torch.nn.Module:
    """A random tiny policy saved under folder/policy and loaded as the trainer holds it (one process)."""
    torch.manual_seed(0)
    save_policy(Qwen3MoeForCausalLM(tiny_config()), build_tokenizer(["abc"]), folder / "policy")
    return load_trainer_model(folder / "policy", TrainerConfig(precision="fp32"), Parallel())[0]


def reference_logprobs_of(model: torch.nn.Module, batch: ExperienceBatch) -> torch.Tensor:
    """The reference pass the train step makes before it loads the policy, here of a copy of model (one process)."""
    return frozen_logprobs(copy.deepcopy(model), batch, 1.0, TrainerConfig().max_tokens_per_microbatch, Parallel())


def train_config(activation_checkpointing: bool = False) -> MoeloopConfig:
    """One optimizer step over the whole batch, clipped (max_grad_norm is below the gradient's norm), with every
    term of the loss: the KL (k3_plus: k3's value, k2's gradient), the entropy bonus (its gradient through the
    chunked LM head), dual clip. The token budget gives every rank one microbatch, so the load-balancing loss is HF's
    over the minibatch (with more, it is the token-weighted mean of the microbatches'; tests/distributed/test_fsdp.py
    checks several microbatches)."""
    return small_config(
        iterations=1,
        trainer={"minibatch_size": 12, "epochs": 1, "learning_rate": 1e-3, "max_grad_norm": 0.05,
                 "max_tokens_per_microbatch": 1024, "activation_checkpointing": activation_checkpointing},
        algorithm={"kl_coef": 0.1, "kl_estimator": "k3_plus", "entropy_coef": 0.01, "dual_clip": 3.0},
    )  # fmt: skip


@dataclass(frozen=True)
class Reference:
    """One process, transformers' causal LM of the family (HF's per-expert loop): what every mesh must reproduce."""

    checkpoint: Path
    logits_BTV: torch.Tensor  # before the update
    report: dict[str, float]
    grads: dict[str, torch.Tensor]  # after clipping: what the optimizer stepped with
    params: dict[str, torch.Tensor]  # after the step; a DeepSeek-V3 router's correction bias too (router_bias.py)
    optimizer_state: dict[str, dict[str, torch.Tensor]]


def for_packed_forwards(model: torch.nn.Module) -> torch.nn.Module:
    """HF's model as the trainer's forwards take it (logprob head, packed attention), not sharded."""
    use_logprob_head(model)
    model.config._attn_implementation = PACKED_ATTENTION["sdpa"]
    return model


def reference(tmp_path: Path, family: str = "qwen3_moe") -> Reference:
    config = tiny_config(family=family)
    config.router_aux_loss_coef = 0.1  # large enough that its gradient shows
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    biases = {name: buffer for name, buffer in model.named_buffers() if name.endswith("e_score_correction_bias")}
    for bias in biases.values():  # HF's are zeros; random and small, so tokens still route apart (ranks' loads differ)
        bias.normal_(std=0.01)
    save_policy(model, build_tokenizer(["abc"]), tmp_path / "checkpoint")
    batch = experience()
    with torch.no_grad():
        logits_BTV = model(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT).logits
    model = for_packed_forwards(model)
    settings = train_config().trainer
    ref_logprobs_BT = frozen_logprobs(copy.deepcopy(model), batch, 1.0, settings.max_tokens_per_microbatch, Parallel())
    optimizer = make_optimizer(model, settings)
    report = policy_update(model, ref_logprobs_BT, optimizer, batch, train_config(), SEED)
    assert report["optimizer_steps"] == 1 and report["grad_norm"] > settings.max_grad_norm
    return Reference(
        tmp_path / "checkpoint",
        logits_BTV,
        report,
        {name: p.grad.clone() for name, p in model.named_parameters()},
        {name: p.detach().clone() for name, p in [*model.named_parameters(), *biases.items()]},
        optimizer_state_by_name(model, optimizer, Parallel()),
    )


def check_mesh(parallel: Parallel, ref: Reference, checkpointing: bool, save_to: Path | None) -> None:
    """This rank's microbatches of the batch through the sharded policy, then everything compared with the
    reference."""
    config = train_config(checkpointing)
    reference_model, _, _ = load_trainer_model(ref.checkpoint, config.trainer, parallel)
    batch = experience()
    ref_logprobs_BT = frozen_logprobs(reference_model, batch, 1.0, config.trainer.max_tokens_per_microbatch, parallel)
    model, tokenizer, optimizer = load_trainer_model(ref.checkpoint, config.trainer, parallel)
    local_experts = num_experts(model.config) // parallel.ep_group.size()
    assert model.model.layers[-1].mlp.dispatcher.num_local_experts == local_experts
    [micro] = rank_microbatches(batch, torch.arange(12), config.trainer.max_tokens_per_microbatch, parallel)
    with torch.no_grad():
        logits_NV = model.lm_head(body_forward(model.model, micro)[0])
    reshard(model)
    torch.testing.assert_close(logits_NV, micro.pack(ref.logits_BTV), **TOLERANCE)

    report = policy_update(model, ref_logprobs_BT, optimizer, batch, config, SEED, parallel)
    keys = ("loss", "kl", "entropy", "clip_fraction_binding", "clip_fraction_out_of_range", "dual_clip_fraction")
    for key in (*keys, "grad_norm", "logprob_mismatch", "behavior_kl"):
        assert report[key] == pytest.approx(ref.report[key], rel=1e-5, abs=1e-7), key
    experts = expert_parameters(model)
    for name, parameter in model.named_parameters():
        grad = whole(parameter.grad, parameter, experts, parallel)
        torch.testing.assert_close(grad, ref.grads[name], **TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")
    stepped = hf_state_dict(model)  # every parameter; buffers too (a DeepSeek-V3 router's correction bias)
    for name, tensor in ref.params.items():
        torch.testing.assert_close(stepped[name], tensor, **TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")
    state = optimizer_state_by_name(model, optimizer, parallel)
    for name, moments in ref.optimizer_state.items():
        for key, value in moments.items():
            torch.testing.assert_close(state[name][key], value, **TOLERANCE)
    if save_to is not None:
        save_trainer_state(model, tokenizer, optimizer, parallel, save_to)


def free_port() -> int:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        return listener.getsockname()[1]


def run_rank(rank: int, world_size: int, port: int, meshes: list[tuple[int, bool]], ref: Reference,
             save_to: Path | None) -> None:
    """As torchrun starts a rank: env:// rendezvous, then init_parallel; then one more mesh per further (EP size,
    activation checkpointing)."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)  # several processes share 2 cores
    (expert_parallel, checkpointing), *more = meshes
    parallel = init_parallel(TrainerConfig(world_size=world_size, expert_parallel=expert_parallel))
    try:
        check_mesh(parallel, ref, checkpointing, save_to)
        for expert_parallel, checkpointing in more:
            check_mesh(mesh_parallel(expert_parallel, "cpu"), ref, checkpointing, None)
    finally:
        dist.destroy_process_group()


def spawn(world_size: int, meshes: list[tuple[int, bool]], ref: Reference, save_to: Path | None = None) -> None:
    spawn_ranks(run_rank, (world_size, free_port(), meshes, ref, save_to), world_size)


def test_trainer_forward_shares_compiled_layers() -> None:
    """The trainer's forward (`token_logprobs`) builds no KV cache, so decoder layers compiled as
    `compile_decoder_layers` compiles them (here on CPU, aot_eager; bf16, so the MoE blocks are traced too) share
    their graphs, with no recompilation: with a cache, each layer's cache state is a guard, and past dynamo's
    recompile limit (8) the later layers run eager. (The graphs are several per layer: transformers' router-logit
    recorder breaks the graph where it runs.)"""
    config = tiny_config()
    config.num_hidden_layers = 10
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    replace_moe_blocks(model, make_dispatcher("local", NUM_EXPERTS))
    for layer in model.model.layers:
        layer.compile(backend="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    input_ids_BT = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    logprobs_BT, router_logits = token_logprobs(model, input_ids_BT, torch.ones_like(input_ids_BT))
    logprobs_BT.sum().backward()
    assert len(router_logits) == 10
    assert counters["frames"]["total"] == counters["frames"]["ok"], dict(counters["unimplemented"])
    assert counters["stats"]["unique_graphs"] < config.num_hidden_layers, dict(counters["stats"])


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_load_balancing_loss_is_transformers_aux_loss(family: str) -> None:
    """Ours is HF's aux loss; DeepSeek-V3's HF model has none (nor its config a coefficient), and the RL loss adds
    none for it, even with a coefficient in its config."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family=family))
    batch = experience()
    output = model(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT, output_router_logits=True)
    mask_t = batch.attention_mask_BT.reshape(-1)
    if family == "deepseek_v3":
        assert output.aux_loss is None and len(output.router_logits) == 2
        model.config.router_aux_loss_coef = 0.1  # a coefficient in its config: still none, the family has no aux loss
        assert router_aux_loss(model, output.router_logits, mask_t, int(mask_t.sum()), Parallel()) == 0
        return
    ours = load_balancing_loss(output.router_logits, mask_t, 8, 2, int(mask_t.sum()), Parallel())
    torch.testing.assert_close(ours, output.aux_loss)
    coefficient = model.config.router_aux_loss_coef
    with_coefficient = router_aux_loss(model, output.router_logits, mask_t, int(mask_t.sum()), Parallel())
    torch.testing.assert_close(with_coefficient, coefficient * output.aux_loss)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_ep2_update_equals_one_process(tmp_path: Path, family: str) -> None:
    spawn(2, [(2, False)], reference(tmp_path, family))


@pytest.mark.slow
@pytest.mark.parametrize("family", [name for name in FAMILY_NAMES if name != "qwen3_moe"])
def test_ep4_and_dp2_x_ep2_updates_equal_one_process(tmp_path: Path, family: str) -> None:
    """Every other family on the 4-process meshes of the test below (which also runs DP 4 and checks the
    checkpoint, with Qwen3-MoE)."""
    spawn(4, [(4, False), (2, True)], reference(tmp_path, family))


@pytest.mark.slow
def test_ep4_dp2_x_ep2_and_dp4_updates_equal_one_process_and_ep4_checkpoint_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4 processes under FSDP2: EP = 4 (which also writes its trainer state), then (dp, ep) = (2, 2) with activation
    checkpointing, then (4, 1)."""
    ref = reference(tmp_path)
    spawn(4, [(4, False), (2, True), (1, False)], ref, save_to=tmp_path / "state")
    # Publish as HF shards of at most 32 KiB, reading every tensor of over 256 elements a saved chunk at a time.
    monkeypatch.setattr("moeloop.steps.rl.checkpoint.READ_BLOCK_ELEMENTS", 256)
    write_hf_checkpoint(tmp_path / "state", tmp_path / "published", max_shard_bytes=32 << 10)
    shards = sorted(path.name for path in (tmp_path / "published").glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    weight_map = json.loads((tmp_path / "published" / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(set(weight_map.values())) == shards
    published = AutoModelForCausalLM.from_pretrained(tmp_path / "published", dtype=torch.float32)
    expected = Qwen3MoeForCausalLM(published.config)
    expected.load_state_dict(ref.params, strict=True)
    batch = experience()
    with torch.no_grad():
        got = published(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT).logits
        want = expected(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT).logits
    torch.testing.assert_close(got, want, **TOLERANCE)
    saved_state = read_whole(tmp_path / "state" / OPTIMIZER_DIR, torch.float32)
    for name, moments in ref.optimizer_state.items():
        for key, value in moments.items():
            torch.testing.assert_close(saved_state[f"{name}.{key}"], value, **TOLERANCE)
