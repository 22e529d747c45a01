"""Reference checks, what no schema can say: entrypoint, template, onExit and hook names, templateRefs to the
templates linted alongside, a DAG's dependencies (dependencies.py), and {{...}} parameter, task and step references."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from moeloop.workflows.lint.dependencies import (
    DEPENDS_RESULTS,
    cycle_text,
    depends_syntax_error,
    find_cycle,
    upstream_references,
)
from moeloop.workflows.lint.helpers import (
    Finding,
    TemplateIndex,
    YamlMap,
    child_path,
    dict_items,
    format_path,
    list_items,
    listing,
    names_of,
)

# Kinds whose spec (at this path) is a WorkflowSpec.
WORKFLOW_SPEC_PATHS: Mapping[str, tuple[str, ...]] = {
    "Workflow": ("spec",),
    "WorkflowTemplate": ("spec",),
    "ClusterWorkflowTemplate": ("spec",),
    "CronWorkflow": ("spec", "workflowSpec"),
}
# {{workflow.parameters.json}} is every workflow parameter as one JSON string.
BUILTIN_WORKFLOW_PARAMETERS = frozenset({"json"})


class _SpecScope(NamedTuple):
    templates: frozenset[str] | None  # None: spec uses workflowTemplateRef, its templates are elsewhere
    workflow_parameters: frozenset[str] | None  # None: not checkable (template kinds, workflowTemplateRef)
    template_index: TemplateIndex


class _Reference(NamedTuple):
    scope: str  # "inputs" | "workflow" | "tasks" | "steps"
    name: str
    text: str  # as written, for messages


_TAG = re.compile(r"\{\{(.*?)\}\}", re.DOTALL)
_SIMPLE_PARAMETER = re.compile(r"\s*(inputs|workflow)\.parameters\.([-\w]+)\s*")
_SIMPLE_NODE = re.compile(r"\s*(tasks|steps)\.([-\w]+)\.\S+\s*")  # {{tasks.T.…}}; {{tasks.name}} is global
# Inside {{=…}} (expr language): dotted names are identifiers; dashed names need brackets.
_EXPRESSION_PARAMETER = re.compile(
    r"(?<![\w.])(inputs|workflow)\.parameters(?:\.([A-Za-z_]\w*)|\[\s*(['\"])(.*?)\3\s*\])"
)
_EXPRESSION_NODE = re.compile(r"(?<![\w.])(tasks|steps)(?:\.([A-Za-z_]\w*)|\[\s*(['\"])(.*?)\3\s*\])\.")


def reference_findings(doc: YamlMap, kind: str, index: TemplateIndex) -> Iterator[Finding]:
    spec_path = WORKFLOW_SPEC_PATHS.get(kind)
    spec = _get(doc, spec_path) if spec_path else None
    if isinstance(spec, dict):
        path = ".".join(spec_path or ())
        if kind in ("Workflow", "CronWorkflow") and "workflowTemplateRef" not in spec and "entrypoint" not in spec:
            yield path, f"no entrypoint: a {kind} that defines its own templates names the one to run"
        yield from _spec_findings(spec, path, _spec_scope(spec, kind, index))


def _spec_scope(spec: YamlMap, kind: str, index: TemplateIndex) -> _SpecScope:
    by_reference = "workflowTemplateRef" in spec
    # A (Cluster)WorkflowTemplate may use workflow parameters that only its submitter declares
    # (a Workflow's or WorkflowEventBinding's workflowTemplateRef arguments, argo submit -p).
    parameters_known = kind in ("Workflow", "CronWorkflow") and not by_reference
    arguments = spec.get("arguments")
    declared = names_of(arguments.get("parameters") if isinstance(arguments, dict) else None)
    return _SpecScope(
        templates=None if by_reference else names_of(spec.get("templates")),
        workflow_parameters=declared if parameters_known else None,
        template_index=index,
    )


def _spec_findings(spec: YamlMap, path: str, scope: _SpecScope) -> Iterator[Finding]:
    for field in ("entrypoint", "onExit"):
        yield from _template_name_findings(spec.get(field), f"{path}.{field}", scope)
    yield from _hooks_findings(spec.get("hooks"), f"{path}.hooks", scope)
    for i, template in dict_items(spec.get("templates")):
        yield from _template_findings(template, f"{path}.templates[{i}]", scope)
    # Outside templates only workflow-level variables are in scope.
    spec_rest = {key: value for key, value in spec.items() if key != "templates"}
    for string_path, reference in _references(spec_rest, path):
        if reference.scope == "workflow":
            yield from _workflow_parameter_findings(reference, string_path, scope)


def _template_findings(template: YamlMap, path: str, scope: _SpecScope) -> Iterator[Finding]:
    inputs = template.get("inputs")
    declared_inputs = names_of(inputs.get("parameters") if isinstance(inputs, dict) else None)
    dag = template.get("dag")
    tasks = list(dict_items(dag.get("tasks"))) if isinstance(dag, dict) else []
    steps = [
        (f"{path}.steps[{i}][{j}]", step)
        for i, group in list_items(template.get("steps"))
        for j, step in dict_items(group)
    ]
    # {{tasks.X…}} / {{steps.X…}} are checked only in the DAG / steps template they belong to.
    node_names = {"tasks": names_of([task for _, task in tasks]), "steps": names_of([step for _, step in steps])}

    for string_path, reference in _references(template, path):
        if reference.scope == "workflow":
            yield from _workflow_parameter_findings(reference, string_path, scope)
        elif reference.scope == "inputs" and reference.name not in declared_inputs:
            what = f"undeclared input parameter {reference.name!r}"
            yield string_path, f"{reference.text} refers to {what} (template declares: {listing(declared_inputs)})"
        elif reference.scope in node_names and not node_names[reference.scope]:
            # Only a DAG's tasks (a steps template's steps) see each other; other templates get inputs.
            kind = "a DAG" if reference.scope == "tasks" else "a steps template"
            yield string_path, f"{reference.text}: only {kind} can refer to its {reference.scope}; pass an input"
        elif (known := node_names.get(reference.scope)) and reference.name not in known:
            what = f"unknown {reference.scope[:-1]} {reference.name!r}"
            yield string_path, f"{reference.text} refers to {what} ({reference.scope}: {listing(known)})"

    if isinstance(dag, dict):
        yield from _dag_findings(tasks, f"{path}.dag", scope)
    for step_path, step in steps:
        yield from _invocation_findings(step, step_path, scope)


def _workflow_parameter_findings(reference: _Reference, path: str, scope: _SpecScope) -> Iterator[Finding]:
    declared = scope.workflow_parameters
    if declared is not None and reference.name not in declared | BUILTIN_WORKFLOW_PARAMETERS:
        what = f"undeclared workflow parameter {reference.name!r}"
        yield path, f"{reference.text} refers to {what} (spec.arguments.parameters declares: {listing(declared)})"


def _dag_findings(tasks: list[tuple[int, YamlMap]], path: str, scope: _SpecScope) -> Iterator[Finding]:
    task_names = names_of([task for _, task in tasks])
    graph: dict[str, list[str]] = {}
    for i, task in tasks:
        task_path = f"{path}.tasks[{i}]"
        yield from _invocation_findings(task, task_path, scope)
        depends = task.get("depends")
        syntax_error = depends_syntax_error(depends) if isinstance(depends, str) else None
        if syntax_error:
            yield f"{task_path}.depends", syntax_error
        upstream = upstream_references(task)
        for field, name, result in upstream:
            if name not in task_names:
                yield f"{task_path}.{field}", f"depends on unknown task {name!r} (tasks: {listing(task_names)})"
            elif result and result not in DEPENDS_RESULTS:
                valid = listing(DEPENDS_RESULTS)
                yield f"{task_path}.{field}", f"unknown task result {name}.{result} (valid: {valid})"
        if isinstance(task.get("name"), str):
            graph[task["name"]] = [name for _, name, _ in upstream if name in task_names]
    cycle = find_cycle(graph)
    if cycle:
        yield f"{path}.tasks", f"dependency cycle: {cycle_text(cycle)}"


def _invocation_findings(node: YamlMap, path: str, scope: _SpecScope) -> Iterator[Finding]:
    """A DAG task or a step: what it runs, its exit handler and hooks, and its inline template."""
    yield from _template_name_findings(node.get("template"), f"{path}.template", scope)
    yield from _template_ref_findings(node.get("templateRef"), f"{path}.templateRef", scope)
    yield from _template_name_findings(node.get("onExit"), f"{path}.onExit", scope)
    yield from _hooks_findings(node.get("hooks"), f"{path}.hooks", scope)
    inline = node.get("inline")
    if isinstance(inline, dict):
        yield from _template_findings(inline, f"{path}.inline", scope)


def _hooks_findings(hooks: object, path: str, scope: _SpecScope) -> Iterator[Finding]:
    if isinstance(hooks, dict):
        for name, hook in hooks.items():
            if isinstance(hook, dict):
                hook_path = child_path(path, name)
                yield from _template_name_findings(hook.get("template"), f"{hook_path}.template", scope)
                yield from _template_ref_findings(hook.get("templateRef"), f"{hook_path}.templateRef", scope)


def _template_name_findings(name: object, path: str, scope: _SpecScope) -> Iterator[Finding]:
    if isinstance(name, str) and scope.templates is not None and name not in scope.templates:
        yield path, f"unknown template {name!r} (templates: {listing(scope.templates)})"


def _template_ref_findings(ref: object, path: str, scope: _SpecScope) -> Iterator[Finding]:
    """Checked only when the referenced (Cluster)WorkflowTemplate was linted alongside."""
    if not isinstance(ref, dict):
        return
    name, template, cluster_scope = ref.get("name"), ref.get("template"), ref.get("clusterScope") is True
    if not isinstance(name, str) or not isinstance(template, str):
        return  # already a schema error
    known = scope.template_index.get((cluster_scope, name))
    if known is not None and template not in known:
        kind = "ClusterWorkflowTemplate" if cluster_scope else "WorkflowTemplate"
        yield f"{path}.template", f"{kind} {name!r} has no template {template!r} (templates: {listing(known)})"


def _references(node: YamlMap, path: str) -> Iterator[tuple[str, _Reference]]:
    tagged: list[tuple[tuple[str | int, ...], str]] = []
    _collect_tagged_strings(node, (), tagged)
    for parts, text in tagged:
        for tag in _TAG.finditer(text):
            for reference in _tag_references(tag.group(1)):
                yield format_path(parts, path), reference


def _tag_references(body: str) -> Iterator[_Reference]:
    """Parameter and node references in one {{...}} tag; unrecognised forms are not checked."""
    if body.lstrip().startswith("="):
        for pattern in (_EXPRESSION_PARAMETER, _EXPRESSION_NODE):
            for match in pattern.finditer(body):
                yield _Reference(match.group(1), match.group(2) or match.group(4), match.group(0))
        return
    for pattern in (_SIMPLE_PARAMETER, _SIMPLE_NODE):
        simple = pattern.fullmatch(body)
        if simple:
            yield _Reference(simple.group(1), simple.group(2), "{{" + body.strip() + "}}")


def _collect_tagged_strings(
    node: YamlMap | list[Any], parts: tuple[str | int, ...], found: list[tuple[tuple[str | int, ...], str]]
) -> None:
    """Append (path parts, string) for strings containing '{{'; inline templates are skipped (their
    own scope). Hot loop: leaves are handled without a call and paths stay tuples until needed."""
    children = node.items() if isinstance(node, dict) else enumerate(node)
    for key, value in children:
        if key == "inline":
            continue
        if isinstance(value, str):
            if "{{" in value:
                found.append(((*parts, key), value))
        elif isinstance(value, (dict, list)):
            _collect_tagged_strings(value, (*parts, key), found)


def _get(doc: YamlMap, keys: Sequence[str]) -> object:
    node: object = doc
    for key in keys:
        node = node.get(key) if isinstance(node, dict) else None
    return node

