"""The MoE routers' load-balancing loss (HF's), split over the ranks so that the shares add up to one process's;
and `trainer.freeze_router`, which takes the routers (and so that loss) out of training."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from steps.rl.parallel import Parallel


def load_balancing_loss(
    router_logits_L: tuple[torch.Tensor, ...],
    attention_mask_bT: torch.Tensor,
    num_experts: int,
    top_k: int,
    parallel: Parallel,
) -> torch.Tensor:
    """This rank's share of HF's load-balancing loss (`load_balancing_loss_func`) over the whole minibatch.

    That loss is E * sum_e f_e * P_e: f_e the share of top-k assignments to expert e and P_e its mean router
    probability, over all layers and unpadded tokens. f has no gradient, so with f and the token count summed over
    all ranks first, the ranks' shares E * f . (their P sums) / count add up to the loss and to its gradient (the
    router gradients are summed over all ranks). A rank's own aux loss, on its tokens only, would not.
    """
    mask_t = attention_mask_bT.reshape(-1).float()
    assigned_E = mask_t.new_zeros(num_experts)
    probability_sum_E = mask_t.new_zeros(num_experts)
    for logits_tE in router_logits_L:
        probabilities_tE = F.softmax(logits_tE.float(), dim=-1)
        chosen_tK = torch.topk(probabilities_tE, top_k, dim=-1).indices
        assigned_E = assigned_E.index_add(0, chosen_tK.reshape(-1), mask_t.repeat_interleave(top_k))
        probability_sum_E = probability_sum_E + (probabilities_tE * mask_t.unsqueeze(1)).sum(0)
    counts = torch.cat([assigned_E, (mask_t.sum() * len(router_logits_L)).reshape(1)])
    if parallel.world_size > 1:
        dist.all_reduce(counts)
    assigned_E, rows = counts[:-1], counts[-1]
    return num_experts * ((assigned_E / rows) * (probability_sum_E / rows)).sum()


def router_aux_loss(
    model: torch.nn.Module, router_logits_L: tuple, attention_mask_bT: torch.Tensor, parallel: Parallel
) -> torch.Tensor:
    """The load-balancing loss of model's routers, weighted by its config's router_aux_loss_coef; 0 when the routers
    are frozen (it is there to train them)."""
    config = model.config
    routers = router_parameters(model)
    if routers and not any(parameter.requires_grad for parameter in routers):
        return torch.zeros((), device=attention_mask_bT.device)
    aux = load_balancing_loss(
        router_logits_L, attention_mask_bT, config.num_experts, config.num_experts_per_tok, parallel
    )
    return config.router_aux_loss_coef * aux


def router_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The routers' weights, of `MoeBlock`s and of HF's own blocks alike (`TopKRouter` subclasses HF's router)."""
    return [p for module in model.modules() if isinstance(module, Qwen3MoeTopKRouter) for p in module.parameters()]


def freeze_routers(model: torch.nn.Module, frozen: bool) -> None:
    """`trainer.freeze_router`: the routers take no gradient, so no optimizer step (and no weight decay) moves them."""
    for parameter in router_parameters(model):
        parameter.requires_grad_(not frozen)
