"""Prompts as the model sees them: a record's prompt rendered into token ids (a string as it is, messages through
the checkpoint's chat template), the checkpoint's end tokens, and start's check of every prompt against the model.

Rollout, evaluate, the reward models and the tiny model's SFT all render through `render_prompt`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from moeloop.steps.config import MoeloopConfig
from moeloop.steps.errors import MoeloopError


@dataclass(frozen=True)
class ChatSettings:
    """What the config adds to a messages prompt: task.system_prompt and rollout.chat_template_kwargs; and an
    environment's tools (OpenAI's function schemas), which the template shows the model (steps/episodes/)."""

    system_prompt: str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None

    @classmethod
    def of(cls, config: MoeloopConfig) -> ChatSettings:
        tools = None
        if config.rollout.environment is not None:  # every render shows the model the tools, as the rollouts do
            from moeloop.steps.episodes.environment import cached_environment, tool_schemas

            tools = tool_schemas(cached_environment(config.rollout.environment.model_dump_json()))
        return cls(config.task.system_prompt, dict(config.rollout.chat_template_kwargs), tools)


def render_prompt(
    tokenizer: Any, prompt: str | list[dict[str, str]], chat: ChatSettings, response: str | None = None
) -> tuple[str, list[int]]:
    """(text, token ids) of a record's prompt as the model reads it before its response. A string goes as it is (with
    the special tokens the tokenizer adds to any text, e.g. a BOS); messages through the tokenizer's chat template
    with its generation prompt, chat.system_prompt first where they have no system message of their own, and
    chat.template_kwargs: the ids are apply_chat_template's. With response (a reward model's input): the prompt and
    the response as one conversation, the response as the assistant's turn."""
    text = render_text(tokenizer, prompt, chat, response)
    return text, tokenizer(text, add_special_tokens=isinstance(prompt, str))["input_ids"]


def render_text(
    tokenizer: Any, prompt: str | list[dict[str, str]], chat: ChatSettings, response: str | None = None
) -> str:
    """render_prompt's text alone."""
    if isinstance(prompt, str):
        return prompt if response is None else prompt + response
    if not getattr(tokenizer, "chat_template", None):
        raise MoeloopError("a messages prompt, and the tokenizer has no chat template")
    messages = list(prompt)
    if chat.system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": chat.system_prompt})
    if response is not None:
        messages.append({"role": "assistant", "content": response})
    try:
        return tokenizer.apply_chat_template(
            messages, tools=chat.tools, tokenize=False, add_generation_prompt=response is None, **chat.template_kwargs
        )
    except (TemplateError, ValueError, TypeError, KeyError) as error:
        raise MoeloopError(f"the chat template fails on it: {type(error).__name__}: {error}") from None


def sft_episode(record: dict[str, Any]) -> list[dict[str, Any]] | None:
    """A record's reference episode after its prompt (`completion`: messages, as conversational SFT sets hold it),
    which the tiny model's SFT trains on where a record has one (steps/episodes/transcript.py)."""
    completion = record.get("completion")
    if isinstance(completion, list) and any(isinstance(m, dict) and m.get("role") == "assistant" for m in completion):
        return completion
    return None


def sft_answer(record: dict[str, Any]) -> str | None:
    """What the tiny model's SFT trains a record's response on: its `answer`, else verl's
    reward_model.ground_truth (a reasoning-gym record's answer), where a string."""
    answer, verifier = record.get("answer"), record.get("reward_model")
    if not isinstance(answer, str) and isinstance(verifier, dict):
        answer = verifier.get("ground_truth")
    return answer if isinstance(answer, str) else None


def end_token_ids(checkpoint_dir: Path, tokenizer: Any) -> list[int]:
    """Every token that ends a response, as the model was trained to end it: its generation_config.json's
    eos_token_id (one or a list; config.json's where that file is missing), and the tokenizer's EOS."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        if (checkpoint_dir / name).exists():
            found = json.loads((checkpoint_dir / name).read_text()).get("eos_token_id")
            ids += [found] if isinstance(found, int) else list(found or [])
            break
    ids += [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if not ids:
        raise MoeloopError(f"checkpoint {checkpoint_dir} names no end token (eos_token_id) to stop a response at")
    return list(dict.fromkeys(ids))


@dataclass(frozen=True)
class FittedPrompts:
    records: list[dict[str, Any]]
    dropped: int  # longer than rollout.max_prompt_tokens


def fit_prompts(
    records: list[dict[str, Any]], rows: list[str], tokenizer: Any, positions: int, config: MoeloopConfig, what: str
) -> FittedPrompts:
    """The records whose rendered prompt the model can read and answer; rows names where each came from (file and
    row). One longer than rollout.max_prompt_tokens is dropped; one that renders to no token, or leaves fewer than
    rollout.max_new_tokens of the model's positions (rollout.vllm.max_model_len's where smaller), is an error naming
    it; what: the model, as the errors name it."""
    rollout = config.rollout
    limit, answer = rollout.max_prompt_tokens, rollout.max_new_tokens
    positions = min(positions, rollout.vllm.max_model_len or positions)
    if limit is not None and limit + answer > positions:
        raise MoeloopError(
            f"rollout.max_prompt_tokens {limit} + max_new_tokens {answer} is more than {what}'s {positions} positions"
        )
    chat = ChatSettings.of(config)
    # No token stands for more characters than the vocabulary's longest (a byte-level BPE's: bytes): a text longer
    # than the tokens it may have times that (twice, for normalizers) is too long without encoding it (a 10 MB prompt
    # would take 4 GB and 14 s to encode with the tiny model's tokenizer).
    longest = 2 * max(map(len, tokenizer.get_vocab()))
    most = limit if limit is not None else positions - answer  # the tokens a prompt may have
    kept = []
    for record, row in zip(records, rows, strict=True):
        try:
            text = render_text(tokenizer, record["prompt"], chat)
        except MoeloopError as error:
            raise MoeloopError(f"{row}: {error} ({what})") from None
        unencoded = len(text) > most * longest  # it has more than `most` tokens, whatever they are
        if unencoded:
            length = max(len(text) // longest, most + 1)  # at least
        else:
            length = len(tokenizer(text, add_special_tokens=isinstance(record["prompt"], str))["input_ids"])
        if not length:
            raise MoeloopError(f"{row}: the prompt renders to no token ({what})")
        if limit is not None and length > limit:
            continue
        if length + answer > positions:
            raise MoeloopError(
                f"{row}: a prompt of {'at least ' if unencoded else ''}{length} tokens"
                f" ({len(text)} characters), which with rollout.max_new_tokens {answer} does not fit {what}'s"
                f" {positions} positions (rollout.max_prompt_tokens drops such prompts)"
            )
        kept.append(record)
    return FittedPrompts(kept, len(records) - len(kept))
