"""What a user of Argo's or HF's tools reaches for first in the `moeloop` command: `--version`, `lint -` reading
standard input, `-o json|yaml` on plan and report, and a config with several problems named in full."""

from __future__ import annotations

import json
import subprocess
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

from tests.conftest import small_config
from tests.processes import TIMEOUT, cli_command, moeloop_cli, start_process
from moeloop.steps.config import parse_config
from moeloop.steps.errors import MoeloopError
from moeloop.steps.storage.run import RunStorage
from moeloop.workflows.render.loop import render


def lint_stdin(*args: str, stdin: str) -> subprocess.CompletedProcess[str]:
    """`moeloop lint ARGS` with stdin on its standard input."""
    command = cli_command("lint", *args)
    process = start_process(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = process.communicate(stdin, timeout=TIMEOUT)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def test_version() -> None:
    result = moeloop_cli("--version")
    assert (result.returncode, result.stdout) == (0, f"moeloop {version('moeloop')}\n")


def test_every_command_parses_from_a_source_tree_with_no_installed_distribution(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkout on PYTHONPATH (a GPU machine's tests, `tests/gpu/test_cuda.py`'s `moeloop run`) has no package
    metadata: the parser, built for every command, failed there with PackageNotFoundError."""
    from importlib.metadata import PackageNotFoundError

    from moeloop.workflows import cli

    def not_installed(name: str) -> str:
        raise PackageNotFoundError(name)

    monkeypatch.setattr(cli, "version", not_installed)
    assert cli.parser().parse_args(["run", "configs/tiny.yaml"]).command == "run"
    with pytest.raises(SystemExit) as exited:
        cli.parser().parse_args(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == "moeloop (not installed: run from a source tree)\n"


def test_lint_reads_standard_input() -> None:
    rendered = render(small_config(), "s3://bucket/runs/x")
    good = yaml.safe_dump_all(list(rendered.values()))
    read = lint_stdin("-", stdin=good)
    assert (read.returncode, read.stdout) == (0, "ok: -\n")
    bad = "apiVersion: argoproj.io/v1alpha1\nkind: Workflow\nmetadata: {name: w}\n"
    bad += "spec: {entrypoint: main, templatez: []}\n"
    refused = lint_stdin("-", stdin=bad)
    assert refused.returncode == 2
    assert refused.stdout.splitlines()[0].startswith("<stdin>: Workflow/w: spec: ")
    assert "templatez" in refused.stdout
    twice = lint_stdin("-", "-", stdin=good)
    assert (twice.returncode, twice.stderr) == (2, "error: lint reads standard input once: give `-` at most once\n")


def test_a_config_with_several_problems_names_every_one() -> None:
    data = json.loads(small_config().to_json())
    data["rollout"]["num_shard"] = 2
    data["trainer"]["learning_rate"] = "fast"
    data["seed"] = "x"
    with pytest.raises(MoeloopError) as raised:
        parse_config(data, "run.yaml")
    message = str(raised.value)
    assert message.startswith("config run.yaml: 3 problems: ")
    assert "\n" not in message
    for problem in ("rollout.num_shard: unknown key", "trainer.learning_rate: ", "seed: "):
        assert problem in message
    data = json.loads(small_config().to_json()) | {"sed": 1}
    with pytest.raises(MoeloopError, match=r"^config run\.yaml: sed: unknown key$"):  # one: as before
        parse_config(data, "run.yaml")


def test_plan_and_report_as_data(tmp_path: Path) -> None:
    target = ("configs/eks.yaml", "--target", "configs/plan-qwen3-30b-h200.yaml")
    as_json, as_yaml = moeloop_cli("plan", *target, "-o", "json"), moeloop_cli("plan", *target, "--output", "yaml")
    assert as_json.returncode == as_yaml.returncode == 0, as_json.stderr + as_yaml.stderr
    assert yaml.safe_load(as_yaml.stdout) == json.loads(as_json.stdout)
    assert json.loads(moeloop_cli("plan", *target, "--format", "json").stdout) == json.loads(as_json.stdout)

    storage = RunStorage(str(tmp_path / "run"))
    storage.write_bytes(RunStorage.CONFIG, b"run_name: x\n")  # a run, as far as report asks
    metrics = [{"iteration": i, "eval_reward_mean": 0.25 * i, "staleness": 0} for i in (0, 1)]
    for iteration_metrics in metrics:
        storage.write_json(storage.metrics(iteration_metrics["iteration"]), iteration_metrics)
    report_json = moeloop_cli("report", storage.uri, "-o", "json")
    assert report_json.returncode == 0, report_json.stderr
    assert json.loads(report_json.stdout) == metrics
    assert yaml.safe_load(moeloop_cli("report", storage.uri, "-o", "yaml").stdout) == metrics
