"""A tiny tool environment written with verifiers' own classes, as a user writes one for the Environments Hub: the
tests import it through PYTHONPATH (tests/environments), as the rollout image imports an installed environment.

Questions ask for a sum; the policy may call `add`, whose result comes back in a tool message; the rubric scores the
last assistant message's number against the answer. `wait` hangs, for the tool time limit's test.
"""

from __future__ import annotations

import re
import time

import verifiers as vf
from datasets import Dataset


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def wait(seconds: int) -> str:
    """Wait, then say so.

    Args:
        seconds: How long to wait.
    """
    time.sleep(seconds)
    return "waited"


def questions(count: int, seed: int) -> Dataset:
    rows = []
    for index in range(count):
        a, b = (seed * 7 + index * 3) % 10, (seed * 3 + index * 5) % 10
        rows.append({"question": f"{a}+{b}", "answer": str(a + b)})
    return Dataset.from_list(rows)


def correct_sum(completion: vf.Messages, answer: str) -> float:
    """1.0 when the last assistant message's last number is the answer."""
    said = [m.content for m in completion if m.role == "assistant" and isinstance(m.content, str)]
    numbers = re.findall(r"-?\d+", said[-1]) if said else []
    return float(bool(numbers) and numbers[-1] == answer)


def load_environment(train_size: int = 64, eval_size: int = 16, max_turns: int = 3) -> vf.Environment:
    return vf.ToolEnv(
        dataset=questions(train_size, seed=0),
        eval_dataset=questions(eval_size, seed=1),
        tools=[add, wait],
        rubric=vf.Rubric(funcs=[correct_sum]),
        max_turns=max_turns,
    )
