"""PPO under expert parallelism: the PPO update at EP 2 (gloo, 2 processes spawned here), the critic sharded like the
policy, equals one process's: the report's figures and every policy and critic weight after it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moeloop.steps.rl.parallel import Parallel
from moeloop.steps.rl.update import policy_update
from tests.conftest import small_config
from tests.distributed.test_train_ep import experience
from tests.processes import spawn_ranks
from tests.unit.test_ppo import ppo_trainer, tiny_policy


def ppo_ep_config():
    return small_config(
        iterations=1,
        algorithm={"name": "ppo", "kl_coef": 0.05},
        trainer={"minibatch_size": 6, "epochs": 1, "learning_rate": 1e-3, "world_size": 2, "expert_parallel": 2},
    )


def ppo_update_on(policy_dir: Path, parallel) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One PPO update (2 minibatches) on this rank's shards: (report, policy and critic weights gathered, HF names)."""
    from moeloop.steps.model.moe import hf_state_dict

    config = ppo_ep_config()
    model, critic, optimizer, ref_logprobs_BT = ppo_trainer(policy_dir, config, parallel)
    report = policy_update(model, ref_logprobs_BT, optimizer, experience(), config, 3, parallel, critic)
    return report, hf_state_dict(model), hf_state_dict(critic.model)


def ppo_rank(rank: int, port: int, policy_dir: Path, expected: tuple) -> None:
    import os

    import torch.distributed as dist

    from moeloop.steps.config import TrainerConfig
    from moeloop.steps.rl.parallel import init_parallel

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    parallel = init_parallel(TrainerConfig(world_size=2, expert_parallel=2))
    try:
        report, policy, critic = ppo_update_on(policy_dir, parallel)
    finally:
        dist.destroy_process_group()
    want_report, want_policy, want_critic = expected
    for key in ("loss", "value_loss", "kl", "grad_norm", "critic_grad_norm", "value_clip_fraction", "return_mean"):
        assert report[key] == pytest.approx(want_report[key], rel=1e-5, abs=1e-7), key
    for got, want in ((policy, want_policy), (critic, want_critic)):
        assert got.keys() == want.keys()
        for name, tensor in got.items():
            torch.testing.assert_close(tensor, want[name], rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_ppo_update_with_ep2_equals_one_process(tmp_path: Path) -> None:
    
    from tests.distributed.test_train_ep import free_port

    policy_dir = tiny_policy(tmp_path)
    expected = ppo_update_on(policy_dir, Parallel())
    assert expected[0]["optimizer_steps"] == 2
    spawn_ranks(ppo_rank, (free_port(), policy_dir, expected), 2)
