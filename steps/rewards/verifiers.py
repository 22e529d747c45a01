"""Built-in reward functions, named in the config by import path like any other:

- `moeloop.steps.rewards.verifiers:math_verify`: 1.0 when the response's answer equals the record's ground truth as
  mathematics (`\\boxed{\\frac{1}{2}}` against `0.5`), by HF's math-verify (`pip install 'moeloop[math]'`), else 0.0;
- `moeloop.steps.rewards.verifiers:format_tags`: 1.0 when the response is exactly the required tags' blocks, in
  order (`<think>...</think><answer>...</answer>` by default), else 0.0.

reasoning-gym's scorer is `moeloop.steps.rewards.reasoning_gym:score`.
"""

from __future__ import annotations

import logging
import re
from functools import cache
from typing import Any

BOXED = "\\boxed{"


def ground_truth(record: dict[str, Any]) -> str:
    """The record's reference answer: verl's reward_model.ground_truth, else a `ground_truth` or `answer` field."""
    reward_model = record.get("reward_model")
    if isinstance(reward_model, dict) and reward_model.get("ground_truth") is not None:
        return str(reward_model["ground_truth"])
    for key in ("ground_truth", "answer"):
        if record.get(key) is not None:
            return str(record[key])
    raise ValueError("the record has no reward_model.ground_truth, ground_truth or answer")


def last_boxed(text: str) -> str | None:
    """The last `\\boxed{...}` of text, braces balanced, or None."""
    start = text.rfind(BOXED)
    if start < 0:
        return None
    depth = 0
    for end in range(start + len(BOXED) - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return text[start : end + 1]
    return None


@cache
def math_parsers() -> tuple[Any, Any, Any]:
    """(parse, verify, the response's extraction targets) of math-verify, imported on first use."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # a warning for every response without an answer
    return parse, verify, (LatexExtractionConfig(), ExprExtractionConfig())


def math_verify(record: dict[str, Any], response: str) -> float:
    """The answer is the response's last `\\boxed{}`, else what math-verify finds as its final answer (`the final
    answer is 72`, the last number); the ground truth is read as the content of a `\\boxed{}`, as verl's math-verify
    reward reads it. A ground truth math-verify finds no answer in is an error (the record is wrong, not the
    response)."""
    parse, verify, targets = math_parsers()
    truth = ground_truth(record)
    gold = parse(f"{BOXED}{truth}}}", targets)
    if not gold:
        raise ValueError(f"math-verify finds no answer in the ground truth {truth!r}")
    answer = parse(last_boxed(response) or response, targets)
    return float(bool(answer) and verify(gold, answer))


def format_tags(record: dict[str, Any], response: str, tags: tuple[str, ...] = ("think", "answer")) -> float:
    """1.0 when the response is the tags' blocks in order, `<tag>...</tag>` each, whitespace alone between and around
    them (DeepSeek-R1's format reward, for any tags); else 0.0."""
    return float(tag_pattern(tuple(tags)).fullmatch(response) is not None)  # the config gives a list


@cache
def tag_pattern(tags: tuple[str, ...]) -> re.Pattern[str]:
    blocks = r"\s*".join(rf"<{re.escape(tag)}>.*?</{re.escape(tag)}>" for tag in tags)
    return re.compile(rf"\s*{blocks}\s*", re.DOTALL)
