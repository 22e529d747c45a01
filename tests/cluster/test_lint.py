"""moeloop.workflows.lint: its checks on documents written here and on moeloop's own render; and against the Argo example
corpus ($MOELOOP_SHARED/corpora/argo-examples, see tests/upstream.py): every upstream example lints clean, and
one-defect mutants of every example are rejected with the problem named in the error's path or message."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.upstream import available, needs_upstream, upstream
from moeloop.workflows.lint.documents import (
    LintError,
    document_label,
    is_argo_document,
    lint_document,
    lint_documents,
    lint_paths,
)
from moeloop.workflows.lint.helpers import YamlMap
from moeloop.workflows.lint.references import WORKFLOW_SPEC_PATHS
from moeloop.workflows.lint.schema_checks import schema_check, schema_validator

SOURCES_PER_MUTATION = 3


def corpus() -> Path:
    return upstream("corpora", "argo-examples")


def corpus_files() -> list[Any]:
    """The corpus's YAML files as pytest params; one skipped param without $MOELOOP_SHARED."""
    if not available():
        return [pytest.param(None, marks=needs_upstream, id="no-corpus")]
    root = corpus()
    files = sorted(path for path in root.rglob("*") if path.suffix in (".yaml", ".yml"))
    return [pytest.param(path, id=str(path.relative_to(root))) for path in files]


@lru_cache(maxsize=1)
def corpus_documents() -> tuple[tuple[str, YamlMap], ...]:
    """(id, document) for every Argo document of the corpus."""
    corpus()  # skips without $MOELOOP_SHARED
    documents: list[tuple[str, YamlMap]] = []
    for param in corpus_files():
        (path,) = param.values
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if is_argo_document(doc):
                documents.append((f"{param.id}:{document_label(doc)}", doc))
    return tuple(documents)


def pick(predicate: Callable[[YamlMap], bool], count: int = SOURCES_PER_MUTATION) -> list[Any]:
    """`count` corpus documents matching predicate, as pytest params: the first match of each kind
    (so Workflow, WorkflowTemplate, CronWorkflow... are all exercised), then the next matches. Without the
    corpus: one skipped param."""
    if not available():
        return [pytest.param(None, marks=needs_upstream, id="no-corpus")]
    matches = [(doc_id, doc) for doc_id, doc in corpus_documents() if predicate(doc)]
    first_of_kind = {doc["kind"]: doc_id for doc_id, doc in reversed(matches)}
    ordered = sorted(matches, key=lambda match: match[0] not in first_of_kind.values())
    assert len(ordered) >= count, "corpus has too few documents for this mutation"
    return [pytest.param(doc, id=doc_id) for doc_id, doc in ordered[:count]]


def first_source(predicate: Callable[[YamlMap], bool]) -> YamlMap:
    corpus()  # skips without $MOELOOP_SHARED
    return copy.deepcopy(pick(predicate, 1)[0].values[0])


def spec_path(doc: YamlMap) -> str:
    return "spec.workflowSpec" if doc["kind"] == "CronWorkflow" else "spec"


def workflow_spec(doc: YamlMap) -> YamlMap:
    spec: YamlMap = doc["spec"]["workflowSpec"] if doc["kind"] == "CronWorkflow" else doc["spec"]
    return spec


def own_templates(doc: YamlMap) -> list[YamlMap]:
    """Templates of a spec that defines its own (no workflowTemplateRef); [] for other kinds."""
    if doc["kind"] not in WORKFLOW_SPEC_PATHS or "workflowTemplateRef" in workflow_spec(doc):
        return []
    templates: list[YamlMap] = workflow_spec(doc).get("templates", [])
    return templates


def first_index(doc: YamlMap, predicate: Callable[[YamlMap], bool]) -> int:
    return next(i for i, template in enumerate(own_templates(doc)) if predicate(template))


def first_template(doc: YamlMap, predicate: Callable[[YamlMap], bool]) -> tuple[str, YamlMap]:
    """(path, template) of the first template matching predicate."""
    i = first_index(doc, predicate)
    return f"{spec_path(doc)}.templates[{i}]", own_templates(doc)[i]


def has_container(template: YamlMap) -> bool:
    return "container" in template


def has_dag(template: YamlMap) -> bool:
    tasks = template.get("dag", {}).get("tasks", [])
    return len(tasks) >= 2 and all("template" in task for task in tasks)


def has_steps(template: YamlMap) -> bool:
    return "steps" in template and "template" in template["steps"][0][0]


def with_template(predicate: Callable[[YamlMap], bool]) -> Callable[[YamlMap], bool]:
    return lambda doc: any(predicate(template) for template in own_templates(doc))


def errors_at(errors: list[LintError], path: str) -> list[str]:
    return [error.message for error in errors if error.path == path]


# ---------------------------------------------------------------------------------------------
# The corpus is accepted


# The corpus's one defect, which lint names: this example gives its metadata `annotations` twice (PyYAML would keep
# the second, dropping the first without a word).
CORPUS_DEFECTS = {
    "k8s-patch-json-workflow.yaml": "not valid YAML (key 'annotations' appears twice in one mapping, line 13)",
}


def corpus_defects(paths: list[Path]) -> list[str]:
    return [f"{path}: {CORPUS_DEFECTS[path.name]}" for path in paths if path.name in CORPUS_DEFECTS]


@pytest.mark.parametrize("path", corpus_files())
def test_corpus_file_lints_clean(path: Path) -> None:
    assert [str(error) for error in lint_paths([path])] == corpus_defects([path])


def test_corpus_has_all_argo_documents_and_lints_clean_as_one_tree() -> None:
    assert len(corpus_documents()) == 225
    # One call: templateRefs are then checked against the corpus's own WorkflowTemplates.
    files = sorted(path for path in corpus().rglob("*") if path.suffix in (".yaml", ".yml"))
    assert [str(error) for error in lint_paths([corpus()])] == corpus_defects(files)


def test_fast_schema_check_agrees_with_jsonschema_on_corpus() -> None:
    # lint skips jsonschema when the compiled check accepts: both must accept every valid document.
    for doc_id, doc in corpus_documents():
        assert schema_check(doc["kind"])(doc), doc_id
        assert not list(schema_validator(doc["kind"]).iter_errors(doc)), doc_id


# Values that break some schema types and fit others, including reference-like strings.
JUNK_VALUES: list[object] = [None, 1, 2.5, 3.0, True, "x", "{{inputs.parameters.q}}", [], {}, [1], ["a"], {"zz": 1}]


def value_slots(node: object) -> Iterator[tuple[Any, Any]]:
    """(container, key) for every value below node."""
    children: Iterable[tuple[Any, object]] = ()
    if isinstance(node, dict):
        children = node.items()
    elif isinstance(node, list):
        children = enumerate(node)
    for key, value in children:
        yield node, key
        yield from value_slots(value)


def test_fast_schema_check_agrees_with_jsonschema_on_random_mutations() -> None:
    """Both verdicts match on broken documents too, and the reference checks never raise on them."""
    rng = random.Random(0)
    for _ in range(400):
        doc_id, doc = rng.choice(corpus_documents())
        doc = copy.deepcopy(doc)
        slots = [(parent, key) for parent, key in value_slots(doc) if parent is not doc or key != "kind"]
        for parent, key in rng.sample(slots, min(2, len(slots))):
            if isinstance(parent, dict) and rng.random() < 0.2:
                parent[f"{key}x"] = parent.pop(key, None)  # a misspelled key
            else:
                parent[key] = copy.deepcopy(rng.choice(JUNK_VALUES))
        jsonschema_accepts = not list(schema_validator(doc["kind"]).iter_errors(doc))
        assert schema_check(doc["kind"])(doc) == jsonschema_accepts, doc_id
        lint_document(doc)


# ---------------------------------------------------------------------------------------------
# Schema mutations


@pytest.mark.parametrize("doc", pick(with_template(has_container)))
def test_misspelled_template_key_is_named(doc: YamlMap) -> None:
    doc = copy.deepcopy(doc)
    path, template = first_template(doc, has_container)
    template["contianer"] = template.pop("container")
    messages = errors_at(lint_document(doc), path)
    assert any("'contianer' was unexpected" in message for message in messages), messages


@pytest.mark.parametrize("doc", pick(with_template(has_dag)))
def test_misspelled_task_key_is_named(doc: YamlMap) -> None:
    doc = copy.deepcopy(doc)
    path, template = first_template(doc, has_dag)
    template["dag"]["tasks"][0]["dependecies"] = []
    messages = errors_at(lint_document(doc), f"{path}.dag.tasks[0]")
    assert any("'dependecies' was unexpected" in message for message in messages), messages


@pytest.mark.parametrize("doc", pick(with_template(has_container)))
def test_list_as_retry_limit_is_rejected(doc: YamlMap) -> None:
    doc = copy.deepcopy(doc)
    path, template = first_template(doc, has_container)
    template["retryStrategy"] = {"limit": ["3"]}
    messages = errors_at(lint_document(doc), f"{path}.retryStrategy.limit")
    assert messages == ["['3'] is not of type 'integer', 'string'"]


@pytest.mark.parametrize("doc", pick(lambda doc: bool(own_templates(doc))))
def test_string_parallelism_is_rejected(doc: YamlMap) -> None:
    doc = copy.deepcopy(doc)
    workflow_spec(doc)["parallelism"] = "abc"
    assert errors_at(lint_document(doc), f"{spec_path(doc)}.parallelism") == ["'abc' is not of type 'integer'"]


@pytest.mark.parametrize("limit", [3, "3"])
@pytest.mark.parametrize("doc", pick(with_template(has_container)))
def test_int_or_string_fields_accept_integers(doc: YamlMap, limit: int | str) -> None:
    doc = copy.deepcopy(doc)
    _, template = first_template(doc, has_container)
    template["retryStrategy"] = {"limit": limit, "backoff": {"factor": 2, "duration": "1s"}}
    template["activeDeadlineSeconds"] = 60
    template["container"]["resources"] = {"limits": {"nvidia.com/gpu": 1, "cpu": "500m"}}
    assert lint_document(doc) == []


def test_labels_and_annotations_stay_open() -> None:
    doc = first_source(with_template(has_container))
    doc["metadata"]["labels"] = {"app.kubernetes.io/name": "moeloop", "anything": "goes"}
    doc["metadata"]["annotations"] = {"example.com/note": "free-form"}
    _, template = first_template(doc, has_container)
    template["metadata"] = {"labels": {"any-key": "v"}, "annotations": {"other/key": "w"}}
    assert lint_document(doc) == []


# ---------------------------------------------------------------------------------------------
# Reference mutations


@pytest.mark.parametrize("doc", pick(lambda doc: bool(own_templates(doc)) and "entrypoint" in workflow_spec(doc)))
def test_entrypoint_to_missing_template(doc: YamlMap) -> None:
    doc = copy.deepcopy(doc)
    workflow_spec(doc)["entrypoint"] = "no-such-template"
    messages = errors_at(lint_document(doc), f"{spec_path(doc)}.entrypoint")
    assert len(messages) == 1 and "unknown template 'no-such-template'" in messages[0]


@pytest.mark.parametrize("doc", pick(with_template(has_dag)))
def test_dag_task_to_missing_template(doc: YamlMap) -> None:
    doc = copy.deepcopy(doc)
    path, template = first_template(doc, has_dag)
    template["dag"]["tasks"][1]["template"] = "no-such-template"
    messages = errors_at(lint_document(doc), f"{path}.dag.tasks[1].template")
    assert len(messages) == 1 and "'no-such-template'" in messages[0]


@pytest.mark.parametrize("doc", pick(with_template(has_steps)))
def test_step_to_missing_template(doc: YamlMap) -> None:
    doc = copy.deepcopy(doc)
    path, template = first_template(doc, has_steps)
    template["steps"][0][0]["template"] = "no-such-template"
    messages = errors_at(lint_document(doc), f"{path}.steps[0][0].template")
    assert len(messages) == 1 and "'no-such-template'" in messages[0]


@pytest.mark.parametrize("doc", pick(with_template(has_steps)))
def test_exit_handlers_to_missing_templates(doc: YamlMap) -> None:
    doc = copy.deepcopy(doc)
    path, template = first_template(doc, has_steps)
    template["steps"][0][0]["hooks"] = {"exit": {"template": "no-such-exit"}}
    workflow_spec(doc)["onExit"] = "no-such-handler"
    errors = lint_document(doc)
    assert "'no-such-exit'" in errors_at(errors, f"{path}.steps[0][0].hooks.exit.template")[0]
    assert "'no-such-handler'" in errors_at(errors, f"{spec_path(doc)}.onExit")[0]


@pytest.mark.parametrize("doc", pick(with_template(has_dag)))
def test_dependency_on_missing_task(doc: YamlMap) -> None:
    doc = copy.deepcopy(doc)
    path, template = first_template(doc, has_dag)
    tasks = template["dag"]["tasks"]
    tasks[-1].pop("depends", None)
    tasks[-1]["dependencies"] = ["ghost-task"]
    messages = errors_at(lint_document(doc), f"{path}.dag.tasks[{len(tasks) - 1}].dependencies[0]")
    assert len(messages) == 1 and "unknown task 'ghost-task'" in messages[0]


@pytest.mark.parametrize("doc", pick(with_template(has_dag)))
def test_depends_expression_naming_missing_task(doc: YamlMap) -> None:
    doc = copy.deepcopy(doc)
    path, template = first_template(doc, has_dag)
    tasks = template["dag"]["tasks"]
    first = tasks[0]["name"]
    tasks[-1].pop("dependencies", None)
    tasks[-1]["depends"] = f"{first} && (ghost-task.Succeeded || !{first}.Failed)"
    messages = errors_at(lint_document(doc), f"{path}.dag.tasks[{len(tasks) - 1}].depends")
    assert len(messages) == 1 and "unknown task 'ghost-task'" in messages[0]


@pytest.mark.parametrize("doc", pick(with_template(has_dag)))
def test_depends_with_misspelled_result(doc: YamlMap) -> None:
    doc = copy.deepcopy(doc)
    path, template = first_template(doc, has_dag)
    tasks = template["dag"]["tasks"]
    tasks[-1].pop("dependencies", None)
    tasks[-1]["depends"] = f"{tasks[0]['name']}.Succeded"
    messages = errors_at(lint_document(doc), f"{path}.dag.tasks[{len(tasks) - 1}].depends")
    assert len(messages) == 1 and f"{tasks[0]['name']}.Succeded" in messages[0]


@pytest.mark.parametrize("doc", pick(with_template(has_dag)))
def test_dependency_cycle_is_reported(doc: YamlMap) -> None:
    doc = copy.deepcopy(doc)
    path, template = first_template(doc, has_dag)
    first, second = template["dag"]["tasks"][:2]
    for task, upstream in ((first, second), (second, first)):
        task.pop("dependencies", None)
        task["depends"] = upstream["name"]
    messages = errors_at(lint_document(doc), f"{path}.dag.tasks")
    assert len(messages) == 1 and messages[0].startswith("dependency cycle: ")
    names = first["name"], second["name"]
    assert messages[0].endswith((" -> ".join(names + names[:1]), " -> ".join(names[::-1] + names[1:])))


@pytest.mark.parametrize("doc", pick(with_template(has_dag)))
def test_task_output_reference_to_missing_task(doc: YamlMap) -> None:
    doc = copy.deepcopy(doc)
    path, template = first_template(doc, has_dag)
    tasks = template["dag"]["tasks"]
    # An argument the called template does not declare is fine; its value's reference is not.
    tasks[-1].setdefault("arguments", {}).setdefault("parameters", []).append(
        {"name": "extra", "value": "{{tasks.ghost-task.outputs.parameters.p}}"}
    )
    errors = lint_document(doc)
    assert len(errors) == 1 and "unknown task 'ghost-task'" in errors[0].message
    assert errors[0].path.startswith(f"{path}.dag.tasks[{len(tasks) - 1}].arguments.parameters[")


@pytest.mark.parametrize("doc", pick(with_template(has_dag)))
def test_extra_task_arguments_are_not_flagged(doc: YamlMap) -> None:
    doc = copy.deepcopy(doc)
    _, template = first_template(doc, has_dag)
    tasks = template["dag"]["tasks"]
    tasks[-1].setdefault("arguments", {}).setdefault("parameters", []).append(
        {"name": "not-declared-by-template", "value": "{{tasks." + tasks[0]["name"] + ".outputs.result}}"}
    )
    assert lint_document(doc) == []


UNDECLARED_INPUT_REFERENCES = [
    "{{inputs.parameters.nope}}",
    "{{ inputs.parameters.nope }}",
    "{{=asInt(inputs.parameters.nope)}}",
    "{{=inputs.parameters['nope']}}",
]


@pytest.mark.parametrize("reference", UNDECLARED_INPUT_REFERENCES)
@pytest.mark.parametrize("doc", pick(with_template(has_container)))
def test_undeclared_input_parameter(doc: YamlMap, reference: str) -> None:
    doc = copy.deepcopy(doc)
    path, template = first_template(doc, has_container)
    args = template["container"].setdefault("args", [])
    args.append(f"say {reference}")
    messages = errors_at(lint_document(doc), f"{path}.container.args[{len(args) - 1}]")
    assert len(messages) == 1 and "undeclared input parameter 'nope'" in messages[0]


# Only Workflows and CronWorkflows: a WorkflowTemplate's submitter may supply workflow parameters.
@pytest.mark.parametrize(
    "doc", pick(lambda doc: doc["kind"] in ("Workflow", "CronWorkflow") and with_template(has_container)(doc))
)
def test_undeclared_workflow_parameter(doc: YamlMap) -> None:
    doc = copy.deepcopy(doc)
    path, template = first_template(doc, has_container)
    args = template["container"].setdefault("args", [])
    args.append("{{workflow.parameters.nope}}")
    messages = errors_at(lint_document(doc), f"{path}.container.args[{len(args) - 1}]")
    assert len(messages) == 1 and "undeclared workflow parameter 'nope'" in messages[0]


def test_declared_parameters_are_accepted() -> None:
    doc = first_source(with_template(has_container))
    workflow_spec(doc)["arguments"] = {"parameters": [{"name": "run-id", "value": "r1"}]}
    _, template = first_template(doc, has_container)
    template["inputs"] = {"parameters": [{"name": "shard", "value": "0"}]}
    template["container"]["args"] = [
        "{{inputs.parameters.shard}} {{workflow.parameters.run-id}} {{workflow.parameters.json}}",
        "{{=inputs.parameters.shard + workflow.parameters['run-id']}} {{item}} {{workflow.name}}",
    ]
    assert lint_document(doc) == []


# ---------------------------------------------------------------------------------------------
# Kinds, files, templateRefs, error format


def test_unknown_kind_under_argoproj_is_an_error() -> None:
    doc = first_source(lambda doc: doc["kind"] == "Workflow")
    doc["kind"] = "Workflw"
    errors = lint_document(doc)
    assert [error.path for error in errors] == ["kind"] and "'Workflw'" in errors[0].message


@pytest.mark.parametrize(
    "doc",
    [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"x": "1"}},
        {"apiVersion": "argoproj.io/v1alpha1", "kind": "Application", "spec": {"anything": True}},
        {"kind": "Workflow", "spec": {"bogus": 1}},
        ["not", "a", "mapping"],
    ],
    ids=["configmap", "argocd-application", "no-apiVersion", "list"],
)
def test_non_argo_documents_are_skipped(doc: object) -> None:
    assert not is_argo_document(doc)
    assert lint_document(doc) == []  # type: ignore[arg-type]


def test_broken_yaml_is_a_lint_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("apiVersion: argoproj.io/v1alpha1\nkind: Workflow\nspec: {templates: [\n")
    errors = lint_paths([tmp_path])
    assert len(errors) == 1 and errors[0].source == str(broken)
    assert errors[0].message.startswith("not valid YAML (") and "line" in errors[0].message
    assert "\n" not in str(errors[0])


def test_missing_path_is_a_lint_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    errors = lint_paths([missing])
    assert [(error.source, error.message) for error in errors] == [(str(missing), "path does not exist")]


def test_multi_document_file(tmp_path: Path) -> None:
    good = first_source(lambda doc: doc["kind"] == "Workflow" and "entrypoint" in doc["spec"])
    bad = copy.deepcopy(good)
    bad["metadata"] = {"name": "typo-wf"}
    bad["spec"]["entrypiont"] = bad["spec"].pop("entrypoint")
    configmap = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}}
    path = tmp_path / "sub" / "many.yml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump_all([good, configmap, None, bad]))
    errors = lint_paths([tmp_path])
    assert [(error.source, error.document, error.path) for error in errors] == [(str(path), "Workflow/typo-wf", "spec")] * 2
    assert "'entrypiont' was unexpected" in errors[0].message
    assert errors[1].message == "no entrypoint: a Workflow that defines its own templates names the one to run"


def test_template_ref_checked_when_template_is_linted_alongside() -> None:
    library = {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "WorkflowTemplate",
        "metadata": {"name": "library"},
        "spec": {"templates": [{"name": "echo", "container": {"image": "alpine"}}]},
    }

    def caller(template: str) -> YamlMap:
        step = {"name": "s", "templateRef": {"name": "library", "template": template}}
        spec = {"entrypoint": "main", "templates": [{"name": "main", "steps": [[step]]}]}
        return {
            "apiVersion": "argoproj.io/v1alpha1",
            "kind": "Workflow",
            "metadata": {"generateName": "c-"},
            "spec": spec,
        }

    assert lint_documents([library, caller("echo")]) == []
    assert lint_document(caller("ehco")) == []  # library not given: not checkable offline
    errors = lint_documents([library, caller("ehco")])
    assert [(error.document, error.path) for error in errors] == [
        ("Workflow/c-", "spec.templates[0].steps[0][0].templateRef.template")
    ]
    assert "'ehco'" in errors[0].message


def test_error_string_format() -> None:
    error = LintError("wf.yaml", "Workflow/w", "spec.entrypoint", "unknown template 'x'")
    assert str(error) == "wf.yaml: Workflow/w: spec.entrypoint: unknown template 'x'"
    assert str(LintError("wf.yaml", "", "", "invalid YAML: oops")) == "wf.yaml: invalid YAML: oops"


@pytest.mark.parametrize(
    "reference", ["{{tasks.plan.outputs.parameters.first}}", "{{=asInt(tasks.plan.outputs.parameters.first) + 1}}"]
)
def test_task_reference_outside_a_dag_is_an_error(reference: str) -> None:
    """A container template cannot see a DAG's tasks (Argo fails to resolve it at run time): pass an input."""
    doc = first_source(with_template(has_container))
    path, template = first_template(doc, has_container)
    args = template["container"].setdefault("args", [])
    args.append(reference)
    messages = errors_at(lint_document(doc), f"{path}.container.args[{len(args) - 1}]")
    assert len(messages) == 1 and "only a DAG can refer to its tasks; pass an input" in messages[0]


def test_expression_naming_a_missing_task_is_an_error() -> None:
    doc = first_source(with_template(has_dag))
    path, template = first_template(doc, has_dag)
    tasks = template["dag"]["tasks"]
    tasks[-1].setdefault("arguments", {}).setdefault("parameters", []).append(
        {"name": "n", "value": "{{=asInt(tasks['ghost-task'].outputs.result) + 1}}"}
    )
    errors = lint_document(doc)
    assert len(errors) == 1 and "unknown task 'ghost-task'" in errors[0].message
    assert errors[0].path.startswith(f"{path}.dag.tasks[{len(tasks) - 1}].arguments.parameters[")


# ---------------------------------------------------------------------------------------------
# Without the corpus: documents written here and moeloop's own render


def diamond() -> YamlMap:
    """A Workflow written for these tests: a DAG with `depends`, a retried container template, pod GC."""
    echo = {"name": "echo", "template": "echo"}
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {"generateName": "diamond-"},
        "spec": {
            "entrypoint": "diamond",
            "podGC": {"strategy": "OnPodSuccess"},
            "arguments": {"parameters": [{"name": "message", "value": "hi"}]},
            "templates": [
                {
                    "name": "diamond",
                    "dag": {
                        "tasks": [
                            {**echo, "name": "a"},
                            {**echo, "name": "b", "depends": "a"},
                            {**echo, "name": "c", "depends": "a.Succeeded"},
                            {**echo, "name": "d", "depends": "b && (c || !c.Failed)"},
                        ]
                    },
                },
                {
                    "name": "echo",
                    "retryStrategy": {"limit": 2, "retryPolicy": "OnFailure", "backoff": {"duration": "1s", "factor": 2}},
                    "container": {
                        "image": "alpine:3.20",
                        "imagePullPolicy": "IfNotPresent",
                        "command": ["echo", "{{workflow.parameters.message}}"],
                        "resources": {"limits": {"memory": "64Mi", "cpu": 1}},
                    },
                },
            ],
        },
    }


def hourly(workflow: YamlMap) -> YamlMap:
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "CronWorkflow",
        "metadata": {"name": "hourly"},
        "spec": {"schedules": ["0 * * * *"], "concurrencyPolicy": "Forbid", "workflowSpec": workflow["spec"]},
    }


def rendered() -> dict[str, YamlMap]:
    from tests.conftest import small_config
    from moeloop.workflows.render.loop import render

    return {name: copy.deepcopy(document) for name, document in render(small_config(), "s3://bucket/runs/tiny").items()}


def test_own_documents_lint_clean() -> None:
    assert lint_documents([diamond(), hourly(diamond()), *rendered().values()]) == []


def _tasks(doc: YamlMap) -> list[YamlMap]:
    return doc["spec"]["templates"][0]["dag"]["tasks"]


def _set(doc: YamlMap, path: str, value: Any) -> YamlMap:
    """doc with `value` at the dotted path (`[i]` indexes a list)."""
    *parents, last = [int(part) if part.isdigit() else part for part in path.replace("[", ".").replace("]", "").split(".")]
    node: Any = doc
    for part in parents:
        node = node[part]
    node[last] = value
    return doc


def _renamed(doc: YamlMap, path: str, old: str, new: str) -> YamlMap:
    node: Any = doc
    for part in [int(p) if p.isdigit() else p for p in path.replace("[", ".").replace("]", "").split(".")]:
        node = node[part]
    node[new] = node.pop(old)
    return doc


def _cycle(doc: YamlMap) -> YamlMap:
    tasks = _tasks(doc)
    tasks[0]["depends"] = "d"
    return doc


def _without_entrypoint(doc: YamlMap) -> YamlMap:
    del doc["spec"]["entrypoint"]
    return doc


T = "spec.templates"
# (what is wrong, how the diamond gets it, where lint must say so, what it must say)
DIAMOND_MUTANTS: list[tuple[str, Callable[[YamlMap], YamlMap], str, str]] = [
    ("misspelled template key", lambda d: _renamed(d, f"{T}[1]", "container", "contianer"), f"{T}[1]", "'contianer' was unexpected"),
    ("misspelled task key", lambda d: _renamed(d, f"{T}[0].dag.tasks[1]", "depends", "depnds"), f"{T}[0].dag.tasks[1]", "'depnds' was unexpected"),
    ("missing entrypoint", _without_entrypoint, "spec", "no entrypoint"),
    ("entrypoint to a missing template", lambda d: _set(d, "spec.entrypoint", "main"), "spec.entrypoint", "unknown template 'main'"),
    ("task to a missing template", lambda d: _set(d, f"{T}[0].dag.tasks[2].template", "ehco"), f"{T}[0].dag.tasks[2].template", "unknown template 'ehco'"),
    ("depends on a missing task", lambda d: _set(d, f"{T}[0].dag.tasks[3].depends", "b && e"), f"{T}[0].dag.tasks[3].depends", "unknown task 'e'"),
    ("misspelled task result", lambda d: _set(d, f"{T}[0].dag.tasks[2].depends", "a.Succeded"), f"{T}[0].dag.tasks[2].depends", "unknown task result a.Succeded"),
    ("depends syntax", lambda d: _set(d, f"{T}[0].dag.tasks[3].depends", "b && (c ||"), f"{T}[0].dag.tasks[3].depends", "invalid depends expression: expected a task name"),
    ("depends and dependencies", lambda d: _set(d, f"{T}[0].dag.tasks[1].dependencies", ["a"]), f"{T}[0].dag.tasks[1]", "cannot use both 'depends' and 'dependencies'"),
    ("dependency cycle", _cycle, f"{T}[0].dag.tasks", "dependency cycle: "),
    ("retryPolicy", lambda d: _set(d, f"{T}[1].retryStrategy.retryPolicy", "OnFaliure"), f"{T}[1].retryStrategy.retryPolicy", "'OnFaliure' is not one of ['Always', 'OnFailure', 'OnError', 'OnTransientError']"),
    ("podGC strategy", lambda d: _set(d, "spec.podGC.strategy", "OnPodSucces"), "spec.podGC.strategy", "'OnPodSucces' is not one of ['', 'OnPodCompletion'"),
    ("imagePullPolicy", lambda d: _set(d, f"{T}[1].container.imagePullPolicy", "IfNotPresnt"), f"{T}[1].container.imagePullPolicy", "'IfNotPresnt' is not one of ['Always', 'IfNotPresent', 'Never'] (or a {{...}} expression)"),
    ("quantity", lambda d: _set(d, f"{T}[1].container.resources.limits.memory", "64 MB"), f"{T}[1].container.resources.limits.memory", "'64 MB' is not a Kubernetes quantity"),
    ("task name", lambda d: _set(d, f"{T}[0].dag.tasks[0].name", "a_1"), f"{T}[0].dag.tasks[0].name", "'a_1' is not a name of letters, digits and '-'"),
    ("parameter name", lambda d: _set(d, "spec.arguments.parameters[0].name", "my message"), "spec.arguments.parameters[0].name", "is not a parameter name"),
    ("int32 range", lambda d: _set(d, f"{T}[1].container.ports", [{"containerPort": 2**31}]), f"{T}[1].container.ports[0].containerPort", "2147483648 is not a valid int32"),
    ("two template types", lambda d: _set(d, f"{T}[1].script", {"image": "alpine", "source": "echo"}), f"{T}[1]", "template must have at most one template type (found container, script)"),
    ("too many tasks", lambda d: _set(d, f"{T}[0].dag.tasks", [{"name": f"t{i}", "template": "echo"} for i in range(201)]), f"{T}[0].dag.tasks", "201 items, more than the 200 allowed"),
    ("parallelism below 1", lambda d: _set(d, "spec.parallelism", 0), "spec.parallelism", "0 is less than the minimum of 1"),
]


@pytest.mark.parametrize(("mutate", "path", "says"), [pytest.param(*m[1:], id=m[0]) for m in DIAMOND_MUTANTS])
def test_a_defect_in_an_own_document_is_named(mutate: Callable[[YamlMap], YamlMap], path: str, says: str) -> None:
    errors = lint_document(mutate(diamond()))
    assert any(error.path == path and says in error.message for error in errors), [str(e) for e in errors]


CRON_MUTANTS = [
    ("concurrencyPolicy", "spec.concurrencyPolicy", "Forbidden", "'Forbidden' is not one of ['Allow', 'Forbid', 'Replace']"),
    ("schedule", "spec.schedules[0]", "every hour", "'every hour' is not a cron schedule"),
    ("no schedule", "spec.schedules", [], "[] should be non-empty"),
]


@pytest.mark.parametrize(("path", "value", "says"), [pytest.param(*m[1:], id=m[0]) for m in CRON_MUTANTS])
def test_a_defect_in_a_cron_workflow_is_named(path: str, value: Any, says: str) -> None:
    errors = lint_document(_set(hourly(diamond()), path, value))
    assert [(error.path, error.message) for error in errors if says in error.message] == [(path, errors[0].message)]


def test_pod_enums_take_an_expression_the_crd_enums_do_not() -> None:
    """Argo substitutes {{...}} before it creates a pod (pod fields are checked then), but the API server checks
    the CRD's own enums on the object as submitted."""
    doc = _set(diamond(), f"{T}[1].container.imagePullPolicy", "{{workflow.parameters.message}}")
    assert lint_document(doc) == []
    doc = _set(diamond(), f"{T}[1].retryStrategy.retryPolicy", "{{workflow.parameters.message}}")
    assert [error.path for error in lint_document(doc)] == [f"{T}[1].retryStrategy.retryPolicy"]


def test_a_defect_in_moeloops_render_is_named() -> None:
    documents = rendered()
    template = documents["workflow-template.yaml"]
    rollout = next(t for t in template["spec"]["templates"] if t["name"] == "rollout")
    rollout["retryStrategy"]["retryPolicy"] = "Allways"
    documents["cron-workflow.yaml"]["spec"]["concurrencyPolicy"] = "forbid"
    errors = lint_documents(documents.values())
    index = template["spec"]["templates"].index(rollout)
    assert [(error.document, error.path) for error in errors] == [
        ("WorkflowTemplate/moeloop-tiny", f"spec.templates[{index}].retryStrategy.retryPolicy"),
        ("CronWorkflow/moeloop-tiny", "spec.concurrencyPolicy"),
    ]


def test_fast_schema_check_agrees_with_jsonschema_on_own_mutations() -> None:
    """As on the corpus below, for the documents written here: both verdicts match on broken documents."""
    rng = random.Random(0)
    sources = [diamond(), hourly(diamond()), *rendered().values()]
    for _ in range(300):
        doc = copy.deepcopy(rng.choice(sources))
        slots = [(parent, key) for parent, key in value_slots(doc) if parent is not doc or key != "kind"]
        for parent, key in rng.sample(slots, 2):
            if isinstance(parent, dict) and rng.random() < 0.2:
                parent[f"{key}x"] = parent.pop(key, None)
            else:
                parent[key] = copy.deepcopy(rng.choice(JUNK_VALUES))
        jsonschema_accepts = not list(schema_validator(doc["kind"]).iter_errors(doc))
        assert schema_check(doc["kind"])(doc) == jsonschema_accepts
        lint_document(doc)


# ---------------------------------------------------------------------------------------------
# One-defect mutants of every upstream example


Mutant = Callable[[YamlMap], tuple[str, str] | None]  # mutates in place; (path, message fragment) or not applicable


def _first_dag(doc: YamlMap, at_least: int) -> tuple[str, list[YamlMap]] | None:
    for i, template in enumerate(own_templates(doc)):
        tasks = template.get("dag", {}).get("tasks", [])
        if len(tasks) >= at_least:
            return f"{spec_path(doc)}.templates[{i}].dag.tasks", tasks
    return None


def misspell_template_key(doc: YamlMap) -> tuple[str, str] | None:
    templates = own_templates(doc)
    if not templates:
        return None
    key = next(key for key in templates[0] if key != "name")
    typo = key[0] + key[2] + key[1] + key[3:] if len(key) > 2 and key[1] != key[2] else key + "x"
    templates[0][typo] = templates[0].pop(key)
    return f"{spec_path(doc)}.templates[0]", f"'{typo}' was unexpected"


def drop_entrypoint_template(doc: YamlMap) -> tuple[str, str] | None:
    entrypoint = workflow_spec(doc).get("entrypoint") if own_templates(doc) else None
    if not entrypoint:
        return None
    workflow_spec(doc)["templates"] = [t for t in own_templates(doc) if t.get("name") != entrypoint]
    return f"{spec_path(doc)}.entrypoint", f"unknown template {entrypoint!r}"


def drop_entrypoint(doc: YamlMap) -> tuple[str, str] | None:
    if doc["kind"] not in ("Workflow", "CronWorkflow") or not own_templates(doc):
        return None
    workflow_spec(doc).pop("entrypoint", None)
    return spec_path(doc), "no entrypoint"


def _rewire_last_task(doc: YamlMap, at_least: int, field: str, value: Callable[[list[YamlMap]], Any]) -> str | None:
    """Give the last task of the first DAG of `at_least` tasks only `field` (depends or dependencies); its path."""
    found = _first_dag(doc, at_least)
    if not found:
        return None
    path, tasks = found
    tasks[-1].pop("depends", None)
    tasks[-1].pop("dependencies", None)
    tasks[-1][field] = value(tasks)
    return f"{path}[{len(tasks) - 1}]"


def depend_on_a_missing_task(doc: YamlMap) -> tuple[str, str] | None:
    path = _rewire_last_task(doc, 1, "dependencies", lambda tasks: ["ghost-task"])
    return (f"{path}.dependencies[0]", "unknown task 'ghost-task'") if path else None


def break_depends_syntax(doc: YamlMap) -> tuple[str, str] | None:
    path = _rewire_last_task(doc, 2, "depends", lambda tasks: f"{tasks[0]['name']} &&")
    return (f"{path}.depends", "invalid depends expression") if path else None


def make_a_cycle(doc: YamlMap) -> tuple[str, str] | None:
    found = _first_dag(doc, 2)
    if not found:
        return None
    path, tasks = found
    for task, upstream_task in ((tasks[0], tasks[1]), (tasks[1], tasks[0])):
        task.pop("dependencies", None)
        task.pop("continueOn", None)
        task["depends"] = upstream_task["name"]
    return path, "dependency cycle: "


def misspell_retry_policy(doc: YamlMap) -> tuple[str, str] | None:
    if doc["kind"] not in WORKFLOW_SPEC_PATHS:
        return None
    templates = own_templates(doc)
    owner, path = (templates[0], f"{spec_path(doc)}.templates[0]") if templates else (workflow_spec(doc), spec_path(doc))
    owner["retryStrategy"] = {**owner.get("retryStrategy", {}), "retryPolicy": "OnFaliure"}
    return f"{path}.retryStrategy.retryPolicy", "'OnFaliure' is not one of"


def misspell_concurrency_policy(doc: YamlMap) -> tuple[str, str] | None:
    if doc["kind"] != "CronWorkflow":
        return None
    doc["spec"]["concurrencyPolicy"] = "Forbidden"
    return "spec.concurrencyPolicy", "'Forbidden' is not one of"


def misspell_pod_gc(doc: YamlMap) -> tuple[str, str] | None:
    if doc["kind"] not in WORKFLOW_SPEC_PATHS:
        return None
    workflow_spec(doc)["podGC"] = {**workflow_spec(doc).get("podGC", {}), "strategy": "OnPodSucess"}
    return f"{spec_path(doc)}.podGC.strategy", "'OnPodSucess' is not one of"


MUTANTS: dict[str, Mutant] = {
    "misspelled key": misspell_template_key,
    "missing template": drop_entrypoint_template,
    "missing entrypoint": drop_entrypoint,
    "dependency on a missing task": depend_on_a_missing_task,
    "broken depends syntax": break_depends_syntax,
    "cycle": make_a_cycle,
    "bad retryPolicy": misspell_retry_policy,
    "bad concurrencyPolicy": misspell_concurrency_policy,
    "bad podGC strategy": misspell_pod_gc,
}


@needs_upstream
@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_every_one_defect_mutant_of_the_corpus_is_rejected(mutant: str) -> None:
    """The mutant applied to every corpus document it fits: lint must name the defect where it is, every time."""
    missed, tried = [], 0
    for doc_id, source in corpus_documents():
        doc = copy.deepcopy(source)
        expected = MUTANTS[mutant](doc)
        if expected is None:
            continue
        tried += 1
        path, says = expected
        errors = lint_document(doc)
        if not any(error.path == path and says in error.message for error in errors):
            missed.append(f"{doc_id}: expected {path}: ...{says}...; got {[str(e) for e in errors]}")
    assert tried >= 5 and not missed, "\n".join(missed)
    print(f"{mutant}: {tried} mutants, all rejected")
