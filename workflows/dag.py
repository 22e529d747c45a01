"""The one definition of the loop's DAG. The local runner and the Argo render are both derived from it.

    start -> eval-0
    start -> it1-rollout-{0..K-1} -> it1-reward -> it1-train -> it1-publish -> it1-eval
                                        it1-publish -> it2-rollout-{0..K-1} -> ...

Evaluation hangs off publish, so it runs while the next iteration's rollouts do. With
`rollout.max_staleness` s >= 1, iteration i's rollouts hang off publish i-1-s (start while i-1-s <= 0):
rollout i+1 runs while train i does, and train i and publish i follow their predecessors instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from steps.config import MoeloopConfig


@dataclass(frozen=True)
class Step:
    """A step: a module `steps.<name>` run as a CLI in a pod of the given placement role."""

    name: str
    role: str  # rollout | reward | train | cpu: selects cluster.<role> placement
    params: tuple[str, ...]  # per-task parameters, passed as --<param> VALUE
    run_params: tuple[str, ...] = ("run",)  # per-run parameters (workflow arguments)
    torchrun: bool = False  # launched by torchrun as trainer.world_size processes (one plain process at 1)

    def processes(self, config: MoeloopConfig) -> int:
        return config.trainer.world_size if self.torchrun else 1

    def argv(self, values: Mapping[str, str], processes: int = 1) -> list[str]:
        """The pod's command; values are concrete locally and Argo placeholders in the render."""
        argv = ["python", "-m", f"steps.{self.name}"]
        if processes > 1:
            # `--` ends torchrun's options: it would take --run for an abbreviation of its own --run-path.
            argv[2:2] = ["torch.distributed.run", "--standalone", f"--nproc-per-node={processes}", "-m"]
            argv.append("--")
        for param in self.run_params + self.params:
            argv += [f"--{param.replace('_', '-')}", values[param]]
        return argv


START = Step("start", "cpu", ("iteration",), run_params=("run", "config"))
ROLLOUT = Step("rollout", "rollout", ("iteration", "shard", "num_shards"))
REWARD = Step("reward", "reward", ("iteration",))
TRAIN = Step("train", "train", ("iteration",), torchrun=True)
PUBLISH = Step("publish", "cpu", ("iteration",))
EVALUATE = Step("evaluate", "cpu", ("iteration",))
STEPS = (START, ROLLOUT, REWARD, TRAIN, PUBLISH, EVALUATE)


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
    shards = config.rollout.num_shards
    tasks = [_task(config, START, "start", 0, []), _task(config, EVALUATE, "eval-0", 0, ["start"])]
    for i in range(1, last + 1):
        version = config.rollout.policy_version(i)
        policy_ready = f"it{version}-publish" if version else "start"
        rollouts = [
            _task(config, ROLLOUT, f"it{i}-rollout-{k}", i, [policy_ready], shard=k, num_shards=shards)
            for k in range(shards)
        ]
        reward = _task(config, REWARD, f"it{i}-reward", i, [t.name for t in rollouts])
        train_after, publish_after = [reward.name], []
        if config.rollout.max_staleness and i > 1:
            # Synchronously the rollouts already wait for publish i-1. Ahead of training, train i still needs
            # trainer state i-1, and publish i follows publish i-1 so that LATEST never passes an unpublished
            # iteration (a resume starts after LATEST).
            train_after.append(f"it{i - 1}-train")
            publish_after.append(f"it{i - 1}-publish")
        train = _task(config, TRAIN, f"it{i}-train", i, train_after)
        publish = _task(config, PUBLISH, f"it{i}-publish", i, [train.name, *publish_after])
        evaluate = _task(config, EVALUATE, f"it{i}-eval", i, [publish.name])
        tasks += [*rollouts, reward, train, publish, evaluate]
    return tasks


def run_uri(config: MoeloopConfig, root: str | None = None) -> str:
    """The run's folder: <storage root>/<run name>."""
    return f"{(root or config.storage_root).rstrip('/')}/{config.run_name}"
