"""The tiny model's BPE tokenizer (model.tokenizer.kind bpe): byte-level BPE trained at start with the `tokenizers`
library on the prompt sets' text, with ChatML's special tokens and template (tool calls included), a turn ending at
<|im_end|> (its EOS), as a chat model's tokenizer is. Nothing is downloaded."""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# ChatML, with Qwen's tool calling in small: the tools named in a system turn, each call a <tool_call> JSON block in
# the assistant's turn, consecutive tool results in one user turn of <tool_response> blocks. Plain conversations
# render as ChatML alone.
CHATML_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}{%- for tool in tools %}{{- tool.function.name + ';' }}"
    "{%- endfor %}{{- '</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>' + message.content + '</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}{{- '<tool_call>' + (call.function | tojson) + '</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# How transformers' parse_response reads an assistant turn of it back: its content and tool calls.
RESPONSE_TEMPLATE = {
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "content": {"content": "text"},
        "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "content": "json", "repeats": True},
    },
}
PAD, TURN_START, TURN_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"


def bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE of vocab_size tokens (the 256 bytes, the special tokens and the merges learned on texts, in
    their order: the same texts train the same tokenizer)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, TURN_START, TURN_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD,
        eos_token=TURN_END,
        chat_template=CHATML_TEMPLATE,
        response_template=RESPONSE_TEMPLATE,
    )
