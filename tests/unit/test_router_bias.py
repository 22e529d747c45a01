"""DeepSeek-V3's auxiliary-loss-free balancing (steps/rl/router_bias.py): the update on known counts, one train step
with a skewed router moving each expert's bias by exactly the rate, and the rate's family default and refusal. (EP = 2
against one process: tests/distributed/test_train_ep.py, whose DeepSeek-V3 reference steps the bias; off for Qwen3-MoE:
tests/unit/test_router_health.py's update.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from moeloop.steps.config import TrainerConfig
from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.policy import build_tokenizer
from moeloop.steps.rl.checkpoint import WEIGHTS_DIR, read_whole
from moeloop.steps.rl.parallel import Parallel
from moeloop.steps.rl.router_bias import balanced_bias, bias_update_rate
from moeloop.steps.rl.state import make_optimizer, save_trainer_state
from moeloop.steps.rl.update import policy_update
from tests.unit.test_moe import NUM_EXPERTS, tiny_config
from tests.distributed.test_train_ep import SEED, experience, for_packed_forwards, reference_logprobs_of, train_config

BIAS = "e_score_correction_bias"


def test_the_bias_moves_by_the_rate_towards_the_mean_load() -> None:
    bias_E = torch.tensor([0.5, -0.25, 0.0, 1.0])
    load_E = torch.tensor([7.0, 3, 1, 5], dtype=torch.float64)  # mean 4
    want_E = torch.tensor([0.5 - 0.01, -0.25 + 0.01, 0.0 + 0.01, 1.0 - 0.01])
    assert torch.equal(balanced_bias(bias_E, load_E, 0.01), want_E)
    balanced_E = torch.tensor([2.0, 2, 2, 2], dtype=torch.float64)
    assert torch.equal(balanced_bias(bias_E, balanced_E, 0.01), bias_E)  # at the mean: unmoved
    assert balanced_bias(bias_E, load_E, 0.01).dtype == torch.float32  # the bias keeps its fp32


def test_the_rate_defaults_by_family_and_is_refused_where_no_bias_is() -> None:
    assert bias_update_rate(TrainerConfig(), "deepseek_v3") == 0.001  # the DeepSeek-V3 report's gamma
    assert bias_update_rate(TrainerConfig(router_bias_update_rate=0.0), "deepseek_v3") == 0.0
    assert bias_update_rate(TrainerConfig(router_bias_update_rate=0.01), "deepseek_v3") == 0.01
    assert bias_update_rate(TrainerConfig(), "qwen3_moe") == 0.0
    assert bias_update_rate(TrainerConfig(router_bias_update_rate=0.0), "mixtral") == 0.0
    message = r"^trainer.router_bias_update_rate 0.01: qwen3_moe's router has no correction bias \(only deepseek_v3"
    with pytest.raises(MoeloopError, match=message):
        bias_update_rate(TrainerConfig(router_bias_update_rate=0.01), "qwen3_moe")


def test_a_step_with_a_skewed_router_moves_the_overloaded_down_and_the_rest_up(tmp_path: Path) -> None:
    """Router weights 0 and a bias favouring experts 0 and 1 send every token to both (group 0 wins, its two best):
    after the step their bias is down by exactly the rate, every other expert's up; the trainer state holds it."""
    torch.manual_seed(0)
    model = for_packed_forwards(AutoModelForCausalLM.from_config(tiny_config(family="deepseek_v3")))
    start_E = torch.tensor([0.4, 0.3, 0.2, 0.1, 0, 0, 0, 0])
    biases = [buffer for name, buffer in model.named_buffers() if name.endswith(BIAS)]
    assert len(biases) == 2
    with torch.no_grad():
        for bias in biases:
            bias.copy_(start_E)
        for name, parameter in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                parameter.zero_()
    config = train_config()  # one optimizer step, over several microbatches; the rate is the family's default
    config = config.model_copy(update={"trainer": config.trainer.model_copy(update={"max_tokens_per_microbatch": 64})})
    batch = experience()
    optimizer = make_optimizer(model, config.trainer)
    report = policy_update(model, reference_logprobs_of(model, batch), optimizer, batch, config, SEED)
    assert report["optimizer_steps"] == 1
    assert report["router_load_imbalance"] == pytest.approx(NUM_EXPERTS / 2 - 1)  # all tokens on 2 of 8 experts
    rate = torch.tensor(0.001)
    want_E = start_E + torch.tensor([-1.0, -1, 1, 1, 1, 1, 1, 1]) * rate
    for bias in biases:
        assert torch.equal(bias, want_E)
    save_trainer_state(model, build_tokenizer(["abc"]), optimizer, Parallel(), tmp_path / "state")
    saved = read_whole(tmp_path / "state" / WEIGHTS_DIR, torch.float32)
    assert torch.equal(saved[f"model.layers.1.mlp.gate.{BIAS}"], want_E)  # what resume and publish read


def test_start_refuses_a_rate_for_the_tiny_qwen3_moe_before_writing(tmp_path: Path) -> None:
    from moeloop.steps.start import start
    from tests.conftest import small_config

    config = small_config(trainer={"router_bias_update_rate": 0.01})
    with pytest.raises(MoeloopError, match="qwen3_moe's router has no correction bias"):
        start(str(tmp_path / "run"), config)
    assert not (tmp_path / "run").exists()
