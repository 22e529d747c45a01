"""FSDP2 over the (dp, ep) mesh on CPU (gloo, 4 processes spawned here): packed microbatches through the sharded
policy equal one process running transformers' own Qwen3-MoE on the padded batch, in fp32: logits, the loss,
gradients after clipping and parameters after one AdamW step (torch's, and the host-offloaded one), with
activation checkpointing on and off, as dp 2 x ep 2 and dp 4 x ep 1."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import Qwen3MoeForCausalLM

from moeloop.steps.config import TrainerConfig
from moeloop.steps.model.logprobs import body_forward, packed_token_logprobs
from moeloop.steps.model.microbatch import pack_rows
from moeloop.steps.model.moe import hf_state_dict
from moeloop.steps.model.policy import build_tokenizer, pack_sequences, save_policy, token_logprobs
from moeloop.steps.rl.offload import OffloadedAdamW
from moeloop.steps.rl.packing import plan_microbatches
from moeloop.steps.rl.parallel import Parallel, clip_grad_norm, expert_parameters
from moeloop.steps.rl.state import load_trainer_model
from tests.unit.test_moe import tiny_config
from tests.distributed.test_train_ep import free_port, whole
from tests.processes import spawn_ranks

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
MAX_NORM = 0.05  # below the gradient's norm: clipping acts
MAX_TOKENS = 24  # several microbatches per rank
# AdamW's first step is lr * g / (|g| + eps): with torch's eps of 1e-8, a gradient element near 0 that differs
# within fp32 tolerance moves its weight by up to lr. An eps of 1e-4 bounds that by lr * 1e-2 per 1e-6 of gradient.
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.99), "eps": 1e-4}



def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """12 samples of varied lengths, right-padded, and a weight per response token."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 64, (3 + i % 3,), generator=generator).tolist() for i in range(12)]
    responses = [torch.randint(2, 64, (2 + i % 5,), generator=generator).tolist() for i in range(12)]
    input_ids_BT, attention_mask_BT, response_mask_BT = pack_sequences(prompts, responses, pad_id=0)
    weights_BT = torch.randn(input_ids_BT.shape, generator=generator) * response_mask_BT
    return input_ids_BT, attention_mask_BT, weights_BT


@dataclass(frozen=True)
class Reference:
    checkpoint: Path
    logits_BTV: torch.Tensor  # before the step
    loss: float
    grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]


def reference(tmp_path: Path) -> Reference:
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(tiny_config())
    save_policy(model, build_tokenizer(["abc"]), tmp_path / "checkpoint")
    input_ids_BT, attention_mask_BT, weights_BT = batch()
    with torch.no_grad():
        logits_BTV = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT).logits
    logprobs_BT, _ = token_logprobs(model, input_ids_BT, attention_mask_BT)
    loss = -(logprobs_BT * weights_BT).sum() / weights_BT.count_nonzero()
    loss.backward()
    assert torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM) > MAX_NORM
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), **ADAMW).step()
    return Reference(
        tmp_path / "checkpoint",
        logits_BTV,
        float(loss.detach()),
        grads,
        {name: p.detach().clone() for name, p in model.named_parameters()},
    )


def check_mesh(rank: int, expert_parallel: int, checkpointing: bool, offload: bool, ref: Reference) -> None:
    world_size = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size // expert_parallel, expert_parallel), mesh_dim_names=("dp", "ep"))
    world_mesh = init_device_mesh("cpu", (world_size,))
    ep_group = mesh["ep"].get_group()
    parallel = Parallel(rank, world_size, ep_group, world_mesh, mesh["dp"])
    settings = TrainerConfig(precision="fp32", activation_checkpointing=checkpointing, offload_optimizer=offload)
    model, _, optimizer = load_trainer_model(ref.checkpoint, settings, parallel)
    assert isinstance(optimizer, OffloadedAdamW) == offload
    optimizer = type(optimizer)(model.parameters(), **ADAMW)  # the same kind, with the eps above
    model.train()
    input_ids_BT, attention_mask_BT, weights_BT = batch()
    lengths_B = attention_mask_BT.sum(1)
    count = weights_BT.count_nonzero()
    loss_sum = torch.zeros(())
    plan = plan_microbatches(lengths_B.tolist(), MAX_TOKENS, world_size)
    assert len(plan[rank]) > 1
    for rows in plan[rank]:
        micro = pack_rows(input_ids_BT, lengths_B.tolist(), rows)
        with torch.no_grad():
            logits_NV = model.lm_head(body_forward(model.model, micro)[0])
        if not micro.empty:
            torch.testing.assert_close(logits_NV, micro.pack(ref.logits_BTV), **TOLERANCE)
        logprobs_nT, _, _ = packed_token_logprobs(model, micro)
        loss = -(logprobs_nT * weights_BT[micro.rows_n]).sum() / count
        loss.backward()
        loss_sum += loss.detach()
    dist.all_reduce(loss_sum)
    assert float(loss_sum) == pytest.approx(ref.loss, rel=1e-5)
    assert clip_grad_norm(model.parameters(), MAX_NORM, parallel) > MAX_NORM
    experts = expert_parameters(model)
    grads = {name: whole(p.grad, p, experts, parallel) for name, p in model.named_parameters()}
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref.grads[name], **TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")
    optimizer.step()
    for name, param in hf_state_dict(model).items():
        torch.testing.assert_close(param, ref.params[name], **TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")


def run_rank(rank: int, world_size: int, port: int, ref: Reference) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # several processes share 2 cores
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        for expert_parallel, checkpointing, offload in ((2, False, False), (2, True, True), (1, True, False), (1, False, True)):
            check_mesh(rank, expert_parallel, checkpointing, offload, ref)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_dp_x_ep_updates_equal_one_process(tmp_path: Path) -> None:
    spawn_ranks(run_rank, (4, free_port(), reference(tmp_path)), 4)
