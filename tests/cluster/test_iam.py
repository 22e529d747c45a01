"""The least-privilege IAM policies in manifests/iam/: well-formed, and, evaluated by a tiny IAM evaluator
against the storage layout's own paths, each step may do what it does and nothing it must not."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path
from typing import Any

import pytest

from moeloop.steps.rl.checkpoint import METADATA, OPTIMIZER_DIR
from moeloop.steps.storage.run import RunStorage
from tests.conftest import REPO

POLICIES = REPO / "manifests" / "iam"
BUCKET, PREFIX = "acme-rl", "runs/tiny"  # what RUN_BUCKET and RUN_PREFIX stand for here
STEPS = ("start", "rollout", "reward", "train", "publish", "evaluate")
READ, WRITE, LIST = "s3:GetObject", "s3:PutObject", "s3:ListBucket"

SHARD = RunStorage.rollout_shard(1, 0, 2)
CHECKPOINT_1 = f"{RunStorage.checkpoint(1)}/model.safetensors"
CHECKPOINT_0 = f"{RunStorage.checkpoint(0)}/model.safetensors"
TRAINER_1 = f"{RunStorage.trainer_state(1)}/{OPTIMIZER_DIR}/{METADATA}"
EXPERIENCE_COMMIT = f"{RunStorage.experience(1)}/COMMIT"
TRAIN_PROMPTS = [f"{RunStorage.prompt_set('train')}/{name}" for name in ("COMMIT", "prompts-00000-of-00001.parquet")]
EVAL_PROMPTS = [f"{RunStorage.prompt_set('eval')}/{name}" for name in ("COMMIT", "prompts-00000-of-00001.parquet")]
OLD_PROMPTS = {split: RunStorage.prompt_lines(split) for split in ("train", "eval")}  # runs started before the sets


def policy(step: str) -> dict[str, Any]:
    text = (POLICIES / f"{step}.json").read_text().replace("RUN_BUCKET", BUCKET).replace("RUN_PREFIX", PREFIX)
    return json.loads(text)


def as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else value


def matches(pattern: str, value: str) -> bool:
    """IAM wildcards: '*' any run of characters ('/' included), '?' any one; nothing else is special."""
    return fnmatch.fnmatchcase(value, pattern.replace("[", "[[]"))


def conditions_hold(statement: dict[str, Any], context: dict[str, str]) -> bool:
    for operator, keys in statement.get("Condition", {}).items():
        assert operator == "StringLike", f"the evaluator knows StringLike only, not {operator}"
        for key, patterns in keys.items():
            if key not in context or not any(matches(p, context[key]) for p in as_list(patterns)):
                return False
    return True


def allowed(document: dict[str, Any], action: str, resource: str, context: dict[str, str] | None = None) -> bool:
    """IAM's rule for one identity policy: some Allow statement matches and no Deny statement does."""
    context = context or {}

    def applies(statement: dict[str, Any]) -> bool:
        return (
            any(matches(a, action) for a in as_list(statement["Action"]))
            and any(matches(r, resource) for r in as_list(statement["Resource"]))
            and conditions_hold(statement, context)
        )

    statements = document["Statement"]
    if any(s["Effect"] == "Deny" and applies(s) for s in statements):
        return False
    return any(s["Effect"] == "Allow" and applies(s) for s in statements)


def can(step: str, action: str, relative: str) -> bool:
    return allowed(policy(step), action, f"arn:aws:s3:::{BUCKET}/{PREFIX}/{relative}")


def can_list(step: str, prefix: str) -> bool:
    return allowed(policy(step), LIST, f"arn:aws:s3:::{BUCKET}", {"s3:prefix": prefix})


# What each step reads and writes (steps/README.md), as the storage layout names it.
NEEDS = {
    "start": {
        READ: [RunStorage.CONFIG, RunStorage.LATEST, f"{RunStorage.checkpoint(0)}/COMMIT"],
        WRITE: [RunStorage.CONFIG, *TRAIN_PROMPTS, *EVAL_PROMPTS, RunStorage.MODEL_SOURCE]
        + [CHECKPOINT_0]
        + [f"{RunStorage.checkpoint(0)}/COMMIT", RunStorage.report(0, "start"), RunStorage.LATEST],
    },
    "rollout": {
        READ: [RunStorage.CONFIG, *TRAIN_PROMPTS, OLD_PROMPTS["train"], CHECKPOINT_0, SHARD]
        + [f"{RunStorage.checkpoint(0)}/COMMIT"],
        WRITE: [SHARD, RunStorage.report(1, "rollout-0")],
    },
    "reward": {
        READ: [RunStorage.CONFIG, *TRAIN_PROMPTS, OLD_PROMPTS["train"], SHARD, EXPERIENCE_COMMIT],
        WRITE: [RunStorage.rewards(1), EXPERIENCE_COMMIT, RunStorage.report(1, "reward")],
    },
    "train": {
        READ: [RunStorage.CONFIG, SHARD, RunStorage.rewards(1), EXPERIENCE_COMMIT, CHECKPOINT_0]
        + [f"{RunStorage.trainer_state(0)}/COMMIT", f"{RunStorage.trainer_state(1)}/COMMIT"],
        WRITE: [TRAINER_1, f"{RunStorage.trainer_state(1)}/COMMIT", RunStorage.report(1, "train")],
    },
    "publish": {
        READ: [RunStorage.CONFIG, TRAINER_1, f"{RunStorage.trainer_state(1)}/COMMIT", RunStorage.LATEST]
        + [f"{RunStorage.checkpoint(1)}/COMMIT"],
        WRITE: [CHECKPOINT_1, f"{RunStorage.checkpoint(1)}/COMMIT", RunStorage.LATEST, RunStorage.report(1, "publish")],
    },
    "evaluate": {
        READ: [RunStorage.CONFIG, *EVAL_PROMPTS, OLD_PROMPTS["eval"], CHECKPOINT_1, RunStorage.report(1, "train")]
        + [RunStorage.metrics(1)],
        WRITE: [RunStorage.metrics(1), RunStorage.report(1, "evaluate")],
    },
}

# What each step must not be able to do: the data of the other roles.
FORBIDDEN_WRITES = {
    "start": [CHECKPOINT_1, SHARD, TRAINER_1, RunStorage.metrics(0), *OLD_PROMPTS.values()],
    "rollout": [CHECKPOINT_1, f"{RunStorage.checkpoint(1)}/COMMIT", RunStorage.LATEST, RunStorage.rewards(1)]
    + TRAIN_PROMPTS
    + [EXPERIENCE_COMMIT, TRAINER_1, RunStorage.CONFIG, RunStorage.report(1, "train")],
    "reward": [SHARD, CHECKPOINT_1, TRAINER_1, RunStorage.LATEST, RunStorage.CONFIG],
    "train": [SHARD, RunStorage.rewards(1), EXPERIENCE_COMMIT, CHECKPOINT_1, RunStorage.LATEST, RunStorage.CONFIG],
    "publish": [SHARD, RunStorage.rewards(1), TRAINER_1, RunStorage.CONFIG, RunStorage.metrics(1)],
    "evaluate": [CHECKPOINT_1, RunStorage.LATEST, SHARD, TRAINER_1, RunStorage.CONFIG],
}


@pytest.mark.parametrize("step", STEPS)
def test_policy_is_a_well_formed_iam_document_scoped_to_the_run(step: str) -> None:
    document = json.loads((POLICIES / f"{step}.json").read_text())
    assert document["Version"] == "2012-10-17"
    assert isinstance(document["Statement"], list) and document["Statement"]
    for statement in document["Statement"]:
        assert set(statement) <= {"Sid", "Effect", "Action", "Resource", "Condition"}
        assert statement["Effect"] in ("Allow", "Deny")
        assert all(a.startswith("s3:") and "*" not in a for a in as_list(statement["Action"]))
        for resource in as_list(statement["Resource"]):
            assert resource == "arn:aws:s3:::RUN_BUCKET" or resource.startswith("arn:aws:s3:::RUN_BUCKET/RUN_PREFIX/")
        if statement["Action"] == LIST or LIST in as_list(statement["Action"]):
            assert statement["Condition"] == {"StringLike": {"s3:prefix": ["RUN_PREFIX/*"]}}


@pytest.mark.parametrize("step", STEPS)
def test_each_step_may_do_what_it_does(step: str) -> None:
    for action, paths in NEEDS[step].items():
        denied = [path for path in paths if not can(step, action, path)]
        assert not denied, f"{step} lacks {action} on {denied}"
    assert can_list(step, f"{PREFIX}/")  # the storage module's first request checks the run's prefix
    assert can_list(step, f"{PREFIX}/{RunStorage.experience(1)}/")


@pytest.mark.parametrize("step", STEPS)
def test_no_step_may_write_another_roles_data_delete_or_leave_the_run(step: str) -> None:
    writable = [path for path in FORBIDDEN_WRITES[step] if can(step, WRITE, path)]
    assert not writable, f"{step} may write {writable}"
    assert not can(step, "s3:DeleteObject", SHARD)
    assert not allowed(policy(step), READ, f"arn:aws:s3:::{BUCKET}/runs/other/{RunStorage.CONFIG}")
    assert not allowed(policy(step), WRITE, f"arn:aws:s3:::{BUCKET}/runs/other/{RunStorage.LATEST}")
    assert not can_list(step, "runs/other/")
    assert not can_list(step, "")


def test_the_rollout_and_train_roles_as_the_issue_states_them() -> None:
    """rollout: reads checkpoints, writes experience, never checkpoints; train: reads experience, writes
    its state (publish turns it into checkpoints/), never experience."""
    assert can("rollout", READ, CHECKPOINT_1) and can("rollout", WRITE, SHARD)
    assert not can("rollout", WRITE, CHECKPOINT_1) and not can("rollout", WRITE, f"{RunStorage.checkpoint(1)}/COMMIT")
    assert can("train", READ, SHARD) and can("train", WRITE, TRAINER_1)
    assert not can("train", WRITE, SHARD) and not can("train", WRITE, EXPERIENCE_COMMIT)


def test_the_evaluator_itself() -> None:
    document = {
        "Version": "2012-10-17",
        "Statement": [
            {"Effect": "Allow", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::b/p/*"},
            {"Effect": "Deny", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::b/p/secret/*"},
        ],
    }
    assert allowed(document, READ, "arn:aws:s3:::b/p/a/b.txt")
    assert not allowed(document, READ, "arn:aws:s3:::b/p/secret/x")  # an explicit Deny wins
    assert not allowed(document, WRITE, "arn:aws:s3:::b/p/a")  # no Allow: implicitly denied
    assert not allowed(document, READ, "arn:aws:s3:::b/q/a")


def test_every_step_has_a_policy_and_nothing_else_is_there() -> None:
    policies = {p.stem for p in Path(POLICIES).glob("*.json")} - {"roles"}
    assert sorted(policies) == sorted((*STEPS, "argo-artifacts"))


# Which policies each service account's IAM role gets (manifests/iam/roles.json): the steps its pods run.
ROLES = json.loads((POLICIES / "roles.json").read_text())


def role_can(account: str, action: str, relative: str) -> bool:
    return any(
        allowed(policy(step), action, f"arn:aws:s3:::{BUCKET}/{PREFIX}/{relative}")
        for step in ROLES[account]
        if step in STEPS
    )


def test_each_service_account_may_do_what_its_steps_do_and_no_more() -> None:
    """cpu runs start, rule rewards, evaluate (and plan); memory runs publish; the GPU roles their own step."""
    runs = {"moeloop-rollout": ["rollout"], "moeloop-reward": ["reward"], "moeloop-train": ["train"]}
    runs |= {"moeloop-cpu": ["start", "reward", "evaluate"], "moeloop-memory": ["publish"], "moeloop-orchestrator": []}
    for account, steps in runs.items():
        assert [p for p in ROLES[account] if p in STEPS] == steps, account
        assert "argo-artifacts" in ROLES[account], f"{account}: Argo archives every pod's log with its credentials"
        for step in steps:
            for action, paths in NEEDS[step].items():
                assert all(role_can(account, action, path) for path in paths), (account, step)
    # The separations the issue asks for hold for the shared roles too.
    assert not role_can("moeloop-rollout", WRITE, CHECKPOINT_1) and not role_can("moeloop-train", WRITE, SHARD)
    assert not role_can("moeloop-cpu", WRITE, CHECKPOINT_1) and not role_can("moeloop-cpu", WRITE, TRAINER_1)
    assert not role_can("moeloop-memory", WRITE, SHARD) and not role_can("moeloop-orchestrator", READ, CHECKPOINT_1)


def test_the_artifact_policy_covers_only_this_namespaces_logs() -> None:
    document = json.loads((POLICIES / "argo-artifacts.json").read_text())
    log = "arn:aws:s3:::ARTIFACT_BUCKET/moeloop/tiny-x7k2p/tiny-x7k2p-rollout-123/main.log"
    assert allowed(document, WRITE, log) and allowed(document, READ, log)
    assert not allowed(document, WRITE, "arn:aws:s3:::ARTIFACT_BUCKET/other-namespace/wf/pod/main.log")
    assert not allowed(document, "s3:DeleteObject", log)
    assert not allowed(document, WRITE, f"arn:aws:s3:::{BUCKET}/{PREFIX}/{RunStorage.LATEST}")
