"""What Argo's retry and resubmit do to a finished run, replayed on a real S3 server (SeaweedFS): every task
of the finished iterations executed again, as the pod commands of the DAG (`Task.argv`, each in a new process
forked from one that has imported the steps, and in a fresh checkpoint cache, like a new pod), changes nothing in
the run.

Compared: every object under the run, key -> sha256 of its bytes. Allowed to differ: what lies outside the
run (the steps' logs, the local checkpoint caches) and S3's own metadata (LastModified, and so the ETag of
an identical rewrite such as start's config.yaml); nothing else.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from pathlib import Path

import pytest
import yaml

from moeloop.steps.storage import s3
from moeloop.steps.storage.run import RunStorage
from tests.conftest import SMALL_TRANSFORMERS_ROLLOUT, run_in_process, small_config
from tests.processes import TIMEOUT, start_forked_step
from tests.seaweed import SeaweedS3
from moeloop.workflows.dag import Task, loop_tasks, run_uri, run_values
from moeloop.workflows.local.launch import local_argv


HEARTBEAT = re.compile(r"commands/(trainer|rollout-engine-\d+)\.json")


def snapshot(seaweed: SeaweedS3, uri: str) -> dict[str, str]:
    """Every object under the run but the long-lived processes' heartbeats: key (relative to the run) -> sha256 of
    its bytes."""
    client, prefix = seaweed.client(), s3.parse_s3_uri(uri).key + "/"
    objects = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=seaweed.bucket, Prefix=prefix):
        for entry in page.get("Contents", []):
            if HEARTBEAT.fullmatch(entry["Key"].removeprefix(prefix)):
                continue
            data = client.get_object(Bucket=seaweed.bucket, Key=entry["Key"])["Body"].read()
            objects[entry["Key"].removeprefix(prefix)] = hashlib.sha256(data).hexdigest()
    return objects


def differences(before: dict[str, str], after: dict[str, str]) -> dict[str, str]:
    return {
        key: "added" if key not in before else "removed" if key not in after else "changed"
        for key in sorted(before.keys() | after.keys())
        if before.get(key) != after.get(key)
    }


def execute(tasks: list[Task], run_values: dict[str, str], work: Path) -> None:
    """The tasks as Argo runs them: the DAG's order, those whose dependencies (among tasks) are done side by
    side, each its pod command in a new process (forked from one that has imported the steps) with an empty
    cache. Every one must succeed, finding its work committed (its printed report says it skipped it)."""
    names = {t.name for t in tasks}
    done: set[str] = set()
    waiting = list(tasks)
    while waiting:
        ready = [t for t in waiting if all(d in done or d not in names for d in t.dependencies)]
        running = []
        for task in ready:
            pod = work / f"{task.name}-{uuid.uuid4().hex[:8]}"
            cache = {"MOELOOP_CACHE": str(pod / "cache")}
            pod.mkdir(parents=True)
            running.append((task, start_forked_step(local_argv(task, run_values), pod / "output.log", cache), pod))
        for task, process, pod in running:
            process.join(TIMEOUT)
            output = (pod / "output.log").read_text(errors="replace")
            assert process.exitcode == 0, f"replayed {task.name} failed ({process.exitcode}):\n{output[-2000:]}"
            report = json.loads([line for line in output.splitlines() if line.startswith("{")][-1])
            served = report.get("served") == []  # a long-lived process that found every iteration done
            assert "skipped" in report or served, f"replayed {task.name} did its work again: {report}"
            done.add(task.name)
            waiting.remove(task)


def downstream(tasks: list[Task], name: str) -> list[Task]:
    """The task and every task that depends on it, directly or not, in the DAG's order."""
    reached = {name}
    for task in tasks:  # topological: a task comes after its dependencies
        if reached & set(task.dependencies):
            reached.add(task.name)
    return [t for t in tasks if t.name in reached]


@pytest.mark.parametrize("lifetime", ["iteration", "chunk"])
def test_replaying_every_task_of_a_finished_run_changes_nothing(
    lifetime: str, s3_run_root: str, seaweed: SeaweedS3, tmp_path: Path
) -> None:
    """With lifetime chunk, the trainer and the rollout engines are tasks too: started again on a finished run, they
    find nothing to serve. Their heartbeats (commands/trainer.json, commands/rollout-engine-*.json) say only that
    they ran: they are left out of the comparison."""
    # The transformers engine at small_config's batch (not tiny.yaml's 192 prompts x 16 samples): quicker to start
    # than vLLM and quicker to run, and what a replay does depends on neither.
    config = small_config(iterations=2, rollout=SMALL_TRANSFORMERS_ROLLOUT)
    uri = run_uri(config, s3_run_root)
    run_in_process(config, uri)  # the run to replay: what made it does not matter
    if lifetime == "chunk":  # the same run, as one whose trainer and engines live for the chunk
        sections = {"trainer": {"lifetime": "chunk"}, "rollout": {**SMALL_TRANSFORMERS_ROLLOUT, "lifetime": "chunk"}}
        config = small_config(iterations=2, **sections)
        RunStorage(uri).write_bytes(RunStorage.CONFIG, yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False).encode())
    finished = snapshot(seaweed, uri)
    assert "LATEST" in finished and "metrics/iter-000002.json" in finished
    tasks = loop_tasks(config)
    values = run_values(config, uri)

    # Argo's retry of each task in turn, in the DAG's order: after each one, the run is as it was.
    for task in tasks:
        execute([task], values, tmp_path)
        assert differences(finished, snapshot(seaweed, uri)) == {}, f"replaying {task.name} changed the run"

    # Argo's resubmit after a failure in the middle: the failed task again, then everything downstream of it,
    # siblings side by side.
    resubmitted = downstream(tasks, "it1-train")
    assert [t.name for t in resubmitted][:3] == ["it1-train", "it1-publish", "it1-eval"]
    execute(resubmitted, values, tmp_path)
    assert differences(finished, snapshot(seaweed, uri)) == {}
