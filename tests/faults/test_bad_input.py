"""Bad input: every case gives a one-line `error: ...` naming the problem, a non-zero exit, and leaves
LATEST untouched (or absent) and nothing half-written. The real CLIs run as processes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO
from tests.processes import TIMEOUT, cli_command, moeloop_cli, run_step, start_process
from moeloop.workflows.local.logs import LOGS, log_folder

# Every test's processes find the checkpoint cache in its own folder.
pytestmark = pytest.mark.usefixtures("private_cache")

TINY = REPO / "configs" / "tiny.yaml"
DATA = REPO / "configs" / "data"


# ---------------------------------------------------------------------------------------------
# Helpers


def tiny_config(**changes: Any) -> dict[str, Any]:
    """configs/tiny.yaml as a dict, prompts as absolute paths; changes are dotted keys -> values."""
    data = yaml.safe_load(TINY.read_text())
    data["task"]["train_prompts"] = str(DATA / "reverse-train.jsonl")
    data["task"]["eval_prompts"] = str(DATA / "reverse-eval.jsonl")
    for dotted, value in changes.items():
        set_dotted(data, dotted, value)
    return data


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        data = data[key]
    data[last] = value


def write_config(folder: Path, data: dict[str, Any], name: str = "config.yaml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def unique_run_name() -> str:
    return f"bad-input-{uuid.uuid4().hex[:8]}"


def assert_user_error(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    """A non-zero exit, no traceback, stderr's last line is `error: ...` and names every needle."""
    output = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode != 0, output
    assert "Traceback" not in result.stderr, output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines, output
    last = lines[-1]
    assert last.startswith("error: "), output
    for needle in needles:
        assert needle in last, f"{needle!r} not named in: {last}"
    return last


def snapshot(root: Path) -> dict[str, str]:
    """Every file under root (relative path -> sha256): equal snapshots mean nothing was written."""
    if not root.exists():
        return {}
    return {
        path.relative_to(root).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def assert_nothing_created(root: Path, run_name: str) -> None:
    assert not root.exists(), f"created under the storage root: {sorted(snapshot(root))}"
    assert not list((REPO / LOGS).glob(f"{run_name}-*")), "the runner made a log folder for a refused run"


# ---------------------------------------------------------------------------------------------
# `moeloop run` refuses bad configs before writing anything


@pytest.mark.parametrize(
    ("dotted", "value", "named"),
    [
        pytest.param("rollout.samples_per_promt", 8, "rollout.samples_per_promt: unknown key", id="unknown-key"),
        pytest.param("iterations", "many", "iterations: ", id="iterations-not-int"),
        pytest.param("rollout.num_shards", 1.5, "rollout.num_shards: ", id="num-shards-fractional"),
        pytest.param("algorithm.scale_rewards", "sometimes", "algorithm.scale_rewards: ", id="bool-not-bool"),
    ],
)
def test_run_rejects_a_config_with_a_bad_key(tmp_path: Path, dotted: str, value: Any, named: str) -> None:
    name = unique_run_name()
    config = write_config(tmp_path, tiny_config(run_name=name, **{dotted: value}))
    root = tmp_path / "root"

    result = moeloop_cli("run", str(config), "--root", str(root), "--no-progress")

    last = assert_user_error(result, named, str(config))
    assert f"error: config {config}: {dotted}: " in last
    assert_nothing_created(root, name)


@pytest.mark.parametrize("which", ["train_prompts", "eval_prompts"])
def test_run_rejects_a_missing_prompt_file(tmp_path: Path, which: str) -> None:
    name = unique_run_name()
    missing = tmp_path / f"no-such-{which}.jsonl"
    config = write_config(tmp_path, tiny_config(run_name=name, **{f"task.{which}": str(missing)}))
    root = tmp_path / "root"

    result = moeloop_cli("run", str(config), "--root", str(root), "--no-progress")

    assert_user_error(result, "prompt file not found", str(missing))
    assert_nothing_created(root, name)


def test_run_resolves_a_relative_prompt_path_against_the_config_and_names_it(tmp_path: Path) -> None:
    name = unique_run_name()
    config = write_config(
        tmp_path / "configs", tiny_config(run_name=name, **{"task.train_prompts": "data/missing.jsonl"})
    )
    root = tmp_path / "root"

    result = moeloop_cli("run", str(config), "--root", str(root), "--no-progress")

    assert_user_error(result, "prompt file not found", str(tmp_path / "configs" / "data" / "missing.jsonl"))
    assert_nothing_created(root, name)


@pytest.mark.parametrize(
    ("path", "named"),
    [
        pytest.param("nosuch.module:fn", "No module named 'nosuch'", id="no-module"),
        pytest.param("moeloop.steps.demo_task:nosuch", "has no attribute 'nosuch'", id="no-function"),
    ],
)
def test_run_rejects_a_reward_path_that_does_not_import(tmp_path: Path, path: str, named: str) -> None:
    name = unique_run_name()
    data = tiny_config(run_name=name)
    data["reward"]["functions"] = [
        {"path": "moeloop.steps.demo_task:reverse_positions", "weight": 1.0},
        {"path": path, "weight": 0.5},
    ]
    config = write_config(tmp_path, data)
    root = tmp_path / "root"

    result = moeloop_cli("run", str(config), "--root", str(root), "--no-progress")

    assert_user_error(result, f"reward function {path!r} does not import", named)
    assert_nothing_created(root, name)


def test_run_rejects_a_reward_path_without_a_function(tmp_path: Path) -> None:
    name = unique_run_name()
    data = tiny_config(run_name=name)
    data["reward"]["functions"] = [{"path": "moeloop.steps.demo_task"}]
    config = write_config(tmp_path, data)
    root = tmp_path / "root"

    result = moeloop_cli("run", str(config), "--root", str(root), "--no-progress")

    assert_user_error(result, "reward.functions.0.path", "moeloop.steps.demo_task")
    assert_nothing_created(root, name)


@pytest.mark.parametrize(
    ("environment", "named"),
    [
        pytest.param(
            {"package": "no-such-env==1.0", "name": "no-such-env"},
            "rollout.environment: no environment 'no-such-env' is installed",
            id="not-installed",
        ),
        pytest.param(
            {"package": "calc-env", "name": "calc-env", "args": {"size": 3}},
            "rollout.environment 'calc-env' does not load: ",
            id="does-not-load",
        ),
    ],
)
def test_run_rejects_an_environment_that_does_not_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, environment: dict[str, Any], named: str
) -> None:
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(REPO / "tests" / "environments"), os.environ.get("PYTHONPATH", "")])
    )
    name = unique_run_name()
    data = tiny_config(run_name=name, **{"model.tokenizer": {"kind": "bpe"}})
    data["task"] = {"source": "environment"}
    data["rollout"]["environment"] = environment
    config = write_config(tmp_path, data)
    root = tmp_path / "root"

    result = moeloop_cli("run", str(config), "--root", str(root), "--no-progress")

    assert_user_error(result, named)
    assert_nothing_created(root, name)


# ---------------------------------------------------------------------------------------------
# Steps on a run that does not exist, or on an iteration whose inputs are missing


@pytest.mark.slow
def test_rollout_on_a_run_that_does_not_exist_names_the_run(tmp_path: Path) -> None:
    run = tmp_path / "does-not-exist"

    result = run_step("rollout", run, 1, "--shard", "0", "--num-shards", "2")

    assert_user_error(result, "run does not exist", str(run))
    assert not run.exists()


def test_publish_on_a_run_that_does_not_exist_names_the_run(tmp_path: Path) -> None:
    run = tmp_path / "does-not-exist"

    result = run_step("publish", run, 1)

    assert_user_error(result, "run does not exist", str(run))
    assert not run.exists()


@pytest.fixture(scope="module")
def started_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run after its start step (checkpoint 0 and LATEST), built in-process with 2 SFT steps."""
    from moeloop.steps.config import load_config
    from moeloop.steps.start import start

    config = load_config(TINY)
    sft = config.model.sft.model_copy(update={"steps": 2})
    config = config.model_copy(update={"iterations": 3, "model": config.model.model_copy(update={"sft": sft})})
    root = tmp_path_factory.mktemp("started") / "root"
    run = root / config.run_name
    report = start(str(run), config)
    assert report["sft_steps"] == 2
    assert json.loads((run / "LATEST").read_text())["iteration"] == 0
    return run


def missing_inputs_cases() -> list[Any]:
    """(step, extra args, what the error names, relative to the run)."""
    shard0 = "experience/iter-000002/rollout-00000-of-00002.parquet"
    return [
        pytest.param("train", [], shard0, marks=pytest.mark.slow, id="train-missing-shard"),
        pytest.param("reward", [], shard0, id="reward-missing-shard"),
        pytest.param("publish", [], "trainer/iter-000002", id="publish-missing-trainer-state"),
        pytest.param(
            "evaluate", [], "checkpoints/iter-000002", marks=pytest.mark.slow, id="evaluate-missing-checkpoint"
        ),
        pytest.param(
            "rollout",
            ["--shard", "0", "--num-shards", "2"],
            "checkpoints/iter-000001",
            marks=pytest.mark.slow,
            id="rollout-missing-previous-checkpoint",
        ),
    ]


@pytest.mark.parametrize(("name", "extra", "named"), missing_inputs_cases())
def test_step_of_an_iteration_whose_inputs_are_missing(
    started_run: Path, tmp_path: Path, name: str, extra: list[str], named: str
) -> None:
    latest_before = (started_run / "LATEST").read_bytes()
    before = snapshot(started_run)

    result = run_step(name, started_run, 2, *extra)

    assert_user_error(result, f"{started_run}/{named}")
    assert (started_run / "LATEST").read_bytes() == latest_before
    assert json.loads(latest_before)["iteration"] == 0
    assert snapshot(started_run) == before, "the failed step wrote into the run"
    assert not any(".tmp-" in path for path in snapshot(started_run))


@pytest.mark.parametrize("iteration", ["0", "4"])
def test_step_outside_the_runs_iterations(started_run: Path, tmp_path: Path, iteration: str) -> None:
    before = snapshot(started_run)

    result = run_step("publish", started_run, iteration)

    assert_user_error(result, f"iteration {iteration} is outside this run's iterations 1..3")
    assert snapshot(started_run) == before


# ---------------------------------------------------------------------------------------------
# Starting a run again with another config


@pytest.fixture
def run_copy(started_run: Path, tmp_path: Path) -> Path:
    """A private copy of the started run, at <tmp>/root/<run name> like the original."""
    copy = tmp_path / "root" / started_run.name
    shutil.copytree(started_run, copy)
    return copy


def start_config(tmp_path: Path, **changes: Any) -> Path:
    """The config the started run was made with (tiny.yaml, 2 SFT steps, 3 iterations), plus changes."""
    return write_config(tmp_path / "configs", tiny_config(**{"iterations": 3, "model.sft.steps": 2, **changes}))


@pytest.mark.slow
def test_start_refuses_a_config_that_differs_and_names_the_key(run_copy: Path, tmp_path: Path) -> None:
    config = start_config(tmp_path, **{"rollout.temperature": 0.7})
    before = snapshot(run_copy)
    stored = (run_copy / "config.yaml").read_bytes()

    result = run_step("start", run_copy, 0, "--config", str(config))

    assert_user_error(result, "already holds a different config", "rollout.temperature")
    assert (run_copy / "config.yaml").read_bytes() == stored
    assert snapshot(run_copy) == before


@pytest.mark.slow
def test_start_accepts_a_config_that_changes_only_iterations(run_copy: Path, tmp_path: Path) -> None:
    config = start_config(tmp_path, iterations=5, storage_root="elsewhere")
    stored = yaml.safe_load((run_copy / "config.yaml").read_text())
    commit = (run_copy / "checkpoints" / "iter-000000" / "COMMIT").read_bytes()

    result = run_step("start", run_copy, 0, "--config", str(config))

    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"skipped": "checkpoint 0 already committed"}
    now = yaml.safe_load((run_copy / "config.yaml").read_text())
    assert now["iterations"] == 5
    assert {k: v for k, v in now.items() if k not in ("iterations", "storage_root")} == {
        k: v for k, v in stored.items() if k not in ("iterations", "storage_root")
    }
    assert (run_copy / "checkpoints" / "iter-000000" / "COMMIT").read_bytes() == commit
    assert json.loads((run_copy / "LATEST").read_text())["iteration"] == 0


@pytest.mark.slow
def test_resumed_local_run_refuses_a_config_that_differs(run_copy: Path, tmp_path: Path) -> None:
    """`moeloop run` on an existing run must not carry on with another config: the steps read the stored
    one, so a changed temperature would be silently ignored. Only the start step (which compares the
    configs) may run. Runs in tmp_path so that its step logs do not land in the repository; stopped as
    soon as it launches any other step."""
    config = start_config(tmp_path, **{"rollout.temperature": 0.7})
    before = snapshot(run_copy)
    logs = tmp_path / log_folder(str(run_copy))
    process = start_process(
        cli_command("run", str(config), "--root", str(run_copy.parent), "--no-progress"),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    others: list[str] = []
    deadline = time.monotonic() + TIMEOUT
    while process.poll() is None and time.monotonic() < deadline:
        # warm-*.log: the workers' imports, started with the run (workflows/local/launch.py:warm_workers), not steps
        others = sorted(p.name for p in logs.glob("*.log") if p.name != "start.log" and not p.name.startswith("warm-"))
        if others:
            break
        time.sleep(0.05)
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)  # the runner's own session: it and the steps it started
        process.wait(timeout=30)
    stdout, stderr = process.communicate()

    assert not others, f"the runner started {others} with a config that differs from the run's config.yaml"
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    assert_user_error(result, "step start failed", "already holds a different config", "rollout")
    assert snapshot(run_copy) == before


# ---------------------------------------------------------------------------------------------
# moeloop lint

MANIFEST = """\
apiVersion: argoproj.io/v1alpha1
kind: Workflow
metadata:
  generateName: hello-
spec:
  entrypoint: main
  {service_account_key}: default
  templates:
    - name: main
      container:
        image: busybox
        command: [echo, hello]
"""


def test_lint_fails_on_a_manifest_with_an_unknown_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(MANIFEST.format(service_account_key="serviceAcountName"))
    good = tmp_path / "good.yaml"
    good.write_text(MANIFEST.format(service_account_key="serviceAccountName"))

    result = moeloop_cli("lint", str(bad))

    assert_user_error(result, "1 lint error(s)")
    assert f"{bad}: Workflow/hello-: spec:" in result.stdout
    assert "serviceAcountName" in result.stdout
    control = moeloop_cli("lint", str(good))
    assert control.returncode == 0, control.stdout + control.stderr
    assert control.stdout.strip() == f"ok: {good}"
