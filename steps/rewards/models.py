"""Reward models: HF sequence-classification models (num_labels=1) that score prompt + response.

The start step commits each configured model into the run (`reward-models/<k>/`, see `adopt_reward_models`), so
the reward step reads it through the storage module: verified against its COMMIT and cached like a checkpoint.
Scoring is batched, in bfloat16 on a GPU and float32 on the CPU. A model scores the prompt and the response as one
text, rendered for its own tokenizer as the policy's prompts are (steps/prompting.py: a string prompt followed by
the response; messages and the response as the assistant's turn, through its chat template), and its pooled logit
(HF pools the last non-padding token) is the score.
"""

from __future__ import annotations

from pathlib import Path

import fsspec
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from moeloop.steps.config_reward import RewardModel
from moeloop.steps.errors import MoeloopError
from moeloop.steps.prompting import ChatSettings, render_prompt
from moeloop.steps.storage.cache import fetch_committed, local_scratch
from moeloop.steps.storage.run import RunStorage


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
    def score(self, samples: list[tuple[str | list[dict[str, str]], str]], chat: ChatSettings) -> list[float]:
        """The score of each (a record's prompt, a response)."""
        ids = [render_prompt(self.tokenizer, prompt, chat, response)[1] for prompt, response in samples]
        scores: list[float] = []
        for start in range(0, len(ids), self.batch_size):
            encoded = self.tokenizer.pad({"input_ids": ids[start : start + self.batch_size]}, return_tensors="pt")
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
        committed = storage.manifest(folder)
        if committed is not None:
            if committed.get("source") != settings.path:
                raise MoeloopError(
                    f"{storage.display(folder)} was committed from {committed.get('source')!r}, not from"
                    f" reward.models.{index}.path {settings.path!r}: this run's reward models are fixed"
                )
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

