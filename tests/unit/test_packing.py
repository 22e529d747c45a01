"""Packed token-budget microbatches: the plan (every sample once, within budget, equal counts per rank), and the
packed forward equal to the padded one (logprobs, values, router logits and gradients), on CPU's exact path."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM, Qwen3MoeForTokenClassification

from moeloop.steps.model.attention import PACKED_ATTENTION
from moeloop.steps.model.logprobs import ChunkedTokenLogprobs, packed_token_logprobs, packed_token_values, use_logprob_head
from moeloop.steps.model.microbatch import pack_rows
from moeloop.steps.model.policy import pack_sequences, token_values
from moeloop.steps.rl.packing import plan_microbatches
from tests.unit.test_moe import tiny_config

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_plan_packs_every_sample_once_within_budget(world_size: int) -> None:
    rng = random.Random(0)
    lengths = [rng.randint(1, 40) for _ in range(37)] + [55]  # one sample over the budget
    plans = plan_microbatches(lengths, 50, world_size)
    assert len(plans) == world_size and len({len(plan) for plan in plans}) == 1
    placed = sorted(i for plan in plans for micro in plan for i in micro)
    assert placed == list(range(len(lengths)))
    for plan in plans:
        for micro in plan:
            assert sum(lengths[i] for i in micro) <= 50 or micro == [len(lengths) - 1]
    assert plans == plan_microbatches(lengths, 50, world_size)
    totals = [sum(lengths[i] for micro in plan for i in micro) for plan in plans]
    assert max(totals) - min(totals) <= max(lengths)  # the ranks carry similar token counts


def test_plan_gives_every_rank_the_same_count_with_empty_microbatches() -> None:
    plans = plan_microbatches([30, 30, 30], 50, 2)  # 3 bins needed, 2 per rank
    assert [len(plan) for plan in plans] == [2, 2]
    assert sorted(len(micro) for plan in plans for micro in plan) == [0, 1, 1, 1]


def samples() -> tuple[list[list[int]], list[list[int]]]:
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 64, (3 + i % 4,), generator=generator).tolist() for i in range(7)]
    responses = [torch.randint(2, 64, (1 + (3 * i) % 7,), generator=generator).tolist() for i in range(7)]
    return prompts, responses


def padded_logprobs_and_entropy(model, input_ids_BT, attention_mask_BT, temperature: float):
    """HF's padded forward: each token's logprob and the entropy of the distribution it was drawn from, from the whole
    [B, T, V] logits (position 0 gets 0), and the router logits."""
    output = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT, output_router_logits=True, use_cache=False)
    log_p_BTV = torch.log_softmax(output.logits[:, :-1].float() / temperature, dim=-1)
    logprobs_BT = log_p_BTV.gather(-1, input_ids_BT[:, 1:, None]).squeeze(-1)
    entropy_BT = -(log_p_BTV.exp() * log_p_BTV).sum(-1)
    pad = torch.nn.functional.pad
    return pad(logprobs_BT, (1, 0)), pad(entropy_BT, (1, 0)), output.router_logits


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_packed_logprobs_entropy_and_gradients_equal_the_padded_batch(family: str) -> None:
    """The padded batch through HF's own attention: SDPA; GPT-OSS's eager attention with sinks, and a window of 4
    on alternate layers, shorter than most samples. A loss of the logprobs and the entropies (the entropy bonus's
    gradient through the chunked head) has the same gradients packed as padded."""
    torch.manual_seed(0)
    config = tiny_config(family=family)
    config._attn_implementation = "eager" if family == "gpt_oss" else "sdpa"
    padded_model = AutoModelForCausalLM.from_config(config)
    packed_model = copy.deepcopy(padded_model)
    use_logprob_head(packed_model)
    packed_model.config._attn_implementation = PACKED_ATTENTION["sdpa"]
    input_ids_BT, attention_mask_BT, response_mask_BT = pack_sequences(*samples(), pad_id=0)
    lengths_B = attention_mask_BT.sum(1)
    generator = torch.Generator().manual_seed(2)
    weights_BT = torch.randn(input_ids_BT.shape, generator=generator) * response_mask_BT
    entropy_weights_BT = torch.randn(input_ids_BT.shape, generator=generator) * response_mask_BT

    logprobs_BT, entropy_BT, router_logits_L = padded_logprobs_and_entropy(
        padded_model, input_ids_BT, attention_mask_BT, temperature=0.7
    )
    ((logprobs_BT * weights_BT).sum() + (entropy_BT * entropy_weights_BT).sum()).backward()
    packed_sum = 0.0
    for rows in plan_microbatches(lengths_B.tolist(), 20, 1)[0]:
        micro = pack_rows(input_ids_BT, lengths_B.tolist(), rows)
        logprobs_nT, entropy_nT, packed_router_L = packed_token_logprobs(packed_model, micro, temperature=0.7)
        mask_nT = attention_mask_BT[micro.rows_n].bool()
        torch.testing.assert_close(logprobs_nT[mask_nT], logprobs_BT[micro.rows_n][mask_nT].detach(), **TOLERANCE)
        torch.testing.assert_close(entropy_nT[mask_nT], entropy_BT[micro.rows_n][mask_nT].detach(), **TOLERANCE)
        padded_router = router_logits_L[0].view(*input_ids_BT.shape, -1)  # [B * T, E] per layer
        torch.testing.assert_close(packed_router_L[0], padded_router[micro.rows_n][mask_nT].detach(), **TOLERANCE)
        packed_sum = packed_sum + (logprobs_nT * weights_BT[micro.rows_n]).sum()
        packed_sum = packed_sum + (entropy_nT * entropy_weights_BT[micro.rows_n]).sum()
    packed_sum.backward()
    for (name, padded), packed in zip(padded_model.named_parameters(), packed_model.parameters(), strict=True):
        torch.testing.assert_close(packed.grad, padded.grad, **TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")


def test_packed_values_equal_the_padded_batch() -> None:
    torch.manual_seed(0)
    config = tiny_config()
    config._attn_implementation = "sdpa"
    config.num_labels = 1
    critic = Qwen3MoeForTokenClassification(config)
    input_ids_BT, attention_mask_BT, _ = pack_sequences(*samples(), pad_id=0)
    lengths_B = attention_mask_BT.sum(1)
    values_BT, _ = token_values(critic, input_ids_BT, attention_mask_BT)
    critic.config._attn_implementation = PACKED_ATTENTION["sdpa"]
    micro = pack_rows(input_ids_BT, lengths_B.tolist(), [4, 0, 6])
    values_nT, _ = packed_token_values(critic, micro)
    mask_nT = attention_mask_BT[micro.rows_n].bool()
    torch.testing.assert_close(values_nT[mask_nT], values_BT[micro.rows_n][mask_nT].detach(), **TOLERANCE)
    assert not values_nT[~mask_nT].any()


@pytest.mark.parametrize("with_entropy", [False, True], ids=["logprobs", "logprobs_and_entropy"])
def test_chunked_logprobs_and_entropy_and_their_gradients_are_the_full_logits(
    monkeypatch: pytest.MonkeyPatch, with_entropy: bool
) -> None:
    """The chunked head's logprobs and entropies equal the ones of the whole logits (the cross-entropy; -sum p log p),
    and so do the gradients: of the logprobs alone (the entropy unused: its gradient is never computed), or of both."""
    monkeypatch.setattr("moeloop.steps.model.logprobs.CHUNK_ROWS", 3)  # several chunks, the last one short
    generator = torch.Generator().manual_seed(0)
    hidden_NH = torch.randn(10, 8, generator=generator, requires_grad=True)
    weight_VH = torch.randn(32, 8, generator=generator, requires_grad=True)
    targets_N = torch.randint(0, 32, (10,), generator=generator)
    grad_N, grad_entropy_N = torch.randn(10, generator=generator), torch.randn(10, generator=generator)
    logprobs_N, entropy_N = ChunkedTokenLogprobs.apply(hidden_NH, weight_VH, targets_N, 0.5)
    ((logprobs_N * grad_N).sum() + ((entropy_N * grad_entropy_N).sum() if with_entropy else 0)).backward()
    chunked = hidden_NH.grad.clone(), weight_VH.grad.clone()
    hidden_NH.grad = weight_VH.grad = None
    log_p_NV = torch.log_softmax(hidden_NH @ weight_VH.T / 0.5, dim=-1)
    want_N = -torch.nn.functional.cross_entropy(hidden_NH @ weight_VH.T / 0.5, targets_N, reduction="none")
    want_entropy_N = -(log_p_NV.exp() * log_p_NV).sum(-1)
    torch.testing.assert_close(logprobs_N.detach(), want_N.detach(), **TOLERANCE)
    torch.testing.assert_close(entropy_N.detach(), want_entropy_N.detach(), **TOLERANCE)
    ((want_N * grad_N).sum() + ((want_entropy_N * grad_entropy_N).sum() if with_entropy else 0)).backward()
    torch.testing.assert_close(chunked[0], hidden_NH.grad, **TOLERANCE)
    torch.testing.assert_close(chunked[1], weight_VH.grad, **TOLERANCE)


def test_empty_microbatch_runs_a_forward_of_no_rows() -> None:
    torch.manual_seed(0)
    config = tiny_config()
    config._attn_implementation = "sdpa"
    model = Qwen3MoeForCausalLM(config)
    use_logprob_head(model)
    model.config._attn_implementation = PACKED_ATTENTION["sdpa"]
    input_ids_BT, attention_mask_BT, _ = pack_sequences(*samples(), pad_id=0)
    micro = pack_rows(input_ids_BT, attention_mask_BT.sum(1).tolist(), [])
    logprobs_nT, _, router_logits_L = packed_token_logprobs(model, micro)
    assert micro.empty and logprobs_nT.shape == (0, input_ids_BT.shape[1]) and router_logits_L[0].shape[0] == 1
