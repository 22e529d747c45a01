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
    # All layers in one pass (one fused kernel chain on CUDA, not one per layer): their sums are the loss's terms.
    assigned_E, probability_sum_E = layer_routing(torch.stack(router_logits_L), mask_t, top_k)
    counts = torch.cat([assigned_E, (mask_t.sum() * len(router_logits_L)).reshape(1)])
    if parallel.world_size > 1:
        dist.all_reduce(counts)
    assigned_E, rows = counts[:-1], counts[-1].clamp(min=1)
    return num_experts * ((assigned_E / rows) * (probability_sum_E / (minibatch_tokens * len(router_logits_L)))).sum()


@fused_on_cuda
def layer_routing(logits_xtE: torch.Tensor, mask_t: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's router logits [t, E], or several layers' stacked [L, t, E]: (top-k assignments per expert, router
    probabilities summed per expert) over the mask's tokens, summed over the layers; the first without gradient, as
    HF's f."""
    probabilities_xtE = F.softmax(logits_xtE.float(), dim=-1)
    chosen_xtK = torch.topk(probabilities_xtE, top_k, dim=-1).indices
    weights_xtK = mask_t.unsqueeze(-1).expand(chosen_xtK.shape)
    assigned_E = mask_t.new_zeros(logits_xtE.shape[-1]).index_add(0, chosen_xtK.reshape(-1), weights_xtK.reshape(-1))
    probability_sum_E = (probabilities_xtE * mask_t.unsqueeze(-1)).reshape(-1, logits_xtE.shape[-1]).sum(0)
    return assigned_E, probability_sum_E


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
