"""The reward functions' worker pool (steps/rewards/pool.py) with real worker processes: rewards routed by data_source,
weighted and given their args; every way a function can fail (it hangs past reward.timeout_s, kills its process, calls
sys.exit or os._exit, returns NaN, raises) ends as one line naming the function, the sample and the step under
`on_error: fail`, or as a counted, logged 0 under `zero`, with the batch's other samples scored and no worker left
running; functions that do not import, or that import forever, are refused before any sample; a step killed outright
takes its workers with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moeloop.steps.config_reward import RewardConfig
from moeloop.steps.errors import MoeloopError
from moeloop.steps.rewards import pool as pool_module
from moeloop.steps.rewards.functions import check_reward_routes
from moeloop.steps.rewards.pool import RewardPool
from tests.processes import start_process

FAULTS = {
    "hangs": "took longer than reward.timeout_s (1 s): its worker process was killed",
    "kills_its_process": "ended its worker process (signal SIGKILL)",
    "exits": "called sys.exit(0)",
    "exits_at_once": "ended its worker process (exit code 0)",
    "nan": "returned nan (float): a reward must be a finite number",
    "raises": "raised ValueError: no answer to check against",
}
STEP = "the reward step of iteration 7"


def faulty_settings(on_error: str) -> RewardConfig:
    """Each fault is its own data_source's function, beside the demo's reward at weight 0.5."""
    demo = {"path": "moeloop.steps.demo_task:reverse_positions", "weight": 0.5}
    by_source = {name: [{"path": f"tests.faulty_rewards:{name}"}, demo] for name in FAULTS}
    return RewardConfig(functions=[demo], by_source=by_source, timeout_s=1, on_error=on_error)


def batch(sources: list[str]) -> tuple[list[dict], list[str], list[str]]:
    """A record of each source whose function misbehaves, one that behaves beside it, and a demo record; each
    response right (the demo's reward: 1.0)."""
    records = [{"data_source": s, "answer": "dcba", "fault": fault} for s in sources for fault in (True, False)]
    records.append({"answer": "ab"})
    responses = [r["answer"] for r in records]
    return records, responses, [f"sample 7-{i}-0" for i in range(len(records))]


def worker_processes() -> list[int]:
    """This process's reward workers still running (or not yet reaped)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                command = (entry / "cmdline").read_bytes()
            except (OSError, IndexError, ValueError):
                continue
            if parent == os.getpid() and b"moeloop.steps.rewards.worker" in command:
                found.append(int(entry.name))
    return found


def test_rewards_are_the_weighted_functions_of_each_record_s_data_source() -> None:
    settings = RewardConfig(
        functions=[{"path": "moeloop.steps.demo_task:reverse_positions", "weight": 2.0}],
        by_source={
            "tags": [
                {"path": "moeloop.steps.rewards.verifiers:format_tags", "weight": 0.5, "args": {"tags": ["answer"]}},
                {"path": "moeloop.steps.demo_task:reverse_positions", "weight": 1.0},
            ],
            "unscored": [],
        },
    )
    records = [
        {"answer": "dcba"},
        {"data_source": "other", "answer": "dcba"},
        {"data_source": "tags", "answer": "<answer>1</answer>"},
        {"data_source": "unscored", "answer": "x"},
    ]
    responses = ["dcbx", "dcba", "<answer>1</answer>", "x"]
    with RewardPool(settings, STEP, processes=2) as pool:
        scores = pool.score(records, responses, [f"sample {i}" for i in range(4)])
        again = pool.score(records[:1], ["dcba"], ["sample 0"])  # the same workers, a second batch
    assert scores.rewards == [2.0 * 0.75, 2.0, 0.5 + 1.0, 0.0] and scores.failures == 0
    assert again.rewards == [2.0]
    assert worker_processes() == []


def test_under_on_error_zero_every_fault_counts_0_is_logged_and_the_rest_is_scored(
    capsys: pytest.CaptureFixture[str],
) -> None:
    records, responses, samples = batch(list(FAULTS))
    started = time.monotonic()
    with RewardPool(faulty_settings("zero"), STEP, processes=2) as pool:
        scores = pool.score(records, responses, samples)
    seconds = time.monotonic() - started

    faulty = [i for i, r in enumerate(records) if r.get("fault")]
    assert scores.failures == len(FAULTS)
    assert [scores.rewards[i] for i in faulty] == [0.5] * len(FAULTS)  # the demo's half still counts
    assert [r for i, r in enumerate(scores.rewards) if i not in faulty] == [1.5] * len(FAULTS) + [0.5]
    lines = capsys.readouterr().err.splitlines()
    for (name, why), index in zip(FAULTS.items(), faulty, strict=True):
        line = f"warning: reward function tests.faulty_rewards:{name} {why} on sample 7-{index}-0"
        assert any(
            entry.startswith(line) and entry.endswith(f"in {STEP}; counted as 0 (reward.on_error zero)")
            for entry in lines
        ), line
    assert seconds < 10, "only the hang waits, once, for its time limit"
    assert worker_processes() == []


@pytest.mark.parametrize("fault", list(FAULTS))
def test_under_on_error_fail_a_fault_stops_the_step_in_one_line_naming_function_sample_and_step(fault: str) -> None:
    records, responses, samples = batch([fault])
    with pytest.raises(MoeloopError) as failure, RewardPool(faulty_settings("fail"), STEP, processes=1) as pool:
        pool.score(records, responses, samples)
    message = str(failure.value)
    assert (
        message
        == f"reward function tests.faulty_rewards:{fault} {FAULTS[fault]} on sample 7-0-0 (response 'dcba') in {STEP}"
    )
    assert worker_processes() == [], "the hung or busy worker is killed, the idle ones end"


def test_an_error_line_shows_the_start_of_a_long_response() -> None:
    settings = RewardConfig(functions=[{"path": "tests.faulty_rewards:nan"}])
    with pytest.raises(MoeloopError) as failure, RewardPool(settings, STEP, processes=1) as pool:
        pool.score([{"fault": True}], ["x" * 5000], ["sample 1"])
    assert f"(response '{'x' * 200}...')" in str(failure.value) and len(str(failure.value)) < 400


@pytest.mark.parametrize(
    ("module", "path", "args", "named"),
    [
        pytest.param(
            None,
            "nosuch.module:fn",
            {},
            "reward function 'nosuch.module:fn' does not import: No module named 'nosuch'",
            id="no-module",
        ),
        pytest.param(None, "moeloop.steps.demo_task:nosuch", {}, "has no attribute 'nosuch'", id="no-function"),
        pytest.param(
            "raise RuntimeError('half-written')",
            "broken:f",
            {},
            "does not import: RuntimeError: half-written",
            id="raises",
        ),
        pytest.param(
            "import sys\nsys.exit(0)", "broken:f", {}, "does not import: it called sys.exit(0)", id="sys-exit"
        ),
        pytest.param(
            "import os\nos._exit(0)",
            "broken:f",
            {},
            "importing reward functions moeloop.steps.demo_task:reverse_positions, broken:f ended its process"
            " (exit code 0)",
            id="os-exit",
        ),
        pytest.param(
            None,
            "moeloop.steps.rewards.verifiers:format_tags",
            {"tag": ["answer"]},
            "does not take (record, response, **{'tag': ['answer']}): got an unexpected keyword argument 'tag'",
            id="wrong-args",
        ),
        pytest.param("f = 3", "broken:f", {}, "reward function 'broken:f' is not callable", id="not-callable"),
    ],
)
def test_functions_that_cannot_be_used_are_refused_before_any_sample(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str | None, path: str, args: dict, named: str
) -> None:
    if module is not None:
        (tmp_path / "broken.py").write_text(module + "\n")
        monkeypatch.syspath_prepend(str(tmp_path))  # the workers import from the step's sys.path
    settings = RewardConfig(
        functions=[{"path": "moeloop.steps.demo_task:reverse_positions"}, {"path": path, "args": args}]
    )
    with pytest.raises(MoeloopError) as failure, RewardPool(settings, "moeloop run's check of the config") as pool:
        pool.check()
    assert named in str(failure.value) and str(failure.value).endswith("(moeloop run's check of the config)")
    assert "\n" not in str(failure.value)


def test_an_import_that_never_ends_is_refused_at_its_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "slow_import.py").write_text(
        "import time\ntime.sleep(3600)\ndef f(record, response):\n    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(pool_module, "IMPORT_SECONDS", 1.0)
    settings = RewardConfig(functions=[{"path": "slow_import:f"}])
    refused = r"^importing reward functions slow_import:f took longer than 1 s \(x\)$"
    with pytest.raises(MoeloopError, match=refused), RewardPool(settings, "x") as pool:
        pool.score([{}], [""], ["sample 0"])
    assert worker_processes() == []


def test_a_step_killed_outright_takes_its_workers_with_it(tmp_path: Path) -> None:
    """A step SIGKILLed while a function hangs (no `finally` runs): the kernel ends its worker (PR_SET_PDEATHSIG)."""
    script = (
        "import os, sys\n"
        "from moeloop.steps.config_reward import RewardConfig\n"
        "from moeloop.steps.rewards.pool import RewardPool\n"
        "pool = RewardPool(RewardConfig(functions=[{'path': 'tests.faulty_rewards:hangs'}], timeout_s=600), 'x', 1)\n"
        "pool.start(1)\n"
        "print(pool.workers[0].process.pid, flush=True)\n"
        "pool.score([{'fault': True}], [''], ['sample 0'])\n"
    )
    step = start_process([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    worker = int(step.stdout.readline())
    time.sleep(1.0)  # the worker has imported and is in the hanging call
    os.kill(step.pid, signal.SIGKILL)
    step.wait()
    deadline = time.monotonic() + 10
    while running(worker):
        assert time.monotonic() < deadline, "the worker outlived its step"
        time.sleep(0.05)


def running(pid: int) -> bool:
    """Alive and not a zombie (one that init has not reaped yet has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_data_source_that_no_function_scores_is_refused() -> None:
    settings = RewardConfig(by_source={"math": [{"path": "moeloop.steps.rewards.verifiers:math_verify"}]})
    records = [{"data_source": "math"}, {"data_source": "code"}, {"data_source": "code"}, {}]
    with pytest.raises(
        MoeloopError,
        match=r"^train: no reward function scores data_source 'code' \(2 records\), 'default' \(1 records\)",
    ):
        check_reward_routes(settings, records, "train", rubric=False)
    check_reward_routes(settings, records[:1], "train", rubric=False)
    check_reward_routes(settings.model_copy(update={"functions": settings.by_source["math"]}), records, "train", False)
