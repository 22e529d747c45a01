"""The README and the capacity README tell the plan's one story: their plan blocks are what the command prints (the
README's its head, down to the best option; the capacity README's all of it), the handoff section's trainer state
(366 GB, committed in 46 s and fetched in 30 s at one node) is the plan's own input, and the table is narrow, with
EP said to be memory only."""

from __future__ import annotations

import json
import re

from tests.conftest import REPO
from tests.processes import moeloop_cli

COMMAND = "moeloop plan configs/eks.yaml --target configs/plan-qwen3-30b-h200.yaml --deadline 24"
MAX_ROW_CHARS = 132


def plan(*more: str) -> str:
    done = moeloop_cli(*COMMAND.split()[1:], *more)
    assert done.returncode == 0, done.stderr
    return done.stdout


def block_after(text: str, opening: str) -> str:
    """The fenced block that starts at `opening` (its first line included)."""
    start = text.index(opening)
    return text[start : text.index("```", start)]


def test_the_readmes_plan_blocks_are_the_commands_output() -> None:
    printed = plan()
    lines = printed.splitlines()
    head = lines[: next(i for i, line in enumerate(lines) if line.startswith("best (")) + 1]
    readme = (REPO / "README.md").read_text()
    assert block_after(readme, f"$ {COMMAND}\n") == "\n".join([f"$ {COMMAND}", *head]) + "\n"
    capacity = (REPO / "workflows" / "capacity" / "README.md").read_text()
    assert block_after(capacity, "plan for family table: qwen3-30b-a3b") == printed


def test_the_handoff_sections_trainer_state_is_the_plans_input() -> None:
    inputs = json.loads(plan("-o", "json"))["inputs"]
    state_gb, seconds_per_gb = inputs["trainer_state_gb"]["value"], inputs["trainer_state_seconds_per_gb"]["value"]
    readme = (REPO / "README.md").read_text()
    [size] = re.findall(r"Qwen3-30B-A3B's is (\d+) GB", readme)
    [(commit, fetch)] = re.findall(r"the trainer's own chain: (\d+) s\s+and (\d+) s for Qwen3-30B-A3B", readme)
    assert int(size) == round(state_gb) == 366
    assert int(commit) + int(fetch) == round(state_gb * seconds_per_gb) == 76  # at one node
    assert f"its {size} GB at {seconds_per_gb:g} s/GB a node, the {commit} + {fetch} s" in " ".join(readme.split())


def test_the_table_is_narrow_and_says_ep_is_memory_only() -> None:
    lines = plan().splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("rollout (Spot)"))
    rows = lines[header : next(i for i, line in enumerate(lines) if line.startswith("path A: "))]
    assert len(rows) >= 4 and max(len(row) for row in rows) <= MAX_ROW_CHARS
    assert rows[0].split()[5:7] == ["EP", "staleness"]
    assert any(line.startswith("EP: ") and "Memory only" in line for line in lines)
