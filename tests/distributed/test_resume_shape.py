"""The sharded trainer state (steps/rl/checkpoint.py) resumes at another mesh (gloo, processes spawned here): written
after one update at world 4 (dp 2 x ep 2), it resumes at world 2 (ep 2, with the host-offloaded AdamW) and at world
1, and the next update there equals the one the world-4 run makes without stopping, in fp32: every parameter, and
the optimizer's step count. Also: a state whose shards are of another model is refused with one line naming the
tensor, and one with a shard missing or damaged by its COMMIT."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

from moeloop.steps.config import MoeloopConfig
from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.moe import hf_state_dict
from moeloop.steps.model.policy import build_tokenizer, save_policy
from moeloop.steps.rl.batch import frozen_logprobs
from moeloop.steps.rl.checkpoint import OPTIMIZER_DIR, read_whole
from moeloop.steps.storage.ranks import commit_from_ranks
from moeloop.steps.rl.parallel import Parallel, init_parallel
from moeloop.steps.rl.state import fetch_trainer_state, load_trainer_model, resume_model, save_trainer_state
from moeloop.steps.rl.update import policy_update
from moeloop.steps.storage.run import RunStorage
from tests.unit.test_moe import tiny_config
from tests.conftest import small_config
from tests.distributed.test_train_ep import experience, free_port
from tests.processes import spawn_ranks

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
SEEDS = (7, 8)  # the first update's, the next one's


def settings_of(world_size: int, expert_parallel: int, offload: bool) -> MoeloopConfig:
    """tests/distributed/test_train_ep.py's one clipped step with KL, at this mesh."""
    trainer = {"world_size": world_size, "expert_parallel": expert_parallel, "offload_optimizer": offload}
    return small_config(
        iterations=1,
        trainer={"minibatch_size": 12, "epochs": 1, "learning_rate": 1e-3, "max_grad_norm": 0.05,
                 "max_tokens_per_microbatch": 1024, **trainer},
        algorithm={"kl_coef": 0.1},
    )  # fmt: skip


def update(model, optimizer, checkpoint: Path, config: MoeloopConfig, seed: int, parallel: Parallel) -> None:
    reference, _, _ = load_trainer_model(checkpoint, config.trainer, parallel)
    batch = experience()
    ref_logprobs_BT = frozen_logprobs(reference, batch, 1.0, config.trainer.max_tokens_per_microbatch, parallel)
    policy_update(model, ref_logprobs_BT, optimizer, batch, config, seed, parallel)


def run_rank(rank: int, world_size: int, port: int, expert_parallel: int, offload: bool, folder: Path) -> None:
    """World 4: the first update, the state saved, then the next update. Smaller worlds: the next update from it.
    Rank 0 saves the parameters after the next update to folder/next-<world>.pt."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)  # several processes share 2 cores
    config = settings_of(world_size, expert_parallel, offload)
    parallel = init_parallel(config.trainer)
    try:
        checkpoint, state = folder / "checkpoint", folder / "state"
        if world_size == 4:
            model, tokenizer, optimizer = load_trainer_model(checkpoint, config.trainer, parallel)
            update(model, optimizer, checkpoint, config, SEEDS[0], parallel)
            save_trainer_state(model, tokenizer, optimizer, parallel, state)
        else:
            model, _, optimizer = resume_model(state, AutoModelForCausalLM, config, None, parallel)
        update(model, optimizer, checkpoint, config, SEEDS[1], parallel)
        params = hf_state_dict(model)
        steps = {float(s["step"]) for s in optimizer.state.values()}
        if rank == 0:
            torch.save({"params": params, "steps": steps}, folder / f"next-{world_size}.pt")
    finally:
        dist.destroy_process_group()


def spawn(world_size: int, expert_parallel: int, offload: bool, folder: Path) -> dict:
    spawn_ranks(run_rank, (world_size, free_port(), expert_parallel, offload, folder), world_size)
    return torch.load(folder / f"next-{world_size}.pt", weights_only=True)


@pytest.mark.slow
def test_state_written_at_world_4_resumes_at_2_and_1_with_the_same_next_update(tmp_path: Path) -> None:
    torch.manual_seed(0)
    save_policy(Qwen3MoeForCausalLM(tiny_config()), build_tokenizer(["abc"]), tmp_path / "checkpoint")
    uninterrupted = spawn(4, 2, False, tmp_path)
    assert uninterrupted["steps"] == {2.0}
    saved = read_whole(tmp_path / "state" / OPTIMIZER_DIR, torch.float32)
    assert {float(v) for k, v in saved.items() if k.endswith(".step")} == {1.0}
    for world_size, expert_parallel, offload in ((2, 2, True), (1, 1, False)):
        resumed = spawn(world_size, expert_parallel, offload, tmp_path)
        assert resumed["steps"] == {2.0}
        assert resumed["params"].keys() == uninterrupted["params"].keys()
        for name, value in uninterrupted["params"].items():
            torch.testing.assert_close(resumed["params"][name], value, **TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")
        # The next update moved the weights: the comparison is not of the saved state with itself.
        assert not torch.equal(resumed["params"]["lm_head.weight"], saved_weights(tmp_path)["lm_head.weight"])


def saved_weights(folder: Path) -> dict[str, torch.Tensor]:
    return read_whole(folder / "state" / "weights", torch.float32)


def one_process_state(folder: Path) -> MoeloopConfig:
    """A tiny policy's trainer state after one update, written by one process without torch.distributed."""
    config = settings_of(1, 1, False)
    torch.manual_seed(0)
    save_policy(Qwen3MoeForCausalLM(tiny_config()), build_tokenizer(["abc"]), folder / "checkpoint")
    model, tokenizer, optimizer = load_trainer_model(folder / "checkpoint", config.trainer, Parallel())
    update(model, optimizer, folder / "checkpoint", config, SEEDS[0], Parallel())
    save_trainer_state(model, tokenizer, optimizer, Parallel(), folder / "state")
    return config


def test_state_of_another_model_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    config = one_process_state(tmp_path)
    other = tiny_config()
    other.num_experts *= 2
    other.save_pretrained(tmp_path / "state")  # the state's config now names another model than its shards hold
    first = r"model\.layers\.0\.mlp\.experts\.down_proj is \(8, \d+, \d+\) there, \(16, \d+, \d+\) in the model$"
    with pytest.raises(MoeloopError, match=rf"^trainer state \S+ is not of this model: {first}"):
        resume_model(tmp_path / "state", AutoModelForCausalLM, config, None, Parallel())


@pytest.mark.parametrize("damage", ["missing", "damaged"])
def test_state_with_a_shard_missing_or_damaged_is_refused_by_its_commit(tmp_path: Path, damage: str) -> None:
    one_process_state(tmp_path)
    storage = RunStorage(str(tmp_path / "run"))
    folder = storage.trainer_state(1)
    commit_from_ranks(storage, folder, tmp_path / "state", Parallel(), {"iteration": 1})
    shard = tmp_path / "run" / folder / OPTIMIZER_DIR / "__0_0.distcp"
    if damage == "missing":
        shard.unlink()
    else:
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 1
        shard.write_bytes(bytes(data))
    with pytest.raises(MoeloopError, match="__0_0.distcp"):
        fetch_trainer_state(storage, folder, tmp_path / "fetched")
