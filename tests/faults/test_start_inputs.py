"""What start refuses of the model and the prompts a user hands in (issue 36, items 7-9), each as one line naming
the tensor or the prompt's file, row and length, before anything is written; and the prompts it drops, counted:
start is called in-process (its CLI turns the error into the one `error:` line, tests/faults/test_bad_input.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeloop.steps.config import MoeloopConfig
from moeloop.steps.demo_task import make_prompts, write_jsonl
from moeloop.steps.errors import MoeloopError
from moeloop.steps.start import start
from moeloop.steps.storage.prompt_set import prompt_count, read_prompts
from moeloop.steps.storage.run import RunStorage
from tests.chat_checkpoints import QWEN3, chat_checkpoint
from tests.conftest import SMALL_TRANSFORMERS_ROLLOUT, small_config


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
