"""The config's `algorithm` section: the policy update's objective (steps/rl/README.md gives each term's formula).
Part of the one typed config (steps/config.py), kept apart for its size."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from moeloop.steps.config_base import Strict

KlEstimator = Literal["k1", "k2", "k3", "k3_plus"]


class MismatchConfig(Strict):
    """Drop from the policy loss the tokens (level token) or whole sequences (level sequence, the length-normalised
    ratio) whose trainer/behaviour ratio pi_old / pi_behavior leaves [low, high]; off keeps them all."""

    level: Literal["off", "token", "sequence"] = "off"
    low: float = Field(0.5, gt=0, le=1)
    high: float = Field(2.0, ge=1)


class OverlongConfig(Strict):
    """Responses cut by rollout.max_new_tokens (DAPO; steps/rl/README.md): mask leaves them out of the loss; penalty
    adds to every reward DAPO's soft overlong punishment, -penalty_factor x (the tokens past max_new_tokens -
    buffer_tokens) / buffer_tokens."""

    mode: Literal["off", "mask", "penalty"] = "off"
    buffer_tokens: int | None = Field(None, gt=0)
    penalty_factor: float = Field(1.0, ge=0)


class AlgorithmConfig(Strict):
    """The policy update: GRPO (group advantages, no value model) or PPO (a critic, GAE). README: "Algorithms"."""

    name: Literal["grpo", "ppo"] = "grpo"
    clip_eps: float = Field(0.2, gt=0)  # the ratio's clip range is [1 - clip_eps, 1 + clip_eps_high]
    clip_eps_high: float | None = Field(None, gt=0)  # DAPO clip-higher; None: clip_eps (symmetric)
    # Dual-clip PPO: for a negative advantage the token's loss is at most -c A (verl's clip_ratio_c); None: off.
    dual_clip: float | None = Field(None, gt=1)
    # GRPO: coefficient of the KL(policy || reference) estimate added to the loss. PPO: of the per-token KL penalty
    # subtracted from the token rewards.
    kl_coef: float = Field(0.0, ge=0)
    # The per-token KL estimate kl_coef weighs: k1 log(pi / pi_ref), k2 (log(pi / pi_ref))^2 / 2, k3 r - log r - 1
    # with r = pi_ref / pi, k3_plus k3's value with k2's gradient. Unset: k3 for grpo (in the loss), k1 for ppo (in
    # the rewards). Each token's estimate is clamped to [-kl_clamp, kl_clamp] (None: not clamped).
    kl_estimator: KlEstimator = "k3"
    kl_clamp: float | None = Field(10.0, gt=0)
    # At kl_coef 0 the reference policy feeds only the `kl` metric: it is then measured on the batch's first this
    # many samples (the metrics' kl_samples says on how many), 0: not at all (kl is None, the reference not loaded).
    kl_metric_samples: int = Field(32, ge=0)
    # The policy's mean token entropy, aggregated like the policy loss, times this is subtracted from the loss (an
    # entropy bonus). The `entropy` metric is reported whatever it is.
    entropy_coef: float = Field(0.0, ge=0)
    # GRPO: divide each group's centred rewards by the group's standard deviation.
    scale_rewards: bool = True
    # token: mean over the minibatch's tokens; sequence: mean over each sequence's tokens, then over sequences;
    # dr_grpo: sum over each sequence's tokens / rollout.max_new_tokens, then mean over sequences (Dr. GRPO).
    loss_aggregation: Literal["token", "sequence", "dr_grpo"] = "token"
    # Leave out groups whose rewards are all equal (DAPO's dynamic-sampling filter): the batch shrinks.
    drop_equal_groups: bool = False
    # Decoupled objective: each token's surrogate is weighted by min(pi_old / pi_behavior, cap), the truncated
    # importance weight of the trainer's policy at the start of the update against the one that sampled.
    # None: no weight (pi_old is taken as the behaviour policy).
    behavior_weight_cap: float | None = Field(2.0, gt=0)
    # The clipped ratio pi / pi_old: token; sequence, GSPO's length-normalised sequence ratio (one advantage per
    # sequence, each sequence weighs the same); sequence_token, GSPO-token (token advantages work). The behaviour
    # weights follow: per sequence at both sequence levels. steps/rl/importance.py.
    importance_level: Literal["token", "sequence", "sequence_token"] = "token"
    # A sequence's behaviour weight at the sequence levels, from its tokens' ratios pi_old / pi_behavior: their
    # geometric mean (length-normalised, as GSPO's ratio), or their product (truncated IS over the whole sequence).
    sequence_weight: Literal["geometric", "product"] = "geometric"
    mismatch: MismatchConfig = MismatchConfig()
    overlong: OverlongConfig = OverlongConfig()
    # rollout: the trainer's MoE blocks route each recorded position to the experts the rollout engine chose there
    # (gate weights from the trainer's router at those experts), in pi_old's pass and the update's. steps/model/moe.py.
    routing_replay: Literal["off", "rollout"] = "off"
    # PPO: GAE over the response tokens, the critic's clipped value loss and its optimizer.
    gae_gamma: float = Field(1.0, ge=0, le=1)
    gae_lambda: float = Field(0.95, ge=0, le=1)
    value_clip: float | None = Field(0.2, gt=0)  # None: the value loss is not clipped
    critic_learning_rate: float = Field(1e-3, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _estimator_of_the_algorithm(cls, data: Any) -> Any:
        """An unset kl_estimator is the algorithm's classic one: GRPO's k3 loss, PPO's k1 reward penalty."""
        if isinstance(data, dict) and "kl_estimator" not in data:
            return {**data, "kl_estimator": "k1" if data.get("name") == "ppo" else "k3"}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> AlgorithmConfig:
        if self.loss_aggregation == "dr_grpo" and self.scale_rewards:
            raise ValueError(
                "loss_aggregation dr_grpo uses advantages without std normalisation: set scale_rewards false"
            )
        if self.importance_level == "sequence" and self.name == "ppo":
            raise ValueError("importance_level sequence needs one advantage per sequence: with ppo use sequence_token")
        if self.importance_level == "sequence" and self.loss_aggregation != "sequence":
            raise ValueError("importance_level sequence weighs every sequence the same: set loss_aggregation sequence")
        if self.sequence_weight == "product" and self.importance_level == "token":
            raise ValueError(
                "sequence_weight product weighs whole sequences: it needs importance_level sequence or sequence_token"
            )
        return self
