"""What the cluster's monitoring sees of a run: each step template's figures as Argo Prometheus gauges, and the
annotations the Argo UI's links (manifests/base/argo/workflow-controller-configmap.yaml) open.

A step's template emits, once it succeeds, one gauge per numeric output parameter, moeloop_<step>_<output>,
labelled by run (and shard, for a rollout): a bounded set of series per run, which the controller drops once not
updated for its metricsTTL. The controller serves them on its metrics port (manifests/monitoring/
prometheus-scrape.yaml); manifests/monitoring/grafana-dashboard.json plots them.
"""

from __future__ import annotations


from hera.workflows import models as m

from moeloop.steps.storage.s3 import parse_s3_uri

# Output parameters that are text, not figures (start's model source, rollout's engine, plan's flags).
TEXT_OUTPUTS = frozenset({"source", "engine", "more", "evaluate"})
RUN_FOLDER_ANNOTATION = "moeloop-run-folder"  # no dots: the UI resolves ${metadata.annotations.<key>} by dots
TENSORBOARD_ANNOTATION = "moeloop-tensorboard"


def metric_name(step: str, output: str) -> str:
    return f"moeloop_{step.replace('-', '_')}_{output}"  # a step's name may have '-', a Prometheus name not


def template_metrics(
    step: str, params: tuple[str, ...], outputs: tuple[str, ...], run_name: str, missing: str
) -> m.Metrics | None:
    """A step template's `metrics`: a gauge per numeric output, emitted when the step succeeded and reported it
    (an output the step did not report reads `missing`); None for a step without figures."""
    labels = [{"key": "run", "value": run_name}]
    # No iteration label: each would be a new series every iteration, held by the controller (and Prometheus) for
    # the run's life. A gauge's iterations are its samples over time; moeloop_evaluate_iteration says which.
    labels += [{"key": "shard", "value": "{{inputs.parameters.shard}}"}] if "shard" in params else []
    gauges = [
        {
            "name": metric_name(step, output),
            "help": f"moeloop {step} step: {output.replace('_', ' ')}",
            "labels": labels,
            "when": f"{{{{status}}}} == Succeeded && '{{{{outputs.parameters.{output}}}}}' != '{missing}'",
            "gauge": {"value": f"{{{{outputs.parameters.{output}}}}}", "realtime": False},  # once, at the end
        }
        for output in outputs
        if output not in TEXT_OUTPUTS
    ]
    return m.Metrics.model_validate({"prometheus": gauges}) if gauges else None


def browser_url(uri: str) -> str:
    """Where a browser opens a storage URI: the S3 console for s3://, the path itself otherwise."""
    if not uri.startswith("s3://"):
        return uri
    location = parse_s3_uri(uri)
    return f"https://s3.console.aws.amazon.com/s3/buckets/{location.bucket}?prefix={location.key.rstrip('/')}/"


def run_annotations(run_uri: str) -> dict[str, str]:
    """The Workflow's annotations behind the UI's links: the run's folder and its TensorBoard event files."""
    return {
        RUN_FOLDER_ANNOTATION: browser_url(run_uri),
        TENSORBOARD_ANNOTATION: browser_url(f"{run_uri.rstrip('/')}/tensorboard"),
    }
