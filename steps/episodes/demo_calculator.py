"""The episodes demo's environment (configs/tiny-tools.yaml), written with verifiers' classes as users write theirs:
sums of two two-digit numbers, which the tiny model cannot work out but can ask its `add` tool for. An episode the
policy gets right calls `add` with the question's numbers, reads the tool's result, and answers it; the rubric gives
1.0 to a last answer that is the sum. Each record carries that reference episode (`completion`), which the tiny
model's SFT trains on: it learns the format, and the loop learns to use it right.
"""

from __future__ import annotations

import random

import verifiers as vf
from datasets import Dataset


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def sums(pairs: list[tuple[int, int]]) -> Dataset:
    """The questions, their answers and their reference episodes."""
    rows = []
    for a, b in pairs:
        call = {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
        rows.append(
            {
                "question": f"{a}+{b}",
                "answer": str(a + b),
                "completion": [
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "content": str(a + b), "tool_call_id": "call_0"},
                    {"role": "assistant", "content": str(a + b)},
                ],
            }
        )
    return Dataset.from_list(rows)


def answered_sum(completion: vf.Messages, answer: str) -> float:
    """1.0 when the episode's last assistant message is the sum, nothing else."""
    said = [m.content for m in completion if m.role == "assistant" and isinstance(m.content, str) and m.content]
    return float(bool(said) and said[-1].strip() == answer)


def load_environment(train_size: int = 2000, eval_size: int = 256, seed: int = 0, max_turns: int = 3) -> vf.Environment:
    """Train and eval questions drawn without overlap from the 8,100 pairs, as a function of seed."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    return vf.ToolEnv(
        dataset=sums(pairs[eval_size : eval_size + train_size]),
        eval_dataset=sums(pairs[:eval_size]),
        tools=[add],
        rubric=vf.Rubric(funcs=[answered_sum]),
        max_turns=max_turns,
    )
