"""The filter of vLLM's log lines that would mislead a reader of a rollout's log, set in the engine's process
(steps/engines/engine.py) and in vLLM's worker (steps/engines/vllm_extension.py). It imports nothing of vLLM."""

from __future__ import annotations

import logging

# (logger, the line's format, its first argument): vLLM lines that are false or expected of moeloop's use.
# - An in-place reload (every iteration of a local worker's engine) warns for each layer whose tensors are all
#   computed, not loaded: the rotary embedding's cos/sin cache. vLLM keeps it as it was, which is right.
# - vLLM's CPU platform says "Triton is not installed" whenever the installed triton has no CPU backend (the
#   triton wheel here has none; the tests use its interpreter); vLLM then runs its own CPU kernels.
# - The engine has no tokenizer (skip_tokenizer_init: prompts go in as moeloop's token ids), so vLLM's warm-up of
#   chat rendering fails, harmlessly, and logs the traceback.
MISLEADING_LINES = (
    ("vllm.model_executor.model_loader.reload.layerwise", "%s: Failed to load weights", "RotaryEmbedding"),
    ("vllm.platforms.cpu", "Triton is not installed. triton-cpu is expected on x86 CPUs.", None),
    ("vllm.renderers.base", "Chat template warmup failed", None),
)


class MisleadingLines(logging.Filter):
    def __init__(self, message: str, argument: str | None):
        super().__init__()
        self.message, self.argument = message, argument

    def filter(self, record: logging.LogRecord) -> bool:
        first = record.args[0] if isinstance(record.args, tuple) and record.args else None
        return not (record.msg == self.message and (self.argument is None or first == self.argument))


def quiet_misleading_lines() -> None:
    """Drop MISLEADING_LINES where vLLM logs them (once per logger: a filter is added only where none is)."""
    for name, message, argument in MISLEADING_LINES:
        logger = logging.getLogger(name)
        if not any(isinstance(f, MisleadingLines) and f.message == message for f in logger.filters):
            logger.addFilter(MisleadingLines(message, argument))
