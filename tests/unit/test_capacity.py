"""The capacity planner (workflows/capacity/): model facts, the memory model, hand-computed plans, bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.shape import parameter_counts, shape_from_hf_config
from moeloop.steps.rl.memory import BF16, FP32, predict_train_peak_bytes
from moeloop.workflows.capacity.inputs import plan_inputs
from moeloop.workflows.capacity.models import FAMILIES, model_config
from moeloop.workflows.capacity.options import make_plan
from moeloop.workflows.capacity.rates import STEPS, fit_core_scaling
from moeloop.workflows.capacity.schedule import GraphTask, Job, play
from moeloop.workflows.local.cores import held_cores

from tests.conftest import REPO
HF_CONFIG = {
    "qwen3_moe": "Qwen3MoeConfig",
    "qwen2_moe": "Qwen2MoeConfig",
    "mixtral": "MixtralConfig",
    "deepseek_v3": "DeepseekV3Config",
    "kimi_k2": "DeepseekV3Config",  # Kimi K2 is DeepSeek-V3's architecture
    "gpt_oss": "GptOssConfig",
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_parameter_count_equals_the_hf_model_built_from_the_same_config(name: str) -> None:
    values = dict(FAMILIES[name])
    kind = values.pop("model_type")
    if kind == "qwen3_moe":
        values["num_local_experts"] = values["num_experts"]  # transformers 5's name for it
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, HF_CONFIG[kind])(**values))
    assert parameter_counts(shape_from_hf_config(FAMILIES[name], name)).total == sum(
        p.numel() for p in model.parameters()
    )


@pytest.mark.parametrize(
    ("name", "total", "active"),
    [
        # The model cards' figures. GPT-OSS counts active parameters without the input embedding (a lookup).
        ("qwen3-30b-a3b", 30.5e9, 3.3e9),
        ("qwen3-235b-a22b", 235e9, 22e9),
        ("deepseek-v3", 671e9, 37e9),
        ("kimi-k2", 1.04e12, 32e9),
        ("qwen2-57b-a14b", 57e9, 14e9),
        ("mixtral-8x7b", 46.7e9, 12.9e9),
        ("gpt-oss-120b", 117e9, 5.1e9),
        ("gpt-oss-20b", 21e9, 3.6e9),
    ],
)
def test_parameter_counts_match_the_published_totals(name: str, total: float, active: float) -> None:
    counts = parameter_counts(shape_from_hf_config(*model_config(name)))
    published_active = counts.active - (counts.embedding if name.startswith("gpt-oss") else 0)
    assert counts.total == pytest.approx(total, rel=0.015)
    assert published_active == pytest.approx(active, rel=0.03)


def test_an_hf_config_json_is_read_from_its_path_and_an_unknown_family_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(FAMILIES["mixtral-8x7b"]))
    values, source = model_config(str(tmp_path))
    assert parameter_counts(shape_from_hf_config(values, source)).total == 46_702_792_704
    with pytest.raises(MoeloopError, match="model_type 'llama' is not a supported MoE family"):
        shape_from_hf_config({"model_type": "llama", "hidden_size": 8}, "dense.json")
    with pytest.raises(MoeloopError, match="neither a known family"):
        model_config("qwen9-moe")


def test_memory_terms_by_hand() -> None:
    """Mixtral-8x7B on 16 GPUs at EP 8, 4096 tokens a microbatch, each term against its formula."""
    shape = shape_from_hf_config(*model_config("mixtral-8x7b"))
    counts = parameter_counts(shape)
    memory = predict_train_peak_bytes(shape, 16, 8, 4096)
    shard = counts.total / 16
    h, layer = 4096, counts.layer_dense + counts.layer_experts / 8  # a layer's attention whole, 1 of 8 experts
    assert counts.layer_experts == 8 * 3 * 4096 * 14336
    assert memory.moment == "backward start"
    assert memory.terms["master_weights"] == int(FP32 * shard)
    assert memory.terms["adam_moments"] == int(2 * FP32 * shard)
    assert memory.terms["reference_policy"] == int(BF16 * shard)
    assert memory.terms["gathered_layers"] == int(2 * BF16 * layer)
    assert memory.terms["logits"] == 4096 * 32000 * (2 + 4 + 4) + 4 * 32000 * 4096  # a chunk, and the head's fp32 grad
    # Checkpointed: every layer's input in bf16, plus one layer recomputed whole. Per token, that layer saves:
    attention = (2 * h + 4) + 2 * h + 2 * (32 * 128 + 8 * 256) + (2 * 32 * 128 + 32 * 4)  # norm, qkv in, q k v, out
    moe = (2 * h + 4 + 2 * h) + (2 * 4 * 8 + 2 * (4 + 8)) + 2 * (2 * 2 * h + 2 * 3 * 14336)  # norm, router, 2 experts
    assert memory.terms["activations"] == 4096 * (32 * 2 * h + attention + moe)
    assert memory.total == sum(memory.terms.values())


def test_memory_moves_the_right_way() -> None:
    shape = shape_from_hf_config(*model_config("qwen3-30b-a3b"))
    base = predict_train_peak_bytes(shape, 8, 1, 16384)
    assert predict_train_peak_bytes(shape, 16, 1, 16384).terms["adam_moments"] == base.terms["adam_moments"] // 2
    assert predict_train_peak_bytes(shape, 8, 8, 16384).terms["gathered_layers"] < base.terms["gathered_layers"]
    unchecked = predict_train_peak_bytes(shape, 8, 1, 16384, activation_checkpointing=False)
    assert unchecked.terms["activations"] > 10 * base.terms["activations"]
    offloaded = predict_train_peak_bytes(shape, 8, 1, 16384, offload_optimizer=True, reference="precomputed")
    # trainer.offload_optimizer keeps AdamW's moments on the host; master weights and gradients stay on the GPU.
    assert [offloaded.terms[t] for t in ("adam_moments", "reference_policy")] == [0] * 2
    assert offloaded.terms["master_weights"] == base.terms["master_weights"]
    # One microbatch a step: gradients fill in as the activations go, so the peak is whichever moment is larger.
    single = predict_train_peak_bytes(shape, 8, 1, 16384, gradient_accumulation=False)
    assert single.total == max(
        base.total - base.terms["gradients"], base.total - base.terms["activations"] - base.terms["logits"]
    )
    skewed = predict_train_peak_bytes(shape, 8, 1, 16384, routing_imbalance=1.5)
    assert skewed.terms["activations"] > base.terms["activations"]


# Hand-computed plans. Qwen3-30B-A3B (61.064245248 GB in bf16) on H200 nodes of 8; one rollout node of 8 shards,
# one train node; batch 80 prompts x 10 samples of 100 + 400 tokens (400,000 tokens); every step starts 5 s
# after what it waits for. A shard generates 10 prompts x 10 samples x 400 tokens = 40,000 tokens.
CHECKPOINT_GB = 30_532_122_624 * 2 / 1e9


def stated_plan(tmp_path: Path, staleness: int, rates: dict, gpu: str = "H200", shards: int = 8, **target):
    """The plan of configs/tiny.yaml's loop for a target whose every rate is stated."""
    interruptions = target.pop("interruptions", 0.0)
    document = {
        "model": "qwen3-30b-a3b",
        "gpu": gpu,
        "rollout_gpus_per_shard": 1,
        "batch": {
            "prompts_per_iteration": 80,
            "samples_per_prompt": 10,
            "prompt_tokens": 100,
            "response_tokens": 400,
            "epochs": 1,
        },
        "rates": {"fetch_seconds_per_gb": 0, "start_seconds": 5, **rates},
        "search": {"rollout_shards": [shards], "train_nodes": [1], "staleness": [staleness]},
        **target,
    }
    if gpu != "local":
        prices = {
            "gpu": gpu,
            "gpus": 8,
            "on_demand_per_hour": 8.0,
            "spot_per_hour": 4.0,
            "spot_interruptions_per_hour": interruptions,
        }
        (tmp_path / "prices.yaml").write_text(yaml.safe_dump({"source": "test", "instances": {"node": prices}}))
        document["prices"] = "prices.yaml"
    (tmp_path / "target.yaml").write_text(yaml.safe_dump(document))
    setup, own, measured = plan_inputs(str(REPO / "configs" / "tiny.yaml"), str(tmp_path / "target.yaml"))
    return make_plan(setup, None, None, own, measured)


def rates(rollout_rate, rollout_overhead, reward_per_sample, train_rate, train_overhead, publish_seconds):
    return {
        "rollout_tokens_per_second_per_gpu": rollout_rate,
        "rollout_overhead_seconds": rollout_overhead,
        "reward_seconds_per_sample": reward_per_sample,
        "train_tokens_per_second_per_gpu": train_rate,
        "train_overhead_seconds": train_overhead,
        "publish_seconds_per_gb": publish_seconds / CHECKPOINT_GB,
        "evaluate_seconds": 0,
    }


# rollout 15 + 40,000 / 1000 = 55 s, reward 800 x 0.00625 = 5 s, train 15 + 400,000 / (1250 x 8) = 55 s, publish 0.
BALANCED = rates(1000, 15, 0.00625, 1250, 15, 0)


def test_plan_balanced(tmp_path: Path) -> None:
    """Staleness 1, rollout and train alike: the policy's round trip (5 + 55, 5 + 5, 5 + 55, 5 + 0: 135 s) spans
    two iterations, 67.5 s each, and neither pool waits on its own."""
    best = stated_plan(tmp_path, 1, BALANCED).best
    assert best.step_seconds == pytest.approx({"rollout": 55, "reward": 5, "train": 55, "publish": 0, "evaluate": 0})
    assert best.period == pytest.approx(135 / 2)
    assert best.critical_path == "publish -> rollout -> reward -> train -> publish (over 2 iterations)"
    assert best.utilisation == pytest.approx({"rollout": 60 / 67.5, "train": 60 / 67.5})
    assert best.cost_per_iteration == pytest.approx(67.5 / 3600 * (4 + 8))  # one Spot node, one on-demand node


def test_plan_synchronous_is_the_sum_of_the_steps(tmp_path: Path) -> None:
    best = stated_plan(tmp_path, 0, BALANCED).best
    assert best.period == pytest.approx(135)
    assert best.critical_path == "publish -> rollout -> reward -> train -> publish"


def test_plan_rollout_bound(tmp_path: Path) -> None:
    """Rollout 40,000 / 400 = 100 s: each iteration's shards wait for the last one's to free the pool (105 s),
    longer than the round trip's half ((105 + 15 + 25 + 5) / 2 = 75 s)."""
    best = stated_plan(tmp_path, 1, rates(400, 0, 0.0125, 12500, 16, 0)).best
    assert best.period == pytest.approx(105)
    assert best.critical_path == "rollout ~> rollout"
    assert best.utilisation["rollout"] == pytest.approx(1.0)
    assert best.utilisation["train"] == pytest.approx(25 / 105)


def test_plan_train_bound(tmp_path: Path) -> None:
    """Train 60 + 400,000 / (1250 x 8) = 100 s: train N starts 5 s after train N-1."""
    best = stated_plan(tmp_path, 1, rates(4000, 10, 0.0125, 1250, 60, 0)).best
    assert best.period == pytest.approx(105)
    assert best.critical_path == "train -> train"
    assert best.utilisation["rollout"] == pytest.approx(25 / 105)


def test_plan_publish_bound(tmp_path: Path) -> None:
    """Publish 100 s (61.06 GB at 1.64 s/GB): publish N follows publish N-1, 105 s apart."""
    best = stated_plan(tmp_path, 1, rates(4000, 10, 0.0125, 12500, 16, 100)).best
    assert best.step_seconds["publish"] == pytest.approx(100)
    assert best.period == pytest.approx(105)
    assert best.critical_path == "publish -> publish"


def test_spot_retry_from_the_interruption_rate_and_the_shard_size(tmp_path: Path) -> None:
    """One shard on one node, 5 + 55 s long, 0.5 reclaims an hour: lost with probability 1 - exp(-0.5 x 60 / 3600),
    then it ends 60 / 2 + the restart (30 s backoff of tiny.yaml's spot_retry + 300 s for a new node) later."""
    plan = stated_plan(tmp_path, 0, BALANCED, shards=8, interruptions=0.5)
    expected = (1 - math.exp(-0.5 * 60 / 3600)) * (30 + 330)
    assert plan.best.spot_retry_seconds == pytest.approx(expected)
    assert plan.best.step_seconds["rollout"] == pytest.approx(55 + expected)


def test_local_runner_slots_delay_a_shard_behind_the_evaluation(tmp_path: Path) -> None:
    """Locally (tiny.yaml: 2 slots, a worker per shard and per step; 2 cores), 2 shards, synchronous; the rates are
    per core, the step times core-seconds. A shard generates 40 prompts x 10 x 400 = 160,000 tokens at 16,000
    tokens/s: 10 core-s. After publish N, eval N and shard 0 of N+1 take the slots and a core each (eval comes
    first in the DAG's order): eval ends at 5 + 5, and shard 1 starts on its core, 5 + 10 later, while shard 0 ends
    at 15 (a step keeps its share: shard 1 does not get shard 0's core). Alone, reward, train and publish run on
    both cores: period = 25 + 5 + reward 1 / 2 + 5 + train 20 / 2 + 5 + publish 2 / 2 = 51.5 s."""
    stated = rates(16000, 0, 0.00125, 20000, 0, 2) | {"evaluate_seconds": 5}
    plan = stated_plan(tmp_path, 0, stated, gpu="local", shards=2, cores=2)
    best = plan.best
    assert best.step_seconds == pytest.approx({"rollout": 10, "reward": 1, "train": 20, "publish": 2, "evaluate": 5})
    assert best.period == pytest.approx(51.5)
    assert best.critical_path == "publish -> evaluate ~> rollout -> reward -> train -> publish"
    assert best.cost_per_iteration is None and best.train_memory is None
    assert plan.setup.figures["local_cores"].source.startswith("stated: ")


def test_local_steps_run_at_the_cores_they_hold() -> None:
    """2 cores. Train (10 core-s) and publish (1) start together, a core each; publish ends at 1 and the rollout
    after it (2 core-s) starts on its core, to 3; train keeps its one core and ends at 10. Replaying the played
    spans gives back each job's core-seconds."""

    def job(name: str, seconds: float, *after: str) -> Job:
        return Job(GraphTask(name, name, 1, after, name), 0.0, seconds, ("slots",))

    jobs = [job("train", 10), job("publish", 1), job("rollout", 2, "publish")]
    schedule = play(jobs, {"slots": 2}, cores=2)
    assert schedule.ends == pytest.approx({"publish": 1, "rollout": 3, "train": 10})
    spans = {name: (schedule.begins[name], schedule.ends[name]) for name in schedule.ends}
    held = held_cores(spans, 2)
    assert {name: held[name] * (end - start) for name, (start, end) in spans.items()} == pytest.approx(
        {"train": 10, "publish": 1, "rollout": 2}
    )
    one = play(jobs, {"slots": 2}, cores=1)  # one core shared by train and publish, then by train and the rollout
    assert one.ends == pytest.approx({"publish": 2, "rollout": 6, "train": 13})
    assert play(jobs, {"slots": 2}).ends == pytest.approx({"publish": 1, "rollout": 3, "train": 10})  # a node each


def test_core_scaling_is_fitted_where_a_step_ran_at_several_shares_and_assumed_linear_otherwise() -> None:
    """Seconds per unit 10 on one core and 10 / 2 ** 0.3 on two: speed grows as cores ** 0.3."""
    points = [(math.log(c), math.log(10 / c**0.3)) for c in (1.0, 1.0, 2.0, 2.0, 1.5)]
    fitted = fit_core_scaling("train", points)
    assert fitted.value == pytest.approx(0.3) and fitted.source.startswith("fitted: 5 train samples at 1.00-2.00")
    assumed = fit_core_scaling("rollout", [(math.log(1.0), 1.0), (math.log(1.1), 0.9)])
    assert assumed.value == 1 and assumed.source.startswith("assumed: linear in cores")
    # Faster on fewer cores (noise) is not a negative exponent, nor faster than linear above 1.
    assert fit_core_scaling("reward", [(0.0, 1.0), (math.log(2), 1.2)]).value == 0
    assert fit_core_scaling("publish", [(0.0, 1.0), (math.log(2), 1.0 - 2 * math.log(2))]).value == 1


def test_runs_pooled_with_a_config_are_refused() -> None:
    with pytest.raises(MoeloopError, match=r"is a config, not a run: runs to pool with it \(--also\) need a run"):
        plan_inputs(str(REPO / "configs" / "tiny.yaml"), None, ("elsewhere/run",))


def test_best_under_a_deadline_and_a_budget(tmp_path: Path) -> None:
    target = tmp_path / "target.yaml"
    stated_plan(tmp_path, 0, BALANCED)  # writes the files
    document = yaml.safe_load(target.read_text())
    document["search"] = {"rollout_shards": [8, 16], "train_nodes": [1, 2], "staleness": [0, 1]}
    target.write_text(yaml.safe_dump(document))
    setup, _, _ = plan_inputs(str(REPO / "configs" / "tiny.yaml"), str(target))
    plan = make_plan(setup, None, None, None, None)
    fastest = min(plan.evaluated, key=lambda e: e.period)
    hours = fastest.period * setup.iterations / 3600
    assert make_plan(setup, None, hours * 1.0001, None, None).best.period == pytest.approx(fastest.period)
    cheapest = min(plan.evaluated, key=lambda e: e.cost_per_iteration)
    assert plan.best is cheapest
    budget = cheapest.cost_per_iteration * setup.iterations * 1.0001
    assert make_plan(setup, budget, None, None, None).best.cost_per_iteration == pytest.approx(
        cheapest.cost_per_iteration
    )
    with pytest.raises(MoeloopError, match="no option runs 24 iterations within"):
        make_plan(setup, None, hours / 2, None, None)
    with pytest.raises(MoeloopError, match="no option runs 24 iterations within \\$"):
        make_plan(setup, budget / 2, None, None, None)


def test_bad_targets_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(MoeloopError, match="GPU type 'A100' is not in the table"):
        stated_plan(tmp_path, 0, BALANCED, gpu="A100")
    with pytest.raises(MoeloopError, match="rates.train_tokens_per_second_per_gpu: Input should be greater than 0"):
        stated_plan(tmp_path, 0, {**BALANCED, "train_tokens_per_second_per_gpu": 0})
    with pytest.raises(MoeloopError, match="its trainer fits no option on H100"):
        stated_plan(tmp_path, 0, BALANCED, gpu="H100", model="deepseek-v3", rollout_gpus_per_shard=32)
    missing = {k: v for k, v in BALANCED.items() if k != "rollout_tokens_per_second_per_gpu"}
    with pytest.raises(
        MoeloopError, match="neither measured for this target nor stated: rollout_tokens_per_second_per_gpu"
    ):
        stated_plan(tmp_path, 0, missing)


def test_a_run_with_no_committed_iteration_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text((REPO / "configs" / "tiny.yaml").read_text())
    with pytest.raises(MoeloopError, match="has no committed iteration yet"):
        plan_inputs(str(run), None)


@pytest.fixture(scope="module")
def measured_run(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A real 4-iteration run of the small demo (transformers rollouts) at staleness 1, to plan from its reports
    (a rollout there waits for the publish two iterations back)."""
    from tests.conftest import SMALL_TRANSFORMERS_ROLLOUT, small_config
    from moeloop.workflows.dag import run_uri
    from moeloop.workflows.local.runner import run_local

    folder = tmp_path_factory.mktemp("measured")
    config = small_config(4, rollout={**SMALL_TRANSFORMERS_ROLLOUT, "max_staleness": 1})
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MOELOOP_CACHE", str(folder / "cache"))
        uri = run_uri(config, str(folder / "runs"))
        run_local(config, uri, folder / "logs", progress=False)
    return uri


@pytest.mark.slow
def test_a_plan_from_a_run_uses_its_measured_rates_and_holds_its_own_setup_against_its_period(
    measured_run: str,
) -> None:
    setup, own, measured_period = plan_inputs(measured_run, None)
    assert own is not None and (own.rollout_shards, own.staleness) == (2, 1)
    for name in ("rollout_tokens_per_second_per_gpu", "train_tokens_per_second_per_gpu", "start_seconds.train"):
        assert setup.figures[name].source.startswith("measured: reports/iter-000003..000004/")
        assert setup.figures[name].value > 0
    # Measured by the local runner: per core, the shares replayed; pooled with a run, the medians stay.
    rate = setup.figures["train_tokens_per_second_per_gpu"]
    assert rate.unit == "tokens/s per core" and "the local runner's shares of" in rate.source
    assert {f"core_scaling.{step}" for step in STEPS} | {"local_cores"} <= set(setup.figures)
    pooled, _, _ = plan_inputs(measured_run, None, (measured_run,))
    assert pooled.figures["train_tokens_per_second_per_gpu"].value == pytest.approx(rate.value)
    assert "(median of 4 iterations of 2 runs)" in pooled.figures["train_tokens_per_second_per_gpu"].source
    plan = make_plan(setup, None, None, own, measured_period)
    predicted, measured = plan.calibration
    assert measured.value > 0 and predicted.period > 0
    assert {(e.option.rollout_shards, e.option.staleness) for e in plan.evaluated} == {
        (k, s) for k in (1, 2, 4) for s in (0, 1)
    }
    # The run's rates do not carry to a GPU: everything measured on this CPU that a GPU plan needs is named.
    target = Path(measured_run).parent / "h200.yaml"
    (target.parent / "prices.yaml").write_text((REPO / "configs" / "prices.yaml").read_text())
    target.write_text(yaml.safe_dump({"gpu": "H200", "prices": "prices.yaml"}))
    with pytest.raises(MoeloopError, match="nor stated: rollout_tokens_per_second_per_gpu, rollout_overhead_seconds"):
        plan_inputs(measured_run, str(target))


@pytest.mark.slow
def test_plan_cli_json_and_bad_input_exit_codes(measured_run: str, tmp_path: Path) -> None:
    import shutil
    from subprocess import CompletedProcess

    from tests.processes import moeloop_cli

    def plan(*args: str) -> CompletedProcess:
        return moeloop_cli("plan", *args)

    done = plan(measured_run, "--format", "json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["calibration"]["measured_period_seconds"] > 0
    assert sum(option["best"] for option in result["options"]) == 1
    zero = tmp_path / "zero"
    shutil.copytree(measured_run, zero)
    report = zero / "reports" / "iter-000004" / "rollout-0.json"
    report.write_text(json.dumps({**json.loads(report.read_text()), "tokens_per_second": 0.0}))
    for args, message in (
        ((str(zero),), "tokens_per_second is 0: a measured rate of zero"),
        ((measured_run, "--budget", "100"), "--budget and --deadline need prices"),
        ((measured_run, "--deadline", "-1"), "--deadline must be positive"),
    ):
        failed = plan(*args)
        assert failed.returncode == 2
        assert failed.stderr.count("\n") == 1 and message in failed.stderr


def test_the_readmes_qwen3_30b_plan_is_what_the_command_prints() -> None:
    """The plan both READMEs show is the output of the command they give, row for row: a change to the planner
    that moves a figure fails here until the READMEs say it."""
    from tests.processes import moeloop_cli

    command = "moeloop plan configs/eks.yaml --target configs/plan-qwen3-30b-h200.yaml --deadline 24"
    done = moeloop_cli(*command.split()[1:])
    assert done.returncode == 0, done.stderr
    printed = done.stdout.splitlines()
    option_rows = [line for line in printed if "GPUs, " in line and not line.startswith("best")]
    assert len(option_rows) >= 3
    for readme in (REPO / "README.md", REPO / "workflows" / "capacity" / "README.md"):
        text = readme.read_text()
        assert command in text, readme
        shown = [line for line in text.splitlines() if line in option_rows or line.startswith("best (")]
        assert shown == [*option_rows, next(line for line in printed if line.startswith("best ("))], readme
