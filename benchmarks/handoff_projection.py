"""The handoff on paper: trainer state commit, publish and the rollouts' fetch for Qwen3-30B-A3B and Qwen3-235B-A22B,
from per-process rates (benchmarks/handoff.py measures them) and stated cluster limits, set against an iteration.

    .venv/bin/python -m benchmarks.handoff_projection [--commit-gbs 0.08 --publish-gbs 0.10 --fetch-gbs 0.28] ...
                                                      [--smoke]

Every input is a flag; benchmarks/handoff.md says where each default comes from. The model, per stage:
- commit: every trainer rank uploads its shard of the state (12 bytes per parameter: fp32 weights and AdamW's two
  moments) at the per-process rate, the node at most its NIC's, the state's prefix at most S3's PUT rate;
- state fetch: the next train step's ranks read it back (the GET rate and the fetch rate);
- publish: one pod reads the fp32 weights (4 bytes per parameter) and writes and uploads the bf16 checkpoint (2 bytes
  per parameter), its shards side by side on its cores, each at the publish rate (measured with one shard), together
  at most its NIC's;
- rollout fetch: K pods fetch the checkpoint at once, each at the fetch rate, the pods of a node at most its NIC's
  together, all of them at most S3's GET rate on the checkpoint's prefix.
An iteration: rollout + reward (R) and train (T). At max_staleness 0 the handoff is serial: commit, then publish and
the fetch (the state fetch beside them), then R, then T. At staleness s the rollouts use a checkpoint s iterations
old, so the period is the longer of the trainer's own chain (state fetch + T + commit) and the whole loop's chain
(publish + fetch + R + T + commit) shared among s + 1 iterations in flight.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import smoke

GB = 1e9
MIB = 1 << 20
STAGES = ("commit", "state fetch", "publish", "rollout fetch", "train")


@dataclass(frozen=True)
class Model:
    name: str
    parameters: float
    active: float
    train_nodes: int
    rollout_pods: int  # vLLM engines fetching the checkpoint at once
    pods_per_node: int


MODELS = (
    Model("Qwen3-30B-A3B", 30.5e9, 3.3e9, train_nodes=1, rollout_pods=32, pods_per_node=8),  # TP 1: a pod per GPU
    Model("Qwen3-235B-A22B", 235e9, 22e9, train_nodes=8, rollout_pods=16, pods_per_node=1),  # TP 8: a pod per node
)


def stage_seconds(model: Model, args: argparse.Namespace) -> dict[str, float]:
    put_cap = args.s3_put_per_s * args.part_mib * MIB / GB  # GB/s on one prefix
    get_cap = args.s3_get_per_s * args.part_mib * MIB / GB
    ranks = model.train_nodes * args.gpus_per_node
    state = 12 * model.parameters / GB
    commit = state / min(ranks * args.commit_gbs, model.train_nodes * args.nic_gbs, put_cap)
    state_fetch = state / min(ranks * args.fetch_gbs, model.train_nodes * args.nic_gbs, get_cap)
    shards = -(-2 * model.parameters // args.shard_bytes)
    publish = 6 * model.parameters / GB / min(min(shards, args.publish_cores) * args.publish_gbs, args.nic_gbs)
    nodes = -(-model.rollout_pods // model.pods_per_node)
    checkpoint = 2 * model.parameters / GB
    rollout_fetch = (
        checkpoint * model.rollout_pods
        / min(model.rollout_pods * args.fetch_gbs, nodes * args.nic_gbs, get_cap)
    )  # fmt: skip
    tokens = args.prompts * args.samples * args.tokens_per_sample
    train = tokens * 8 * model.active / (ranks * args.mfu * args.peak_tflops * 1e12)  # fwd + bwd + 2 logprob passes
    return {
        "commit": commit, "state fetch": state_fetch, "publish": publish, "rollout fetch": rollout_fetch, "train": train
    }  # fmt: skip


def period(seconds: dict[str, float], rollout: float, staleness: int) -> float:
    trainer_chain = seconds["state fetch"] + seconds["train"] + seconds["commit"]
    if staleness == 0:
        handoff = max(seconds["state fetch"], seconds["publish"] + seconds["rollout fetch"] + rollout)
        return seconds["commit"] + handoff + seconds["train"]
    loop_chain = seconds["publish"] + seconds["rollout fetch"] + rollout + seconds["train"] + seconds["commit"]
    return max(trainer_chain, loop_chain / (staleness + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    rates = parser.add_argument_group("per-process rates, GB/s (benchmarks/handoff.py)")
    rates.add_argument("--commit-gbs", type=float, default=1.0)
    rates.add_argument("--publish-gbs", type=float, default=0.5, help="one shard's, from fetch to upload")
    rates.add_argument("--fetch-gbs", type=float, default=1.5)
    limits = parser.add_argument_group("cluster limits (stated assumptions)")
    limits.add_argument("--nic-gbs", type=float, default=12.5, help="one node's S3 throughput: 100 Gb/s")
    limits.add_argument("--s3-put-per-s", type=float, default=3500, help="S3's PUTs per second per prefix")
    limits.add_argument("--s3-get-per-s", type=float, default=5500, help="S3's GETs per second per prefix")
    limits.add_argument("--part-mib", type=float, default=8, help="the storage module's part size")
    limits.add_argument("--gpus-per-node", type=int, default=8)
    limits.add_argument(
        "--publish-cores", type=int, default=16, help="the publish pod's CPU (workflows/render/placement.py)"
    )
    limits.add_argument("--shard-bytes", type=float, default=4 << 30, help="trainer.checkpoint_shard_bytes")
    work = parser.add_argument_group("one iteration")
    work.add_argument("--prompts", type=int, default=512)
    work.add_argument("--samples", type=int, default=16)
    work.add_argument("--tokens-per-sample", type=int, default=2500)
    work.add_argument("--mfu", type=float, default=0.345, help="the update's on H200 (benchmarks/policy_update.md)")
    work.add_argument("--peak-tflops", type=float, default=989, help="H200 dense bf16")
    work.add_argument("--rollout-over-train", type=float, default=1.0, help="rollout + reward time over train time")
    args = smoke.parse_args(parser)  # the projection is arithmetic: a smoke run is the real one

    print(
        f"per process: commit {args.commit_gbs} GB/s, publish {args.publish_gbs} GB/s per shard on"
        f" {args.publish_cores} cores, fetch {args.fetch_gbs} GB/s;"
        f" node NIC {args.nic_gbs} GB/s; S3 {args.s3_put_per_s:.0f} PUT/s and {args.s3_get_per_s:.0f} GET/s per prefix"
        f" of {args.part_mib:g} MiB parts; {args.prompts} x {args.samples} samples of {args.tokens_per_sample} tokens,"
        f" MFU {args.mfu:.1%}, rollout + reward = {args.rollout_over_train:g} x train"
    )
    print("| model | train GPUs | rollout pods | commit s | state fetch s | publish s | rollout fetch s | train s |"
          " R s | R + T s | period at staleness 0 s | period at staleness 1 s | at staleness 1 |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for model in MODELS:
        seconds = stage_seconds(model, args)
        rollout = args.rollout_over_train * seconds["train"]
        bare = period({**seconds, "commit": 0.0, "state fetch": 0.0, "publish": 0.0, "rollout fetch": 0.0}, rollout, 0)
        trainer_chain = seconds["state fetch"] + seconds["train"] + seconds["commit"]
        hidden = "publish + fetch hidden" if period(seconds, rollout, 1) == trainer_chain else "publish + fetch bind"
        print(
            f"| {model.name} | {model.train_nodes * args.gpus_per_node} | {model.rollout_pods}"
            + "".join(f" | {seconds[stage]:.0f}" for stage in STAGES)
            + f" | {rollout:.0f} | {bare:.0f} | {period(seconds, rollout, 0):.0f} | {period(seconds, rollout, 1):.0f}"
            + f" | {hidden} |"
        )


if __name__ == "__main__":
    main()
