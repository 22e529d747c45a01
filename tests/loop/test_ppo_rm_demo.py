"""The PPO demo with a reward model learns (tests/loop/test_ppo_demo.py:check_ppo_demo_learns)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.loop.test_ppo_demo import check_ppo_demo_learns


def test_ppo_rm_demo_learns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    check_ppo_demo_learns("tiny-ppo-rm.yaml", tmp_path, monkeypatch)
