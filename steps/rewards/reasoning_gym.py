"""reasoning-gym's procedural tasks (`task.source: reasoning_gym`): the records start generates and commits, and the
reward function that scores them with each task's own scorer.

Each task's train and eval sets are generated from task.reasoning_gym.seed (and the task's place in the list), so the
same config gives the same records; an eval question that the train set also drew is dropped from the train set, so
the eval set stays held out. A record is in verl's layout:

    {"data_source": NAME, "prompt": [{"role": "user", "content": QUESTION}],
     "reward_model": {"style": "rule", "ground_truth": ANSWER},
     "extra_info": {"split": "train" or "eval", "index": I, "entry": JSON}}

where entry is reasoning-gym's whole entry (question, answer, metadata) as JSON text: tasks' metadata differ in shape,
which one table's columns could not hold, and the scorer reads it back. A task whose scorer does not score its
round-tripped entries as it scores the originals (ARC's, whose metadata holds tuples) is refused at start.
"""

from __future__ import annotations

import json
import random
from functools import cache
from typing import TYPE_CHECKING, Any

from moeloop.steps.errors import MoeloopError

if TYPE_CHECKING:  # a reward worker imports this module for `score`: it keeps to the scorer's imports
    from moeloop.steps.config_task import ReasoningGymConfig, ReasoningGymTask

CHECKED_ENTRIES = 8  # of each task, scored as generated and as stored: a difference is the task's, not an entry's


def generate_records(settings: ReasoningGymConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train records, eval records) of every task, in the config's order."""
    train: list[dict[str, Any]] = []
    evaluation: list[dict[str, Any]] = []
    for position, task in enumerate(settings.tasks):
        held_out = entries(task, "eval", task.eval_size, split_seed(settings.seed, position, task.name, "eval"))
        drawn = entries(task, "train", task.train_size, split_seed(settings.seed, position, task.name, "train"))
        questions = {entry["question"] for entry in held_out}
        check_round_trip(task.name, drawn[:CHECKED_ENTRIES])
        evaluation += [record(task.name, "eval", i, entry) for i, entry in enumerate(held_out)]
        train += [
            record(task.name, "train", i, entry) for i, entry in enumerate(drawn) if entry["question"] not in questions
        ]
    return train, evaluation


def split_seed(seed: int, position: int, name: str, split: str) -> int:
    """A set's seed, far from every other set's: reasoning-gym seeds entry i with seed + i, so consecutive seeds would
    give the train and eval sets the same entries. random.Random hashes a string with SHA-512, in any process."""
    return random.Random(f"{seed}/{position}/{name}/{split}").randrange(2**31)


def entries(task: ReasoningGymTask, split: str, size: int, seed: int) -> list[dict[str, Any]]:
    import reasoning_gym

    where = f"task.reasoning_gym {task.name!r} ({split} set)"
    try:
        return list(reasoning_gym.create_dataset(task.name, **task.config, seed=seed, size=size))
    except ValueError as error:  # an unknown name, or a setting the task refuses
        raise MoeloopError(f"{where}: {error}") from None
    except TypeError as error:  # a setting the task's config does not have
        raise MoeloopError(f"{where}: {error}; see the task's config in reasoning-gym") from None
    except AssertionError as error:  # how most tasks check their settings
        raise MoeloopError(f"{where}: a setting is out of range: {error or 'reasoning-gym refuses it'}") from None


def record(name: str, split: str, index: int, entry: dict[str, Any]) -> dict[str, Any]:
    return {
        "data_source": name,
        "prompt": [{"role": "user", "content": entry["question"]}],
        "reward_model": {"style": "rule", "ground_truth": entry["answer"]},
        "extra_info": {"split": split, "index": index, "entry": json.dumps(entry, sort_keys=True)},
    }


def check_round_trip(name: str, generated: list[dict[str, Any]]) -> None:
    """The task's scorer gives the reference answer the same score on the stored entry as on the generated one."""
    scorer = score_answer_function(name)
    for entry in generated:
        stored = json.loads(json.dumps(entry))
        if entry["answer"] is not None and scorer(entry["answer"], stored) != scorer(entry["answer"], entry):
            raise MoeloopError(
                f"task.reasoning_gym {name!r}: its scorer scores an entry read back from JSON differently from the"
                " generated one (its metadata holds values JSON does not keep): this task cannot be committed"
            )


@cache
def score_answer_function(name: str) -> Any:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(name)


def score(record: dict[str, Any], response: str, answer_tag: str | None = "answer") -> float:
    """The reward function of reasoning-gym records (`moeloop.steps.rewards.reasoning_gym:score`): the record's task
    scores the answer, which is the last <answer_tag>...</answer_tag> of the response (none: 0), or, with
    answer_tag null, the whole response, stripped."""
    from reasoning_gym.utils import extract_answer

    entry = json.loads(record["extra_info"]["entry"])
    answer = response.strip() if answer_tag is None else extract_answer(response, tag_name=answer_tag)
    return float(score_answer_function(entry["metadata"]["source_dataset"])(answer, entry))
