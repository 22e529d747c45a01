"""Responses cut by rollout.max_new_tokens, as DAPO treats them (algorithm.overlong; steps/rl/README.md): left out of
the policy loss (mode mask, DAPO's overlong filtering, in steps/rl/update.py), or penalised by their length (mode
penalty, DAPO's soft overlong punishment, added to the reward by the reward step)."""

from __future__ import annotations

from moeloop.steps.config_algorithm import OverlongConfig


def overlong_penalty(response_tokens: int, max_new_tokens: int, settings: OverlongConfig) -> float:
    """DAPO's soft overlong punishment, as verl's DAPORewardManager.__call__ computes it: 0 for a response of up to
    max_new_tokens - buffer_tokens tokens, then falling linearly to -penalty_factor at max_new_tokens (0 unless mode
    is penalty)."""
    if settings.mode != "penalty" or settings.buffer_tokens is None:
        return 0.0
    past = response_tokens - (max_new_tokens - settings.buffer_tokens)
    return min(-past / settings.buffer_tokens * settings.penalty_factor, 0.0)
