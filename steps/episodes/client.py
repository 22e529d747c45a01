"""A `verifiers` client over moeloop's engine: an environment's episodes sample from the policy token in, token out.

verifiers drives each episode (its environment's turns, tools and stop conditions) and asks its client for each of the
policy's turns with the conversation so far as messages. This client never re-encodes what was sampled: a turn's
prompt is the previous turn's prompt and sampled tokens, as the engine gave them, and then the tokens of the messages
the environment added, rendered by the checkpoint's chat template as a continuation of an assistant turn
(steps/episodes/transcript.py). So the trainer sees exactly the tokens sampled and inserted.

The episodes' requests are batched: the engine generates once every live episode waits for its next turn (or has
ended), the requests in episode order, so a shard's samples do not depend on how long its tools took.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

import verifiers as vf

from moeloop.steps.config import derive_seed
from moeloop.steps.engines.engine import Completion, Engine, Sampling
from moeloop.steps.episodes.environment import tool_schema
from moeloop.steps.episodes.transcript import environment_tokens
from moeloop.steps.errors import MoeloopError
from moeloop.steps.prompting import ChatSettings, render_prompt

EPISODE = "moeloop_episode"  # the sampling argument that names a request's episode (its index in the shard)


@dataclass(frozen=True)
class Turn:
    """One of the policy's turns: what it read, the environment's tokens added before it, and what it sampled."""

    prompt_ids: list[int]
    environment_ids: list[int]  # after the previous turn's sampled tokens (empty on the first turn)
    completion: Completion
    model_seconds: float  # the engine's generate call that sampled it (shared by its batch)
    environment_seconds: float  # from the previous turn's return to this request: the environment's turn


@dataclass
class Request:
    episode: int
    prompt_ids: list[int]
    max_new_tokens: int
    future: asyncio.Future


class EngineClient(vf.Client):
    """`verifiers` asks it for the policy's turns (`get_response`); `turn(response.id)` gives back each turn's tokens.

    context_tokens: the engine's positions; episode_tokens: what an episode may add after its prompt (None: no limit
    but the context). A turn that would start with no room left ends the episode as too long (verifiers'
    OverlongPromptError)."""

    def __init__(
        self,
        engine: Engine,
        sampling: Sampling,
        chat: ChatSettings,
        context_tokens: int,
        episode_tokens: int | None,
    ):
        super().__init__(engine)
        self.engine, self.sampling, self.chat = engine, sampling, chat
        self.context_tokens, self.episode_tokens = context_tokens, episode_tokens
        self.tokenizer = engine.tokenizer
        self.end_token_ids = set(engine.end_tokens)
        self.turns: dict[str, Turn] = {}
        self.first_prompt: dict[int, int] = {}  # episode -> its prompt's length
        self.returned_at: dict[int, float] = {}  # episode -> when its last turn went back to the environment
        self.live = 0  # episodes started and not ended (`episode_started`, `episode_ended`)
        self.pending: list[Request] = []
        self.flushes = 0

    def episode_started(self) -> None:
        self.live += 1

    def episode_ended(self) -> None:
        self.live -= 1
        self.maybe_generate()

    def turn(self, response_id: str) -> Turn:
        return self.turns[response_id]

    def setup_client(self, config: Any) -> Engine:
        raise MoeloopError("the engine client wraps an engine; it is not configured from a ClientConfig")

    async def to_native_tool(self, tool: vf.Tool) -> dict[str, Any]:
        return tool_schema(tool)

    async def to_native_prompt(self, messages: vf.Messages) -> tuple[list[dict[str, Any]], dict]:
        return [template_message(m) for m in messages], {}

    async def get_native_response(
        self, prompt: list[dict[str, Any]], model: str, sampling_args: dict, tools: list | None = None, **kwargs: Any
    ) -> tuple[Turn, list[dict[str, Any]], list | None]:
        episode = sampling_args[EPISODE]
        asked = time.perf_counter()
        prompt_ids, environment_ids = self.prompt_tokens(kwargs["state"], prompt, tools)
        if episode not in self.first_prompt:
            self.first_prompt[episode] = len(prompt_ids)
        room = self.context_tokens - len(prompt_ids)
        if self.episode_tokens is not None:
            room = min(room, self.episode_tokens - (len(prompt_ids) - self.first_prompt[episode]))
        if room <= 0:
            raise vf.OverlongPromptError(f"episode {episode}: no tokens left for another turn")
        request = Request(
            episode, prompt_ids, min(room, self.sampling.max_new_tokens), asyncio.get_running_loop().create_future()
        )
        self.pending.append(request)
        self.maybe_generate()
        completion, model_seconds = await request.future
        environment_seconds = asked - self.returned_at[episode] if episode in self.returned_at else 0.0
        self.returned_at[episode] = time.perf_counter()
        return Turn(prompt_ids, environment_ids, completion, model_seconds, environment_seconds), prompt, tools

    def prompt_tokens(self, state: Any, messages: list[dict[str, Any]], tools: list | None) -> tuple[list, list]:
        """(the turn's prompt ids, those of them the environment added since the previous turn's sampled tokens)."""
        trajectory = state["trajectory"]
        if not trajectory:
            return render_prompt(self.tokenizer, messages, replace(self.chat, tools=tools))[1], []
        previous = self.turns[trajectory[-1]["response"].id]
        seen = len(trajectory[-1]["prompt"]) + len(trajectory[-1]["completion"])
        if previous.completion.token_ids[-1:] and previous.completion.token_ids[-1] not in self.end_token_ids:
            raise vf.OverlongPromptError("the previous turn ended without an end token: the episode cannot go on")
        chat = replace(self.chat, tools=tools)
        environment_ids = environment_tokens(self.tokenizer, chat, messages[seen:], previous.completion.token_ids[-1])
        return previous.prompt_ids + previous.completion.token_ids + environment_ids, environment_ids

    def maybe_generate(self) -> None:
        """Generate once every live episode waits: its requests in episode order, one engine call per length limit."""
        if not self.pending or len(self.pending) < self.live:
            return
        requests, self.pending = sorted(self.pending, key=lambda r: r.episode), []
        self.flushes += 1
        for limit in sorted({r.max_new_tokens for r in requests}):
            batch = [r for r in requests if r.max_new_tokens == limit]
            seed = derive_seed(self.sampling.seed, "turns", self.flushes, limit)
            sampling = replace(self.sampling, n=1, max_new_tokens=limit, seed=seed)
            started = time.perf_counter()
            try:
                completions = self.engine.generate([r.prompt_ids for r in batch], sampling)
            except Exception as error:  # every waiting episode hears of it
                for request in batch:
                    request.future.set_exception(error)
                continue
            seconds = time.perf_counter() - started
            for request, (completion,) in zip(batch, completions, strict=True):
                request.future.set_result((completion, seconds))

    async def raise_from_native_response(self, response: tuple) -> None:
        return None

    async def from_native_response(self, response: tuple[Turn, list[dict[str, Any]], list | None]) -> vf.Response:
        turn, prompt, tools = response
        completion = turn.completion
        message = self.parse(completion.token_ids, turn.prompt_ids, tools)
        response_id = uuid.uuid4().hex
        self.turns[response_id] = turn
        calls = message.get("tool_calls") or None
        finish = {"stop": "stop", "stop_string": "stop", "length": "length"}[completion.finish_reason]
        return vf.Response(
            id=response_id,
            created=int(time.time()),
            model=self.engine.name,
            usage=vf.Usage(
                prompt_tokens=len(turn.prompt_ids),
                reasoning_tokens=0,
                completion_tokens=len(completion.token_ids),
                total_tokens=len(turn.prompt_ids) + len(completion.token_ids),
            ),
            message=vf.ResponseMessage(
                content=message.get("content"),
                reasoning_content=message.get("thinking") or message.get("reasoning_content"),
                tool_calls=[tool_call(call, index) for index, call in enumerate(calls or [])] or None,
                finish_reason="tool_calls" if calls and finish == "stop" else finish,
                is_truncated=finish == "length",
                tokens=vf.ResponseTokens(
                    prompt_ids=turn.prompt_ids,
                    prompt_mask=[0] * len(turn.prompt_ids),
                    completion_ids=completion.token_ids,
                    completion_mask=[1] * len(completion.token_ids),
                    completion_logprobs=completion.logprobs,
                ),
            ),
        )

    def parse(self, token_ids: list[int], prompt_ids: list[int], tools: list | None) -> dict[str, Any]:
        """The sampled turn as a message: by the checkpoint's response template (its tokenizer's
        `response_template`, transformers' `parse_response`: content, tool calls) where it has one; else its text
        alone, which an environment with tools cannot use. A turn the template cannot read (a malformed call) is its
        text alone."""
        if getattr(self.tokenizer, "response_template", None) is None:
            if tools:
                raise MoeloopError(
                    "the environment has tools, and the checkpoint's tokenizer has no response_template to parse the"
                    " policy's tool calls with (transformers' parse_response): add one to its tokenizer_config.json"
                )
            return {"content": self.tokenizer.decode(token_ids, skip_special_tokens=True)}
        if token_ids and token_ids[-1] in self.end_token_ids:  # the turn's end, not its content
            token_ids = token_ids[:-1]
        text = self.tokenizer.decode(token_ids)
        try:
            return self.tokenizer.parse_response(text, prefix=self.tokenizer.decode(prompt_ids), tools=tools)
        except ValueError:  # a malformed call: the turn is its text, and calls nothing (as vLLM's tool parsers do)
            return {"content": self.tokenizer.decode(token_ids, skip_special_tokens=True)}

    async def close(self) -> None:
        return None


def template_message(message: Any) -> dict[str, Any]:
    """A verifiers message as chat templates take it: OpenAI's shape, tool calls' arguments as a dict."""
    data = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)
    if data.get("tool_calls"):
        data["tool_calls"] = [
            {"type": "function", "id": c["id"], "function": {"name": c["name"], "arguments": arguments(c)}}
            for c in data["tool_calls"]
        ]
    return data


def arguments(call: dict[str, Any]) -> Any:
    try:
        return json.loads(call["arguments"])
    except ValueError:
        return call["arguments"]


def tool_call(call: dict[str, Any], index: int) -> vf.ToolCall:
    """A parsed tool call as verifiers takes it: its arguments as JSON text (verifiers parses them, and answers a
    malformed call with an error message to the policy)."""
    function = call.get("function", call)
    parsed = function.get("arguments", {})
    text = parsed if isinstance(parsed, str) else json.dumps(parsed)
    return vf.ToolCall(id=call.get("id") or f"call_{index}", name=str(function.get("name", "")), arguments=text)
