"""`python -m moeloop.steps.reward_model --like CONFIG --out DIR` builds a tiny random MoE reward model (of
model.tiny's family) with the demo's character tokenizer: noise as a reward, for showing that the path runs end to
end (configs/tiny-ppo-rm.yaml).
The reward models themselves (scoring, committing into a run, loading) are in steps/rewards/models.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification

from moeloop.steps.common import quiet_libraries
from moeloop.steps.config import MoeloopConfig, load_config
from moeloop.steps.errors import ArgumentParser, run_cli
from moeloop.steps.model.policy import save_policy, tiny_model_config, tiny_tokenizer
from moeloop.steps.storage.prompts import task_prompt_sets


def build_tiny_reward_model(config: MoeloopConfig, directory: Path, seed: int = 0) -> None:
    """A random sequence classifier of the config's tiny family and shape, with the character tokenizer the start
    step builds for the same prompts (so it reads the policy's text)."""
    sources = task_prompt_sets(config)
    records = [record for split_records, _ in sources.values() for record in split_records]
    tokenizer = tiny_tokenizer(records, config.model.tokenizer)
    model_config = tiny_model_config(config.model.tiny, tokenizer, num_labels=1)
    torch.manual_seed(seed)
    save_policy(AutoModelForSequenceClassification.from_config(model_config), tokenizer, directory)


def main() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--like", required=True, help="the config whose tiny shape and prompts to use")
    parser.add_argument("--out", required=True, help="the folder to write the reward model to")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    quiet_libraries()
    build_tiny_reward_model(load_config(args.like), Path(args.out), args.seed)
    print(f"wrote a random tiny reward model to {args.out}")


if __name__ == "__main__":
    run_cli(main)
