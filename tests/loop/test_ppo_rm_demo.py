"""The PPO demo with a reward model learns (tests/unit/test_ppo.py:check_ppo_demo_learns)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_ppo import check_ppo_demo_learns


@pytest.mark.slow
def test_ppo_rm_demo_learns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    check_ppo_demo_learns("tiny-ppo-rm.yaml", tmp_path, monkeypatch)
