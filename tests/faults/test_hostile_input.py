"""Bad input and faults, as a hostile user would try them (issue 17): every case gives one `error: ...` line
naming the file, key, function or path, exit 2, and commits nothing; non-finite numbers stop the step that
meets them; one `moeloop run` drives a run at a time (steps/storage/lease.py). The real CLIs run as processes, with
the working directory in the test's folder (step logs land there) and the repo on PYTHONPATH."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from moeloop.steps.demo_task import make_prompts, write_jsonl
from moeloop.steps.errors import MoeloopError
from tests.faults.test_bad_input import (
    assert_user_error,
    set_dotted,
    snapshot,
    start_config,
    started_run,  # noqa: F401 - the module-scoped fixture: a run after its start step
    tiny_config,
    unique_run_name,
    write_config,
)
from tests.processes import TIMEOUT, cli_command, moeloop_cli, run_command, run_step, start_process, step_command

# Every test's processes find the checkpoint cache in its own folder, and run there.
pytestmark = pytest.mark.usefixtures("private_cache")


def one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit 2, no traceback, the last stderr line `error: ...` naming every needle."""
    last = assert_user_error(result, *needles)
    assert result.returncode == 2, result.stderr
    return last


def refused_before_anything(tmp_path: Path, root: Path) -> None:
    """Nothing under the storage root, no step log: the refusal came before anything ran."""
    assert not root.exists(), f"written under the storage root: {sorted(snapshot(root))}"
    assert not (tmp_path / ".moeloop").exists(), "the runner made a log folder for a refused run"


def strict_json(path: Path) -> Any:
    """json.loads accepts NaN and Infinity, which no other JSON parser does: refuse them."""

    def refuse(literal: str) -> None:
        raise AssertionError(f"{path} holds the non-JSON literal {literal}")

    return json.loads(path.read_text(), parse_constant=refuse)


# ---------------------------------------------------------------------------------------------
# Configs that the config check refuses, before anything runs


def run_with(tmp_path: Path, data: dict[str, Any]) -> tuple[subprocess.CompletedProcess[str], Path, Path]:
    config = write_config(tmp_path / "configs", data)
    root = tmp_path / "root"
    return moeloop_cli("run", str(config), "--root", str(root), "--no-progress", cwd=tmp_path), config, root


def run_with_prompts(tmp_path: Path, key: str, prompts: Path) -> tuple[subprocess.CompletedProcess[str], Path, Path]:
    return run_with(tmp_path, tiny_config(**{"run_name": unique_run_name(), key: str(prompts)}))


CONFIG_CASES = [
    pytest.param(
        {"model.tiny.num_experts": 8, "trainer.expert_parallel": 3, "trainer.world_size": 3},
        "model.tiny.num_experts 8 does not split over trainer.expert_parallel 3",
        id="experts-over-ep",
    ),
    pytest.param(
        {"trainer.world_size": 3, "trainer.expert_parallel": 2},
        "trainer: world_size 3 is not a multiple of expert_parallel 2",
        id="world-over-ep",
    ),
    pytest.param(
        {"rollout.num_shards": 200},
        "rollout.num_shards 200 is more than rollout.prompts_per_iteration 192",
        id="shards-over-prompts",
    ),
    pytest.param({"run_name": "My_Run"}, "run_name: 'My_Run' is not a DNS label", id="run-name-not-dns"),
    pytest.param(
        {"reward.functions": [{"path": "moeloop.steps.demo_task:reverse_positions", "weight": float("nan")}]},
        "reward.functions.0.weight: Input should be a finite number",
        id="nan-weight",
    ),
    pytest.param(
        {"trainer.learning_rate": float("inf")}, "trainer.learning_rate: Input should be a finite number", id="inf-lr"
    ),
    pytest.param({"trainer.betas": [1.5, 0.99]}, "trainer: betas [1.5, 0.99]: each must be in [0, 1)", id="betas"),
    pytest.param(
        {"model.tiny.num_key_value_heads": 3},
        "model.tiny: num_attention_heads 4 is not a multiple of num_key_value_heads 3",
        id="kv-heads",
    ),
    pytest.param(
        {"model.tiny.n_group": 2},
        "model.tiny.n_group: unknown key (model.tiny.family qwen3_moe)",
        id="other-family-key",
    ),
    pytest.param(
        {"model.tiny.family": "llama"}, "model.tiny.family: 'llama' is none of 'qwen3_moe', 'qwen2_moe'", id="family"
    ),
    pytest.param(
        {"model.tiny.num_experts_per_tok": 9}, "num_experts_per_tok 9 is more than num_experts 8", id="top-k"
    ),
    pytest.param(
        {"rollout.samples_per_prompt": 1}, "rollout.samples_per_prompt must be at least 2", id="grpo-one-sample"
    ),
    pytest.param({"iterations": 10**6}, "iterations: Input should be less than or equal to 999999", id="iterations"),
    pytest.param({"seed": 2**64}, "seed: Input should be less than", id="seed-overflow"),
    pytest.param({"rollout.max_new_tokens": -1}, "rollout.max_new_tokens: Input should be greater than 0", id="minus"),
    pytest.param({"trainer.minibatch_size": 0}, "trainer.minibatch_size: Input should be greater than 0", id="zero"),
    pytest.param(
        {"local.parallelism": 10**9}, "local.parallelism: Input should be less than or equal to 256", id="parallelism"
    ),
    pytest.param({"rollout": "fast"}, "rollout: Input should be a valid dictionary", id="section-not-a-mapping"),
    pytest.param(
        {"reward.functions": {"path": "moeloop.steps.demo_task:reverse_positions"}},
        "reward.functions: Input should be a valid list",
        id="list-not-a-list",
    ),
    pytest.param({"storage_root": "s3://"}, "storage_root: s3:// needs a bucket", id="root-s3-without-bucket"),
    pytest.param({"storage_root": ""}, "storage_root: storage_root is empty", id="root-empty"),
    pytest.param(
        {"task.train_prompts": "gs://bucket/train.jsonl"},
        "task.train_prompts: unsupported URI scheme 'gs' in gs://bucket/train.jsonl",
        id="prompts-unsupported-scheme",
    ),
    pytest.param(
        {"task.eval_prompts": "s3:///eval.jsonl"}, "task.eval_prompts: s3:///eval.jsonl needs a bucket", id="no-bucket"
    ),
    pytest.param({"model.checkpoint": "s3://"}, "model.checkpoint: s3:// needs a bucket", id="checkpoint-no-bucket"),
    pytest.param(
        {"reward.models": [{"path": "http://example.com/rm"}]},
        "reward.models.0.path: unsupported URI scheme 'http'",
        id="reward-model-scheme",
    ),
]


@pytest.mark.parametrize(("changes", "named"), CONFIG_CASES)
def test_run_refuses_a_config_before_anything_runs(tmp_path: Path, changes: dict[str, Any], named: str) -> None:
    result, config, root = run_with(tmp_path, tiny_config(**{"run_name": unique_run_name(), **changes}))

    last = one_line_error(result, named)
    assert last.startswith(f"error: config {config}: ")
    refused_before_anything(tmp_path, root)


def test_a_run_name_too_long_says_so(tmp_path: Path) -> None:
    result, _, root = run_with(tmp_path, tiny_config(run_name="a" * 43))

    one_line_error(result, "is 43 characters long, over the limit of 42")
    refused_before_anything(tmp_path, root)


@pytest.mark.parametrize(
    ("root", "named"),
    [
        pytest.param("s3://", "--root: s3:// needs a bucket", id="s3-without-bucket"),
        pytest.param("gs://bucket/runs", "--root: unsupported URI scheme 'gs'", id="unsupported-scheme"),
    ],
)
def test_run_and_render_refuse_a_root_that_is_no_storage(tmp_path: Path, root: str, named: str) -> None:
    config = write_config(tmp_path / "configs", tiny_config(run_name=unique_run_name()))

    one_line_error(moeloop_cli("run", str(config), "--root", root, "--no-progress", cwd=tmp_path), named)
    one_line_error(moeloop_cli("render", str(config), "--root", root, "-o", str(tmp_path / "out"), cwd=tmp_path), named)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["configs"], "something was written beside the config"


def test_run_refuses_a_root_that_is_a_file(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.write_text("not a folder\n")
    name = unique_run_name()
    config = write_config(tmp_path / "configs", tiny_config(run_name=name))

    result = moeloop_cli("run", str(config), "--root", str(root), "--no-progress", cwd=tmp_path)

    one_line_error(result, f"cannot create the run's folder {root}/{name}: ")
    assert root.read_text() == "not a folder\n" and not (tmp_path / ".moeloop").exists()


# ---------------------------------------------------------------------------------------------
# Files that are not what they should be: the config file and the prompt files


def make_symlink_loop(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.other").symlink_to(folder / name)
    (folder / name).symlink_to(folder / f"{name}.other")
    return folder / name


def bad_file(tmp_path: Path, kind: str) -> Path:
    """A path that is not a readable UTF-8 text file of kind `kind`."""
    path = tmp_path / "files" / f"{kind}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "binary":
        path.write_bytes(b"run_name: x\n" + bytes(range(128, 256)))
    elif kind == "directory":
        path.mkdir()
    elif kind == "symlink-loop":
        make_symlink_loop(path.parent, path.name)
    elif kind == "huge":
        path.write_bytes(b"#" * (2 << 20))
    return path


@pytest.mark.parametrize(
    ("kind", "named"),
    [
        pytest.param("binary", "config {path}: not UTF-8 text (byte 0x80 on line 2)", id="binary"),
        pytest.param("directory", "config file is a directory, not a file: {path}", id="directory"),
        pytest.param("symlink-loop", "cannot read config file {path}: Too many levels of symbolic links", id="loop"),
        pytest.param("huge", "config file {path} is larger than 1048576 bytes", id="huge"),
    ],
)
def test_a_config_path_that_is_no_config_file(tmp_path: Path, kind: str, named: str) -> None:
    path = bad_file(tmp_path, kind)
    root = tmp_path / "root"

    for command in (["run", str(path), "--root", str(root)], ["render", str(path), "-o", str(tmp_path / "out")]):
        one_line_error(moeloop_cli(*command, cwd=tmp_path), named.format(path=path))
    start = run_step("start", root / "x", 0, "--config", str(path), cwd=tmp_path)
    one_line_error(start, named.format(path=path))
    refused_before_anything(tmp_path, root)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("text", "named"),
    [
        pytest.param("run_name: a\nrun_name: b\n", "key 'run_name' appears twice in one mapping, line 2", id="dup-key"),
        pytest.param("run_name: [a\n", "not valid YAML", id="bad-yaml"),
        pytest.param("!!python/object/apply:os.system ['true']\n", "not valid YAML", id="python-tag"),
        pytest.param("", "expected a mapping at the top level", id="empty"),
        pytest.param("- run_name\n", "expected a mapping at the top level", id="list"),
    ],
)
def test_a_config_file_whose_text_is_no_config(tmp_path: Path, text: str, named: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    root = tmp_path / "root"

    one_line_error(moeloop_cli("run", str(path), "--root", str(root), cwd=tmp_path), f"config {path}: ", named)
    refused_before_anything(tmp_path, root)


def test_a_prompt_file_with_a_byte_that_is_not_utf8_is_named_with_its_line(tmp_path: Path) -> None:
    prompts = tmp_path / "data" / "train.jsonl"
    prompts.parent.mkdir()
    prompts.write_bytes(b'{"prompt": "ab=", "answer": "ba"}\n' * 2 + b'{"prompt": "\xff="}\n')
    result, _, root = run_with_prompts(tmp_path, "task.train_prompts", prompts)

    one_line_error(result, f"prompt file {prompts}: not UTF-8 text (byte 0xff on line 3)")
    refused_before_anything(tmp_path, root)


@pytest.mark.parametrize(
    ("kind", "named"),
    [
        pytest.param(
            "directory", "prompt set {path}: a folder with no *.parquet or *.jsonl file", id="folder-of-no-prompts"
        ),
        pytest.param("symlink-loop", "cannot read prompt file {path}: Too many levels of symbolic links", id="loop"),
    ],
)
def test_a_prompt_path_that_is_no_prompt_set(tmp_path: Path, kind: str, named: str) -> None:
    path = bad_file(tmp_path, kind)
    result, _, root = run_with_prompts(tmp_path, "task.eval_prompts", path)

    one_line_error(result, named.format(path=path))
    refused_before_anything(tmp_path, root)


def test_fewer_prompts_than_an_iteration_takes(tmp_path: Path) -> None:
    prompts = tmp_path / "train.jsonl"
    write_jsonl(prompts, make_prompts(10, random.Random(0), set()))
    result, _, root = run_with_prompts(tmp_path, "task.train_prompts", prompts)

    one_line_error(result, f"{prompts} has 10 prompts, fewer than rollout.prompts_per_iteration 192")
    refused_before_anything(tmp_path, root)


def test_prompts_without_the_answer_that_sft_trains_on(tmp_path: Path) -> None:
    prompts = tmp_path / "train.jsonl"
    records = make_prompts(200, random.Random(0), set())
    del records[6]["answer"]
    write_jsonl(prompts, records)
    result, _, root = run_with_prompts(tmp_path, "task.train_prompts", prompts)

    one_line_error(
        result,
        f"{prompts}: prompt 7 has no string 'answer' (nor reward_model.ground_truth, nor a reference episode's"
        " 'completion' messages), which model.sft trains the tiny model on",
    )
    refused_before_anything(tmp_path, root)


def test_a_reward_module_that_fails_as_it_imports(tmp_path: Path) -> None:
    (tmp_path / "broken_reward.py").write_text("raise RuntimeError('half-written module')\n")
    data = tiny_config(run_name=unique_run_name())
    data["reward"]["functions"] = [{"path": "broken_reward:score"}]
    result, _, root = run_with(tmp_path, data)

    one_line_error(result, "reward function 'broken_reward:score' does not import: RuntimeError: half-written module")
    refused_before_anything(tmp_path, root)


# ---------------------------------------------------------------------------------------------
# Every entry point's usage errors are one line too


SERVER = ["--host", "http://127.0.0.1:9"]


@pytest.mark.parametrize(
    ("command", "named"),
    [
        pytest.param(
            cli_command("run", "c.yaml", "--iterations", "many"),
            "error: moeloop run: argument --iterations: invalid int value: 'many'",
            id="moeloop-run",
        ),
        pytest.param(cli_command("frobnicate"), "error: moeloop: argument command: invalid choice", id="moeloop"),
        pytest.param(
            step_command("publish", "r", "one"),
            "argument --iteration: invalid int value: 'one'",
            id="step",
        ),
        pytest.param(
            step_command("rollout", "r", 1),
            "the following arguments are required: --shard, --num-shards",
            id="step-missing",
        ),
        pytest.param(step_command("chunk", "r", None), "the following arguments are required: --chunk", id="chunk"),
        pytest.param(
            step_command("start", "r", 0, "--config", " "),
            "error: --config is empty",
            id="start-empty-config",
        ),
        pytest.param(
            step_command("start", "r", 0, "--config", "{"),
            "config --config: not valid YAML",
            id="start-bad-json",
        ),
        pytest.param(
            cli_command("status", "x", "--host", "http://[::1", "--namespace", "ns"),
            "Argo server http://[::1: not a valid URL",
            id="status-bad-url",
        ),
        pytest.param(
            cli_command("status", "x/../y", *SERVER, "--namespace", "ns"),
            "workflow 'x/../y' is not a Kubernetes name",
            id="status-bad-name",
        ),
        pytest.param(
            cli_command("resubmit", "x", *SERVER, "--namespace", "a/b"),
            "namespace 'a/b' is not a Kubernetes name",
            id="resubmit-bad-namespace",
        ),
        pytest.param(cli_command("report", "s3://"), "an s3:// URI needs a bucket: s3://", id="report-no-bucket"),
    ],
)
def test_usage_errors_are_one_line(tmp_path: Path, command: list[str], named: str) -> None:
    result = run_command(command, cwd=tmp_path)

    one_line_error(result, named)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "an entry point wrote something for a usage error"


@pytest.mark.parametrize("kind", ["empty-folder", "symlink-loop"])
def test_lint_names_a_path_with_nothing_to_lint(tmp_path: Path, kind: str) -> None:
    if kind == "empty-folder":
        path = tmp_path / "manifests"
        path.mkdir()
        expected = "no *.yaml or *.yml files in this folder"
    else:
        path = make_symlink_loop(tmp_path / "manifests", "workflow.yaml")
        expected = "a symbolic link to nothing readable"

    result = moeloop_cli("lint", str(path), cwd=tmp_path)

    one_line_error(result, "1 lint error(s)")
    assert result.stdout.strip().startswith(f"{path}: {expected}"), result.stdout


# ---------------------------------------------------------------------------------------------
# Loops that meet a fault: a tiny model, one iteration, the transformers engine, one step at a time


def small_task(folder: Path) -> dict[str, str]:
    """32 train prompts and 4 eval prompts (marked `"eval": true`, see tests/faulty_rewards.py)."""
    rng = random.Random(0)
    evaluation = [{**record, "eval": True} for record in make_prompts(4, rng, set())]
    write_jsonl(folder / "train.jsonl", make_prompts(32, rng, {r["answer"][::-1] for r in evaluation}))
    write_jsonl(folder / "eval.jsonl", evaluation)
    return {"task.train_prompts": str(folder / "train.jsonl"), "task.eval_prompts": str(folder / "eval.jsonl")}


# The smallest tiny model that runs: the loops here are about faults, not the model.
TINY_SHAPE = {
    "hidden_size": 32,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}


def loop_config(tmp_path: Path, reward: str, **changes: Any) -> Path:
    data = tiny_config(run_name=unique_run_name(), iterations=1)
    data["model"]["tiny"] = dict(TINY_SHAPE)
    data["model"]["sft"] = {"steps": 2, "batch_size": 8}
    data["rollout"] = {
        "engine": "transformers",
        "prompts_per_iteration": 4,
        "samples_per_prompt": 2,
        "num_shards": 1,
        "max_new_tokens": 6,
    }
    data["reward"] = {"functions": [{"path": reward}]}
    data["trainer"] = {"minibatch_size": 8}
    data["eval"] = {"max_prompts": 4}
    data["local"] = {"parallelism": 1}  # start, eval-0, the rollouts, reward, ...: in that order
    for dotted, value in {**small_task(tmp_path / "data"), **changes}.items():
        set_dotted(data, dotted, value)
    return write_config(tmp_path / "configs", data)


def assert_stopped_before_publish(run: Path) -> None:
    """LATEST still at the start's checkpoint, no later checkpoint, every metrics file valid JSON."""
    assert json.loads((run / "LATEST").read_text())["iteration"] == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter-000000"]
    metrics = sorted((run / "metrics").glob("*.json"))
    assert [p.name for p in metrics] == ["iter-000000.json"], "eval-0 ran before the fault: its metrics are there"
    for path in metrics:
        assert math.isfinite(strict_json(path)["eval_reward_mean"])
    for path in (run / "reports").rglob("*.json"):
        strict_json(path)
    assert not any(".tmp-" in name for name in snapshot(run))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("reward", "returned"),
    [("nan_on_train", "returned nan (float)"), ("text_on_train", "returned 'good' (str)")],
)
def test_a_reward_that_is_no_number_stops_the_loop_before_it_trains(tmp_path: Path, reward: str, returned: str) -> None:
    config = loop_config(tmp_path, f"tests.faulty_rewards:{reward}")
    root = tmp_path / "root"

    result = moeloop_cli("run", str(config), "--root", str(root), "--no-progress", cwd=tmp_path)

    function = f"tests.faulty_rewards:{reward}"
    last = one_line_error(result, "step it1-reward failed: ", f"reward function {function} {returned}")
    assert " on sample 1-" in last and "a reward must be a finite number" in last
    assert last.count("error:") == 1, last
    run = root / yaml.safe_load(config.read_text())["run_name"]
    assert not (run / "experience" / "iter-000001" / "COMMIT").exists()
    assert not (run / "trainer").exists()
    assert_stopped_before_publish(run)


@pytest.mark.slow
def test_a_non_finite_gradient_stops_the_train_step_and_nothing_is_committed(tmp_path: Path) -> None:
    """PPO on a reward of 1e30: finite, but the critic's value loss (V - R)^2 overflows float32."""
    config = loop_config(tmp_path, "tests.faulty_rewards:huge", **{"algorithm.name": "ppo"})
    root = tmp_path / "root"

    result = moeloop_cli("run", str(config), "--root", str(root), "--no-progress", cwd=tmp_path)

    last = one_line_error(result, "step it1-train failed: the ", " of the critic at minibatch 1 of ", " is inf: stopping")
    assert "the loss of" in last or "the gradient norm of" in last, last
    run = root / yaml.safe_load(config.read_text())["run_name"]
    assert (run / "experience" / "iter-000001" / "COMMIT").exists()  # the experience was fine
    assert not (run / "trainer").exists() and not (run / "critics").exists()
    assert not (run / "reports" / "iter-000001" / "train.json").exists()
    assert_stopped_before_publish(run)


def tiny_update(tmp_path: Path, algorithm: str = "grpo") -> tuple[Any, ...]:
    """(model, reference logprobs, optimizer, batch, config, critic) of test_grpo's and test_ppo's one update."""
    from moeloop.steps.rl.parallel import Parallel
    from moeloop.steps.rl.state import load_trainer_model
    from tests.conftest import small_config
    from tests.unit.test_ppo import ppo_trainer, tiny_policy
    from tests.distributed.test_train_ep import experience

    config = small_config(iterations=1, algorithm={"name": algorithm}, trainer={"minibatch_size": 12, "epochs": 1})
    policy_dir = tiny_policy(tmp_path)
    if algorithm == "ppo":
        model, critic, optimizer, ref_logprobs_BT = ppo_trainer(policy_dir, config, Parallel())
        return model, ref_logprobs_BT, optimizer, experience(), config, critic
    from moeloop.steps.rl.batch import frozen_logprobs

    model, _, optimizer = load_trainer_model(policy_dir, config.trainer, Parallel())
    budget = config.trainer.max_tokens_per_microbatch
    ref_logprobs_BT = frozen_logprobs(model, experience(), 1.0, budget, Parallel())
    return model, ref_logprobs_BT, optimizer, experience(), config, None


def test_a_nan_weight_stops_the_update_at_its_first_minibatch(tmp_path: Path) -> None:
    """The check runs once the step is queued (steps/rl/update.py: no wait for the GPU before it): the step's
    in-memory weights are never committed, since the error stops the train step before its commit."""
    import torch

    from moeloop.steps.rl.update import policy_update

    model, ref_logprobs_BT, optimizer, batch, config, _ = tiny_update(tmp_path)
    norm = dict(model.named_parameters())["model.norm.weight"]  # an FSDP2 DTensor: write into its local shard
    with torch.no_grad():
        (norm.to_local() if hasattr(norm, "to_local") else norm).fill_(float("nan"))

    with pytest.raises(MoeloopError, match=r"of the policy at minibatch 1 of 1 is nan: stopping the update"):
        policy_update(model, ref_logprobs_BT, optimizer, batch, config, seed=0)


def test_a_nan_reward_in_the_experience_stops_the_update_at_the_advantages(tmp_path: Path) -> None:
    """The reward step refuses a NaN; one in stored experience (foreign data) is met by PPO's advantages."""
    from dataclasses import replace

    from moeloop.steps.rl.update import policy_update

    model, ref_logprobs_BT, optimizer, batch, config, critic = tiny_update(tmp_path, "ppo")
    rewards_B = batch.rewards_B.clone()
    rewards_B[3] = float("nan")

    with pytest.raises(MoeloopError, match=r"the largest advantage is nan"):
        policy_update(model, ref_logprobs_BT, optimizer, replace(batch, rewards_B=rewards_B), config, 0, critic=critic)


def test_a_non_finite_value_is_never_written_as_json(tmp_path: Path) -> None:
    from moeloop.steps.storage.run import RunStorage

    storage = RunStorage(str(tmp_path / "run"))

    with pytest.raises(MoeloopError, match=r"refusing to write .*/run/metrics/x.json: steps.2.loss \(inf\) is not"):
        storage.write_json("metrics/x.json", {"iteration": 1, "steps": [{}, {}, {"loss": float("inf")}]})
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------
# The start step: the doubled prefix, a checkpoint that does not split over EP, a full disk, a fixed config


def not_a_checkpoint(tmp_path: Path) -> Path:
    folder = tmp_path / "not-hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "notes.txt").write_text("an export of something else\n")
    return folder


@pytest.mark.slow
def test_a_checkpoint_that_does_not_load_is_one_line_with_one_prefix_and_nothing_written(tmp_path: Path) -> None:
    folder = not_a_checkpoint(tmp_path)
    result, _, root = run_with(tmp_path, tiny_config(run_name=unique_run_name(), **{"model.checkpoint": str(folder)}))

    last = one_line_error(result, f"error: step start failed: model.checkpoint {folder} does not load: ")
    assert last.count("error:") == 1 and str(tmp_path / "cache") not in last, last
    assert not root.exists(), f"start wrote into the run before its model loaded: {sorted(snapshot(root))}"


@pytest.mark.slow
def test_a_checkpoint_whose_experts_do_not_split_over_ep_is_refused_by_start(tmp_path: Path) -> None:
    from moeloop.steps.model.policy import build_tiny_model, build_tokenizer, save_policy
    from moeloop.steps.config_model import TinyQwen3Moe

    tokenizer = build_tokenizer(["abcdefgh="])
    folder = tmp_path / "hf-model"
    save_policy(build_tiny_model(TinyQwen3Moe(num_experts=8), tokenizer, seed=0), tokenizer, folder)
    changes = {"model.checkpoint": str(folder), "trainer.world_size": 3, "trainer.expert_parallel": 3}
    config = write_config(tmp_path / "configs", tiny_config(run_name=unique_run_name(), **changes))
    run = tmp_path / "root" / "run"

    result = run_step("start", run, 0, "--config", str(config), cwd=tmp_path)

    one_line_error(result, f"model.checkpoint {folder}'s num_experts 8 does not split over trainer.expert_parallel 3")
    assert not run.exists()


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["llama", "made_up_moe"])  # a dense model; one transformers does not know
def test_a_checkpoint_of_no_known_moe_family_is_refused_by_start_naming_the_families(
    tmp_path: Path, model_type: str
) -> None:
    from transformers import LlamaConfig

    folder = tmp_path / "hf-model"
    dense = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)
    dense.save_pretrained(folder)
    if model_type != "llama":
        hf_config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**hf_config, "model_type": model_type}))
    changes = {"model.checkpoint": str(folder)}
    config = write_config(tmp_path / "configs", tiny_config(run_name=unique_run_name(), **changes))
    run = tmp_path / "root" / "run"

    result = run_step("start", run, 0, "--config", str(config), cwd=tmp_path)

    one_line_error(
        result,
        f"model.checkpoint {folder}: model_type '{model_type}' is no MoE family moeloop trains"
        " (it trains qwen3_moe, qwen2_moe, mixtral, deepseek_v3, gpt_oss)",
    )
    assert not run.exists()


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Path:
    """A 256 KiB tmpfs: too small for a checkpoint, large enough for a run's config and prompts."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.slow
def test_a_full_disk_names_the_object_and_commits_nothing(tmp_path: Path, small_tmpfs: Path) -> None:
    changes = {**small_task(tmp_path / "data"), "model.sft.steps": 2, "rollout.prompts_per_iteration": 8}
    config = write_config(tmp_path / "configs", tiny_config(run_name=unique_run_name(), **changes))
    run = small_tmpfs / "run"

    result = run_step("start", run, 0, "--config", str(config), cwd=tmp_path)

    one_line_error(result, f"No space left on device: {run}/checkpoints/iter-000000/")
    assert not (run / "LATEST").exists()
    assert not (run / "checkpoints" / "iter-000000" / "COMMIT").exists()
    assert not any(".tmp-" in name for name in snapshot(run)), "a temporary file was left on the full disk"


@pytest.mark.slow
def test_a_start_that_failed_after_writing_the_config_accepts_a_fixed_config(tmp_path: Path) -> None:
    """Killed right after it wrote config.yaml (after the objects of the two prompt sets it commits), a start
    leaves a run that nothing depends on yet: a changed config is adopted, not refused."""
    from moeloop.steps.config import load_config
    from moeloop.steps.start import start

    changes = {**small_task(tmp_path / "data"), "model.sft.steps": 2, "rollout.prompts_per_iteration": 8}
    first = write_config(tmp_path / "first", tiny_config(run_name="fixed-later", **changes))
    run = tmp_path / "root" / "fixed-later"
    # The writes before the config: each object of the prompt sets (their shards, then each set's COMMIT), as a
    # whole start of the same config elsewhere commits them.
    elsewhere = tmp_path / "elsewhere" / "fixed-later"
    start(str(elsewhere), load_config(first))
    config_write = sum(path.is_file() for path in (elsewhere / "data").rglob("*")) + 1

    crash = {"MOELOOP_CRASH_AFTER_WRITES": str(config_write)}
    crashed = run_step("start", run, 0, "--config", str(first), cwd=tmp_path, env=crash)
    assert crashed.returncode == -9, crashed.stderr
    assert (run / "config.yaml").exists() and not (run / "checkpoints").exists()

    fixed = write_config(
        tmp_path / "fixed", tiny_config(run_name="fixed-later", **{**changes, "rollout.temperature": 0.7})
    )
    result = run_step("start", run, 0, "--config", str(fixed), cwd=tmp_path)

    assert result.returncode == 0, result.stderr
    assert yaml.safe_load((run / "config.yaml").read_text())["rollout"]["temperature"] == 0.7
    assert json.loads((run / "LATEST").read_text())["iteration"] == 0
    # Once checkpoint 0 is committed, the same change is refused.
    refused = run_step("start", run, 0, "--config", str(first), cwd=tmp_path)
    one_line_error(refused, "already holds a different config (differs in: rollout.temperature)")


@pytest.mark.slow
def test_a_stored_config_that_fails_a_newer_check_can_be_fixed(
    started_run: Path,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    """A run made before the experts-over-EP check (8 experts over EP 3) is refused by every step with that
    check's line, and accepts the fixed EP: the trainer's process layout may change between submissions."""
    run = tmp_path / "root" / started_run.name
    shutil.copytree(started_run, run)
    stored = yaml.safe_load((run / "config.yaml").read_text())
    stored["trainer"].update(world_size=3, expert_parallel=3)
    (run / "config.yaml").write_text(yaml.safe_dump(stored, sort_keys=False))

    publish = run_step("publish", run, 1, cwd=tmp_path)
    one_line_error(publish, f"config {run}/config.yaml: model.tiny.num_experts 8 does not split over")

    other_config = start_config(tmp_path / "other", **{"rollout.temperature": 0.7})
    other = run_step("start", run, 0, "--config", str(other_config), cwd=tmp_path)
    one_line_error(other, "already holds a different config (differs in: rollout.temperature)")
    fixed_config = start_config(tmp_path / "fixed", **{"trainer.expert_parallel": 1})
    fixed = run_step("start", run, 0, "--config", str(fixed_config), cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stderr
    assert yaml.safe_load((run / "config.yaml").read_text())["trainer"]["expert_parallel"] == 1


# ---------------------------------------------------------------------------------------------
# The run lease (steps/storage/lease.py)


def lease_record(**fields: Any) -> bytes:
    now = time.time()
    holder = {"host": "elsewhere", "pid": 1, "since": now - 60, "expires_at": now + 60, "token": "theirs", **fields}
    return json.dumps(holder).encode()


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_the_lease_admits_one_driver_and_is_taken_over_only_when_stale(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    from moeloop.steps.storage.lease import LEASE, RunLease
    from moeloop.steps.storage.run import RunStorage

    uri = request.getfixturevalue("s3_run_root") + "/run" if backend == "s3" else str(tmp_path / "root" / "run")
    storage = RunStorage(uri)

    first = RunLease(uri, ttl=60, renew_every=0)
    first.acquire()
    holder = json.loads(storage.read_bytes(LEASE))
    assert holder["pid"] == os.getpid() and holder["token"] == first.holder.token
    with pytest.raises(MoeloopError, match=rf"run {uri} is busy: .*\(host {holder['host']}, pid {os.getpid()}, since"):
        RunLease(uri).acquire()
    first.renew_if_due()
    assert json.loads(storage.read_bytes(LEASE))["expires_at"] > holder["expires_at"]
    first.release()
    assert not storage.exists(LEASE)

    # Another host's live lease is refused; once expired it is taken over, and its holder finds it lost.
    storage.write_bytes(LEASE, lease_record())
    with pytest.raises(MoeloopError, match=r"host elsewhere, pid 1, since"):
        RunLease(uri).acquire()
    storage.write_bytes(LEASE, lease_record(expires_at=time.time() - 1))
    with RunLease(uri) as second:
        assert json.loads(storage.read_bytes(LEASE))["token"] == second.holder.token
    assert not storage.exists(LEASE)

    # A lease of this host whose process is gone is stale at once.
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    storage.write_bytes(LEASE, lease_record(host=socket.gethostname(), pid=int(gone.stdout)))
    third = RunLease(uri, ttl=60, renew_every=0)
    third.acquire()
    # Taken over behind its back (it stalled past its expiry): its next renewal stops it.
    storage.write_bytes(LEASE, lease_record())
    with pytest.raises(MoeloopError, match=rf"lost the lease of run {uri}"):
        third.renew_if_due()
    third.release()
    assert json.loads(storage.read_bytes(LEASE))["token"] == "theirs", "release removed another driver's lease"


def test_a_lease_that_is_not_one_is_named(tmp_path: Path) -> None:
    from moeloop.steps.storage.lease import RunLease

    run = tmp_path / "run"
    run.mkdir()
    (run / "LEASE").write_text("not json")

    with pytest.raises(MoeloopError, match=rf"not a lease: {run}/LEASE \(foreign data"):
        RunLease(str(run)).acquire()


def test_a_refused_lease_leaves_no_folder_behind(tmp_path: Path) -> None:
    from moeloop.steps.storage.lease import RunLease

    with RunLease(str(tmp_path / "root" / "run")):
        pass
    assert not (tmp_path / "root").exists(), "the lease left the folders it made for its lock file"


def test_chunk_step_refuses_a_chunk_while_a_local_driver_holds_the_lease(
    started_run: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    from moeloop.steps.storage.lease import RunLease

    run = tmp_path / "root" / started_run.name
    shutil.copytree(started_run, run)
    before = snapshot(run)

    with RunLease(str(run)):
        held = run_step("chunk", run, None, "--chunk", "20", cwd=tmp_path)
    free = run_step("chunk", run, None, "--chunk", "20", cwd=tmp_path)

    one_line_error(held, f"run {run} is driven by a `moeloop run` (host ", f"pid {os.getpid()}")
    assert free.returncode == 0, free.stderr
    assert json.loads(free.stdout.strip().splitlines()[-1])["first"] == 1
    assert snapshot(run) == before


@pytest.mark.slow
def test_two_runs_of_one_run_one_drives_and_the_other_is_refused_naming_it(tmp_path: Path) -> None:
    config = loop_config(tmp_path, "moeloop.steps.demo_task:reverse_positions")
    root = tmp_path / "root"
    command = cli_command("run", str(config), "--root", str(root), "--no-progress")
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    processes = [start_process(command, cwd=tmp_path, **pipes) for _ in range(2)]
    deadline = time.monotonic() + TIMEOUT
    while all(p.poll() is None for p in processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    refused = next(p for p in processes if p.poll() is not None)
    driver = next(p for p in processes if p is not refused)
    assert driver.poll() is None, "both ended: neither waited on the other"
    out, err = refused.communicate()
    refusal = subprocess.CompletedProcess(command, refused.returncode, out, err)
    one_line_error(refusal, "is busy: another `moeloop run` holds its lease", f"pid {driver.pid}")
    out, err = driver.communicate(timeout=TIMEOUT)
    assert driver.returncode == 0, err
    assert "done: " in err and "iteration   1: eval_reward_mean" in out + err
    run = root / yaml.safe_load(config.read_text())["run_name"]
    assert json.loads((run / "LATEST").read_text())["iteration"] == 1
    assert not (run / "LEASE").exists(), "the driver left its lease"

    third = moeloop_cli("run", str(config), "--root", str(root), "--no-progress", cwd=tmp_path)

    assert third.returncode == 0, third.stderr
    # start and LATEST's evaluation run again, and skip: nothing left to run
    assert third.stderr.splitlines()[-1].startswith("done: nothing to run, the run had reached iteration 1 already")
    assert not (run / "LEASE").exists()


@pytest.mark.slow
def test_the_runner_quotes_a_torchrun_steps_own_error_line(tmp_path: Path) -> None:
    """Under torchrun each rank prints its `error: ...` line, then torchrun a summary block of `=` lines."""
    from moeloop.workflows.dag import TRAIN
    from moeloop.workflows.local.runner import failure_line

    run = tmp_path / "no-such-run"
    result = run_command([sys.executable, *TRAIN.argv({"run": str(run), "iteration": "1"}, 2)[1:]], cwd=tmp_path)
    log = tmp_path / "train.log"
    log.write_text(result.stdout + result.stderr)

    assert result.returncode != 0 and "=====" in result.stderr
    assert failure_line(log) == f"run does not exist (no config.yaml): {run}"


def test_a_steps_report_and_error_lines_are_each_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unbuffered (PYTHONUNBUFFERED), print writes a line and its newline apart, and two torchrun ranks' lines
    then ran together on their shared stream (the test above failed so): each line is one write."""
    from moeloop.steps.common import print_json
    from moeloop.steps.errors import run_cli

    class Writes(list):
        def write(self, text: str) -> int:
            self.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    out, err = Writes(), Writes()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    print_json({"skipped": "already committed"})

    def refuse() -> None:
        raise MoeloopError("run does not exist")

    with pytest.raises(SystemExit):
        run_cli(refuse)
    assert out == ['{"skipped": "already committed"}\n']
    assert err == ["error: run does not exist\n"]
