"""Reward functions that misbehave, for the tests of tests/faults/ and tests/unit/test_reward_pool.py. A config
selects one by its import path (`tests.faulty_rewards:nan_on_train`), as it would a real one; the steps' reward
workers import it from the repo.

The eval prompts of tests/faults/test_hostile_input.py carry `"eval": true`, so that evaluation scores them normally:
the fault is met by the reward step, after a real evaluation has written its metrics.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from moeloop.steps.demo_task import reverse_positions


def nan_on_train(record: dict, response: str) -> float:
    return reverse_positions(record, response) if record.get("eval") else float("nan")


def text_on_train(record: dict, response: str) -> object:
    return reverse_positions(record, response) if record.get("eval") else "good"


def huge(record: dict, response: str) -> float:
    """Finite, but its square is not in float32: PPO's value loss overflows."""
    return 1e30


# Every way a reward function can fail to return a reward (tests/unit/test_reward_pool.py): each ends as one line
# naming it, the sample and the step, or as a counted 0 under reward.on_error zero. They misbehave only on records
# marked "fault": true, so one batch can mix them with samples that score.


def hangs(record: dict, response: str) -> float:
    if record.get("fault"):
        time.sleep(3600)
    return 1.0


def kills_its_process(record: dict, response: str) -> float:
    if record.get("fault"):
        os.kill(os.getpid(), signal.SIGKILL)
    return 1.0


def exits(record: dict, response: str) -> float:
    if record.get("fault"):
        sys.exit(0)
    return 1.0


def exits_at_once(record: dict, response: str) -> float:
    if record.get("fault"):
        os._exit(0)
    return 1.0


def nan(record: dict, response: str) -> float:
    return float("nan") if record.get("fault") else 1.0


def raises(record: dict, response: str) -> float:
    if record.get("fault"):
        raise ValueError("no answer to check against")
    return 1.0


def record_says(record: dict, response: str) -> float:
    """The reward the record carries, whatever the response: known pass/fail figures for the evaluation's tests."""
    return float(record["reward"])
