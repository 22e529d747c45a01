"""An episode's tokens as the chat template gives them, without re-encoding what came before: the tokens of the
messages an environment adds after an assistant turn, and of an assistant turn itself. The rollouts' client builds
each turn's prompt with the first (steps/episodes/client.py); the tiny model's SFT on reference episodes builds its
sequences with both, so it trains on the very layout the rollouts sample in.

Each is rendered after a fixed conversation: only what the template puts after an assistant turn's end token (and
before the next generation prompt) is taken, whatever was said before it.
"""

from __future__ import annotations

from typing import Any

from moeloop.steps.errors import MoeloopError
from moeloop.steps.prompting import ChatSettings, render_text

BASE_USER = {"role": "user", "content": "-"}
BASE_ASSISTANT = "-"


def environment_tokens(tokenizer: Any, chat: ChatSettings, added: list[dict[str, Any]], end_token: int) -> list[int]:
    """The tokens of the messages the environment added after an assistant turn that ended with end_token: what the
    template renders after that token, up to and with the next assistant turn's generation prompt."""
    base = render_text(tokenizer, [BASE_USER], chat, response=BASE_ASSISTANT)
    whole = render_text(tokenizer, [BASE_USER, {"role": "assistant", "content": BASE_ASSISTANT}, *added], chat)
    if not whole.startswith(base):
        raise MoeloopError("the chat template renders a conversation's start differently once it goes on")
    end_text = tokenizer.decode([end_token])
    cut = base.rfind(end_text)
    cut = cut + len(end_text) if cut >= 0 else len(base)
    return tokenizer(whole[cut:], add_special_tokens=False)["input_ids"]


def assistant_tokens(tokenizer: Any, chat: ChatSettings, message: dict[str, Any], end_token: int) -> list[int]:
    """The tokens of an assistant turn (its content and tool calls) as the template renders it after its generation
    prompt, ending with end_token: what the policy samples for it."""
    prompt = render_text(tokenizer, [BASE_USER], chat)
    whole = render_text(tokenizer, [BASE_USER, message], chat)
    if not whole.startswith(prompt):
        raise MoeloopError("the chat template renders an assistant turn differently from its generation prompt")
    end_text = tokenizer.decode([end_token])
    turn = whole[len(prompt) :]
    if end_text not in turn:
        raise MoeloopError(f"the chat template ends an assistant turn without {end_text!r}")
    return tokenizer(turn[: turn.index(end_text)], add_special_tokens=False)["input_ids"] + [end_token]


def episode_tokens(
    tokenizer: Any, chat: ChatSettings, completion: list[dict[str, Any]], end_token: int
) -> tuple[list[int], list[int]]:
    """(the response tokens, their mask: 1 on the policy's) of a reference episode after its prompt: its assistant
    turns and the environment's messages between them, laid out as the rollouts lay out a sampled episode. Messages
    after the last assistant turn are not part of it (nothing is sampled after them)."""
    tokens: list[int] = []
    mask: list[int] = []
    added: list[dict[str, Any]] = []
    for message in completion:
        if message["role"] != "assistant":
            added.append(message)
            continue
        if added:
            if not tokens:
                raise MoeloopError("a reference episode starts with the environment's messages, not an assistant turn")
            inserted = environment_tokens(tokenizer, chat, added, end_token)
            tokens += inserted
            mask += [0] * len(inserted)
            added = []
        said = assistant_tokens(tokenizer, chat, message, end_token)
        tokens += said
        mask += [1] * len(said)
    return tokens, mask
