"""The engines' recorded routing (`Completion.routed_experts`): which experts each MoE layer chose at each position,
keyed by decoder layer, as the trainer replays them (steps/model/moe.py:replaying).

Positions run from the prompt's first (`rollout.prompt_routes: all`, the whole prefill) or its last (`last`) to the
response's second to last: position t's forward sampled token t + 1 (the last token is never fed back). The
transformers engine records from its routers (forward hooks); vLLM returns one column per decoder layer (its
`RoutedExpertsCapturer`: each MoE layer writes its column, a dense layer's stays 0), of which the engine keeps the
model's MoE layers' after checking, before anything is sampled, that vLLM captures where the checkpoint has them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from moeloop.steps.errors import MoeloopError
from moeloop.steps.storage.experience import expert_id_type


def expert_id_dtype(num_experts: int) -> np.dtype:
    """The narrowest type that holds every expert id, the experience's (`expert_id_type`)."""
    return np.dtype(expert_id_type(num_experts).to_pandas_dtype())


class RouteRecorder:
    """Records, while active, the top-k experts every MoE router of an HF model picks in each generate step
    (forward hooks on the routers, which return (logits, weights, experts)); off, it does nothing."""

    def __init__(self, model: torch.nn.Module, active: bool, whole_prompt: bool) -> None:
        from moeloop.steps.model.families import is_router

        self.routers = [m for m in model.modules() if is_router(m)] if active else []
        self.whole_prompt = whole_prompt
        self.steps_L: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self.handles: list[Any] = []

    def __enter__(self) -> RouteRecorder:
        for router, steps in zip(self.routers, self.steps_L, strict=True):
            self.handles.append(router.register_forward_hook(lambda _m, _i, out, steps=steps: steps.append(out[2])))
        return self

    def __exit__(self, *_: object) -> None:
        for handle in self.handles:
            handle.remove()

    def routes_BTLK(self, rows: int) -> torch.Tensor | None:
        """[B, T, L, K]: each row's experts at the positions generate ran a forward at. A step's forward routes
        [B * tokens, K]: the prompt at step 0 (all its positions kept, or its last, which sampled the first token),
        then one token per row."""
        if not self.routers:
            return None
        first = slice(None) if self.whole_prompt else slice(-1, None)
        per_layer = [
            torch.cat([step.view(rows, -1, step.shape[-1])[:, first if s == 0 else slice(None)] for s, step in
                       enumerate(steps)], 1)
            for steps in self.steps_L
        ]  # fmt: skip
        return torch.stack(per_layer, 2)


def vllm_route_columns(
    layout: tuple[int, list[int]], moe_layers: tuple[int, ...], decoder_layers: int
) -> tuple[int, ...]:
    """The columns of vLLM's routed experts that hold the checkpoint's MoE layers, from vLLM's capture layout (its
    column count and the decoder layers its MoE layers capture at: `PolicyWeightReload.route_layout`). They are the
    MoE layers' decoder indices; a layout of another layer count or other layers is refused in one line."""
    columns, captured = layout
    if columns != decoder_layers or tuple(captured) != tuple(moe_layers):
        raise MoeloopError(
            f"vLLM records routes in {columns} columns for MoE layers {list(captured)}; the checkpoint has"
            f" {decoder_layers} decoder layers, MoE layers {list(moe_layers)}: its routes would not replay"
        )
    return tuple(moe_layers)


def vllm_completion_routes(
    routed_TLK: np.ndarray | None, columns: tuple[int, ...], positions: int, response_tokens: int
) -> np.ndarray:
    """A vLLM sample's routed experts ([positions, decoder layers, K]) at the MoE layers' columns; a count of
    positions other than the request's is refused (positions: the prompt's from routed_experts_prompt_start, and
    the response's but the last)."""
    if routed_TLK is None or len(routed_TLK) != positions:
        rows = "none" if routed_TLK is None else len(routed_TLK)
        raise MoeloopError(
            f"vLLM returned routed experts for {rows} positions of a {response_tokens}-token response, not {positions}"
        )
    return np.ascontiguousarray(routed_TLK[:, list(columns)])
