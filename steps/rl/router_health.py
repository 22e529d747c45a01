"""The routers' health over the policy update's forwards: load imbalance per MoE layer, router entropy, and the
agreement of the trainer's routing with the engine's recorded one. Plain numbers for the train report.

- load imbalance of a layer: max over experts of the tokens routed to it / the mean over experts - 1 (0 is
  perfectly balanced; E - 1 puts every token on one expert when top_k is 1), over the unpadded tokens of every
  training forward of the update, all ranks' tokens together; `router_load_imbalance` is its mean over layers;
- router entropy: the mean over unpadded tokens and layers of the entropy (nats) of the router's distribution over
  the experts (`probabilities`: the softmax; DeepSeek-V3's sigmoid scores normalised);
- routing agreement: the share of (position, layer) pairs with recorded engine routes whose expert set the trainer's
  own router picks, too (by the family's own routing, `choose`: DeepSeek-V3's groups and correction bias too), in
  pi_old's pass (the update measures it there: pi_old is the policy the engine sampled with at max_staleness 0),
  apart for the positions whose forwards sampled a response token (`routing_agreement`) and the prompt's others
  (`routing_agreement_prompt`, where `rollout.prompt_routes` recorded them). Under routing replay the forward routes
  to the recorded experts, so the agreement is that of the trainer's router logits (its unreplayed choice) with the
  engine's. Recorded routes are matched to the routers by decoder layer (`moe.check_route_layers`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moeloop.steps.model.families import moe_layers, moe_routers, routing_of
from moeloop.steps.model.moe import Routes, check_route_layers


class RouterHealth:
    """Sums over the update's forwards; `report` all-reduces them once (collective: every rank calls it). routers:
    the model's routers in layer order (`moeloop.steps.model.families.moe_routers`), whose family's routing it
    recomputes; layers: the decoder layer of each (`moe_layers`)."""

    def __init__(self, routers: list[nn.Module], layers: tuple[int, ...], device: torch.device) -> None:
        self.routers = routers
        self.layers = layers
        self.routings = [routing_of(router) for router in routers]
        self.top_k = routers[0].top_k
        self.load_LE = torch.zeros(len(routers), routers[0].num_experts, dtype=torch.float64, device=device)
        # entropy sum, tokens (per layer); agreeing and recorded (position, layer) pairs at the response's positions,
        # then at the prompt's
        self.sums_6 = torch.zeros(6, dtype=torch.float64, device=device)

    @classmethod
    def of(cls, model: nn.Module, device: torch.device) -> RouterHealth:
        return cls(moe_routers(model), moe_layers(model), device)

    @torch.no_grad()
    def add(
        self,
        router_logits_L: tuple[torch.Tensor, ...],
        attention_mask_bT: torch.Tensor,
        routes: Routes | None = None,
        replayed: bool = False,
    ) -> torch.Tensor:
        """One forward's router logits ([b * T, E] per layer); routes the engine's recorded experts per position and
        layer (-1 where none), which the forward routed to where replayed. Returns this forward's load [L, E]: the
        unpadded tokens each expert took (the recorded experts' where replayed)."""
        # Padding is weighted out rather than indexed out: a boolean index waits for the GPU, once per layer.
        real_t = attention_mask_bT.reshape(-1).bool()
        weight_t = real_t.to(self.load_LE.dtype)
        load_LE = torch.zeros_like(self.load_LE)
        if routes is not None:
            check_route_layers(routes.layers, self.layers)
            sampled_t = routes.sampled_bT.reshape(-1).bool()
        for layer, (router, logits_tE) in enumerate(zip(self.routers, router_logits_L, strict=True)):
            routing, logits_tE = self.routings[layer], logits_tE.detach().float()
            own_tK = routing.choose(router, logits_tE)
            routed_tK = own_tK
            if routes is not None:
                recorded_tK = routes.experts_bTLK[:, :, layer].reshape(-1, self.top_k).long()
                has_t = (recorded_tK[:, 0] >= 0) & real_t
                same_t = (own_tK.sort(1).values == recorded_tK.sort(1).values).all(1)
                for first, positions_t in ((2, has_t & sampled_t), (4, has_t & ~sampled_t)):
                    self.sums_6[first] += (same_t & positions_t).sum()
                    self.sums_6[first + 1] += positions_t.sum()
                if replayed:
                    routed_tK = torch.where(has_t.unsqueeze(1), recorded_tK, own_tK)
            routed_weight_tK = weight_t.unsqueeze(1).expand(-1, self.top_k)
            load_LE[layer].index_add_(0, routed_tK.reshape(-1), routed_weight_tK.reshape(-1))
            p_tE = routing.probabilities(router, logits_tE)
            self.sums_6[0] += -((p_tE * p_tE.clamp(min=1e-30).log()).sum(1) * weight_t).sum()
        self.sums_6[1] += weight_t.sum()
        self.load_LE += load_LE
        return load_LE

    def report(self, group: dist.ProcessGroup | None = None, distributed: bool = False) -> dict[str, float]:
        """The figures, imbalance per layer keyed by decoder layer; an agreement only where routes were recorded."""
        summed = torch.cat([self.load_LE.reshape(-1), self.sums_6])
        if distributed:
            dist.all_reduce(summed, group=group)
        load_LE = summed[: self.load_LE.numel()].view_as(self.load_LE)
        entropy, tokens, agreeing, recorded, agreeing_prompt, recorded_prompt = summed[self.load_LE.numel() :].tolist()
        imbalance_L = load_LE.max(1).values / load_LE.mean(1).clamp(min=1e-12) - 1
        report = {"router_load_imbalance": float(imbalance_L.mean())}
        imbalances = zip(self.layers, imbalance_L.tolist(), strict=True)
        report.update({f"router_load_imbalance_layer_{layer}": value for layer, value in imbalances})
        report["router_entropy"] = entropy / max(tokens * len(load_LE), 1.0)
        if recorded:
            report["routing_agreement"] = agreeing / recorded
        if recorded_prompt:
            report["routing_agreement_prompt"] = agreeing_prompt / recorded_prompt
        return report
