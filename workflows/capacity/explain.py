"""The plan as a table (options, the best one, the run's own setup against its measured period, then every
input with its source) or as JSON for scripts."""

from __future__ import annotations

from typing import Any

from moeloop.steps.rl.memory import GIB
from moeloop.workflows.capacity.handoff import CHUNK
from moeloop.workflows.capacity.options import Evaluated, Plan, pareto


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _pools(plan: Plan, e: Evaluated) -> dict[str, str]:
    """The option's pools, by column."""
    o, setup = e.option, plan.setup
    if setup.local:
        return {"rollout": f"{o.rollout_shards} shard(s)", "train": f"{o.train_gpus} process(es)", "reward": "-"}
    reward = f"{o.reward_nodes * setup.prices.gpus} GPUs" if o.reward_nodes else "-"
    return {
        "rollout (Spot)": f"{o.rollout_shards} x {setup.gpus_per_shard} GPU, {_plural(o.rollout_nodes, 'node')}",
        "train (on demand)": f"{o.train_gpus} GPUs, {_plural(o.train_nodes, 'node')}",
        "EP": str(o.expert_parallel),
        "reward": reward,
    }


def _columns(plan: Plan, e: Evaluated, paths: list[str]) -> dict[str, str]:
    """The option's row, by column header. The critical path is a letter of the legend under the table (the paths
    are long, and few); the busy shares are the pools' in the legend's order."""
    row = {
        "": "*" if e is plan.best else "",
        **_pools(plan, e),
        "staleness": str(e.option.staleness),
        "period s": f"{e.period:.1f}",
        "handoff s": f"{e.handoff_seconds:.1f}",
        "path": _path_key(paths.index(e.critical_path)),
        "busy %": " / ".join(f"{share:.0%}".rstrip("%") for share in e.utilisation.values()),
    }
    if e.cost_per_iteration is not None:
        row |= {
            "$/iteration": f"{e.cost_per_iteration:.2f}",
            "$/M tokens": f"{e.cost_per_iteration / plan.setup.tokens * 1e6:.3f}",
            "GiB/GPU": f"{e.train_memory.total / GIB:.0f}/{plan.setup.gpu.memory_bytes / GIB:.0f}",
        }
    return row


def _path_key(index: int) -> str:
    return chr(ord("A") + index)


def _table(plan: Plan, shown: list[Evaluated]) -> list[str]:
    """The options' rows under their headers, then the legend: each critical path by its letter, and what the
    columns that need it mean. A column every row leaves empty ("-": no reward GPUs) is left out."""
    paths = list(dict.fromkeys(e.critical_path for e in shown))
    rows = [_columns(plan, e, paths) for e in shown]
    headers = [h for h in rows[0] if any(row[h] != "-" for row in rows)]
    cells = [headers] + [[row[h] for h in headers] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip() for line in cells]
    lines += [f"path {_path_key(i)}: {path}" for i, path in enumerate(paths)]
    lines.append(f"busy %: the share of the period each pool is busy, {' / '.join(shown[0].utilisation)}")
    lines += [
        "handoff s: what the trainer state's I/O, the rollout engines' start and the policy's way (publish or",
        "    commit, fetch, delta) add to the critical path, per iteration (the trainer's start-up is not in it)",
    ]
    if "EP" in headers:
        lines += [
            "EP: the smallest expert-parallel size whose trainer fits the GPU's memory (GiB/GPU). Memory only: the",
            "    plan takes the trainer's speed to be the same at every EP size.",
        ]
    return lines


def _count(value: float) -> str:
    return f"{value / 1e9:.3g}B" if value >= 1e9 else f"{value / 1e6:.3g}M"


def _described_pools(plan: Plan, e: Evaluated) -> list[str]:
    """The option's pools in words, for the lines under the table."""
    pools = _pools(plan, e)
    if "EP" in pools:
        pools["train (on demand)"] += f", EP {pools.pop('EP')}"
    return [pool for pool in pools.values() if pool != "-"]


def _best_lines(plan: Plan) -> list[str]:
    best, setup = plan.best, plan.setup
    run = f"{best.period * setup.iterations / 3600:.2f} h for {setup.iterations} iterations"
    if best.cost_per_iteration is not None:
        run += f", ${best.cost_per_iteration * setup.iterations:,.0f}"
    pools = ", ".join(_described_pools(plan, best))
    retry = f" (Spot retry {best.spot_retry_seconds:.1f})" if best.cost_per_iteration is not None else ""
    lines = [
        f"best ({plan.constraint}): {pools}, staleness {best.option.staleness}: {best.period:.1f} s/iteration, {run}",
        f"  step seconds{' on one core' if setup.local else ''}: "
        + ", ".join(f"{step} {s:.1f}{retry if step == 'rollout' else ''}" for step, s in best.step_seconds.items()),
        *_handoff_lines(best),
    ]
    if best.train_memory is not None:
        terms = ", ".join(f"{name} {size / GIB:.1f}" for name, size in best.train_memory.terms.items())
        lines.append(f"  train memory per GPU, GiB, at the {best.train_memory.moment}: {terms}")
    return lines


def _parts(e: Evaluated, parts: dict[str, float]) -> str:
    return " + ".join(f"{e.paid.label(part)} {seconds:.1f}" for part, seconds in parts.items())


def _handoff_lines(e: Evaluated) -> list[str]:
    chunk = e.paid.chunk_iterations
    where = f", a chunk of {chunk} iterations" if chunk is not None else ""
    return [
        f"  handoff on the critical path, s an iteration: {e.handoff_seconds:.1f} = {_parts(e, e.handoff)}",
        f"  handoff paid every iteration{where}, s (a rollout shard's): {_parts(e, e.paid.parts)}",
        f"  not in the handoff: the trainer's start-up and overhead, in train's time, s: {e.paid.trainer_overhead:.1f}",
    ]


def _trainer_line(plan: Plan) -> str:
    setup = plan.setup
    if setup.lifetime != CHUNK:
        return f"trainer: lifetime iteration, a new one every iteration ({setup.lifetime_source})"
    every = setup.value("state_every")
    return (
        f"trainer: lifetime chunk, one a chunk, its state committed every {every:.0f} iteration(s) in the background"
        f" ({setup.lifetime_source})"
    )


def _engines_line(plan: Plan) -> str:
    setup = plan.setup
    if setup.rollout_lifetime != CHUNK:
        return f"rollout engines: lifetime iteration, new ones every iteration ({setup.rollout_lifetime_source})"
    return (
        "rollout engines: lifetime chunk, one a shard a chunk, each policy taken by its delta in place"
        f" ({setup.rollout_lifetime_source})"
    )


def plan_table(plan: Plan) -> str:
    setup = plan.setup
    counts, v = setup.counts, setup.value
    where = (
        "the local runner" if setup.local else f"{setup.gpu.name}, {setup.instance} ({setup.prices.gpus} GPUs a node)"
    )
    lines = [
        f"plan for {setup.model}: {_count(counts.total)} parameters, {_count(counts.active)} active; on {where}",
        *([] if setup.local else [f"prices: {setup.prices_source}"]),
        (
            f"batch: {v('prompts_per_iteration'):.0f} prompts x {v('samples_per_prompt'):.0f} samples of"
            f" {v('prompt_tokens'):.0f} + {v('response_tokens'):.0f} tokens ({_count(setup.tokens)} tokens an"
            f" iteration), {v('epochs'):.0f} epoch(s)"
        ),
        _trainer_line(plan),
        _engines_line(plan),
        "",
    ]
    shown = pareto(plan.evaluated)
    lines += _table(plan, shown + ([] if plan.best in shown else [plan.best]))
    lines.append(
        f"{len(plan.evaluated)} options weighed; shown: those no other beats on both period and cost"
        + (f"; {len(plan.unfit)} left out: their trainer fits no EP size on the GPU" if plan.unfit else "")
    )
    lines += ["", *_best_lines(plan)]
    if plan.calibration is not None:
        own, measured = plan.calibration
        error = (own.period - measured.value) / measured.value if measured.value else float("nan")
        lines += [
            "",
            (
                f"the run's own setup ({', '.join(_described_pools(plan, own))}, staleness"
                f" {own.option.staleness}): predicted {own.period:.2f} s an iteration, measured {measured.value:.2f} s"
                f" ({error:+.0%}; {measured.source})"
            ),
        ]
    lines += ["", "inputs:"] + [f"  {name} = {f.value:.4g} {f.unit}  [{f.source}]" for name, f in setup.figures.items()]
    return "\n".join(lines)


def _option_json(plan: Plan, e: Evaluated, front: list[Evaluated]) -> dict[str, Any]:
    result: dict[str, Any] = {
        **vars(e.option),
        "period_seconds": e.period,
        "critical_path": e.critical_path,
        "step_seconds": e.step_seconds,
        "spot_retry_seconds": e.spot_retry_seconds,
        "handoff": {
            "seconds_on_critical_path": e.handoff_seconds,
            "parts_on_critical_path": e.handoff,
            "paid_per_iteration": e.paid.parts,
            "paid_by_step": e.paid.steps,
            "chunk_iterations": e.paid.chunk_iterations,
            "background_commit_seconds": e.paid.background_commit,
            "trainer_overhead_seconds_not_in_handoff": e.paid.trainer_overhead,
            "restart_seconds": e.paid.restart,
        },
        "utilisation": e.utilisation,
        "cost_per_iteration": e.cost_per_iteration,
        "cost_per_million_tokens": None
        if e.cost_per_iteration is None
        else e.cost_per_iteration / plan.setup.tokens * 1e6,
        "best": e is plan.best,
        "pareto": e in front,
    }
    if e.train_memory is not None:
        result["train_memory"] = {
            "moment": e.train_memory.moment,
            "bytes": e.train_memory.total,
            "terms": e.train_memory.terms,
        }
    return result


def plan_json(plan: Plan) -> dict[str, Any]:
    setup, front = plan.setup, pareto(plan.evaluated)
    counts = setup.counts
    return {
        "model": {
            "source": setup.model,
            "model_type": setup.shape.model_type,
            "parameters": counts.total,
            "active_parameters": counts.active,
        },
        "gpu": None if setup.local else setup.gpu.name,
        "instance": setup.instance,
        "gpus_per_shard": setup.gpus_per_shard,
        "iterations": setup.iterations,
        "tokens_per_iteration": setup.tokens,
        "trainer": {
            "lifetime": setup.lifetime,
            "source": setup.lifetime_source,
            "state_every": int(setup.value("state_every")) if setup.lifetime == CHUNK else 1,
        },
        "rollout": {"lifetime": setup.rollout_lifetime, "source": setup.rollout_lifetime_source},
        "inputs": {name: vars(figure) for name, figure in setup.figures.items()},
        "best": {"constraint": plan.constraint, **_option_json(plan, plan.best, front)},
        "options": [_option_json(plan, e, front) for e in plan.evaluated],
        "unfit": [vars(option) for option in plan.unfit],
        "calibration": None
        if plan.calibration is None
        else {
            "predicted_period_seconds": plan.calibration[0].period,
            "measured_period_seconds": plan.calibration[1].value,
            "measured": plan.calibration[1].source,
        },
    }
