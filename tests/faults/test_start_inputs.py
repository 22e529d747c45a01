"""What start refuses of the model and the prompts a user hands in (issue 36, items 7-9), each as one line naming
the tensor or the prompt's file, row and length, before anything is written; and the prompts it drops, counted; and
an environment's datasets as the prompt sets (task.source environment, issue 42): start is called in-process (its CLI
turns the error into the one `error:` line, tests/faults/test_bad_input.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeloop.steps.config import MoeloopConfig, parse_config
from moeloop.steps.demo_task import make_prompts, write_jsonl
from moeloop.steps.episodes import environment as environment_module
from moeloop.steps.episodes.environment import dataset_records, load_environment
from moeloop.steps.errors import MoeloopError
from moeloop.steps.prompting import sft_answer
from moeloop.steps.start import start
from moeloop.steps.storage.prompt_set import prompt_count, read_prompts
from moeloop.steps.storage.run import RunStorage
from tests.chat_checkpoints import QWEN3, chat_checkpoint
from tests.conftest import REPO, SMALL_TRANSFORMERS_ROLLOUT, small_config


def config_with(tmp_path: Path, train: list[dict[str, Any]] | None = None, **sections: dict) -> MoeloopConfig:
    """small_config with its train prompts replaced by train (the demo's otherwise: 40 of them), eval the demo's."""
    rng = random.Random(0)
    write_jsonl(tmp_path / "train.jsonl", train if train is not None else make_prompts(40, rng, set()))
    write_jsonl(tmp_path / "eval.jsonl", make_prompts(8, rng, set()))
    task = {"train_prompts": str(tmp_path / "train.jsonl"), "eval_prompts": str(tmp_path / "eval.jsonl")}
    return small_config(iterations=1, task=task, **sections)


def refused(run: Path, config: MoeloopConfig, *needles: str) -> str:
    with pytest.raises(MoeloopError) as raised:
        start(str(run), config)
    message = str(raised.value)
    assert all(needle in message for needle in needles), message
    assert "\n" not in message and not run.exists(), "start wrote into the run"
    return message


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return chat_checkpoint(QWEN3, tmp_path / "checkpoint")


def test_a_checkpoint_of_integer_weights_is_refused_naming_the_tensor(
    tmp_path: Path, checkpoint: Path, run_root: Path
) -> None:
    tensors = load_file(checkpoint / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})

    refused(
        run_root / "run", config_with(tmp_path, model={"checkpoint": str(checkpoint)}),
        f"model.checkpoint {checkpoint} does not load: ",
        "model.norm.weight is I32 in model.safetensors, not a floating-point dtype",
    )  # fmt: skip


def test_a_config_that_disagrees_with_the_weights_names_the_tensors_and_shapes(
    tmp_path: Path, checkpoint: Path, run_root: Path
) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "num_local_experts": 8}))  # 4 in the weights

    refused(
        run_root / "run", config_with(tmp_path, model={"checkpoint": str(checkpoint)}),
        "its weights are not the model its config.json makes: ",
        "model.layers.0.mlp.gate.weight is [4, 32] in model.safetensors, [8, 32] by config.json",
        "model.layers.0.mlp.experts.4.gate_proj.weight is in no safetensors file",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("prompt", "named"),
    [
        pytest.param("", "train.jsonl:3: an empty prompt", id="empty"),
        pytest.param(" \n", "train.jsonl:3: an empty prompt", id="blank"),
        pytest.param(
            "ab" * 5_000_000 + "=",
            "train.jsonl:3: a prompt of at least 1000000 tokens (10000001 characters), which with rollout.max_new_tokens"
            " 10 does not fit the tiny model's 64 positions",
            id="10MB",
        ),
        pytest.param(
            "ab" * 30 + "=", "train.jsonl:3: a prompt of 61 tokens (61 characters), which with rollout.max_new_tokens 10",
            id="past-the-positions",
        ),  # fmt: skip
        pytest.param(
            [{"role": "user", "content": "ab="}],
            "train.jsonl:3: a messages prompt, and the tokenizer has no chat template (the tiny model)",
            id="messages-without-a-template",
        ),
    ],
)
def test_a_prompt_the_model_cannot_take_is_named_by_file_row_and_length(
    tmp_path: Path, run_root: Path, prompt: Any, named: str
) -> None:
    train = make_prompts(40, random.Random(1), set())
    train[2]["prompt"] = prompt

    refused(run_root / "run", config_with(tmp_path, train), f"{tmp_path}/{named}")


def test_prompts_longer_than_max_prompt_tokens_are_dropped_and_counted(
    tmp_path: Path, run_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train = make_prompts(40, random.Random(1), set())
    long = {3, 17, 18}
    for index in long:
        train[index]["prompt"] = "ab" * 20 + "="  # 41 tokens: past the limit below, within the model's positions
    config = config_with(tmp_path, train, rollout={**SMALL_TRANSFORMERS_ROLLOUT, "max_prompt_tokens": 30})
    run = run_root / "run"

    report = start(str(run), config)

    assert (report["dropped_train_prompts"], report["train_prompts"], report["dropped_eval_prompts"]) == (3, 37, 0)
    assert "start: dropped 3 of 40 train prompts longer than rollout.max_prompt_tokens 30" in capsys.readouterr().out
    storage = RunStorage(str(run))
    kept = [record for index, record in enumerate(train) if index not in long]
    assert prompt_count(storage, "train") == 37
    assert list(read_prompts(storage, "train", range(37)).values()) == kept


def test_a_limit_the_model_cannot_take_is_refused(tmp_path: Path, run_root: Path) -> None:
    refused(
        run_root / "run", config_with(tmp_path, rollout={**SMALL_TRANSFORMERS_ROLLOUT, "max_prompt_tokens": 60}),
        "rollout.max_prompt_tokens 60 + max_new_tokens 10 is more than the tiny model's 64 positions",
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# task.source environment: the prompt sets are rollout.environment's datasets (tests/environments/calc_env.py)

CALC_ENV = {"package": "calc-env", "name": "calc-env", "args": {"train_size": 12, "eval_size": 4}}


@pytest.fixture
def calc_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "tests" / "environments"))


def environment_config(**environment: Any) -> MoeloopConfig:
    """small_config on calc-env's datasets, with the BPE tokenizer, whose chat template reads their messages."""
    data = small_config(iterations=1).model_dump()
    data["task"].update(source="environment", train_prompts=None, eval_prompts=None)
    data["rollout"]["environment"] = {**CALC_ENV, **environment}
    data["model"]["tokenizer"]["kind"] = "bpe"
    return MoeloopConfig.model_validate(data)


def test_an_environments_datasets_are_the_runs_prompt_sets(calc_env: None, run_root: Path) -> None:
    config = environment_config()
    run = run_root / "run"

    report = start(str(run), config)

    assert (report["train_prompts"], report["eval_prompts"], report["sft_steps"]) == (12, 4, 3)
    environment = load_environment(config.rollout.environment)
    storage = RunStorage(str(run))
    for split, count in (("train", 12), ("eval", 4)):
        records = list(read_prompts(storage, split, range(count)).values())
        assert records == dataset_records(environment, split)
        assert all(isinstance(r["prompt"], list) and sft_answer(r) for r in records)  # messages; the SFT's answers


@pytest.mark.parametrize(
    ("environment", "named"),
    [
        pytest.param(
            {"name": "no-such-env", "package": "no-such-env==1.0"},
            "rollout.environment: no environment 'no-such-env' is installed (its module no_such_env does not import):"
            " install 'no-such-env==1.0'",
            id="not-installed",
        ),
        pytest.param(
            {"args": {"size": 3}}, "rollout.environment 'calc-env' does not load: ", id="arguments-it-does-not-take"
        ),
        pytest.param({"args": {"train_size": 0}}, "rollout.environment calc-env's train set: no prompts", id="empty"),
    ],
)
def test_an_environment_that_gives_no_prompts_is_refused(
    calc_env: None, run_root: Path, environment: dict[str, Any], named: str
) -> None:
    refused(run_root / "run", environment_config(**environment), named)


def test_an_environments_bad_record_is_named(calc_env: None, run_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def with_a_bad_fourth_record(environment: Any, split: str) -> list[dict[str, Any]]:
        records = dataset_records(environment, split)
        records[3]["prompt"][0]["content"] = None
        return records

    monkeypatch.setattr(environment_module, "dataset_records", with_a_bad_fourth_record)
    refused(
        run_root / "run", environment_config(),
        "rollout.environment calc-env's train set, record 3: 'prompt' is neither a string nor a list of "
        "{role, content}",
    )  # fmt: skip


def test_an_environment_whose_datasets_fail_is_named(
    calc_env: None, run_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_dataset(environment: Any, split: str) -> list[dict[str, Any]]:
        raise ValueError("dataset is not set\n(a second line the error leaves out)")

    monkeypatch.setattr(environment_module, "dataset_records", no_dataset)
    refused(
        run_root / "run", environment_config(),
        "rollout.environment calc-env: its datasets do not load (ValueError: dataset is not set)",
    )  # fmt: skip


def test_the_tiny_model_reads_an_environments_messages_with_the_bpe_tokenizer() -> None:
    data = environment_config().model_dump(mode="json")
    data["model"]["tokenizer"]["kind"] = "characters"
    with pytest.raises(MoeloopError, match=r"the tiny model \(model.checkpoint null\) reads them with model.tokenizer"):
        parse_config(data, "test")
    data["model"]["checkpoint"] = "s3://b/some-chat-model"  # a checkpoint brings its own chat template
    assert parse_config(data, "test").rollout.environment is not None
