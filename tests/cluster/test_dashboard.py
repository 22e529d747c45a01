"""The cluster's monitoring of a run, on the single-node config (configs/tiny.yaml) and the JobSet one
(configs/eks.yaml): every metric the Grafana dashboard queries is a gauge the render emits, from a pod Argo sees;
no gauge is labelled per iteration, so a run's series are a fixed set; the controller forgets old series
(metricsTTL); a multi-node trainer's figures reach Argo through train-report."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.processes import run_step
from moeloop.steps.config import load_config
from moeloop.steps.storage.run import RunStorage
from moeloop.workflows.dag import EVALUATE, PLAN, PUBLISH, REWARD, START, TRAIN
from moeloop.workflows.monitoring import TEXT_OUTPUTS
from moeloop.workflows.render.loop import render

CONFIGS = ("tiny.yaml", "eks.yaml")
DASHBOARD = REPO / "manifests" / "monitoring" / "grafana-dashboard.json"
CONTROLLER = REPO / "manifests" / "base" / "argo" / "workflow-controller-configmap.yaml"


def gauges(config_name: str) -> dict[str, list[tuple[str, dict]]]:
    """Metric name -> (the template that emits it, its kind of template, the gauge) for the config's render."""
    config = load_config(REPO / "configs" / config_name)
    templates = render(config, f"s3://bucket/runs/{config.run_name}")["workflow-template.yaml"]["spec"]["templates"]
    found: dict[str, list[tuple[str, dict]]] = {}
    for template in templates:
        kind = next(k for k in ("container", "resource", "dag", "steps") if k in template)
        for gauge in template.get("metrics", {}).get("prometheus", []):
            found.setdefault(gauge["name"], []).append((f"{template['name']} ({kind})", gauge))
    return found


def dashboard_metrics() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    queries += [variable["definition"] for variable in dashboard["templating"]["list"] if "definition" in variable]
    return {name for query in queries for name in re.findall(r"\bmoeloop_[a-z_]+", query)}


@pytest.mark.parametrize("config_name", CONFIGS)
def test_every_dashboard_query_names_a_gauge_a_pod_emits(config_name: str) -> None:
    emitted = gauges(config_name)
    assert dashboard_metrics() - emitted.keys() == set()
    for name in dashboard_metrics():
        # Only a pod's template has the figures: a resource template (the JobSet's) has no outputs to emit.
        assert all(where.endswith("(container)") for where, _ in emitted[name]), (name, emitted[name])


@pytest.mark.parametrize("config_name", CONFIGS)
def test_a_runs_series_are_a_fixed_set(config_name: str) -> None:
    """No label but run (and a rollout's shard): an iteration label would add a series per gauge per iteration."""
    config = load_config(REPO / "configs" / config_name)
    emitted = gauges(config_name)
    series = 0
    for name, places in emitted.items():
        for _, gauge in places:
            keys = [label["key"] for label in gauge["labels"]]
            assert keys in (["run"], ["run", "shard"]), (name, keys)
            assert gauge["labels"][0]["value"] == config.run_name
            series += config.rollout.num_shards if "shard" in keys else 1
    steps = (START, PLAN, REWARD, TRAIN, PUBLISH, EVALUATE)
    figures = [output for step in steps for output in step.outputs if output not in TEXT_OUTPUTS]
    assert series == len(figures) + 4 * config.rollout.num_shards == 21 + 4 * config.rollout.num_shards


def test_the_controller_forgets_series_of_finished_runs() -> None:
    [configmap] = yaml.safe_load_all(CONTROLLER.read_text())
    metrics = yaml.safe_load(configmap["data"]["metricsConfig"])
    # Argo's TTL (config/ttl.go): a whole number and one of d, h, m, s; a run's series are updated at least every
    # chunk, so they outlive any chunk of configs/eks.yaml at up to half an hour an iteration.
    number, unit = re.fullmatch(r"(\d+)([dhms])", metrics["metricsTTL"]).groups()
    hours = int(number) * {"d": 24, "h": 1, "m": 1 / 60, "s": 1 / 3600}[unit]
    assert hours >= 16 * 0.5


def test_the_jobset_train_template_reports_the_train_figures_after_the_jobset() -> None:
    config = load_config(REPO / "configs" / "eks.yaml")
    rendered = render(config, "s3://bucket/runs/tiny-eks")["workflow-template.yaml"]
    templates = {t["name"]: t for t in rendered["spec"]["templates"]}
    train = templates["train"]
    assert [[step["template"] for step in group] for group in train["steps"]] == [["train-jobset"], ["train-report"]]
    assert "resource" in templates["train-jobset"] and "metrics" not in templates["train-jobset"]
    report = templates["train-report"]
    assert report["container"]["command"] == ["python", "-m", "moeloop.steps.train_report"]
    assert report["nodeSelector"] == {"moeloop.dev/role": "cpu"}
    assert [p["name"] for p in report["outputs"]["parameters"]] == list(TRAIN.outputs)
    assert {g["name"] for g in report["metrics"]["prometheus"]} == {f"moeloop_train_{o}" for o in TRAIN.outputs}


def test_train_report_prints_the_committed_report_as_the_steps_outputs(tmp_path: Path) -> None:
    config = load_config(REPO / "configs" / "eks.yaml")
    run = tmp_path / "run"
    storage = RunStorage(str(run))
    storage.write_bytes(RunStorage.CONFIG, yaml.safe_dump(config.model_dump(mode="json")).encode())
    report = {"loss": -0.25, "kl": 0.01, "grad_norm": 1.5, "clip_fraction_binding": 0.02, "entropy": 1.25,
              "train_tokens_per_second": 900.0, "seconds": 12.5, "started_at": 1.0, "ended_at": 13.5}  # fmt: skip
    storage.write_json(storage.report(3, "train"), report)

    def train_report(iteration: int) -> subprocess.CompletedProcess[str]:
        return run_step("train_report", run, iteration, env={"MOELOOP_OUTPUTS": str(tmp_path / "outputs")})

    done = train_report(3)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == report
    outputs = {o: json.loads((tmp_path / "outputs" / o).read_text()) for o in TRAIN.outputs}
    assert outputs == {o: report[o] for o in TRAIN.outputs}
    missing = train_report(4)
    assert missing.returncode == 2
    assert missing.stderr == f"error: iteration 4 has no train report: {run}/reports/iter-000004/train.json\n"
