"""Prompts rendered as the checkpoint was trained to read them, and responses ended where it was trained to end
them, with tokenizers built here (tests/chat_checkpoints.py): a Qwen3-style template (thinking switch, two end
tokens) and a Llama-style one (BOS, <|eot_id|>). The rendered ids are apply_chat_template's; both engines stop at
every end token of the generation config and at rollout.stop strings, and say which ended each sample."""

from __future__ import annotations

from pathlib import Path

import pytest

from moeloop.steps.config import VLLMConfig
from moeloop.steps.engines.engine import Completion, Sampling, TransformersEngine
from moeloop.steps.engines.vllm_engine import VLLMEngine
from moeloop.steps.errors import MoeloopError
from moeloop.steps.config_model import TinyQwen3Moe, TinyTokenizerConfig
from moeloop.steps.model.policy import build_tiny_model, build_tokenizer, save_policy, tiny_tokenizer
from moeloop.steps.prompting import ChatSettings, end_token_ids, render_prompt
from tests.chat_checkpoints import LLAMA, QWEN3, ChatStyle, chat_checkpoint, chat_tokenizer

QUESTION = [{"role": "user", "content": "what is 12+30?"}]
OWN_SYSTEM = [{"role": "system", "content": "answer in words."}, *QUESTION]
MAX_NEW_TOKENS = 40


@pytest.fixture(scope="module", params=[QWEN3, LLAMA], ids=lambda style: style.name)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[ChatStyle, Path]:
    style = request.param
    return style, chat_checkpoint(style, tmp_path_factory.mktemp(style.name) / "checkpoint")


@pytest.mark.parametrize("style", [QWEN3, LLAMA], ids=lambda style: style.name)
@pytest.mark.parametrize(
    ("messages", "chat", "expected_messages"),
    [
        pytest.param(QUESTION, ChatSettings(), QUESTION, id="plain"),
        pytest.param(QUESTION, ChatSettings("be brief."), [{"role": "system", "content": "be brief."}, *QUESTION],
                     id="system-prompt"),  # fmt: skip
        pytest.param(OWN_SYSTEM, ChatSettings("be brief."), OWN_SYSTEM, id="its-own-system-message"),
        pytest.param(QUESTION, ChatSettings(template_kwargs={"enable_thinking": False}), QUESTION, id="no-thinking"),
    ],
)
def test_rendered_prompt_ids_are_apply_chat_templates(
    style: ChatStyle, messages: list[dict], chat: ChatSettings, expected_messages: list[dict]
) -> None:
    tokenizer = chat_tokenizer(style)

    text, ids = render_prompt(tokenizer, messages, chat)

    expected = tokenizer.apply_chat_template(
        expected_messages, add_generation_prompt=True, tokenize=True, **chat.template_kwargs
    )["input_ids"]
    assert ids == expected and tokenizer.decode(ids) == text
    thinking_off = style is QWEN3 and chat.template_kwargs.get("enable_thinking") is False
    assert text.endswith("<think>\n\n</think>\n\n") == thinking_off
    assert (ids[0] == tokenizer.bos_token_id) == (style is LLAMA)  # the template's BOS, once


def test_a_string_prompt_goes_as_it_is() -> None:
    tokenizer = chat_tokenizer(LLAMA)

    text, ids = render_prompt(tokenizer, "12+30=", ChatSettings(template_kwargs={"enable_thinking": False}))

    assert text == "12+30=" and ids == tokenizer("12+30=")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id  # a base model's BOS, as its tokenizer adds it to any text


@pytest.mark.parametrize("style", [QWEN3, LLAMA], ids=lambda style: style.name)
def test_a_reward_models_input_is_the_conversation_with_the_response(style: ChatStyle) -> None:
    tokenizer = chat_tokenizer(style)

    text, ids = render_prompt(tokenizer, QUESTION, ChatSettings("be brief."), response="42.")

    conversation = [{"role": "system", "content": "be brief."}, *QUESTION, {"role": "assistant", "content": "42."}]
    assert ids == tokenizer.apply_chat_template(conversation, tokenize=True)["input_ids"]
    assert render_prompt(tokenizer, "12+30=", ChatSettings(), response="42")[0] == "12+30=42"


def test_messages_need_a_chat_template() -> None:
    with pytest.raises(MoeloopError, match="a messages prompt, and the tokenizer has no chat template"):
        render_prompt(build_tokenizer(["abc"]), QUESTION, ChatSettings())


def test_a_template_that_fails_is_one_line() -> None:
    tokenizer = chat_tokenizer(QWEN3)
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"

    with pytest.raises(MoeloopError, match="the chat template fails on it: TemplateError: roles must alternate"):
        render_prompt(tokenizer, QUESTION, ChatSettings())


def test_the_end_tokens_are_the_generation_configs(checkpoint: tuple[ChatStyle, Path], tmp_path: Path) -> None:
    style, folder = checkpoint
    tokenizer = chat_tokenizer(style)

    assert end_token_ids(folder, tokenizer) == tokenizer.convert_tokens_to_ids(list(style.end_tokens))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):  # no generation_config.json
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    assert end_token_ids(tmp_path, tokenizer) == [tokenizer.eos_token_id]  # config.json's, and the tokenizer's


def test_the_tiny_models_bpe_tokenizer_is_trained_on_the_records_and_renders_chatml(tmp_path: Path) -> None:
    """model.tokenizer bpe: the same records train the same tokenizer; ChatML's template and end token; the
    answers (verl's ground truth where there is no `answer`) among its training text; the saved tiny model's one
    end token is <|im_end|>."""
    records = [
        {"prompt": [{"role": "user", "content": f"spell {word} backward"}], "reward_model": {"ground_truth": word[::-1]}}
        for word in ("bird", "neon", "bliss", "bingo", "chess") * 20
    ]
    settings = TinyTokenizerConfig(kind="bpe", vocab_size=300)
    tokenizer = tiny_tokenizer(records, settings)

    assert tokenizer.get_vocab() == tiny_tokenizer(records, settings).get_vocab() and len(tokenizer) == 300
    assert tokenizer.tokenize("spell bingo backward") == ["spell", "Ġbingo", "Ġbackward"]
    assert len(tokenizer.tokenize("ognib")) < 5  # an answer's letters merged: it was trained on
    text, ids = render_prompt(tokenizer, records[0]["prompt"], ChatSettings("be brief."))
    assert text == "<|im_start|>system\nbe brief.<|im_end|>\n<|im_start|>user\nspell bird backward<|im_end|>\n" \
        "<|im_start|>assistant\n"  # fmt: skip
    assert tokenizer.decode(ids) == text and tokenizer.eos_token == "<|im_end|>"
    save_policy(build_tiny_model(TinyQwen3Moe(), tokenizer, seed=0), tokenizer, tmp_path)
    assert end_token_ids(tmp_path, tokenizer) == [tokenizer.convert_tokens_to_ids("<|im_end|>")]


def prompts_of(tokenizer: object) -> list[list[int]]:
    questions = ([{"role": "user", "content": f"what is {a}+{b}?"}] for a, b in ((1, 2), (12, 30), (7, 70)))
    return [render_prompt(tokenizer, question, ChatSettings())[1] for question in questions]


def check_endings(engine: object, completions: list[list[Completion]], stop: tuple[str, ...]) -> set[str]:
    """Every sample ends where its finish_reason says, and nowhere before: an end token as its last token, a stop
    string in the text of its tokens (and in no shorter start of them), or max_new_tokens. The end tokens met."""
    ends = end_token_ids(engine.checkpoint_dir, engine.tokenizer)
    met = set()
    for sample in (sample for samples in completions for sample in samples):
        tokens, reason = sample.token_ids, sample.finish_reason
        assert len(sample.logprobs) == len(tokens) and not any(token in ends for token in tokens[:-1]), sample
        text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
        assert not any(s in engine.tokenizer.decode(tokens[:-1], skip_special_tokens=True) for s in stop), sample
        if reason == "stop":
            assert tokens[-1] in ends
            met.add(engine.tokenizer.convert_ids_to_tokens(tokens[-1]))
        elif reason == "stop_string":
            assert tokens[-1] not in ends and any(s in text for s in stop)
        else:
            assert reason == "length" and len(tokens) == MAX_NEW_TOKENS and tokens[-1] not in ends
    return met


def sampling(seed: int, stop: tuple[str, ...] = ()) -> Sampling:
    return Sampling(n=16, temperature=1.0, top_p=1.0, max_new_tokens=MAX_NEW_TOKENS, seed=seed, stop=stop)


def test_transformers_stops_at_either_end_token(checkpoint: tuple[ChatStyle, Path]) -> None:
    style, folder = checkpoint
    engine = TransformersEngine(folder)

    completions = engine.generate(prompts_of(engine.tokenizer), sampling(seed=0))

    assert check_endings(engine, completions, ()) == set(style.end_tokens)
    reasons = {sample.finish_reason for samples in completions for sample in samples}
    assert reasons == {"stop", "length"}


def test_transformers_stops_at_a_stop_string(checkpoint: tuple[ChatStyle, Path]) -> None:
    engine = TransformersEngine(checkpoint[1])

    completions = engine.generate(prompts_of(engine.tokenizer), sampling(seed=1, stop=("7", "ab")))

    check_endings(engine, completions, ("7", "ab"))
    assert {sample.finish_reason for samples in completions for sample in samples} == {"stop", "stop_string", "length"}


@pytest.mark.slow
def test_vllm_stops_at_either_end_token_and_at_a_stop_string(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One engine (builds cost seconds), built with its tokenizer for the stop strings, sampling with and without."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    folder = chat_checkpoint(QWEN3, tmp_path / "checkpoint")
    settings = VLLMConfig(kv_cache_bytes=64 << 20, max_model_len=256, max_num_seqs=64, enforce_eager=True)
    engine = VLLMEngine(folder, settings, stop_strings=True)
    try:
        prompts = prompts_of(engine.tokenizer)
        ended = engine.generate(prompts, sampling(seed=0))
        stopped = engine.generate(prompts, sampling(seed=1, stop=("7", "ab")))
    finally:
        engine.close()

    assert check_endings(engine, ended, ()) == set(QWEN3.end_tokens)
    check_endings(engine, stopped, ("7", "ab"))
    assert {sample.finish_reason for samples in stopped for sample in samples} == {"stop", "stop_string", "length"}
