"""DeepSeek-V3's auxiliary-loss-free load balancing (the DeepSeek-V3 report, section 2.1.2): after each optimizer
step, each MoE layer's router correction bias (`e_score_correction_bias`, fp32, which chooses experts but does not
weigh them) moves by `trainer.router_bias_update_rate` towards balanced load:

    bias_e += rate * sign(mean_e' load_e' - load_e)

load_e the real tokens routed to expert e over the step's microbatches and all ranks (all-reduced, so every rank
applies the same update and the replicated bias stays replicated). Under routing replay the load is that of the
experts the forwards used, the recorded ones (the engine chose them with the same published bias). The bias is a
buffer of the trainer state (steps/rl/checkpoint.py), so a resumed run continues it and publish carries it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moeloop.steps.config import TrainerConfig
from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.families import FAMILIES, family_named
from moeloop.steps.rl.parallel import Parallel


def bias_update_rate(settings: TrainerConfig, model_type: str | None) -> float:
    """The rate for a model of model_type: the config's, else its family's default (0: off); a one-line error for a
    non-zero rate where the family's router has no correction bias."""
    family = family_named(model_type)
    rate = settings.router_bias_update_rate
    if rate is None:
        return family.bias_update_rate or 0.0
    if rate and family.bias_update_rate is None:
        with_bias = ", ".join(f.model_type for f in FAMILIES if f.bias_update_rate is not None)
        raise MoeloopError(
            f"trainer.router_bias_update_rate {rate}: {model_type}'s router has no correction bias (only {with_bias}"
            " routers do); leave it unset or 0"
        )
    return rate


def balanced_bias(bias_E: torch.Tensor, load_E: torch.Tensor, rate: float) -> torch.Tensor:
    """bias_E moved by rate: down for experts with more than the mean load, up for those with less."""
    return bias_E + rate * torch.sign(load_E.mean() - load_E).to(bias_E.dtype)


@torch.no_grad()
def update_correction_biases(
    routers: list[nn.Module], load_LE: torch.Tensor, rate: float, parallel: Parallel
) -> None:
    """One step's update of every layer's bias from this rank's load [L, E] (summed over its microbatches).
    Collective where there are several ranks: every rank calls it."""
    if parallel.world_size > 1:
        dist.all_reduce(load_LE)
    for router, load_E in zip(routers, load_LE, strict=True):
        bias_E = router.e_score_correction_bias
        bias_E.copy_(balanced_bias(bias_E, load_E, rate))
