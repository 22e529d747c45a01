"""Which prompts each iteration's rollouts draw: epochs over the train prompts, a function of (run, seed, iteration)."""

from __future__ import annotations

from moeloop.steps.engines.shards import iteration_prompt_ids, shard_prompt_ids
from tests.conftest import small_config


def test_no_prompt_comes_twice_before_every_prompt_has_come_once() -> None:
    config = small_config(rollout={"prompts_per_iteration": 8})
    num_prompts = 30  # 3 batches of 8 an epoch; 6 prompts are left to the next epoch's permutation
    batches = [iteration_prompt_ids(config, num_prompts, iteration) for iteration in range(1, 10)]
    assert all(len(batch) == len(set(batch)) == 8 for batch in batches)
    for epoch in range(3):
        drawn = [p for batch in batches[3 * epoch : 3 * epoch + 3] for p in batch]
        assert len(set(drawn)) == 24 and set(drawn) <= set(range(num_prompts))
    # Epochs are permuted afresh: the second does not repeat the first's order.
    assert batches[3:6] != batches[0:3]


def test_the_batch_is_a_function_of_run_seed_and_iteration() -> None:
    config = small_config()
    assert iteration_prompt_ids(config, 100, 5) == iteration_prompt_ids(small_config(), 100, 5)
    other_seed = config.model_copy(update={"seed": config.seed + 1})
    assert iteration_prompt_ids(other_seed, 100, 5) != iteration_prompt_ids(config, 100, 5)
    # Fewer prompts than a batch: every prompt, every iteration.
    assert sorted(iteration_prompt_ids(config, 5, 3)) == list(range(5))
    # The shards split the batch between them.
    batch = iteration_prompt_ids(config, 100, 2)
    shards = [shard_prompt_ids(batch, k, 3) for k in range(3)]
    assert sorted(p for shard in shards for p in shard) == sorted(batch)
