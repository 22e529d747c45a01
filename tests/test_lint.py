"""workflows.lint: the Argo example corpus lints clean, and mutations of it are rejected with the
problem named in the error's path or message."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from workflows import lint
from workflows.lint import LintError, YamlMap, is_argo_document, lint_document, lint_documents, lint_paths

SOURCES_PER_MUTATION = 3


def shared_dir() -> Path:
    """The shared/ folder, found the way lint finds its schemas (shared/schemas)."""
    return lint.find_schema_dir().parent


CORPUS = shared_dir() / "corpora" / "argo-examples"


def corpus_files() -> list[Path]:
    return sorted(path for path in CORPUS.rglob("*") if path.suffix in (".yaml", ".yml"))


@lru_cache(maxsize=1)
def corpus_documents() -> tuple[tuple[str, YamlMap], ...]:
    """(id, document) for every Argo document of the corpus."""
    documents: list[tuple[str, YamlMap]] = []
    for path in corpus_files():
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if is_argo_document(doc):
                documents.append((f"{path.relative_to(CORPUS)}:{lint._document_label(doc)}", doc))
    return tuple(documents)


def pick(predicate: Callable[[YamlMap], bool], count: int = SOURCES_PER_MUTATION) -> list[Any]:
    """`count` corpus documents matching predicate, as pytest params: the first match of each kind
    (so Workflow, WorkflowTemplate, CronWorkflow... are all exercised), then the next matches."""
    matches = [(doc_id, doc) for doc_id, doc in corpus_documents() if predicate(doc)]
    first_of_kind = {doc["kind"]: doc_id for doc_id, doc in reversed(matches)}
    ordered = sorted(matches, key=lambda match: match[0] not in first_of_kind.values())
    assert len(ordered) >= count, "corpus has too few documents for this mutation"
    return [pytest.param(doc, id=doc_id) for doc_id, doc in ordered[:count]]


def first_source(predicate: Callable[[YamlMap], bool]) -> YamlMap:
    return copy.deepcopy(pick(predicate, 1)[0].values[0])


def spec_path(doc: YamlMap) -> str:
    return "spec.workflowSpec" if doc["kind"] == "CronWorkflow" else "spec"


def workflow_spec(doc: YamlMap) -> YamlMap:
    spec: YamlMap = doc["spec"]["workflowSpec"] if doc["kind"] == "CronWorkflow" else doc["spec"]
    return spec


def own_templates(doc: YamlMap) -> list[YamlMap]:
    """Templates of a spec that defines its own (no workflowTemplateRef); [] for other kinds."""
    if doc["kind"] not in lint.WORKFLOW_SPEC_PATHS or "workflowTemplateRef" in workflow_spec(doc):
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


@pytest.mark.parametrize("path", corpus_files(), ids=lambda path: str(path.relative_to(CORPUS)))
def test_corpus_file_lints_clean(path: Path) -> None:
    assert [str(error) for error in lint_paths([path])] == []


def test_corpus_has_all_argo_documents_and_lints_clean_as_one_tree() -> None:
    assert len(corpus_documents()) == 225
    # One call: templateRefs are then checked against the corpus's own WorkflowTemplates.
    assert [str(error) for error in lint_paths([CORPUS])] == []


def test_fast_schema_check_agrees_with_jsonschema_on_corpus() -> None:
    # lint skips jsonschema when the compiled check accepts: both must accept every valid document.
    for doc_id, doc in corpus_documents():
        assert lint._schema_check(doc["kind"])(doc), doc_id
        assert not list(lint._schema_validator(doc["kind"]).iter_errors(doc)), doc_id


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
        jsonschema_accepts = not list(lint._schema_validator(doc["kind"]).iter_errors(doc))
        assert lint._schema_check(doc["kind"])(doc) == jsonschema_accepts, doc_id
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
    assert errors[0].message.startswith("invalid YAML: ") and "line" in errors[0].message
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
    assert [(error.source, error.document, error.path) for error in errors] == [(str(path), "Workflow/typo-wf", "spec")]
    assert "'entrypiont' was unexpected" in errors[0].message


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


def test_schema_dir_not_found_names_where_it_looked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(lint.SCHEMA_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        lint.find_schema_dir()


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
