"""Reward functions that misbehave, for the tests of tests/faults/test_hostile_input.py. A config selects one by its
import path (`tests.faulty_rewards:nan_on_train`), as it would a real one; the steps import it from the repo.

The eval prompts of those tests carry `"eval": true`, so that evaluation scores them normally: the fault is met
by the reward step, after a real evaluation has written its metrics.
"""

from __future__ import annotations

from moeloop.steps.demo_task import reverse_positions


def nan_on_train(record: dict, response: str) -> float:
    return reverse_positions(record, response) if record.get("eval") else float("nan")


def text_on_train(record: dict, response: str) -> object:
    return reverse_positions(record, response) if record.get("eval") else "good"


def huge(record: dict, response: str) -> float:
    """Finite, but its square is not in float32: PPO's value loss overflows."""
    return 1e30
