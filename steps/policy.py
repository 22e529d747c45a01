"""The policy: a Qwen3-MoE causal LM in HF format, its character tokenizer, and token log-probabilities."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

from steps.config import TinyModelConfig
from steps.errors import MoeloopError

PAD, EOS = "<pad>", "<eos>"


def build_tokenizer(texts: Iterable[str]) -> PreTrainedTokenizerFast:
    """One token per character seen in texts; built locally, nothing is downloaded."""
    characters = sorted(set("".join(texts)))
    vocab = {token: index for index, token in enumerate([PAD, EOS, *characters])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=PAD, eos_token=EOS)


def build_tiny_model(shape: TinyModelConfig, tokenizer: PreTrainedTokenizerFast, seed: int) -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        moe_intermediate_size=shape.moe_intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        num_experts=shape.num_experts,
        num_experts_per_tok=shape.num_experts_per_tok,
        max_position_embeddings=shape.max_position_embeddings,
        router_aux_loss_coef=shape.router_aux_loss_coef,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config)


def load_policy(directory: Path) -> tuple[Qwen3MoeForCausalLM, PreTrainedTokenizerFast]:
    """Load an HF checkpoint folder in fp32 (the trainer's and the CPU engine's precision)."""
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
    except (OSError, ValueError) as error:
        raise MoeloopError(f"not a loadable HF checkpoint: {directory} ({str(error).splitlines()[0]})") from None
    return model, tokenizer


def save_policy(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, directory: Path) -> None:
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)


def pack_sequences(
    prompts: list[list[int]], responses: list[list[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt+response batch.

    Returns input_ids_BT, attention_mask_BT, and response_mask_BT marking the response tokens.
    """
    length = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=False))
    input_ids_BT = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    attention_mask_BT = torch.zeros((len(prompts), length), dtype=torch.long)
    response_mask_BT = torch.zeros((len(prompts), length), dtype=torch.bool)
    for row, (prompt, response) in enumerate(zip(prompts, responses, strict=False)):
        end = len(prompt) + len(response)
        input_ids_BT[row, :end] = torch.tensor(prompt + response)
        attention_mask_BT[row, :end] = 1
        response_mask_BT[row, len(prompt) : end] = True
    return input_ids_BT, attention_mask_BT, response_mask_BT


def token_logprobs(
    model: torch.nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each token given its prefix (position 0 gets 0), and the router's aux loss.

    Logits are divided by the sampling temperature so that they match the engine's behaviour logprobs.
    """
    output = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT, output_router_logits=True)
    logits_BTV = output.logits[:, :-1].float() / temperature
    targets_BT = input_ids_BT[:, 1:]
    logprobs_BT = -F.cross_entropy(logits_BTV.transpose(1, 2), targets_BT, reduction="none")
    return F.pad(logprobs_BT, (1, 0)), output.aux_loss
