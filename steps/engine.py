"""Generation engines behind one interface: given prompt token ids, return sampled completions with logprobs."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch


@dataclass(frozen=True)
class Sampling:
    n: int  # samples per prompt
    temperature: float  # 0 means greedy
    top_p: float
    max_new_tokens: int
    seed: int


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]  # the response, ending with EOS when finish_reason is "stop"
    logprobs: list[float]  # the sampling distribution's logprob of each response token
    finish_reason: str  # "stop" (EOS) or "length" (max_new_tokens)


class Engine(Protocol):
    name: str

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        """For each prompt, sampling.n completions."""
        ...


class TransformersEngine:
    """transformers `generate` on the policy checkpoint; the reference engine and the CPU fallback."""

    name = "transformers"

    def __init__(self, checkpoint_dir: Path):
        from steps.policy import load_policy

        self.model, self.tokenizer = load_policy(checkpoint_dir)
        self.model.eval()

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
            for i, completions in zip(indices, self._generate_batch(batch, sampling), strict=False):
                results[i] = completions
        return results

    def _generate_batch(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        greedy = sampling.temperature == 0
        input_ids_BP = torch.tensor(prompts, dtype=torch.long)
        output = self.model.generate(
            input_ids=input_ids_BP,
            attention_mask=torch.ones_like(input_ids_BP),
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
        new_tokens_NS = output.sequences[:, input_ids_BP.shape[1] :]
        # scores are the processed logits (after temperature and top-p): the distribution sampled from.
        logprobs_NSV = torch.stack(output.scores, dim=1).float().log_softmax(dim=-1)
        chosen_NS = logprobs_NSV.gather(-1, new_tokens_NS.unsqueeze(-1)).squeeze(-1)
        samples = [self._completion(t, lp) for t, lp in zip(new_tokens_NS, chosen_NS, strict=True)]
        per_prompt = 1 if greedy else sampling.n
        return [samples[i : i + per_prompt] for i in range(0, len(samples), per_prompt)]

    def _completion(self, tokens_S: torch.Tensor, logprobs_S: torch.Tensor) -> Completion:
        tokens = tokens_S.tolist()
        eos = self.tokenizer.eos_token_id
        if eos in tokens:
            end = tokens.index(eos) + 1
            return Completion(tokens[:end], logprobs_S[:end].tolist(), "stop")
        return Completion(tokens, logprobs_S.tolist(), "length")


def make_engine(name: str, checkpoint_dir: Path) -> Engine:
    if name == "transformers":
        return TransformersEngine(checkpoint_dir)
    raise ValueError(f"unknown engine {name!r}")
