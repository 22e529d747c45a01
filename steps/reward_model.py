"""Reward models: HF sequence-classification models (num_labels=1) that score prompt + response.

The start step commits each configured model into the run (`reward-models/<k>/`, see `adopt_reward_models`), so
the reward step reads it through the storage module: verified against its COMMIT and cached like a checkpoint.
Scoring is batched, in bfloat16 on a GPU and float32 on the CPU. A model scores the prompt text followed by the
response text, tokenized by its own tokenizer, and its pooled logit (HF pools the last non-padding token) is the
score.

`python -m steps.reward_model --like CONFIG --out DIR` builds a tiny random Qwen3-MoE reward model with the demo's
character tokenizer: noise as a reward, for showing that the path runs end to end (configs/tiny-ppo-rm.yaml).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import fsspec
import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    Qwen3MoeForSequenceClassification,
)

from steps.common import fetch_committed, local_scratch, quiet_libraries
from steps.config import MoeloopConfig, RewardModel, load_config
from steps.errors import MoeloopError, run_cli
from steps.policy import build_tokenizer, save_policy, tiny_model_config
from steps.storage import RunStorage, read_prompt_file


class RewardModelScorer:
    """One reward model, loaded for scoring: bfloat16 on a GPU, float32 on the CPU."""

    def __init__(self, directory: Path, batch_size: int, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        try:
            self.model = AutoModelForSequenceClassification.from_pretrained(directory, dtype=dtype)
            self.tokenizer = AutoTokenizer.from_pretrained(directory)
        except (OSError, ValueError) as error:
            raise MoeloopError(f"not a loadable reward model: {directory} ({str(error).splitlines()[0]})") from None
        if self.model.config.num_labels != 1:
            raise MoeloopError(f"reward model {directory} has num_labels {self.model.config.num_labels}, not 1")
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # HF pools each row's last token that is not padding: it must know the padding id.
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(self.device).eval()
        self.batch_size = batch_size

    @torch.no_grad()
    def score(self, texts: list[str]) -> list[float]:
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            encoded = self.tokenizer(texts[start : start + self.batch_size], padding=True, return_tensors="pt")
            logits_B1 = self.model(
                input_ids=encoded["input_ids"].to(self.device),
                attention_mask=encoded["attention_mask"].to(self.device),
                use_cache=False,  # one forward per batch: a KV cache would only hold memory
            ).logits
            scores += logits_B1[:, 0].float().cpu().tolist()
        return scores


def check_reward_models(models: list[RewardModel]) -> None:
    """Each configured reward model is an HF model folder (it has a config.json): checked before start writes."""
    for index, settings in enumerate(models):
        try:
            fs, path = fsspec.core.url_to_fs(settings.path)
            found = fs.isfile(f"{path.rstrip('/')}/config.json")
        except (OSError, ValueError) as error:
            raise MoeloopError(f"reward.models.{index}.path: cannot read {settings.path} ({error})") from None
        if not found:
            raise MoeloopError(
                f"reward.models.{index}.path is not an HF model folder (no config.json): {settings.path}"
            )


def adopt_reward_models(storage: RunStorage, models: list[RewardModel]) -> None:
    """Commit a copy of each configured reward model into the run (a no-op for one already committed there).
    A local folder is committed as it is; a URI is downloaded first."""
    for index, settings in enumerate(models):
        folder = storage.reward_model(index)
        if storage.is_committed(folder):
            continue
        with local_scratch() as scratch:
            source = Path(settings.path)
            if "://" in settings.path:
                source = scratch / "model"
                fs, path = fsspec.core.url_to_fs(settings.path)
                fs.get(path.rstrip("/") + "/", str(source), recursive=True)
            storage.commit_folder(folder, source, extra={"reward_model": index, "source": settings.path})


def load_reward_models(storage: RunStorage, models: list[RewardModel]) -> list[tuple[RewardModelScorer, float]]:
    """The run's committed reward models, fetched through the verified cache: [(scorer, weight)]."""
    return [
        (RewardModelScorer(fetch_committed(storage, storage.reward_model(index)), settings.batch_size), settings.weight)
        for index, settings in enumerate(models)
    ]


def build_tiny_reward_model(config: MoeloopConfig, directory: Path, seed: int = 0) -> None:
    """A random Qwen3-MoE sequence classifier of the config's tiny shape, with the character tokenizer the start
    step builds for the same prompts (so it reads the policy's text)."""
    records = read_prompt_file(config.task.train_prompts) + read_prompt_file(config.task.eval_prompts)
    tokenizer = build_tokenizer([r["prompt"] + r.get("answer", "") for r in records])
    model_config = tiny_model_config(config.model.tiny, tokenizer, num_labels=1)
    torch.manual_seed(seed)
    save_policy(Qwen3MoeForSequenceClassification(model_config), tokenizer, directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--like", required=True, help="the config whose tiny shape and prompts to use")
    parser.add_argument("--out", required=True, help="the folder to write the reward model to")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    quiet_libraries()
    build_tiny_reward_model(load_config(args.like), Path(args.out), args.seed)
    print(f"wrote a random tiny reward model to {args.out}")


if __name__ == "__main__":
    run_cli(main)
