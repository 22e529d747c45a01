"""The vLLM log lines a rollout's log leaves out (steps/engines/vllm_logs.py): the rotary embedding's "Failed to
load weights" on each in-place reload, "Triton is not installed" from vLLM's CPU platform while it is, and the chat
warm-up's traceback of an engine without a tokenizer. Checked
against the installed vLLM's own source (its modules log these very lines, from the loggers the filter is on) and
through those loggers, without importing vLLM (which takes a minute here)."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from moeloop.steps.engines.vllm_logs import MISLEADING_LINES, quiet_misleading_lines


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def captured() -> Iterator[Captured]:
    """The loggers' lines, their filters taken off for the test (an engine built earlier in this process installed
    them) and put back after."""
    handler = Captured()
    loggers = [logging.getLogger(name) for name, _, _ in MISLEADING_LINES]
    installed = [logger.filters for logger in loggers]
    for logger in loggers:
        logger.filters = []
        logger.addHandler(handler)
    yield handler
    for logger, filters in zip(loggers, installed, strict=True):
        logger.removeHandler(handler)
        logger.filters = filters


def test_the_installed_vllm_logs_these_lines_from_these_loggers() -> None:
    root = Path(importlib.util.find_spec("vllm").origin).parent
    for name, message, _ in MISLEADING_LINES:
        source = (root.parent / (name.replace(".", "/") + ".py")).read_text()
        assert "logger = init_logger(__name__)" in source, name
        assert message in " ".join(source.replace('"\n', "").replace('    "', "").split()), (name, message)


def test_only_the_misleading_lines_are_dropped(captured: Captured) -> None:
    layerwise, cpu, renderer = (logging.getLogger(name) for name, _, _ in MISLEADING_LINES)

    def log_all() -> None:
        layerwise.warning("%s: Failed to load weights", "RotaryEmbedding")
        layerwise.warning("%s: Failed to load weights", "QKVParallelLinear")  # a real failure: kept
        cpu.warning("Triton is not installed. triton-cpu is expected on x86 CPUs.")
        cpu.warning("some other CPU platform warning")
        try:
            raise ValueError("no tokenizer")
        except ValueError:
            renderer.warning("Chat template warmup failed", exc_info=True)

    log_all()
    assert len(captured.lines) == 5
    captured.lines.clear()
    quiet_misleading_lines()
    quiet_misleading_lines()  # idempotent: one filter per logger
    log_all()
    assert captured.lines == ["QKVParallelLinear: Failed to load weights", "some other CPU platform warning"]
    assert all(len(logging.getLogger(name).filters) == 1 for name, _, _ in MISLEADING_LINES)
