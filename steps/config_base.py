"""The base of every config model: the run config's sections (steps/config.py, config_cluster.py, config_model.py,
config_reward.py, config_task.py) and the capacity planner's target (workflows/capacity/target.py)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    # No NaN or infinity anywhere: `.nan` in a weight would make every reward NaN, `.inf` a learning rate.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
