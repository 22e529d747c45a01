"""`moeloop run` as a user runs it, its output piped: Ctrl-C and the line that says how to resume, the resumed run's
progress (SFT's steps, one line per iteration with its ETA, no redrawn frames), what its last line says when it ran
and when there was nothing left, and its step logs read back with `moeloop logs`."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import SMALL_TRANSFORMERS_ROLLOUT, small_config
from tests.processes import TIMEOUT, cli_command, moeloop_cli, start_process
from moeloop.workflows.local.logs import log_folder


@pytest.mark.usefixtures("private_cache")
def test_interrupted_resumed_finished_and_its_logs(tmp_path: Path) -> None:
    config = small_config(iterations=1, rollout={**SMALL_TRANSFORMERS_ROLLOUT, "num_shards": 1})
    path = tmp_path / "run.yaml"
    path.write_text(config.to_json())
    root = tmp_path / "root"
    uri = f"{root}/{config.run_name}"
    command = ["run", str(path), "--root", str(root)]
    logs = tmp_path / log_folder(uri)

    # Ctrl-C (the terminal's SIGINT to the whole foreground group) once start runs. The run takes SIGINT as a
    # terminal's job does: a suite started in the background by a script (`make test &`) has it ignored, and
    # would hand that on.
    interrupted = start_process(
        cli_command(*command),
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    deadline = time.monotonic() + TIMEOUT
    while not (logs / "start.log").exists() and interrupted.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(interrupted.pid, signal.SIGINT)
    _, stderr = interrupted.communicate(timeout=TIMEOUT)
    assert interrupted.returncode == 130, stderr
    again = f"moeloop run {path} --root {root}"
    resumes = f"error: interrupted; `{again}` resumes the run after its last published iteration"
    assert stderr.splitlines()[-1] == resumes

    done = moeloop_cli(*command, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stdout + done.stderr  # piped: nothing redrawn
    lines = done.stderr.splitlines()
    assert lines[0] == f"run {uri}: 1 iteration, step logs in {log_folder(uri)}/"
    sft = [line.split(", loss ")[0] for line in lines if line.startswith("start: SFT step")]
    assert sft == ["start: SFT step 1/3", "start: SFT step 2/3", "start: SFT step 3/3"]  # each, none missed
    metrics = done.stdout.splitlines()
    assert metrics[0].startswith("iteration   0: eval_reward_mean ")
    assert metrics[1].startswith("iteration   1: ") and metrics[1].endswith(" elapsed, ETA 0:00:00]")
    assert "[1/1 iterations, " in metrics[1] and len(metrics) == 2
    assert lines[-1].startswith("done: iteration 1 in ") and lines[-1].endswith(f"; metrics in {uri}/metrics/")

    nothing = moeloop_cli(*command, cwd=tmp_path)
    assert nothing.returncode == 0, nothing.stderr
    assert nothing.stderr.splitlines()[-1] == (
        f"done: nothing to run, the run had reached iteration 1 already; metrics in {uri}/metrics/"
    )

    train = moeloop_cli("logs", uri, "it1-train", cwd=tmp_path)
    assert train.returncode == 0 and train.stdout == (logs / "it1-train.log").read_text() != ""
    every = moeloop_cli("logs", uri, cwd=tmp_path)
    assert {line.split(": ", 1)[0] for line in every.stdout.splitlines()} >= {"start", "it1-train", "it1-eval"}
    missing = moeloop_cli("logs", uri, "it9-train", cwd=tmp_path)
    assert missing.returncode == 2 and missing.stderr.startswith(f"error: run {uri} has no log of task 'it9-train'")

