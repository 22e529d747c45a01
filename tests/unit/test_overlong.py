"""algorithm.overlong, DAPO's treatment of responses cut by rollout.max_new_tokens: the soft overlong punishment
against values computed by hand (verl's DAPORewardManager's formula), and overlong filtering, which leaves the cut
samples out of the policy loss and nothing else."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from moeloop.steps.config_algorithm import OverlongConfig
from moeloop.steps.rl.overlong import overlong_penalty
from moeloop.steps.rl.state import make_optimizer
from moeloop.steps.rl.update import policy_update
from tests.conftest import small_config
from tests.distributed.test_train_ep import experience, reference_logprobs_of, tiny_policy


@pytest.mark.parametrize(
    ("tokens", "factor", "expected"),
    [
        (10, 1.0, 0.0),  # well within max_new_tokens - buffer_tokens = 16
        (16, 1.0, 0.0),
        (17, 1.0, -0.25),  # 1 of the 4 buffer tokens used
        (18, 1.0, -0.5),
        (20, 1.0, -1.0),  # cut at max_new_tokens: the whole factor
        (20, 0.5, -0.5),
    ],
)
def test_the_soft_overlong_punishment(tokens: int, factor: float, expected: float) -> None:
    settings = OverlongConfig(mode="penalty", buffer_tokens=4, penalty_factor=factor)
    assert overlong_penalty(tokens, 20, settings) == pytest.approx(expected)
    assert overlong_penalty(tokens, 20, settings.model_copy(update={"mode": "mask"})) == 0.0


def test_overlong_filtering_leaves_the_cut_samples_out_of_the_policy_loss(tmp_path) -> None:
    """The update with mask equals the update on the same batch whose cut samples have no response tokens (the
    policy loss is all they count in), and differs from the update that keeps them."""
    cut_B = torch.zeros(12, dtype=torch.bool)
    cut_B[[0, 5, 9]] = True
    batch = replace(experience(), truncated_B=cut_B)
    without = replace(batch, response_mask_BT=batch.response_mask_BT & ~cut_B.unsqueeze(1))
    start = tiny_policy(tmp_path)
    ref_logprobs_BT = reference_logprobs_of(start, batch)

    def updated(mode: str, experience_batch: object) -> list[torch.Tensor]:
        model = copy.deepcopy(start)
        config = small_config(
            iterations=1, algorithm={"overlong": {"mode": mode}}, trainer={"minibatch_size": 12, "epochs": 1}
        )
        policy_update(model, ref_logprobs_BT, make_optimizer(model, config.trainer), experience_batch, config, seed=0)
        return [parameter.detach() for parameter in model.parameters()]

    masked, dropped, kept = updated("mask", batch), updated("off", without), updated("off", batch)
    for a, b in zip(masked, dropped, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert any(not torch.allclose(a, b) for a, b in zip(masked, kept, strict=True))
