"""The MoE routers' load-balancing loss (HF's), split over the ranks and microbatches; and `trainer.freeze_router`,
which takes the routers (and so that loss) out of training."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moeloop.steps.model.families import family_of_config, is_router, num_experts
from moeloop.steps.model.kernels import fused_on_cuda
from moeloop.steps.rl.parallel import Parallel


def load_balancing_loss(
    router_logits_L: tuple[torch.Tensor, ...],
    mask_t: torch.Tensor,
    num_experts: int,
    top_k: int,
    minibatch_tokens: int,
    parallel: Parallel,
) -> torch.Tensor:
    """This rank's share of HF's load-balancing loss (`load_balancing_loss_func`) for one microbatch index.

    That loss is E * sum_e f_e * P_e: f_e the share of top-k assignments to expert e and P_e its mean router
    probability, over all layers and real tokens (mask_t: 1 for the tokens of router_logits' rows that count). f has
    no gradient. Here f is over the tokens of this microbatch on all ranks (the ranks run equally many, summed
    first), and P's sum over this rank's tokens is divided by the whole minibatch's tokens (minibatch_tokens, all
    ranks): the ranks' shares add up to the loss of the microbatch index, weighted by its share of the minibatch's
    tokens. With one microbatch per rank that is HF's loss over the minibatch; with more, the token-weighted mean
    of each microbatch's (f cannot be known for the whole minibatch before its last microbatch has run, and the
    earlier ones' graphs are gone by then).
    """
    mask_t = mask_t.float()
    assigned_E = mask_t.new_zeros(num_experts)
    probability_sum_E = mask_t.new_zeros(num_experts)
    for logits_tE in router_logits_L:
        assigned_layer_E, probability_sum_layer_E = layer_routing(logits_tE, mask_t, top_k)
        assigned_E, probability_sum_E = assigned_E + assigned_layer_E, probability_sum_E + probability_sum_layer_E
    counts = torch.cat([assigned_E, (mask_t.sum() * len(router_logits_L)).reshape(1)])
    if parallel.world_size > 1:
        dist.all_reduce(counts)
    assigned_E, rows = counts[:-1], counts[-1].clamp(min=1)
    return num_experts * ((assigned_E / rows) * (probability_sum_E / (minibatch_tokens * len(router_logits_L)))).sum()


@fused_on_cuda
def layer_routing(logits_tE: torch.Tensor, mask_t: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's (top-k assignments per expert, router probabilities summed per expert) over the mask's tokens;
    the first without gradient, as HF's f."""
    probabilities_tE = F.softmax(logits_tE.float(), dim=-1)
    chosen_tK = torch.topk(probabilities_tE, top_k, dim=-1).indices
    assigned_E = mask_t.new_zeros(logits_tE.shape[1])
    assigned_E = assigned_E.index_add(0, chosen_tK.reshape(-1), mask_t.repeat_interleave(top_k))
    return assigned_E, (probabilities_tE * mask_t.unsqueeze(1)).sum(0)


def router_aux_loss(
    model: torch.nn.Module,
    router_logits_L: tuple,
    mask_t: torch.Tensor,
    minibatch_tokens: int,
    parallel: Parallel,
) -> torch.Tensor:
    """The load-balancing loss of model's routers, weighted by its config's router_aux_loss_coef; 0 when the routers
    are frozen (it is there to train them), the config has no coefficient, or the family trains without it
    (DeepSeek-V3: its HF model has no aux loss, whatever its config holds; it balances with the routers' correction
    bias, `moeloop.steps.rl.router_bias`)."""
    config = model.config
    routers = router_parameters(model)
    coefficient = getattr(config, "router_aux_loss_coef", 0.0) if family_of_config(config).aux_loss else 0.0
    if not coefficient or (routers and not any(parameter.requires_grad for parameter in routers)):
        return torch.zeros((), device=mask_t.device)
    aux = load_balancing_loss(
        router_logits_L, mask_t, num_experts(config), config.num_experts_per_tok, minibatch_tokens, parallel
    )
    return coefficient * aux


def router_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The routers' weights, of `MoeBlock`s and of HF's own blocks alike (a family's fused router subclasses HF's)."""
    return [p for module in model.modules() if is_router(module) for p in module.parameters()]


def freeze_routers(model: torch.nn.Module, frozen: bool) -> None:
    """`trainer.freeze_router`: the routers take no gradient, so no optimizer step (and no weight decay) moves them."""
    for parameter in router_parameters(model):
        parameter.requires_grad_(not frozen)
