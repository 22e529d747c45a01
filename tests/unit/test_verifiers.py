"""The built-in verifiers with the real libraries: math-verify's answers on a table of known cases, the format reward,
and reasoning-gym's tasks: sets generated from a seed (the same records again from the same seed, the eval set held
out), committed into the run by start, scored by each task's own scorer through the worker pool; a task whose entries
JSON cannot keep, and bad task settings, are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeloop.steps.config import parse_config
from moeloop.steps.config_reward import RewardConfig
from moeloop.steps.config_task import ReasoningGymConfig
from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.policy import build_tiny_model, build_tokenizer, save_policy
from moeloop.steps.rewards.pool import RewardPool
from moeloop.steps.rewards.reasoning_gym import generate_records, score
from moeloop.steps.rewards.verifiers import format_tags, last_boxed, math_verify
from moeloop.steps.start import start
from moeloop.steps.storage.prompt_set import SPLITS, prompt_count, read_prompts
from moeloop.steps.storage.run import RunStorage
from tests.chat_checkpoints import QWEN3_TEMPLATE
from tests.conftest import small_config

MATH_CASES = [
    # (ground truth, response, reward)
    ("0.5", r"So the probability is \boxed{\frac{1}{2}}.", 1.0),
    (r"\frac{1}{2}", "The answer is 0.5", 1.0),
    ("1/2", r"\boxed{0.5}", 1.0),
    (r"\sqrt{2}", r"\boxed{\sqrt 2}", 1.0),
    ("x^2+1", r"\boxed{1 + x^2}", 1.0),
    (r"\{1,2\}", r"\boxed{\{2, 1\}}", 1.0),
    ("72", "Natalia sold 48 + 24 = 72 clips. The final answer is 72", 1.0),
    ("3", r"<think>maybe \boxed{4}? no</think><answer>\boxed{3}</answer>", 1.0),  # the last \boxed{}
    ("4", r"<think>maybe \boxed{4}? no</think><answer>\boxed{3}</answer>", 0.0),
    ("0.5", r"\boxed{\frac{1}{3}}", 0.0),
    ("72", "The final answer is 73", 0.0),
    ("0.5", "I do not know.", 0.0),  # no answer
    ("0.5", "", 0.0),
]


@pytest.mark.parametrize(("truth", "response", "expected"), MATH_CASES)
def test_math_verify_on_known_cases(truth: str, response: str, expected: float) -> None:
    assert math_verify({"reward_model": {"style": "rule", "ground_truth": truth}}, response) == expected


def test_math_verify_reads_the_ground_truth_where_verl_or_a_plain_record_has_it() -> None:
    assert math_verify({"ground_truth": "0.5"}, r"\boxed{1/2}") == 1.0
    assert math_verify({"answer": 12}, r"\boxed{12}") == 1.0
    assert math_verify({"reward_model": {"ground_truth": "7"}, "answer": "8"}, "7") == 1.0
    with pytest.raises(ValueError, match="no reward_model.ground_truth, ground_truth or answer"):
        math_verify({"prompt": "2+2"}, "4")
    with pytest.raises(ValueError, match="math-verify finds no answer in the ground truth ''"):
        math_verify({"answer": ""}, "4")
    assert last_boxed(r"a \boxed{\frac{1}{2}} b \boxed{x^{2}}") == r"\boxed{x^{2}}"
    assert last_boxed(r"\boxed{unclosed") is None


@pytest.mark.parametrize(
    ("response", "tags", "expected"),
    [
        ("<think>a\nb</think>\n<answer>3</answer>\n", ["think", "answer"], 1.0),
        ("<think></think><answer>3</answer>", ["think", "answer"], 1.0),
        ("<answer>3</answer><think>a</think>", ["think", "answer"], 0.0),  # out of order
        ("so: <think>a</think><answer>3</answer>", ["think", "answer"], 0.0),  # text outside the blocks
        ("<think>a</think> and <answer>3</answer>", ["think", "answer"], 0.0),
        ("<think>a</think>", ["think", "answer"], 0.0),
        (" <answer>3</answer> ", ["answer"], 1.0),
        ("<answer>3</answer>", ["reasoning", "answer"], 0.0),
    ],
)
def test_format_tags(response: str, tags: list[str], expected: float) -> None:
    assert format_tags({}, response, tags=tags) == expected


def test_format_tags_default_is_think_then_answer() -> None:
    assert format_tags({}, "<think>x</think><answer>y</answer>") == 1.0


RG = {
    "tasks": [
        {"name": "leg_counting", "train_size": 60, "eval_size": 12, "config": {"min_animals": 1, "max_animals": 2}},
        {"name": "basic_arithmetic", "train_size": 30, "eval_size": 6},
    ],
    "seed": 11,
}


@pytest.fixture(scope="module")
def rg_sets() -> tuple[list[dict], list[dict]]:
    return generate_records(ReasoningGymConfig.model_validate(RG))


def test_reasoning_gym_sets_come_again_from_their_seed_and_keep_the_eval_set_out(rg_sets: tuple) -> None:
    train, evaluation = rg_sets
    assert (train, evaluation) == generate_records(ReasoningGymConfig.model_validate(RG))
    other_train, _ = generate_records(ReasoningGymConfig.model_validate({**RG, "seed": 12}))
    assert [r["prompt"] for r in other_train] != [r["prompt"] for r in train]
    assert [r["data_source"] for r in evaluation] == ["leg_counting"] * 12 + ["basic_arithmetic"] * 6
    assert {r["data_source"] for r in train} == {"leg_counting", "basic_arithmetic"}
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in evaluation}
    assert len(train) <= 90 and len(train) >= 80  # an eval question drawn for train too is dropped from it
    for record in train + evaluation:
        entry = json.loads(record["extra_info"]["entry"])
        assert record["prompt"] == [{"role": "user", "content": entry["question"]}]
        assert record["reward_model"] == {"style": "rule", "ground_truth": entry["answer"]}
        assert entry["metadata"]["source_dataset"] == record["data_source"]


def test_each_reasoning_gym_task_s_scorer_scores_through_the_pool(rg_sets: tuple) -> None:
    _, evaluation = rg_sets
    settings = RewardConfig(functions=[{"path": "moeloop.steps.rewards.reasoning_gym:score"}])
    right = [f"<think>counting</think><answer>{r['reward_model']['ground_truth']}</answer>" for r in evaluation]
    wrong = ["<answer>-1</answer>"] * len(evaluation)
    untagged = [r["reward_model"]["ground_truth"] for r in evaluation]
    names = [f"eval prompt {i}" for i in range(len(evaluation))]
    with RewardPool(settings, "test", processes=2) as pool:
        assert pool.score(evaluation, right, names).rewards == [1.0] * len(evaluation)
        assert pool.score(evaluation, wrong, names).rewards == [0.0] * len(evaluation)
        assert pool.score(evaluation, untagged, names).rewards == [0.0] * len(evaluation)  # no <answer> tag
    assert score(evaluation[0], f" {untagged[0]}\n", answer_tag=None) == 1.0


@pytest.mark.parametrize(
    ("task", "named"),
    [
        pytest.param(
            {"name": "arc_agi", "train_size": 2, "eval_size": 1},
            "'arc_agi': its scorer scores an entry read back",
            id="arc",
        ),
        pytest.param(
            {"name": "no_such_task"}, "'no_such_task' (eval set): Dataset 'no_such_task' not registered", id="unknown"
        ),
        pytest.param(
            {"name": "leg_counting", "config": {"max_animals": 0}},
            "'leg_counting' (eval set): a setting is out of range",
            id="range",
        ),
        pytest.param(
            {"name": "leg_counting", "config": {"colour": 1}},
            "unexpected keyword argument 'colour'",
            id="no-such-setting",
        ),
    ],
)
def test_a_reasoning_gym_task_that_cannot_be_generated_is_one_line(task: dict, named: str) -> None:
    with pytest.raises(MoeloopError, match="^task.reasoning_gym ") as failure:
        generate_records(ReasoningGymConfig.model_validate({"tasks": [task]}))
    assert named in str(failure.value) and "\n" not in str(failure.value)


@pytest.mark.parametrize(
    ("task", "named"),
    [
        ({"source": "reasoning_gym"}, "task: source reasoning_gym needs reasoning_gym.tasks"),
        ({"source": "files", "train_prompts": "a.jsonl"}, "task: source files needs train_prompts and eval_prompts"),
        (
            {"source": "reasoning_gym", "reasoning_gym": {"tasks": []}},
            "task.reasoning_gym.tasks: List should have at least 1 item",
        ),
        (
            {"source": "reasoning_gym", "reasoning_gym": {"tasks": [{"name": "gcd", "config": {"seed": 3}}]}},
            "task.reasoning_gym.tasks.0.config: seed: set by train_size, eval_size and task.reasoning_gym.seed",
        ),
    ],
)
def test_task_settings_are_checked_with_the_config(task: dict, named: str) -> None:
    data = small_config().model_dump(mode="json")
    data["task"] = task
    with pytest.raises(MoeloopError, match=f"^config test: {named}"):
        parse_config(data, "test")


def test_start_commits_the_generated_sets_into_the_run(tmp_path: Path, run_root: Path, rg_sets: tuple) -> None:
    """From a checkpoint of the test's: a character tokenizer over the sets' text with a ChatML template, which
    renders their messages prompts."""
    checkpoint = tmp_path / "policy"
    tokenizer = build_tokenizer([QWEN3_TEMPLATE] + [r["prompt"][0]["content"] for records in rg_sets for r in records])
    tokenizer.chat_template = QWEN3_TEMPLATE
    shape = small_config().model.tiny.model_copy(update={"max_position_embeddings": 512})  # a question: 250 tokens
    save_policy(build_tiny_model(shape, tokenizer, seed=0), tokenizer, checkpoint)
    config = small_config(model={"checkpoint": str(checkpoint)})
    data = config.model_dump(mode="json")
    data["rollout"]["vllm"]["max_model_len"] = None
    data["task"] = {"source": "reasoning_gym", "reasoning_gym": RG}
    data["reward"] = {"functions": [{"path": "moeloop.steps.rewards.reasoning_gym:score"}]}
    config = parse_config(data, "test")
    storage = RunStorage(str(run_root / config.run_name))

    start(storage.uri, config)

    committed = [list(read_prompts(storage, split, range(prompt_count(storage, split))).values()) for split in SPLITS]
    assert tuple(committed) == rg_sets
    assert storage.read_json(storage.report(0, "start"))["source"] == str(checkpoint)
