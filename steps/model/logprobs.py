"""Token log-probabilities and values of packed microbatches (`moeloop.steps.model.microbatch`), in the padded batch's layout.

The LM head computes the log-probability of each token's target only, and the entropy of the distribution it was
drawn from, a chunk of rows at a time (`ChunkedTokenLogprobs`): the [N, V] logits (151936 wide for Qwen3) are
never held whole, in the forward or the backward, where HF's head and a cross-entropy would keep them, their fp32
copy and their gradient (about 30 GB at 16k tokens). `LogprobHead` swaps it into the model's `lm_head` in place, so
parameter names, checkpoints and a plain logits call are unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moeloop.steps.model.families import is_router
from moeloop.steps.model.kernels import fused_on_cuda
from moeloop.steps.model.microbatch import Microbatch

CHUNK_ROWS = 4096  # 4096 x 151936 fp32 logits: 2.5 GB at a time


# On CUDA a chunk's work after its matmul is one fused pass over the [c, V] fp32 logits, not one per operation.
@fused_on_cuda
def chunk_logprobs(
    hidden_cH: torch.Tensor, weight_VH: torch.Tensor, targets_c: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-probability of each row's target, entropy of its distribution, log-sum-exp of its logits) of one chunk
    of rows, in fp32. The entropy is -sum_v p_v log p_v, p the softmax of the logits over temperature (not lse -
    sum_v p_v z_v, which cancels to a few digits where the distribution is sharp)."""
    logits_cV = F.linear(hidden_cH, weight_VH).float() / temperature
    lse_c = torch.logsumexp(logits_cV, dim=-1)
    log_p_cV = logits_cV - lse_c[:, None]
    entropy_c = -(torch.exp(log_p_cV) * log_p_cV).sum(-1)
    return logits_cV.gather(1, targets_c[:, None]).squeeze(1) - lse_c, entropy_c, lse_c


@fused_on_cuda
def chunk_logit_grads(
    hidden_cH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_c: torch.Tensor,
    lse_c: torch.Tensor,
    grad_c: torch.Tensor,
    temperature: float,
    entropy_c: torch.Tensor | None = None,
    grad_entropy_c: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gradient of the chunk's logits, (onehot(target) - softmax) x grad / temperature, in the hidden dtype; with
    grad_entropy_c, plus the entropy's, -p (log p + H) x grad_entropy / temperature."""
    logits_cV = F.linear(hidden_cH, weight_VH).float() / temperature
    target_cV = torch.arange(logits_cV.shape[1], device=logits_cV.device) == targets_c[:, None]
    log_p_cV = logits_cV - lse_c[:, None]
    grad_logits_cV = (target_cV.float() - torch.exp(log_p_cV)) * (grad_c[:, None] / temperature)
    if grad_entropy_c is not None and entropy_c is not None:
        grad_entropy_cV = -torch.exp(log_p_cV) * (log_p_cV + entropy_c[:, None])
        grad_logits_cV = grad_logits_cV + grad_entropy_cV * (grad_entropy_c[:, None] / temperature)
    return grad_logits_cV.to(hidden_cH.dtype)


class ChunkedTokenLogprobs(torch.autograd.Function):
    """log_softmax(hidden_NH @ weight_VH.T / temperature)[n, targets_N[n]] for every row n, and the entropy of that
    softmax, chunk by chunk.

    The forward keeps only each row's log-sum-exp and entropy; the backward recomputes a chunk's logits from them
    (the gradient of a log-probability with respect to the logits is onehot(target) - softmax; the entropy's, taken
    only where the loss has the entropy, -p (log p + H)). Logits are computed as HF's head computes them, in the
    weight's dtype, then taken to fp32.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden_NH: torch.Tensor, weight_VH: torch.Tensor, targets_N: torch.Tensor, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logprobs_N = hidden_NH.new_empty(len(hidden_NH), dtype=torch.float32)
        entropy_N, lse_N = torch.empty_like(logprobs_N), torch.empty_like(logprobs_N)
        for start in range(0, len(hidden_NH), CHUNK_ROWS):
            rows = slice(start, start + CHUNK_ROWS)
            logprobs_N[rows], entropy_N[rows], lse_N[rows] = chunk_logprobs(
                hidden_NH[rows], weight_VH, targets_N[rows], temperature
            )
        ctx.save_for_backward(hidden_NH, weight_VH, targets_N, lse_N, entropy_N)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)  # no entropy in the loss: its gradient is None, and not computed
        return logprobs_N, entropy_N

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_N: torch.Tensor | None, grad_entropy_N: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        hidden_NH, weight_VH, targets_N, lse_N, entropy_N = ctx.saved_tensors
        grad_N = torch.zeros_like(lse_N) if grad_N is None else grad_N
        grad_hidden_NH = torch.empty_like(hidden_NH)
        grad_weight_VH = torch.zeros(weight_VH.shape, dtype=torch.float32, device=weight_VH.device)
        for start in range(0, len(hidden_NH), CHUNK_ROWS):
            rows = slice(start, start + CHUNK_ROWS)
            entropy_terms = (entropy_N[rows], grad_entropy_N[rows]) if grad_entropy_N is not None else (None, None)
            grad_logits_cV = chunk_logit_grads(
                hidden_NH[rows], weight_VH, targets_N[rows], lse_N[rows], grad_N[rows], ctx.temperature, *entropy_terms
            )
            grad_hidden_NH[rows] = grad_logits_cV @ weight_VH
            grad_weight_VH += (grad_logits_cV.T @ hidden_NH[rows]).float()
        return grad_hidden_NH, grad_weight_VH.to(weight_VH.dtype), None, None


class LogprobHead(nn.Linear):
    """An LM head (`nn.Linear`, no bias) that, given targets, returns their log-probabilities and the entropy of the
    distribution at each row instead of logits."""

    def forward(  # type: ignore[override]
        self, hidden_NH: torch.Tensor, targets_N: torch.Tensor | None = None, temperature: float = 1.0
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if targets_N is None:
            return super().forward(hidden_NH)
        return ChunkedTokenLogprobs.apply(hidden_NH, self.weight, targets_N, temperature)


def use_logprob_head(model: nn.Module) -> None:
    """Swap the causal LM's head for a `LogprobHead`, in place (same parameter, same name)."""
    if model.lm_head.bias is not None:
        raise ValueError("the LM head has a bias, which LogprobHead does not compute")
    model.lm_head.__class__ = LogprobHead


def packed_token_logprobs(
    model: nn.Module, micro: Microbatch, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """`moeloop.steps.model.policy.token_logprobs` of the microbatch's samples: [n, T] (position 0 and the padding 0),
    the entropy of the distribution each token was drawn from, alike, and each MoE layer's router logits [N, E]. The
    model's head is a `LogprobHead`."""
    hidden_NH, router_logits_L = body_forward(model.model, micro)
    next_token_N = micro.input_ids_1N[0].roll(-1)  # the target of a sample's last token is not used
    next_logprobs_N, next_entropy_N = model.lm_head(hidden_NH, next_token_N, temperature)
    unpacked = (micro.unpack(shift_into_place(values_N, micro)) for values_N in (next_logprobs_N, next_entropy_N))
    return *unpacked, router_logits_L


def packed_token_values(critic: nn.Module, micro: Microbatch) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """`moeloop.steps.model.policy.token_values` of the microbatch's samples: [n, T], and each MoE layer's router logits."""
    hidden_NH, router_logits_L = body_forward(critic.model, micro)
    values_N = critic.score(hidden_NH).squeeze(-1).float()
    return micro.unpack(shift_into_place(values_N, micro)), router_logits_L


class RouterLogits:
    """Each MoE layer's router logits [N, E] of a forward, which forward hooks on the routers (installed once on a
    model's body) set on the router as `recorded_logits`. The hook is traced into a compiled decoder layer like the
    rest of it: the logits leave the layer's one graph as an output (an attribute set on a module is an output of
    dynamo's graph), with no graph break, and the layers of one class still share one graph (no list grows with
    the layers). (HF's own recorder, `output_router_logits=True`, looks its hooks up by the model's class, which
    FSDP2's `fully_shard` replaces with a subclass of its own.)"""

    def __init__(self, body: nn.Module) -> None:
        self.routers = [module for module in body.modules() if is_router(module)]
        self.recording = False  # off outside a forward: activation checkpointing's recompute records nothing
        for router in self.routers:
            router.register_forward_hook(self.record)

    def record(self, module: nn.Module, args: Any, output: tuple[torch.Tensor, ...]) -> None:
        if self.recording:
            module.recorded_logits = output[0]

    @classmethod
    def of(cls, body: nn.Module) -> RouterLogits:
        if "_router_logits" not in body.__dict__:
            body.__dict__["_router_logits"] = cls(body)
        return body.__dict__["_router_logits"]


def body_forward(body: nn.Module, micro: Microbatch) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The body's last hidden states [N, H] of the microbatch, and each MoE layer's router logits."""
    recorder = RouterLogits.of(body)
    recorder.recording = True
    try:
        # No KV cache (see moeloop.steps.model.policy.token_logprobs); the sample boundaries go down to attention.
        output = body(input_ids=micro.input_ids_1N, position_ids=micro.position_ids_1N, use_cache=False,
                      **micro.attention_kwargs())  # fmt: skip
        return output.last_hidden_state[0], tuple(router.recorded_logits for router in recorder.routers)
    finally:
        recorder.recording = False
        for router in recorder.routers:  # not held past the forward (the backward holds what it needs)
            router.recorded_logits = None


def shift_into_place(per_prefix_N: torch.Tensor, micro: Microbatch) -> torch.Tensor:
    """Values computed at each token for the token after it, moved onto that token; a sample's first token gets 0."""
    return torch.where(micro.position_ids_1N[0] > 0, per_prefix_N.roll(1), 0.0)
