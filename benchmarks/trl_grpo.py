"""moeloop against TRL's GRPOTrainer on the demo, one after the other, from the same SFT checkpoint (issue 25).

TRL lives in an environment of its own, never moeloop's (its versions are the ones this table was made with):

    python3 -m venv /tmp/trl-env
    /tmp/trl-env/bin/pip install torch==2.13.0 transformers==5.19.0 trl==1.16.0
    PYTHONPATH=$PWD .venv/bin/python benchmarks/trl_grpo.py --trl-python /tmp/trl-env/bin/python \\
        [--seeds 0 1 2] [--draws 1] [--engines transformers vllm] [--iterations 24] [--keep DIR] \\
        [--variant NAME SECTION.KEY=VALUE ... [--variant ...]] [--no-trl] [--smoke]

For each seed: the demo's SFT (`python -m moeloop.steps.start` on configs/tiny.yaml at that seed) makes one checkpoint;
then each moeloop engine runs `moeloop run` on configs/tiny.yaml with `model.checkpoint` that checkpoint, and
TRL runs `benchmarks/trl_contender.py` on it, one process after the other on the otherwise idle machine. Both
clocks start when their process is launched. moeloop's time of an iteration is when its checkpoint was
published (reports' publish `ended_at`); TRL's when that iteration's last optimizer step ended, its
evaluations (run inside its loop) taken out. "SFT + d" is the first iteration whose greedy eval on the 256
held-out prompts reaches the SFT checkpoint's own eval (iteration 0) + d. CPU cores used: the machine's busy CPU
seconds over the contender's wall seconds (the machine otherwise idle). Prints Markdown.

`--draws D` runs every contender D times from each seed's checkpoint, each time a different draw of prompts,
samples and minibatches: moeloop under another run name (which seeds its draws with the seed), TRL with another
seed (SEED + 1000 x draw; the checkpoint stays the seed's). A table column holds every run, seed by seed and draw
by draw, then the median and the range. The summary compares each moeloop contender with TRL run for run (same
seed, same draw): the ratio of TRL's seconds to moeloop's to SFT + d, and to the same iteration (the last: speed
alone, whatever the draw learnt), each as median and range.

`--variant NAME SECTION.KEY=VALUE ...` adds, for each engine, a moeloop contender "moeloop (ENGINE, NAME)" with
those settings changed from the demo's (values in YAML, e.g. `algorithm.drop_equal_groups=true`): the demo's
defaults weighed against others from the same checkpoints, per iteration and per second. `--no-trl` leaves TRL out
(and needs no `--trl-python`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import smoke
import yaml

from moeloop.steps.config import load_config

REPO = Path(__file__).resolve().parents[1]
GAINS = (0.20, 0.25)
# --smoke: every run at a toy size (with --no-trl, one seed, one engine, one iteration).
SMOKE_CHANGES = {"model.sft.steps": 1, "rollout.prompts_per_iteration": 4, "rollout.samples_per_prompt": 2,
                 "eval.max_prompts": 4}  # fmt: skip


def demo_config(folder: Path, name: str, seed: int, iterations: int, changes: dict[str, object]) -> Path:
    """configs/tiny.yaml as run NAME, with changes: {"section.key": value} (or "section.subsection.key")."""
    config = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    config.update(run_name=name, seed=seed, iterations=iterations)
    config["task"] = {key: str(REPO / "configs" / path) for key, path in config["task"].items()}
    for dotted, value in changes.items():
        *sections, key = dotted.split(".")
        node = config
        for section in sections:
            node = node[section]
        node[key] = value
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def contender_settings(config_path: Path) -> list[str]:
    """trl_contender.py's arguments for the settings of the run's config it must match, read from the config as
    moeloop reads it (its defaults included), not restated."""
    config = load_config(config_path)
    trainer = config.trainer
    return [
        "--learning-rate", repr(trainer.learning_rate),
        "--betas", *map(repr, trainer.betas),
        "--weight-decay", repr(trainer.weight_decay),
        "--max-grad-norm", repr(trainer.max_grad_norm),
        "--clip-eps", repr(config.algorithm.clip_eps),
        "--clip-eps-high", repr(config.algorithm.clip_eps_high or config.algorithm.clip_eps),
        "--max-new-tokens", str(config.rollout.max_new_tokens),
    ]  # fmt: skip


def busy_seconds() -> float:
    """The machine's CPU seconds spent busy so far, all cores and processes (/proc/stat's first line: every count
    but idle and iowait). Not RUSAGE_CHILDREN: the local runner's workers are its fork server's children, which
    the runner never waits for, so their time never reaches it (it read 0.012 cores for `moeloop run`)."""
    user, nice, system, idle, iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def timed(command: list[str], environment: dict[str, str], log: Path) -> tuple[float, float]:
    """Run command to its end (its output in log); returns (when it was launched, the CPU cores the machine used
    meanwhile: the command's, on a machine otherwise idle)."""
    before = busy_seconds()
    launched = time.time()
    with open(log, "wb") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=environment, cwd=REPO, check=False)
    wall = time.time() - launched
    if done.returncode:
        raise SystemExit(f"{' '.join(command[:4])} ... failed (exit {done.returncode}): see {log}")
    return launched, (busy_seconds() - before) / wall


def moeloop_curve(run: Path, launched: float) -> tuple[list[dict], float]:
    """Per iteration: its eval and when its checkpoint was published, from the run's committed files."""
    curve = []
    for metrics_file in sorted((run / "metrics").glob("iter-*.json")):
        metrics = json.loads(metrics_file.read_text())
        i = metrics["iteration"]
        published = (
            json.loads((run / "reports" / f"iter-{i:06d}" / "publish.json").read_text())["ended_at"] if i else launched
        )
        curve.append({"iteration": i, "eval_reward_mean": metrics["eval_reward_mean"], "seconds": published - launched})
    return curve, max(point["seconds"] for point in curve)


def measures(curve: list[dict], total: float, cores: float) -> dict[str, float | None]:
    sft = curve[0]["eval_reward_mean"]
    found = {}
    for gain in GAINS:
        reached = [p for p in curve if p["iteration"] and p["eval_reward_mean"] >= sft + gain - 1e-12]
        found[f"seconds to SFT + {gain:.2f}"] = reached[0]["seconds"] if reached else None
    for gain in GAINS:  # learning per iteration, whatever an iteration costs
        reached = [p for p in curve if p["iteration"] and p["eval_reward_mean"] >= sft + gain - 1e-12]
        found[f"iterations to SFT + {gain:.2f}"] = reached[0]["iteration"] if reached else None
    by_iteration = {p["iteration"]: p for p in curve}
    last = max(by_iteration)
    steady = [by_iteration[i]["seconds"] - by_iteration[i - 1]["seconds"] for i in range(5, last + 1)]
    tail = [by_iteration[i]["eval_reward_mean"] for i in range(max(1, last - 4), last + 1)]
    return {
        **found,
        "seconds to iteration 1 (start-up and one iteration)": by_iteration[1]["seconds"] if 1 in by_iteration else None,
        f"total seconds, {last} iterations": total,
        f"seconds per iteration, iterations 5-{last}": statistics.mean(steady) if steady else None,
        f"mean eval over iterations {max(1, last - 4)}-{last}": statistics.mean(tail),
        "SFT eval": sft,
        "CPU cores used, on average": cores,
    }


def variant(words: list[str]) -> tuple[str, dict[str, object]]:
    """NAME SECTION.KEY=VALUE ... -> (NAME, {"SECTION.KEY": value}), each value read as YAML."""
    name, *settings = words
    changes = {}
    for setting in settings:
        dotted, equals, value = setting.partition("=")
        if not equals or dotted.count(".") != 1:
            raise SystemExit(f"--variant {name}: {setting!r} is not SECTION.KEY=VALUE")
        changes[dotted] = yaml.safe_load(value)
    return name, changes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl-python", help="the python of TRL's own environment")
    parser.add_argument("--no-trl", action="store_true", help="moeloop's contenders only")
    parser.add_argument("--variant", nargs="+", action="append", default=[], metavar="WORD",
                        help="NAME SECTION.KEY=VALUE ...: a moeloop contender per engine with these settings")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--draws", type=int, default=1, help="runs of each contender from each seed's checkpoint")
    parser.add_argument("--engines", nargs="+", default=["transformers", "vllm"], choices=["transformers", "vllm"])
    parser.add_argument("--iterations", type=int, default=24)
    parser.add_argument("--keep", type=Path, help="run in this (new) folder and keep everything")
    args = smoke.parse_args(parser, no_trl=True, seeds=[0], engines=["transformers"], iterations=1)
    toy = SMOKE_CHANGES if args.smoke else {}
    if not args.no_trl and not args.trl_python:
        parser.error("--trl-python is needed unless --no-trl")
    variants = [("", {}), *map(variant, args.variant)]
    if args.keep:
        args.keep.mkdir(parents=True)

    with tempfile.TemporaryDirectory(prefix="moeloop-trl-") as temporary:
        folder = args.keep.resolve() if args.keep else Path(temporary)
        environment = {**os.environ, "MOELOOP_CACHE": str(folder / "cache"), "PYTHONPATH": str(REPO)}
        moeloop = {
            f"moeloop ({engine}{', ' + name if name else ''})": (engine, name, changes)
            for name, changes in variants
            for engine in args.engines
        }
        contenders = [*moeloop, *([] if args.no_trl else ["TRL"])]
        results: dict[str, list[dict]] = {name: [] for name in contenders}
        load = os.getloadavg()[0]
        for seed in args.seeds:
            sft_config = demo_config(folder, f"sft-{seed}", seed, args.iterations, toy)
            sft_run = folder / "runs" / f"sft-{seed}"
            start = [sys.executable, "-m", "moeloop.steps.start", "--run", str(sft_run), "--iteration", "0"]
            timed([*start, "--config", str(sft_config)], environment, folder / f"sft-{seed}.log")
            checkpoint = sft_run / "checkpoints" / "iter-000000"
            for draw in range(args.draws):
                for contender, (engine, variant_name, changes) in moeloop.items():
                    name = f"moeloop-{engine}{'-' + variant_name if variant_name else ''}-{seed}{drawn(draw)}"
                    settings = {**toy, "model.checkpoint": str(checkpoint), "rollout.engine": engine, **changes}
                    config = demo_config(folder, name, seed, args.iterations, settings)
                    command = [sys.executable, "-m", "moeloop.workflows.cli", "run", str(config), "--root",
                               str(folder / "runs"), "--no-progress"]  # fmt: skip
                    launched, cores = timed(command, environment, folder / f"{name}.log")
                    curve, total = moeloop_curve(folder / "runs" / name, launched)
                    results[contender].append(measures(curve, total, cores))
                if args.no_trl:
                    continue
                out = folder / f"trl-{seed}{drawn(draw)}.json"
                trl_seed = str(seed + 1000 * draw)
                trl_command = [args.trl_python, str(REPO / "benchmarks" / "trl_contender.py"), "--seed", trl_seed]
                trl_command += ["--checkpoint", str(checkpoint), "--iterations", str(args.iterations), "--out", str(out)]
                trl_command += contender_settings(sft_config)
                launched = time.time()
                log = folder / f"trl-{seed}{drawn(draw)}.log"
                _, cores = timed([*trl_command, "--started-at", str(launched)], environment, log)
                trl = json.loads(out.read_text())
                results["TRL"].append(measures(trl["iterations"], trl["seconds"], cores))

    print(
        f"seeds {args.seeds}, {args.draws} draw(s) each, {args.iterations} iterations of 192 prompts x 16,"
        f" {os.cpu_count()} cores, 1-minute load {load:.1f} before; moeloop's contenders by `rollout.engine`.\n"
    )
    print("| measure (every run; median, range) | " + " | ".join(contenders) + " |")
    print("|---|" + "---|" * len(contenders))
    for measure in results[contenders[0]][0]:
        cells = [cell([r[measure] for r in results[name]]) for name in contenders]
        print(f"| {measure} | " + " | ".join(cells) + " |")
    print()
    if not args.no_trl:
        for line in comparison(results, list(moeloop), args.iterations):
            print(line)


def drawn(draw: int) -> str:
    """A run's suffix for its draw: none for the first (the names of runs before --draws), -dN after."""
    return f"-d{draw}" if draw else ""


def cell(values: list[float | None]) -> str:
    runs = " / ".join("-" if v is None else f"{v:.3g}" for v in values)
    if len(values) < 3 or None in values:
        return runs
    return f"{runs}; **{statistics.median(values):.3g}**, {min(values):.3g}-{max(values):.3g}"


def comparison(results: dict[str, list[dict]], moeloop: list[str], iterations: int) -> list[str]:
    """Each moeloop contender against TRL, run for run (same seed and draw): TRL's seconds over moeloop's, to
    SFT + d (speed and the draw's learning) and to the last iteration (speed alone)."""
    lines = []
    keys = [f"seconds to SFT + {gain:.2f}" for gain in GAINS] + [f"total seconds, {iterations} iterations"]
    for key in keys:
        for name in moeloop:
            pairs = list(zip(results["TRL"], results[name], strict=True))
            ratios = [t[key] / m[key] for t, m in pairs if t[key] is not None and m[key] is not None]
            if len(ratios) < len(pairs):
                lines.append(f"- {key}, {name}: not reached by both in {len(pairs) - len(ratios)} of {len(pairs)} runs")
            if not ratios:
                continue
            wins = sum(r > 1 for r in ratios)
            lines.append(
                f"- {key}, {name}: ahead in {wins} of {len(ratios)} runs; TRL's seconds over ours, run for run: median"
                f" {statistics.median(ratios):.2f}x, range {min(ratios):.2f}-{max(ratios):.2f}x"
            )
    return lines


if __name__ == "__main__":
    main()
