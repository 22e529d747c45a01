"""start: create the run and its starting policy (checkpoint 0).

The starting policy is an existing HF checkpoint (model.checkpoint) or, by default, a tiny Qwen3-MoE built
here with a character tokenizer and trained briefly with supervised fine-tuning on the task, so that RL
starts from an SFT checkpoint as in real post-training.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import fsspec
import torch
import yaml

from steps.common import local_scratch, print_json, quiet_libraries, step_parser, write_report
from steps.config import MoeloopConfig, SFTConfig, load_config, parse_config
from steps.errors import MoeloopError, run_cli
from steps.policy import build_tiny_model, build_tokenizer, load_policy, pack_sequences, save_policy, token_logprobs
from steps.reward_model import adopt_reward_models, check_reward_models
from steps.storage import RunStorage, read_prompt_file

# Settings that may change between submissions of one run without changing its results.
RESTARTABLE_FIELDS = {"iterations", "cluster", "local", "storage_root"}


def load_config_argument(value: str) -> MoeloopConfig:
    """--config is a YAML file, or the config itself as JSON (how the Argo workflow passes it)."""
    if value.lstrip().startswith("{"):
        try:
            return parse_config(yaml.safe_load(value), "--config")
        except yaml.YAMLError:
            raise MoeloopError("--config: not valid JSON") from None
    return load_config(value)


def adopt_run(storage: RunStorage, config: MoeloopConfig, train: list[dict], evaluation: list[dict]) -> None:
    """Write the run's config and prompts, or check that an existing run holds the same ones."""
    if storage.exists(RunStorage.CONFIG):
        stored = parse_config(yaml.safe_load(storage.read_bytes(RunStorage.CONFIG)), storage.display(RunStorage.CONFIG))
        changed = differing_keys(
            stored.model_dump(exclude=RESTARTABLE_FIELDS), config.model_dump(exclude=RESTARTABLE_FIELDS)
        )
        if changed:
            raise MoeloopError(f"run {storage.uri} already holds a different config (differs in: {', '.join(changed)})")
    for relative, records in ((RunStorage.TRAIN_PROMPTS, train), (RunStorage.EVAL_PROMPTS, evaluation)):
        if not storage.exists(relative):
            storage.write_bytes(relative, "".join(_json_line(r) for r in records).encode())
    storage.write_bytes(RunStorage.CONFIG, yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False).encode())


def differing_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted paths of the leaves where two config dumps differ."""
    keys = []
    for key in sorted(old.keys() | new.keys()):
        left, right = old.get(key), new.get(key)
        if isinstance(left, dict) and isinstance(right, dict):
            keys += differing_keys(left, right, f"{prefix}{key}.")
        elif left != right:
            keys.append(f"{prefix}{key}")
    return keys


def _json_line(record: dict) -> str:
    return json.dumps(record, sort_keys=True) + "\n"


def sft(model: torch.nn.Module, tokenizer: Any, records: list[dict], settings: SFTConfig, seed: int) -> list[float]:
    """Teacher-forced training on prompt -> answer+EOS, loss on the answer tokens only."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(settings.steps):
        batch = rng.sample(records, min(settings.batch_size, len(records)))
        prompts = [tokenizer(r["prompt"])["input_ids"] for r in batch]
        answers = [tokenizer(r["answer"])["input_ids"] + [tokenizer.eos_token_id] for r in batch]
        input_ids_BT, attention_mask_BT, response_mask_BT = pack_sequences(prompts, answers, tokenizer.pad_token_id)
        logprobs_BT, _ = token_logprobs(model, input_ids_BT, attention_mask_BT)
        loss = -(logprobs_BT * response_mask_BT).sum() / response_mask_BT.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def starting_policy(
    config: MoeloopConfig, train: list[dict], evaluation: list[dict], scratch: Path
) -> tuple[Any, Any, dict]:
    if config.model.checkpoint is not None:
        source = scratch / "source"
        try:
            fs, path = fsspec.core.url_to_fs(config.model.checkpoint)
            fs.get(path.rstrip("/") + "/", str(source), recursive=True)
        except FileNotFoundError:
            raise MoeloopError(f"model.checkpoint not found: {config.model.checkpoint}") from None
        model, tokenizer = load_policy(source)
        return model, tokenizer, {"source": config.model.checkpoint}
    texts = [r["prompt"] + r.get("answer", "") for r in train + evaluation]
    tokenizer = build_tokenizer(texts)
    model = build_tiny_model(config.model.tiny, tokenizer, seed=config.seed)
    losses = sft(model, tokenizer, train, config.model.sft, seed=config.seed)
    tail = losses[-20:] or [float("nan")]
    return model, tokenizer, {"source": "tiny+sft", "sft_steps": len(losses), "sft_loss": sum(tail) / len(tail)}


def start(run_uri: str, config: MoeloopConfig) -> dict[str, Any]:
    # Read every input before writing anything, so bad input leaves nothing behind.
    train = read_prompt_file(config.task.train_prompts)
    evaluation = read_prompt_file(config.task.eval_prompts)
    check_reward_models(config.reward.models)
    storage = RunStorage(run_uri)
    adopt_run(storage, config, train, evaluation)
    adopt_reward_models(storage, config.reward.models)
    checkpoint = storage.checkpoint(0)
    if storage.is_committed(checkpoint):
        storage.move_latest(0)
        return {"skipped": "checkpoint 0 already committed"}

    started = time.perf_counter()
    with local_scratch() as scratch:
        model, tokenizer, report = starting_policy(config, train, evaluation, scratch)
        save_policy(model, tokenizer, scratch / "checkpoint")
        report["seconds"] = round(time.perf_counter() - started, 3)
        write_report(storage, 0, "start", report)
        storage.commit_folder(checkpoint, scratch / "checkpoint", extra={"iteration": 0})
    storage.move_latest(0)
    return report


def main() -> None:
    parser = step_parser(__doc__)
    parser.add_argument("--config", required=True, help="config YAML file, or the config as JSON text")
    parser.add_argument("--iterations", type=int, help="the run's iteration count (default: the config's)")
    parser.add_argument("--model", default="", help="checkpoint URI to start from (default: model.checkpoint)")
    args = parser.parse_args()
    if args.iteration != 0:
        raise MoeloopError(f"start builds iteration 0, not {args.iteration}")
    quiet_libraries()
    print_json(start(args.run, with_run_arguments(load_config_argument(args.config), args.iterations, args.model)))


def with_run_arguments(config: MoeloopConfig, iterations: int | None, model: str) -> MoeloopConfig:
    """The config with the run's parameters (Argo's submit form) applied; re-validated."""
    data = config.model_dump(mode="json")
    if iterations is not None:
        data["iterations"] = iterations
    if model:
        data["model"]["checkpoint"] = model
    return parse_config(data, "--iterations/--model")


if __name__ == "__main__":
    run_cli(main)
