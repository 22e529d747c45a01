"""start: create the run and its starting policy (checkpoint 0).

The starting policy is an existing HF checkpoint (model.checkpoint) or, by default, a tiny Qwen3-MoE built
here with a character tokenizer and trained briefly with supervised fine-tuning on the task, so that RL
starts from an SFT checkpoint as in real post-training.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors import SafetensorError

from moeloop.steps.common import print_json, print_progress, quiet_libraries, step_parser
from moeloop.steps.config import (
    MoeloopConfig,
    SFTConfig,
    TrainerConfig,
    check_expert_split,
    load_config,
    parse_config,
    parse_config_text,
)
from moeloop.steps.errors import MoeloopError, print_line, run_cli
from moeloop.steps.model.families import family_named, num_experts
from moeloop.steps.model.policy import (
    build_tiny_model,
    check_stored_tensors,
    load_policy,
    pack_sequences,
    save_policy,
    tiny_model_config,
    tiny_tokenizer,
    token_logprobs,
)
from moeloop.steps.observe.trackers import begin_trackers, check_trackers
from moeloop.steps.episodes.transcript import episode_tokens
from moeloop.steps.prompting import ChatSettings, fit_prompts, render_prompt, sft_answer, sft_episode
from moeloop.steps.rewards.functions import check_reward_routes
from moeloop.steps.rewards.models import adopt_reward_models, check_reward_models
from moeloop.steps.rl.memory import refuse_unfit_trainer
from moeloop.steps.rl.router_bias import bias_update_rate
from moeloop.steps.storage.cache import cache_root, fetch_verified, local_scratch
from moeloop.steps.storage.manifest import json_bytes, manifest_of, parse_manifest
from moeloop.steps.storage.prompt_set import commit_prompt_set
from moeloop.steps.storage.prompts import PromptRows, check_prompts, set_name, task_prompt_sets
from moeloop.steps.storage.reports import write_report
from moeloop.steps.storage.run import RunStorage

# Settings that may change between submissions of one run without changing its results. The trainer's process
# layout is one of them: its update equals one process's on the whole minibatch, and its state is stored whole.
RESTARTABLE_FIELDS = {"iterations", "cluster", "local", "storage_root", "observe"}
RESTARTABLE_TRAINER = {"world_size", "expert_parallel", "dispatcher", "experts_impl"}


def load_config_argument(value: str) -> MoeloopConfig:
    """--config is a YAML file, or the config itself: YAML text (how the Argo workflow passes it) or JSON (the
    local runner's), told from a path by its lines or braces."""
    if "\n" in value or value.lstrip().startswith("{"):
        return parse_config_text(value.encode(), "--config")
    if not value.strip():
        raise MoeloopError("--config is empty: give a YAML file or the config as YAML or JSON text")
    return load_config(value)


def adopt_run(storage: RunStorage, config: MoeloopConfig, prompts: dict[str, list[dict]]) -> None:
    """Write the run's config and commit its prompt sets (none to commit for a run started already), or check that
    an existing run holds the same ones.

    Once checkpoint 0 is committed, the run's data depends on the stored config: only RESTARTABLE_FIELDS may
    change. Before that (a start that failed, e.g. on a model that does not load), the submitted config replaces the
    stored one; the prompt sets are fixed once committed (steps/storage/prompt_set.py)."""
    if storage.is_committed(storage.checkpoint(0)):
        changed = differing_keys(results_part(stored_config(storage)), results_part(config.model_dump(mode="json")))
        if changed:
            raise MoeloopError(f"run {storage.uri} already holds a different config (differs in: {', '.join(changed)})")
    for split, records in prompts.items():
        commit_prompt_set(storage, split, records, {"source": set_name(config, split)})
    storage.write_bytes(RunStorage.CONFIG, yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False).encode())


def results_part(dump: dict[str, Any]) -> dict[str, Any]:
    """A config dump without the fields that may change between submissions."""
    kept = {key: value for key, value in dump.items() if key not in RESTARTABLE_FIELDS}
    if isinstance(kept.get("trainer"), dict):
        kept["trainer"] = {key: value for key, value in kept["trainer"].items() if key not in RESTARTABLE_TRAINER}
    return kept


def stored_config(storage: RunStorage) -> dict[str, Any]:
    """The run's stored config as a JSON-mode dump. One that this moeloop no longer accepts (a check added
    since, e.g. experts over EP ranks) is compared as it was written, so that a fix of it can be adopted."""
    data, shown = storage.read_bytes(RunStorage.CONFIG), storage.display(RunStorage.CONFIG)
    try:
        return parse_config_text(data, shown).model_dump(mode="json")
    except MoeloopError:
        raw = yaml.safe_load(data)
        if not isinstance(raw, dict):
            raise
        return raw


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


def sft_target(tokenizer: Any, record: dict, chat: ChatSettings) -> tuple[list[int], list[int]]:
    """(the response tokens SFT trains a record on, the mask of those it learns): its reference episode, laid out as
    the rollouts lay out an episode, the policy's turns learnt; else its answer and the end token, all learnt."""
    episode = sft_episode(record)
    if episode is not None:
        return episode_tokens(tokenizer, chat, episode, tokenizer.eos_token_id)
    answer = tokenizer(sft_answer(record), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return answer, [1] * len(answer)


def sft(
    model: torch.nn.Module, tokenizer: Any, records: list[dict], settings: SFTConfig, seed: int, chat: ChatSettings
) -> list[float]:
    """Teacher-forced training on prompt -> answer+EOS (or a reference episode, `sft_target`), the prompt rendered as
    the rollouts render it, loss on the answer's (the policy's) tokens only. Every tenth of the way it prints a progress
    line (`progress: SFT step 8/40, loss 1.234`), which `moeloop run` shows as it goes."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(settings.steps):
        batch = rng.sample(records, min(settings.batch_size, len(records)))
        prompts = [render_prompt(tokenizer, r["prompt"], chat)[1] for r in batch]
        answers, masks = zip(*(sft_target(tokenizer, r, chat) for r in batch), strict=True)
        input_ids_BT, attention_mask_BT, response_mask_BT = pack_sequences(prompts, answers, tokenizer.pad_token_id)
        for row, (prompt, mask) in enumerate(zip(prompts, masks, strict=True)):
            response_mask_BT[row, len(prompt) : len(prompt) + len(mask)] = torch.tensor(mask, dtype=torch.bool)
        logprobs_BT, _ = token_logprobs(model, input_ids_BT, attention_mask_BT)
        loss = -(logprobs_BT * response_mask_BT).sum() / response_mask_BT.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if len(losses) % max(1, settings.steps // 10) == 0 or len(losses) == settings.steps:
            print_progress(f"SFT step {len(losses)}/{settings.steps}, loss {losses[-1]:.3f}")
    return losses


def source_folder(uri: str) -> tuple[RunStorage, str]:
    """model.checkpoint as (the storage it lives in, the folder's name there): a local folder or s3://..."""
    if "://" not in uri:
        uri = os.path.abspath(uri)
    parent, _, name = uri.rstrip("/").rpartition("/")
    if not name or parent in ("s3:/", "file:/"):
        raise MoeloopError(f"model.checkpoint must name a folder, not a bucket or a root: {uri}")
    try:
        return RunStorage(parent or "/"), name
    except MoeloopError as error:
        raise MoeloopError(f"model.checkpoint: {error}") from None


def fetch_model_source(storage: RunStorage, uri: str) -> tuple[Path, dict[str, Any] | None]:
    """model.checkpoint as a local folder, verified and cached like the run's checkpoints; and, at the first
    fetch of a folder without a COMMIT, its files' entries, for record_model_source once they load.

    A moeloop checkpoint (a folder with a COMMIT, of any run) is verified against its COMMIT. Any other
    folder (an HF checkpoint uploaded from outside moeloop) has nothing to be verified against: it is
    trusted as this run first finds it. That first fetch checks each object's length against the listing
    (and the loader checks each safetensors file against its own header); once the files load, start
    records every file's size and digest in the run's data/model-source.json, and every later fetch for the
    run (a re-run of start, a cached copy) is verified against that record, so a source changed or damaged
    since is an error naming the object."""
    source, folder = source_folder(uri)
    manifest = source.manifest(folder)
    if manifest is not None:
        return fetch_verified(source, folder, manifest["files"]), None
    if storage.exists(RunStorage.MODEL_SOURCE):
        recorded = recorded_source(storage, uri)["files"]
        try:
            return fetch_verified(source, folder, recorded), None
        except MoeloopError as error:
            raise MoeloopError(
                f"model.checkpoint is not what this run first fetched, as recorded in"
                f" {storage.display(RunStorage.MODEL_SOURCE)}: {error}"
            ) from None
    cache_root().mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache_root()))
    try:
        files = source.fetch_as_found(folder, staging)
        if not files:
            raise MoeloopError(f"model.checkpoint not found (no objects there): {uri}")
        return fetch_verified(source, folder, files, fetched=staging), files
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def record_model_source(storage: RunStorage, uri: str, files: dict[str, Any]) -> None:
    """Pin model.checkpoint's files as this run first found them (created once; a concurrent start that
    found other bytes is an error)."""
    created = storage.create_bytes(RunStorage.MODEL_SOURCE, json_bytes(manifest_of(files, {"uri": uri})))
    if not created and recorded_source(storage, uri)["files"] != files:
        raise MoeloopError(f"model.checkpoint changed while this run first fetched it: {uri}")


def recorded_source(storage: RunStorage, uri: str) -> dict[str, Any]:
    shown = storage.display(RunStorage.MODEL_SOURCE)
    record = parse_manifest(storage.read_bytes(RunStorage.MODEL_SOURCE), shown)
    if record.get("uri") != uri:
        raise MoeloopError(f"{shown} records another model.checkpoint ({record.get('uri')!r}, not {uri!r})")
    return record


@dataclass(frozen=True)
class StartingPolicy:
    model: torch.nn.Module
    tokenizer: Any
    report: dict[str, Any]
    first_found: dict[str, Any] | None  # model.checkpoint's files at their first fetch, for record_model_source
    prompts: dict[str, list[dict]]  # the prompt sets the model can read, by split (steps/prompting.py:fit_prompts)


def starting_policy(storage: RunStorage, config: MoeloopConfig, sources: dict[str, PromptRows]) -> StartingPolicy:
    """model.checkpoint loaded (or the tiny model built and trained with SFT), and the prompts it can read. Writes
    nothing into the run: it is part of reading the inputs."""
    uri = config.model.checkpoint
    first_found = None
    if uri is not None:
        refuse_unknown_family(uri, config.trainer)
        local, first_found = fetch_model_source(storage, uri)
        try:
            check_stored_tensors(local)
            model, tokenizer = load_policy(local)
        except (MoeloopError, SafetensorError) as error:  # a truncated weights file is a SafetensorError
            reason = str(error).splitlines()[0].replace(str(local), uri)  # the user's folder, not the cache's copy
            raise MoeloopError(f"model.checkpoint {uri} does not load: {reason}") from None
        try:
            where = f"model.checkpoint {uri}'s num_experts"
            check_expert_split(num_experts(model.config), config.trainer.expert_parallel, where)
        except ValueError as error:
            raise MoeloopError(str(error)) from None
    else:
        tokenizer = demo_tokenizer(sources, config)
        model = build_tiny_model(config.model.tiny, tokenizer, seed=config.seed)
        bias_update_rate(config.trainer, model.config.model_type)  # a one-line error for a rate it has no bias for
    what = f"model.checkpoint {uri}" if uri is not None else "the tiny model"
    positions = model.config.max_position_embeddings
    fitted = {split: fit_prompts(*rows, tokenizer, positions, config, what) for split, rows in sources.items()}
    check_prompts(config, fitted["train"].records, set_name(config, "train"))
    if not fitted["eval"].records:
        raise MoeloopError(f"{set_name(config, 'eval')}: every prompt is longer than rollout.max_prompt_tokens")
    report: dict[str, Any] = {"source": uri or "tiny+sft"}
    for split, prompts in fitted.items():
        report.update({f"{split}_prompts": len(prompts.records), f"dropped_{split}_prompts": prompts.dropped})
        if prompts.dropped:
            print_line(
                f"start: dropped {prompts.dropped} of {len(sources[split][0])} {split} prompts longer than"
                f" rollout.max_prompt_tokens {config.rollout.max_prompt_tokens}"
            )
    if uri is None:
        report.update(supervised_start(model, tokenizer, fitted["train"].records, config))
    return StartingPolicy(model, tokenizer, report, first_found, {split: p.records for split, p in fitted.items()})


def supervised_start(model: torch.nn.Module, tokenizer: Any, train: list[dict], config: MoeloopConfig) -> dict:
    """The tiny model's SFT on the train prompts' answers, and its report."""
    losses = sft(model, tokenizer, train, config.model.sft, config.seed, ChatSettings.of(config))
    diverged = next((step for step, loss in enumerate(losses, start=1) if not math.isfinite(loss)), None)
    if diverged is not None:
        raise MoeloopError(
            f"model.sft diverged: loss {losses[diverged - 1]} at step {diverged}; lower model.sft.learning_rate"
        )
    tail = losses[-20:]
    return {"sft_steps": len(losses), "sft_loss": sum(tail) / len(tail) if tail else None}


def refuse_unknown_family(uri: str, settings: TrainerConfig) -> None:
    """A one-line error naming the families the trainer runs where model.checkpoint's config.json names another
    model_type (a dense model's, one transformers does not know), or where trainer.router_bias_update_rate is set
    for a family without a correction bias, before any weight is fetched. A folder without a
    readable config.json or model_type is left to the loader, which names what is wrong with it."""
    source, folder = source_folder(uri)
    try:
        model_type = json.loads(source.read_bytes(f"{folder}/config.json")).get("model_type")
    except (MoeloopError, json.JSONDecodeError, AttributeError):
        return
    if model_type is not None:
        try:
            family_named(model_type)
            bias_update_rate(settings, model_type)
        except MoeloopError as error:
            raise MoeloopError(f"model.checkpoint {uri}: {error}") from None


def demo_tokenizer(sources: dict[str, PromptRows], config: MoeloopConfig) -> Any:
    return tiny_tokenizer((record for records, _ in sources.values() for record in records), config.model.tokenizer)


def refuse_unfit_trainer_of(config: MoeloopConfig, sources: dict[str, PromptRows]) -> None:
    """The trainer's memory check (steps/rl/memory.py) for the starting policy's architecture, read from
    model.checkpoint's config.json or made for the tiny model: no weight is loaded, nothing written."""
    if config.trainer.gpu_memory_bytes is None:
        return
    if config.model.checkpoint is None:
        hf_config = tiny_model_config(config.model.tiny, demo_tokenizer(sources, config)).to_dict()
    else:
        source, folder = source_folder(config.model.checkpoint)
        try:
            hf_config = json.loads(source.read_bytes(f"{folder}/config.json"))
        except (MoeloopError, json.JSONDecodeError) as error:
            raise MoeloopError(f"model.checkpoint {config.model.checkpoint}: no readable config.json ({error})") from None
    refuse_unfit_trainer(config.trainer, hf_config, "model")


def adopt_inputs(storage: RunStorage, config: MoeloopConfig, prompts: dict[str, list[dict]]) -> None:
    """The run's config, prompt sets, trackers and reward models, written (or checked) once every input has been
    read."""
    adopt_run(storage, config, prompts)
    begin_trackers(storage, config)
    adopt_reward_models(storage, config.reward.models)


def start(run_uri: str, config: MoeloopConfig) -> dict[str, Any]:
    check_reward_models(config.reward.models)
    check_trackers(config)
    storage = RunStorage(run_uri)
    checkpoint = storage.checkpoint(0)
    if (manifest := storage.manifest(checkpoint)) is not None:  # its prompt sets too: their sources are not read
        if config.trainer.gpu_memory_bytes is not None:  # the trainer's layout may have changed since
            files = storage.read_committed(checkpoint, manifest, ["config.json"])
            refuse_unfit_trainer(config.trainer, json.loads(files["config.json"]), "checkpoint 0")
        adopt_inputs(storage, config, {})
        storage.move_latest(0)
        return {"skipped": "checkpoint 0 already committed"}

    # Read every input (the starting model too) before writing anything, so bad input leaves nothing behind.
    sources = task_prompt_sets(config)
    check_prompts(config, sources["train"][0], set_name(config, "train"))
    records = [record for split_records, _ in sources.values() for record in split_records]
    rubric = config.rollout.environment is not None
    check_reward_routes(config.reward, records, "the train and eval records", rubric)
    refuse_unfit_trainer_of(config, sources)
    started = time.perf_counter()
    with local_scratch() as scratch:
        policy = starting_policy(storage, config, sources)
        adopt_inputs(storage, config, policy.prompts)
        if policy.first_found is not None:
            record_model_source(storage, config.model.checkpoint, policy.first_found)
        save_policy(policy.model, policy.tokenizer, scratch / "checkpoint")
        report = {**policy.report, "seconds": round(time.perf_counter() - started, 3)}
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
