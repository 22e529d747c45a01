"""The tiny model's BPE tokenizer (model.tokenizer.kind bpe): byte-level BPE trained at start with the `tokenizers`
library on the prompt sets' text, with ChatML's special tokens and template, a turn ending at <|im_end|> (its EOS), as
a chat model's tokenizer is. Nothing is downloaded."""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CHATML_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
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
        tokenizer_object=tokenizer, pad_token=PAD, eos_token=TURN_END, chat_template=CHATML_TEMPLATE
    )
