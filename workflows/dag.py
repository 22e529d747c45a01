"""The one definition of the loop's DAG. The local runner and the Argo render are both derived from it.

    start -> eval-0
    start -> it1-rollout-{0..K-1} -> it1-reward -> it1-train -> it1-publish -> it1-eval
                                        it1-publish -> it2-rollout-{0..K-1} -> ...

Evaluation hangs off publish, so it runs while the next iteration's rollouts do. With
`rollout.max_staleness` s >= 1, iteration i's rollouts hang off publish i-1-s (start while i-1-s <= 0;
steps/config.py:policy_version): rollout i+1 runs while train i does, and train i and publish i follow their
predecessors instead. Where the trainer and the rollout engines both live for a chunk (`policy_by_delta`), the
rollouts hang off train, not publish: the engines take the policy by the delta the trainer has committed when
train is done, and publish waits for its checkpoint meanwhile.

On Argo a run is a chain of Workflows of `cluster.chunk_iterations` iterations each (workflows/render/):
one chunk is `start -> plan -> iteration_tasks(slots 1..C, root="plan")`, where `plan` decides at run time
which iteration slot 1 is (LATEST + 1). There an iteration's rollout shards are one task of K items, which Argo
expands into these K tasks (workflows/render/chunk.py, `fan_out`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from moeloop.steps.config import MoeloopConfig, policy_version


@dataclass(frozen=True)
class Step:
    """A step: a module of moeloop.steps run as a CLI in a pod of the given placement role."""

    name: str  # the DAG's word for it: its Argo template's name, and its tasks'
    role: str  # rollout | reward | train | cpu | memory: selects cluster.<role> placement
    params: tuple[str, ...]  # per-task parameters, passed as --<param> VALUE
    run_params: tuple[str, ...] = ("run",)  # per-run parameters (workflow arguments)
    torchrun: bool = False  # launched by torchrun as trainer.world_size processes (one plain process at 1)
    outputs: tuple[str, ...] = ()  # report keys exposed as Argo output parameters (steps/outputs.py)
    program: str = ""  # the module moeloop.steps.<program> its pods run; "": the step's name
    # Lives beside the iterations, which talk to it through the run's storage: nothing waits for its end, and the
    # local runner starts it again when it fails, as its Job does on Argo (workflows/render/trainer.py).
    daemon: bool = False

    @property
    def module(self) -> str:
        return f"moeloop.steps.{self.program or self.name}"

    def processes(self, config: MoeloopConfig) -> int:
        return config.trainer.world_size if self.torchrun and not asks_trainer(self, config) else 1

    def argv(self, values: Mapping[str, str], processes: int = 1, rendezvous: Sequence[str] = ()) -> list[str]:
        """The pod's command; values are concrete locally and Argo placeholders in the render.

        Several processes run under torchrun: on this node alone (`--standalone`), or as one node of several
        given the `rendezvous` flags (the multi-node trainer's JobSet)."""
        argv = ["python", "-m", self.module]
        if processes > 1 or rendezvous:
            # `--` ends torchrun's options: it would take --run for an abbreviation of its own --run-path.
            launcher = list(rendezvous) or ["--standalone"]
            argv[2:2] = ["torch.distributed.run", *launcher, f"--nproc-per-node={processes}", "-m"]
            argv.append("--")
        for param in self.run_params + self.params:
            argv += [f"--{param.replace('_', '-')}", values[param]]
        return argv


START = Step("start", "cpu", ("iteration",), ("run", "config", "iterations", "model"), outputs=("source", "seconds"))
PLAN = Step(
    "plan", "cpu", ("chunk",), outputs=("latest", "first", "count", "more", "target", "evaluate"), program="chunk"
)
ROLLOUT = Step(
    "rollout",
    "rollout",
    ("iteration", "shard", "num_shards"),
    outputs=("samples", "response_tokens", "tokens_per_second", "engine", "seconds"),
)
# Rule rewards run on CPU; reward models (when configured) move it to the `reward` role's GPUs (step_role).
REWARD = Step("reward", "cpu", ("iteration",), outputs=("samples", "reward_mean", "seconds"))
TRAIN = Step(
    "train",
    "train",
    ("iteration",),
    torchrun=True,
    outputs=("loss", "kl", "grad_norm", "clip_fraction_binding", "entropy", "train_tokens_per_second", "seconds"),
)
# trainer.lifetime chunk: the chunk's trainer, which holds the policy in memory across the chunk's iterations up to
# `last` (steps/trainer.py); each iteration's train step then asks it for the update, from a CPU pod.
# How many times a long-lived process that fails is started again: by the local runner, and on Argo by the trainer's
# JobSet (a rollout engine's: cluster.spot_retry.limit, workflows/render/daemons.py).
DAEMON_RESTARTS = 3
TRAINER = Step("trainer", "train", ("last",), torchrun=True, daemon=True)
# On Argo, with trainer.lifetime chunk: the chunk ends (its exit handler deletes the trainer's JobSet) and the next is
# submitted only once the trainer has committed the state of the chunk's last iteration (steps/trainer_state.py).
# Not a task of the loop: locally the runner waits for the trainer's own exit, which follows that commit.
TRAINER_STATE = Step("trainer-state", "cpu", ("last",), outputs=("seconds",), program="trainer_state")
# rollout.lifetime chunk: shard k's rollout engine, which keeps its engine across the chunk's iterations up to `last`
# (steps/rollout_engine.py); each iteration's rollout step of shard k then asks it for the shard, from a CPU pod.
ROLLOUT_ENGINE = Step(
    "rollout-engine", "rollout", ("shard", "num_shards", "last"), daemon=True, program="rollout_engine"
)
# A trainer of several nodes runs in a JobSet's pods, which Argo does not see: this pod after the JobSet reads the
# iteration's committed train report, so that the train template has its figures as outputs and gauges
# (workflows/render/jobset.py). Not a task of the loop: the local runner and a single-node train have no need of it.
TRAIN_REPORT = Step("train-report", "cpu", ("iteration",), outputs=TRAIN.outputs, program="train_report")
# A chunk's exit handler on Argo, where observe.trackers has mlflow: a Workflow that did not succeed ends the
# MLflow run FAILED (workflows/render/loop.py). Not a task of the loop: the local runner ends the runs itself.
FINISH = Step("finish", "cpu", ("status",))
# Publish copies the checkpoint the next rollouts load: on memory-optimized nodes, which cache it.
PUBLISH = Step("publish", "memory", ("iteration",), outputs=("seconds",))
# Its `iteration` output is the run's progress as a gauge (moeloop_evaluate_iteration): no gauge has an iteration
# label, which would make new series every iteration (workflows/monitoring.py).
EVALUATE = Step(
    "evaluate", "cpu", ("iteration",), outputs=("iteration", "eval_reward_mean", "reward_mean", "kl", "loss")
)
STEPS = (START, PLAN, ROLLOUT, REWARD, TRAIN, PUBLISH, EVALUATE)  # each a template of every render


def asks_trainer(step: Step, config: MoeloopConfig) -> bool:
    """Whether the step is a train step that asks the chunk's trainer for its update (trainer.lifetime chunk)."""
    return step is TRAIN and config.trainer.lifetime == "chunk"


def asks(step: Step, config: MoeloopConfig) -> bool:
    """Whether the step asks a long-lived process for its work: a train step the chunk's trainer, a rollout step
    its shard's rollout engine (`lifetime: chunk`)."""
    return asks_trainer(step, config) or (step is ROLLOUT and config.rollout.lifetime == "chunk")


def step_role(step: Step, config: MoeloopConfig) -> str:
    """The placement role of the step's pods: the reward step scores with reward models on GPUs when it has any;
    a step that asks a long-lived process waits on a CPU node."""
    if step is REWARD and config.reward.models:
        return "reward"
    if asks(step, config):
        return "cpu"
    return step.role


@dataclass(frozen=True)
class Task:
    name: str
    step: Step
    iteration: int
    arguments: tuple[tuple[str, str], ...]  # (param, value) for the step's per-task params
    dependencies: tuple[str, ...]
    processes: int = 1  # how many processes the step's command starts (torchrun's --nproc-per-node)

    def argv(self, run_values: Mapping[str, str]) -> list[str]:
        return self.step.argv({**run_values, **dict(self.arguments)}, self.processes)


def _task(config: MoeloopConfig, step: Step, name: str, iteration: int, depends: list[str], **arguments: int) -> Task:
    values = {"iteration": iteration, **arguments}
    parameters = tuple((p, str(values[p])) for p in step.params)
    return Task(name, step, iteration, parameters, tuple(depends), step.processes(config))


def loop_tasks(config: MoeloopConfig, iterations: int | None = None) -> list[Task]:
    """Every task of the run in a topological order, for iterations 1..N after the start (iteration 0)."""
    last = config.iterations if iterations is None else iterations
    start = _task(config, START, "start", 0, [])
    evaluate = _task(config, EVALUATE, "eval-0", 0, [start.name])
    return [start, evaluate, *daemons(config, last, start.name), *iteration_tasks(config, last, start.name)]


def daemons(config: MoeloopConfig, last: int, root: str) -> list[Task]:
    """The long-lived processes of `lifetime: chunk`, serving iterations up to `last`, started after root."""
    found = []
    if config.trainer.lifetime == "chunk":
        found.append(_task(config, TRAINER, TRAINER.name, 1, [root], last=last))
    if config.rollout.lifetime == "chunk":
        shards = config.rollout.num_shards
        name = ROLLOUT_ENGINE.name
        found += [
            _task(config, ROLLOUT_ENGINE, f"{name}-{k}", 1, [root], shard=k, num_shards=shards, last=last)
            for k in range(shards)
        ]
    return found


def iteration_tasks(config: MoeloopConfig, last: int, root: str, prefix: str = "it") -> list[Task]:
    """Tasks of iterations 1..last, named <prefix><i>-<step>; what has no earlier iteration depends on `root`.

    The local run's root is start; a chunk's is plan, and its iterations are slots (slot i: LATEST + i)."""
    shards = config.rollout.num_shards
    staleness = config.rollout.max_staleness
    by_delta = policy_by_delta(config)
    tasks: list[Task] = []
    ready: dict[int, str] = {}  # iteration -> the task after which rollouts can take its policy
    for i in range(1, last + 1):
        # Rollouts of iteration i load the policy of iteration policy_version(i, s): the root where that is
        # checkpoint 0, or, in a chunk, an iteration of an earlier chunk (finished: chunks run one at a time).
        policy_ready = ready.get(policy_version(i, staleness), root)
        rollouts = [
            _task(config, ROLLOUT, f"{prefix}{i}-rollout-{k}", i, [policy_ready], shard=k, num_shards=shards)
            for k in range(shards)
        ]
        reward = _task(config, REWARD, f"{prefix}{i}-reward", i, [t.name for t in rollouts])
        train_after, publish_after = [reward.name], []
        if staleness and i > 1:
            # Synchronously the rollouts already wait for publish i-1. Ahead of training, train i still needs
            # trainer state i-1, and publish i follows publish i-1 so that LATEST never passes an unpublished
            # iteration (a resume starts after LATEST).
            train_after.append(f"{prefix}{i - 1}-train")
            publish_after.append(f"{prefix}{i - 1}-publish")
        train = _task(config, TRAIN, f"{prefix}{i}-train", i, train_after)
        publish = _task(config, PUBLISH, f"{prefix}{i}-publish", i, [train.name, *publish_after])
        evaluate = _task(config, EVALUATE, f"{prefix}{i}-eval", i, [publish.name])
        tasks += [*rollouts, reward, train, publish, evaluate]
        ready[i] = train.name if by_delta else publish.name
    return tasks


def policy_by_delta(config: MoeloopConfig) -> bool:
    """Whether rollouts take a new policy once the train step is done, not publish: the chunk's trainer has committed
    its delta then, which the engines that live for the chunk apply, and commits the checkpoint after, in the
    background (steps/rl/held.py), which publish waits for."""
    return config.trainer.lifetime == "chunk" and config.rollout.lifetime == "chunk"


def run_values(config: MoeloopConfig, run_uri: str) -> dict[str, str]:
    """The run parameters' values (the Argo workflow's arguments; the local runner's argv)."""
    return {
        "run": run_uri,
        "config": config.to_json(),
        "iterations": str(config.iterations),
        "model": config.model.checkpoint or "",
    }


def run_uri(config: MoeloopConfig, root: str | None = None) -> str:
    """The run's folder: <storage root>/<run name>."""
    return f"{(root or config.storage_root).rstrip('/')}/{config.run_name}"
