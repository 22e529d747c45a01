"""The routers' health (steps/rl/router_health.py) against hand counts, in the update's report and `moeloop report`'s
table; and `trainer.freeze_router`."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from transformers import Qwen3MoeConfig

from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.families import Qwen3MoeRouter
from moeloop.steps.model.moe import Routes
from moeloop.steps.rl.router_health import RouterHealth
from tests.distributed.test_train_ep import experience, reference_logprobs_of, tiny_policy


def softmax_routers(layers: int) -> list[Qwen3MoeRouter]:
    """Routers of 4 experts, top 2, for router logits given by hand (their weights are never used)."""
    config = Qwen3MoeConfig(hidden_size=8, num_experts=4, num_experts_per_tok=2)
    return [Qwen3MoeRouter(config) for _ in range(layers)]


def test_imbalance_entropy_and_agreement_match_hand_counts() -> None:
    # 2 rows x 3 positions, the last position of row 1 padding; 2 layers, 4 experts, top 2.
    logits_L = (
        torch.tensor([[4.0, 3, 0, 0], [4, 0, 3, 0], [0, 4, 3, 0], [4, 3, 0, 0], [0, 0, 3, 4], [9, 9, 9, 9]]),
        torch.tensor([[0.0, 0.1, 0.2, 1], [0, 0, 1, 2], [1, 2, 0, 0], [0, 5, 1, 0], [0, 0.1, 0.2, 0.5], [9, 0, 0, 9]]),
    )
    attention_mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    routes = torch.full((2, 3, 2, 2), -1)
    routes[0, 0, 0] = torch.tensor([1, 0])  # layer 0 picks {0, 1}: agrees
    routes[0, 1, 0] = torch.tensor([0, 1])  # picks {0, 2}: disagrees
    routes[1, 1, 1] = torch.tensor([3, 2])  # layer 1 picks {2, 3}: agrees
    routes[1, 2, 0] = torch.tensor([0, 1])  # padding: never counted
    routes[1, 0, 1] = torch.tensor([3, 1])  # a prompt position (no response token sampled there): picks {1, 2}
    sampled = torch.tensor([[True, True, True], [False, True, True]])  # the positions that sampled a response token
    health = RouterHealth(softmax_routers(2), (1, 3), torch.device("cpu"))  # keyed by decoder layer
    health.add(logits_L, attention_mask, Routes(routes, (1, 3), sampled))
    report = health.report()
    # Layer 0's picks over the 5 tokens: {0,1} {0,2} {1,2} {0,1} {2,3}: loads [3, 3, 3, 1], mean 2.5.
    assert report["router_load_imbalance_layer_1"] == pytest.approx(3 / 2.5 - 1)
    # Layer 1's: {2,3} {2,3} {0,1} {1,2} {2,3}: loads [1, 2, 4, 3].
    assert report["router_load_imbalance_layer_3"] == pytest.approx(4 / 2.5 - 1)
    assert report["router_load_imbalance"] == pytest.approx((0.2 + 0.6) / 2)
    entropies = []
    for logits in logits_L:
        for row in logits[:5].tolist():
            z = sum(math.exp(v) for v in row)
            entropies.append(-sum(math.exp(v) / z * (v - math.log(z)) for v in row))
    assert report["router_entropy"] == pytest.approx(sum(entropies) / len(entropies), rel=1e-6)
    # Agreement over the recorded unpadded (position, layer) pairs that sampled a response token: two of three; at
    # the prompt's: none of one.
    assert report["routing_agreement"] == pytest.approx(2 / 3)
    assert report["routing_agreement_prompt"] == 0.0
    with pytest.raises(MoeloopError, match=r"decoder layers \[0, 1\], the model's MoE layers are \[1, 3\]"):
        health.add(logits_L, attention_mask, Routes(routes, (0, 1), sampled))


def test_replayed_forwards_count_the_recorded_experts() -> None:
    logits_L = (torch.tensor([[4.0, 3, 0, 0], [4, 3, 0, 0]]),)
    routes = torch.tensor([[[[2, 3]], [[-1, -1]]]])  # token 0 replayed to {2, 3}, token 1 free
    health = RouterHealth(softmax_routers(1), (0,), torch.device("cpu"))
    load_LE = health.add(logits_L, torch.ones(1, 2), Routes(routes, (0,), torch.ones(1, 2)), replayed=True)
    assert load_LE.tolist() == [[1, 1, 1, 1]]  # the forward's load, which the correction-bias update counts
    report = health.report()
    assert report["router_load_imbalance_layer_0"] == pytest.approx(0.0)  # loads [1, 1, 1, 1]
    assert report["routing_agreement"] == 0.0  # the trainer's own pick {0, 1} against the recorded {2, 3}
    assert "routing_agreement_prompt" not in report  # no prompt position recorded


def test_the_update_reports_the_routers_health_of_its_forward(tmp_path) -> None:
    """One minibatch, one epoch: the update's only forward is the start policy's, so its health is the start
    policy's, counted by hand from the router logits of that forward."""
    from moeloop.steps.model.policy import token_logprobs
    from moeloop.steps.rl.state import make_optimizer
    from moeloop.steps.rl.update import policy_update
    from tests.conftest import small_config

    model = tiny_policy(tmp_path)
    start = copy.deepcopy(model)
    config = small_config(iterations=1, trainer={"minibatch_size": 12, "epochs": 1})
    batch = experience()
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    assert not any(name.endswith("e_score_correction_bias") for name in buffers)  # Qwen3-MoE balances with aux loss
    report = policy_update(model, reference_logprobs_of(model, batch), make_optimizer(model, config.trainer), batch, config, seed=0)
    assert all(torch.equal(buffer, buffers[name]) for name, buffer in model.named_buffers())  # no bias update: off
    with torch.no_grad():
        _, router_logits_L = token_logprobs(start.train(), batch.input_ids_BT, batch.attention_mask_BT)
    unpadded = batch.attention_mask_BT.reshape(-1).bool()
    imbalances = []
    for layer, logits in enumerate(router_logits_L):
        loads = [0] * model.config.num_experts
        for row in logits[unpadded].tolist():
            for expert in sorted(range(len(row)), key=lambda e: -row[e])[: model.config.num_experts_per_tok]:
                loads[expert] += 1
        imbalances.append(max(loads) / (sum(loads) / len(loads)) - 1)
        assert report[f"router_load_imbalance_layer_{layer}"] == pytest.approx(imbalances[-1], rel=1e-6)
    assert report["router_load_imbalance"] == pytest.approx(sum(imbalances) / len(imbalances), rel=1e-6)
    assert 0 < report["router_entropy"] <= math.log(model.config.num_experts)
    assert "routing_agreement" not in report  # no recorded routes in this experience


def test_freeze_router_keeps_the_routers_and_trains_the_rest(tmp_path) -> None:
    from moeloop.steps.model.moe import MoeBlock
    from moeloop.steps.rl.router_loss import freeze_routers
    from moeloop.steps.rl.state import make_optimizer
    from moeloop.steps.rl.update import policy_update
    from tests.conftest import small_config

    model = tiny_policy(tmp_path)
    config = small_config(
        iterations=1, trainer={"minibatch_size": 6, "epochs": 2, "weight_decay": 0.1, "freeze_router": True}
    )
    freeze_routers(model, config.trainer.freeze_router)
    gates = [m.gate for m in model.modules() if isinstance(m, MoeBlock)]
    before_gates = [g.weight.detach().clone() for g in gates]
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    batch = experience()
    report = policy_update(model, reference_logprobs_of(model, batch), make_optimizer(model, config.trainer), batch, config, 0)
    assert report["optimizer_steps"] == 4 and math.isfinite(report["loss"])
    assert all(torch.equal(g.weight, b) for g, b in zip(gates, before_gates, strict=True))
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert changed and not any(".gate." in name for name in changed)
    assert any("experts" in name for name in changed) and any("self_attn" in name for name in changed)


def test_the_report_table_has_the_stability_columns() -> None:
    from moeloop.workflows.report import format_table

    metrics = [
        {"iteration": 0, "eval_reward_mean": 0.5},
        {
            "iteration": 1,
            "entropy": 0.7342,  # the policy's
            "router": {"load_imbalance": 0.4321, "entropy": 1.98765, "routing_agreement": 0.875},
            "logprob_mismatch": 0.01234,
            "mismatch_masked": 0.0625,
            "eval_reward_mean": 0.61,
        },
    ]
    header, first, second = format_table(metrics).splitlines()
    assert header.split()[-11:] == [
        "entropy", "imbalance", "router", "entropy", "agreement", "mismatch", "masked", "eval", "reward", "greedy", "pass@1"
    ]
    assert first.split()[-8:] == ["-", "-", "-", "-", "-", "-", "0.500", "-"]
    assert second.split()[-8:] == ["0.734", "0.432", "1.988", "0.875", "0.012", "0.062", "0.610", "-"]


def test_the_metrics_carry_the_router_health_where_the_plots_find_it(tmp_path) -> None:
    from moeloop.steps.evaluate import router_health
    from moeloop.steps.observe.plots import imbalance_series

    train = {"loss": 0.1, "router_load_imbalance": 0.4, "router_load_imbalance_layer_0": 0.3, "router_entropy": 1.5}
    health = router_health({**train, "routing_agreement": 0.9})
    assert health == {"load_imbalance": 0.4, "load_imbalance_layer_0": 0.3, "entropy": 1.5, "routing_agreement": 0.9}
    assert router_health({"loss": 0.1}) is None
    series = imbalance_series([{"iteration": 1, "router": health}, {"iteration": 0, "router": None}])
    assert series == {"router/load_imbalance": ([1], [0.4]), "router/load_imbalance_layer_0": ([1], [0.3])}
