"""Offline lint of Argo Workflows manifests.

Two layers:
- the closed JSON Schema of workflows/argo_schema.py: Hera's models with the facts of Argo's full CRDs (enums,
  patterns, formats, bounds, CEL rules) and Kubernetes' pod enums; a misspelled key fails;
- reference checks the schema cannot express: entrypoint/template/onExit/hook names, DAG
  dependencies (names, ``depends`` syntax and results, cycles) and ``{{...}}`` parameter/task/step refs.

Validation is cached per kind. Valid documents are accepted by a predicate compiled from the same
closed schema (roughly 10x faster than jsonschema); only rejected documents go through jsonschema,
which is the authority for whether and where a document is wrong.
"""

from __future__ import annotations

import re
import reprlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path
from typing import Any, NamedTuple

import yaml
from jsonschema import Draft202012Validator, FormatChecker, validators
from jsonschema.exceptions import ValidationError

from moeloop.workflows import argo_schema
from moeloop.workflows.argo_schema import POD_ENUM_KEYWORD, RULES, RULES_KEYWORD, is_expression

ARGO_KINDS = frozenset(argo_schema.KINDS)
# Real kinds that share the argoproj.io API group but are not Argo Workflows manifests a user
# writes (Argo Events, Argo CD, Argo Rollouts, and the Workflows controller's own bookkeeping):
# skipped like any non-Argo document, so a kind typo under argoproj.io is still an error.
OTHER_ARGOPROJ_KINDS = frozenset(
    {
        "EventSource",
        "Sensor",
        "EventBus",
        "Application",
        "ApplicationSet",
        "AppProject",
        "Rollout",
        "AnalysisTemplate",
        "ClusterAnalysisTemplate",
        "AnalysisRun",
        "Experiment",
        "WorkflowTaskSet",
        "WorkflowTaskResult",
        "WorkflowArtifactGCTask",
    }
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
DEPENDS_RESULTS = frozenset(
    {"Succeeded", "Failed", "Errored", "Skipped", "Omitted", "Daemoned", "AnySucceeded", "AllFailed"}
)


@dataclass(frozen=True)
class LintError:
    source: str  # file path or "<name>" given by caller
    document: str  # e.g. "Workflow/my-wf" (metadata.name or generateName)
    path: str  # dotted/bracketed location, e.g. "spec.templates[2].dag.tasks[0].dependencies"
    message: str  # one line

    def __str__(self) -> str:
        return ": ".join(part for part in (self.source, self.document, self.path, self.message) if part)


YamlMap = dict[str, Any]  # a parsed YAML mapping: a document, spec, template, task, ...
Check = Callable[[object], bool]  # a compiled schema: does the value conform?
Finding = tuple[str, str]  # (path, message) before source and document are attached
TemplateIndex = Mapping[tuple[bool, str], frozenset[str]]  # (cluster scope, name) -> template names


# ---------------------------------------------------------------------------------------------
# Public API


def is_argo_document(doc: object) -> bool:
    """True for documents in the argoproj.io API group that this linter is responsible for.

    Unknown kinds under argoproj.io count (and are reported), other Argo projects' kinds do not.
    """
    if not isinstance(doc, dict):
        return False
    api_version, kind = doc.get("apiVersion"), doc.get("kind")
    return (
        isinstance(api_version, str)
        and api_version.startswith("argoproj.io/")
        and not (isinstance(kind, str) and kind in OTHER_ARGOPROJ_KINDS)
    )


def lint_document(doc: YamlMap, source: str = "<memory>") -> list[LintError]:
    """Lint one document; non-Argo documents give no errors. templateRefs are not checkable alone."""
    return _lint(doc, source, {})


def lint_documents(docs: Iterable[YamlMap], source: str = "<memory>") -> list[LintError]:
    """Lint several documents; templateRefs to (Cluster)WorkflowTemplates among them are checked."""
    docs = list(docs)
    index = _index_templates(docs)
    return [error for doc in docs for error in _lint(doc, source, index)]


def lint_paths(paths: Iterable[str | Path]) -> list[LintError]:
    """Lint files and directories (recursive *.yaml / *.yml), templateRefs checked across all of them."""
    loaded: list[tuple[str, list[object] | LintError]] = [
        (str(path), _load_yaml(path)) if isinstance(path, Path) else (path.source, path)
        for path in _expand_paths(paths)
    ]
    index = _index_templates(doc for _, docs in loaded if not isinstance(docs, LintError) for doc in docs)
    errors: list[LintError] = []
    for source, docs in loaded:
        if isinstance(docs, LintError):
            errors.append(docs)
        else:
            errors.extend(error for doc in docs for error in _lint(doc, source, index))
    return errors


# ---------------------------------------------------------------------------------------------
# Documents and files


def _lint(doc: object, source: str, index: TemplateIndex) -> list[LintError]:
    if not isinstance(doc, dict) or not is_argo_document(doc):
        return []
    document = _document_label(doc)
    kind = doc.get("kind")
    if not isinstance(kind, str) or kind not in ARGO_KINDS:
        expected = ", ".join(sorted(ARGO_KINDS))
        message = f"unknown kind {kind!r} for apiVersion {doc['apiVersion']!r}; expected one of {expected}"
        return [LintError(source, document, "kind", message)]
    findings = [*_schema_findings(doc, kind), *_reference_findings(doc, kind, index)]
    return [LintError(source, document, path, message) for path, message in findings]


def _document_label(doc: YamlMap) -> str:
    metadata = doc.get("metadata")
    metadata = metadata if isinstance(metadata, dict) else {}
    name = metadata.get("name") or metadata.get("generateName") or "<unnamed>"
    return f"{doc.get('kind') or '<no kind>'}/{name}"


def _expand_paths(paths: Iterable[str | Path]) -> Iterator[Path | LintError]:
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files = sorted(file for file in path.rglob("*") if file.suffix in (".yaml", ".yml") and file.is_file())
            yield from files or [LintError(str(path), "", "", "no *.yaml or *.yml files in this folder")]
        elif path.exists():
            yield path
        elif path.is_symlink():
            yield LintError(str(path), "", "", "a symbolic link to nothing readable (missing, or a loop)")
        else:
            yield LintError(str(path), "", "", "path does not exist")


def _load_yaml(path: Path) -> list[object] | LintError:
    try:
        return list(yaml.load_all(path.read_text(encoding="utf-8"), Loader=_YAML_LOADER))
    except yaml.YAMLError as error:
        return LintError(str(path), "", "", _yaml_error_message(error))
    except (OSError, UnicodeDecodeError) as error:
        return LintError(str(path), "", "", f"cannot read file: {error}")


_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _yaml_error_message(error: yaml.YAMLError) -> str:
    problem = getattr(error, "problem", None) or str(error)
    mark = getattr(error, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return _one_line(f"invalid YAML: {problem}{where}")


def _index_templates(docs: Iterable[object]) -> dict[tuple[bool, str], frozenset[str]]:
    index: dict[tuple[bool, str], frozenset[str]] = {}
    for doc in docs:
        if not isinstance(doc, dict) or doc.get("kind") not in ("WorkflowTemplate", "ClusterWorkflowTemplate"):
            continue
        if not is_argo_document(doc):
            continue
        metadata, spec = doc.get("metadata"), doc.get("spec")
        if isinstance(metadata, dict) and isinstance(metadata.get("name"), str) and isinstance(spec, dict):
            key = (doc["kind"] == "ClusterWorkflowTemplate", metadata["name"])
            # Same name defined twice (e.g. in two files): accept templates from either.
            index[key] = index.get(key, frozenset()) | _names(spec.get("templates"))
    return index


# ---------------------------------------------------------------------------------------------
# Schema: validating against workflows/argo_schema.py


def _rules(validator: Any, names: list[str], instance: object, schema: Any) -> Iterator[ValidationError]:
    """The CRDs' CEL rules (argo_schema.RULES) on the object they are attached to."""
    for message in _rule_messages(names, instance):
        yield ValidationError(message)


def _rule_messages(names: Sequence[str], instance: object) -> Iterator[str]:
    if isinstance(instance, dict):
        for name in names:
            message = RULES[name](instance)
            if message:
                yield message


def _pod_enum(validator: Any, allowed: list[str], instance: object, schema: Any) -> Iterator[ValidationError]:
    if not _pod_enum_check(allowed)(instance):
        yield ValidationError(f"{instance!r} is not one of {allowed!r} (or a {{{{...}}}} expression)")


def _pod_enum_check(allowed: Sequence[str]) -> Check:
    values = frozenset(allowed)
    return lambda value: not isinstance(value, str) or value in values or is_expression(value)


def _format_checker() -> FormatChecker:
    checker = FormatChecker(formats=())
    for name, check in argo_schema.FORMATS.items():
        checker.checks(name)(check)
    return checker


_Validator = validators.extend(Draft202012Validator, {RULES_KEYWORD: _rules, POD_ENUM_KEYWORD: _pod_enum})


@cache
def _schema_validator(definition: str) -> Any:
    """jsonschema's validator for a kind (or any definition) of argo_schema."""
    root = {"$ref": f"#/$defs/{definition}", "$defs": argo_schema.definitions()}
    return _Validator(root, format_checker=_format_checker())


@cache
def _schema_check(kind: str) -> Check:
    return _check_compiler().compile({"$ref": f"#/$defs/{kind}"})


@lru_cache(maxsize=1)
def _check_compiler() -> _CheckCompiler:
    return _CheckCompiler(argo_schema.definitions())


def _schema_findings(doc: YamlMap, kind: str) -> Iterator[Finding]:
    if _schema_check(kind)(doc):
        return
    for error in _schema_validator(kind).iter_errors(doc):
        yield _format_path(error.absolute_path), _schema_message(error)


def _schema_message(error: ValidationError) -> str:
    instance = reprlib.repr(error.instance)
    if error.validator == "pattern" and error.validator_value in argo_schema.PATTERN_NAMES:
        return _one_line(f"{instance} is not {argo_schema.PATTERN_NAMES[error.validator_value]}")
    if error.validator == "format":
        return _one_line(f"{instance} is not a valid {error.validator_value}")
    if error.validator == "maxItems":
        return f"{len(error.instance)} items, more than the {error.validator_value} allowed"
    # jsonschema starts most messages with repr(instance), which can be a whole template.
    message, instance_repr = error.message, repr(error.instance)
    if message.startswith(instance_repr):
        message = instance + message[len(instance_repr) :]
    return _one_line(message)


def _is_integer(value: object) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# Same semantics as jsonschema's draft 2020-12 type checker.
_TYPE_CHECKS: Mapping[str, Check] = {
    "object": lambda value: isinstance(value, dict),
    "array": lambda value: isinstance(value, list),
    "string": lambda value: isinstance(value, str),
    "boolean": lambda value: isinstance(value, bool),
    "integer": _is_integer,
    "number": _is_number,
    "null": lambda value: value is None,
}
# Keywords that never reject.
_ANNOTATIONS = frozenset({"description", "title", "default", "example", "examples"})


class _CheckCompiler:
    """Compiles the (closed) schema into a plain-Python predicate equivalent to jsonschema's verdict.

    Supports exactly the keywords argo_schema writes; any other keyword raises at build time.
    """

    def __init__(self, definitions: Mapping[str, Any]) -> None:
        self._definitions = definitions
        self._compiled: dict[str, Check] = {}

    def compile(self, schema: Mapping[str, Any]) -> Check:
        keyword_checks = (self._keyword(keyword, value, schema) for keyword, value in schema.items())
        checks = [check for check in keyword_checks if check is not None]
        if len(checks) == 1:
            return checks[0]

        def all_pass(value: object) -> bool:
            for check in checks:
                if not check(value):
                    return False
            return True

        return all_pass

    def _keyword(self, keyword: str, value: Any, schema: Mapping[str, Any]) -> Check | None:
        if keyword in _ANNOTATIONS:
            return None
        if keyword == "$ref":
            return self._reference(value)
        if keyword == "type":
            return _type_check(value)
        if keyword == "properties":
            return _properties_check({key: self.compile(sub) for key, sub in value.items()})
        if keyword == "additionalProperties":
            extra = value if isinstance(value, bool) else self.compile(value)
            return _additional_properties_check(frozenset(schema.get("properties", {})), extra)
        if keyword == "items" and isinstance(value, dict):
            return _items_check(self.compile(value))
        if keyword == "required":
            return _required_check(tuple(value))
        if keyword == "enum" and all(isinstance(item, str) for item in value):
            allowed = frozenset(value)
            return lambda instance: isinstance(instance, str) and instance in allowed
        if keyword == "pattern":
            pattern = re.compile(value)
            return lambda instance: not isinstance(instance, str) or pattern.search(instance) is not None
        if keyword in _BOUNDS:
            applies, measure, holds = _BOUNDS[keyword]
            return lambda instance: not applies(instance) or holds(measure(instance), value)
        if keyword == "format":
            return argo_schema.FORMATS.get(value)  # unknown formats are annotations, as in jsonschema
        if keyword == RULES_KEYWORD:
            return lambda instance: next(_rule_messages(value, instance), None) is None
        if keyword == POD_ENUM_KEYWORD:
            return _pod_enum_check(value)
        raise ValueError(f"workflows/lint.py cannot compile JSON Schema keyword {keyword!r}: {value!r:.80}")

    def _reference(self, ref: str) -> Check:
        name = ref.removeprefix("#/$defs/")
        if name not in self._compiled:
            self._compiled[name] = _PENDING  # marks a definition that refers to itself (recursion)
            self._compiled[name] = self.compile(self._definitions[name])
        if self._compiled[name] is not _PENDING:
            return self._compiled[name]
        compiled = self._compiled
        return lambda value: compiled[name](value)  # looked up late, once compiling has finished


def _at_least(measured: float, bound: float) -> bool:
    return measured >= bound


def _at_most(measured: float, bound: float) -> bool:
    return measured <= bound


def _is_list(value: object) -> bool:
    return isinstance(value, list)


def _is_string(value: object) -> bool:
    return isinstance(value, str)


def _itself(value: Any) -> Any:
    return value


# keyword -> (the values it applies to, what it measures, whether the measure keeps the bound)
_BOUNDS: Mapping[str, tuple[Check, Callable[[Any], float], Callable[[float, float], bool]]] = {
    "minimum": (_is_number, _itself, _at_least),
    "maximum": (_is_number, _itself, _at_most),
    "minItems": (_is_list, len, _at_least),
    "maxItems": (_is_list, len, _at_most),
    "minLength": (_is_string, len, _at_least),
    "maxLength": (_is_string, len, _at_most),
}


def _pending(value: object) -> bool:
    raise AssertionError("recursive schema reference evaluated before it was compiled")


_PENDING: Check = _pending


def _type_check(types: str | Sequence[str]) -> Check:
    checks = [_TYPE_CHECKS[name] for name in ([types] if isinstance(types, str) else types)]
    if len(checks) == 1:
        return checks[0]
    return lambda value: any(check(value) for check in checks)


def _properties_check(properties: Mapping[str, Check]) -> Check:
    def check(value: object) -> bool:
        if isinstance(value, dict):
            for key, item in value.items():
                property_check = properties.get(key)
                if property_check is not None and not property_check(item):
                    return False
        return True

    return check


def _additional_properties_check(declared: frozenset[str], extra: bool | Check) -> Check:
    if extra is True:
        return lambda value: True
    if extra is False:
        return lambda value: not isinstance(value, dict) or value.keys() <= declared
    return lambda value: (
        not isinstance(value, dict) or all(extra(item) for key, item in value.items() if key not in declared)
    )


def _items_check(item_check: Check) -> Check:
    def check(value: object) -> bool:
        if isinstance(value, list):
            for item in value:
                if not item_check(item):
                    return False
        return True

    return check


def _required_check(required: tuple[str, ...]) -> Check:
    return lambda value: not isinstance(value, dict) or all(key in value for key in required)


# ---------------------------------------------------------------------------------------------
# Reference checks (what the schema cannot say)


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
# Argo's task term in `depends` (workflow/common/ancestry.go): a task name, optionally with .Result.
_DEPENDS_TERM = re.compile(r"([a-zA-Z0-9][-a-zA-Z0-9]*)(?:\.([A-Za-z]+))?")
_DEPENDS_OPERATOR = re.compile(r"&&|\|\||!|\(|\)")
_PLAIN_KEY = re.compile(r"[A-Za-z_][-\w]*")


def _reference_findings(doc: YamlMap, kind: str, index: TemplateIndex) -> Iterator[Finding]:
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
    declared = _names(arguments.get("parameters") if isinstance(arguments, dict) else None)
    return _SpecScope(
        templates=None if by_reference else _names(spec.get("templates")),
        workflow_parameters=declared if parameters_known else None,
        template_index=index,
    )


def _spec_findings(spec: YamlMap, path: str, scope: _SpecScope) -> Iterator[Finding]:
    for field in ("entrypoint", "onExit"):
        yield from _template_name_findings(spec.get(field), f"{path}.{field}", scope)
    yield from _hooks_findings(spec.get("hooks"), f"{path}.hooks", scope)
    for i, template in _dict_items(spec.get("templates")):
        yield from _template_findings(template, f"{path}.templates[{i}]", scope)
    # Outside templates only workflow-level variables are in scope.
    spec_rest = {key: value for key, value in spec.items() if key != "templates"}
    for string_path, reference in _references(spec_rest, path):
        if reference.scope == "workflow":
            yield from _workflow_parameter_findings(reference, string_path, scope)


def _template_findings(template: YamlMap, path: str, scope: _SpecScope) -> Iterator[Finding]:
    inputs = template.get("inputs")
    declared_inputs = _names(inputs.get("parameters") if isinstance(inputs, dict) else None)
    dag = template.get("dag")
    tasks = list(_dict_items(dag.get("tasks"))) if isinstance(dag, dict) else []
    steps = [
        (f"{path}.steps[{i}][{j}]", step)
        for i, group in _list_items(template.get("steps"))
        for j, step in _dict_items(group)
    ]
    # {{tasks.X…}} / {{steps.X…}} are checked only in the DAG / steps template they belong to.
    node_names = {"tasks": _names([task for _, task in tasks]), "steps": _names([step for _, step in steps])}

    for string_path, reference in _references(template, path):
        if reference.scope == "workflow":
            yield from _workflow_parameter_findings(reference, string_path, scope)
        elif reference.scope == "inputs" and reference.name not in declared_inputs:
            what = f"undeclared input parameter {reference.name!r}"
            yield string_path, f"{reference.text} refers to {what} (template declares: {_listing(declared_inputs)})"
        elif reference.scope in node_names and not node_names[reference.scope]:
            # Only a DAG's tasks (a steps template's steps) see each other; other templates get inputs.
            kind = "a DAG" if reference.scope == "tasks" else "a steps template"
            yield string_path, f"{reference.text}: only {kind} can refer to its {reference.scope}; pass an input"
        elif (known := node_names.get(reference.scope)) and reference.name not in known:
            what = f"unknown {reference.scope[:-1]} {reference.name!r}"
            yield string_path, f"{reference.text} refers to {what} ({reference.scope}: {_listing(known)})"

    if isinstance(dag, dict):
        yield from _dag_findings(tasks, f"{path}.dag", scope)
    for step_path, step in steps:
        yield from _invocation_findings(step, step_path, scope)


def _workflow_parameter_findings(reference: _Reference, path: str, scope: _SpecScope) -> Iterator[Finding]:
    declared = scope.workflow_parameters
    if declared is not None and reference.name not in declared | BUILTIN_WORKFLOW_PARAMETERS:
        what = f"undeclared workflow parameter {reference.name!r}"
        yield path, f"{reference.text} refers to {what} (spec.arguments.parameters declares: {_listing(declared)})"


def _dag_findings(tasks: list[tuple[int, YamlMap]], path: str, scope: _SpecScope) -> Iterator[Finding]:
    task_names = _names([task for _, task in tasks])
    graph: dict[str, list[str]] = {}
    for i, task in tasks:
        task_path = f"{path}.tasks[{i}]"
        yield from _invocation_findings(task, task_path, scope)
        depends = task.get("depends")
        syntax_error = _depends_syntax_error(depends) if isinstance(depends, str) else None
        if syntax_error:
            yield f"{task_path}.depends", syntax_error
        upstream = _upstream_references(task)
        for field, name, result in upstream:
            if name not in task_names:
                yield f"{task_path}.{field}", f"depends on unknown task {name!r} (tasks: {_listing(task_names)})"
            elif result and result not in DEPENDS_RESULTS:
                valid = _listing(DEPENDS_RESULTS)
                yield f"{task_path}.{field}", f"unknown task result {name}.{result} (valid: {valid})"
        if isinstance(task.get("name"), str):
            graph[task["name"]] = [name for _, name, _ in upstream if name in task_names]
    cycle = _find_cycle(graph)
    if cycle:
        yield f"{path}.tasks", f"dependency cycle: {_cycle_text(cycle)}"


def _upstream_references(task: YamlMap) -> list[tuple[str, str, str]]:
    """(field, task name, result or "") for each task named in `dependencies` or the `depends` expression."""
    references = [
        (f"dependencies[{j}]", name, "") for j, name in _list_items(task.get("dependencies")) if isinstance(name, str)
    ]
    depends = task.get("depends")
    if isinstance(depends, str):
        references += [("depends", name, result) for name, result in _DEPENDS_TERM.findall(depends)]
    return references


def _depends_syntax_error(depends: str) -> str | None:
    """What is wrong with a `depends` expression's syntax: task terms joined by && and ||, with ! and parentheses."""
    tokens: list[tuple[str, int]] = []  # (token, its 1-based column)
    position = 0
    while position < len(depends):
        if depends[position].isspace():
            position += 1
            continue
        match = _DEPENDS_OPERATOR.match(depends, position) or _DEPENDS_TERM.match(depends, position)
        if match is None:
            return _depends_problem(f"unexpected {depends[position]!r} at column {position + 1}")
        tokens.append((match.group(0), position + 1))
        position = match.end()
    if not tokens:
        return None
    tokens.append(("", len(depends) + 1))  # the end
    problem = _DependsParser(tokens).problem()
    return _depends_problem(problem) if problem else None


def _depends_problem(problem: str) -> str:
    return f"invalid depends expression: {problem} (write task or task.Result terms joined by &&, ||, ! and parentheses)"


class _DependsParser:
    """Recursive descent over `expression := term (("&&" | "||") term)*`, `term := "!" term | "(" expression ")" |
    task[.Result]`; `problem()` says where the tokens leave the grammar."""

    def __init__(self, tokens: list[tuple[str, int]]) -> None:
        self.tokens, self.at = tokens, 0

    def problem(self) -> str | None:
        return self._expression() or self._expect_end()

    def _expression(self) -> str | None:
        problem = self._term()
        while not problem and self._peek() in ("&&", "||"):
            self.at += 1
            problem = self._term()
        return problem

    def _term(self) -> str | None:
        token = self._peek()
        self.at += 1
        if token == "!":
            return self._term()
        if token == "(":
            problem = self._expression()
            if problem:
                return problem
            if self._peek() != ")":
                return self._found("')'")
            self.at += 1
            return None
        if token and _DEPENDS_TERM.fullmatch(token):
            return None
        self.at -= 1
        return self._found("a task name, '!' or '('")

    def _expect_end(self) -> str | None:
        return None if self._peek() == "" else self._found("'&&', '||' or the end")

    def _peek(self) -> str:
        return self.tokens[self.at][0]

    def _found(self, expected: str) -> str:
        token, column = self.tokens[self.at]
        return f"expected {expected} at column {column}, found {repr(token) if token else 'the end'}"


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
                hook_path = _child(path, name)
                yield from _template_name_findings(hook.get("template"), f"{hook_path}.template", scope)
                yield from _template_ref_findings(hook.get("templateRef"), f"{hook_path}.templateRef", scope)


def _template_name_findings(name: object, path: str, scope: _SpecScope) -> Iterator[Finding]:
    if isinstance(name, str) and scope.templates is not None and name not in scope.templates:
        yield path, f"unknown template {name!r} (templates: {_listing(scope.templates)})"


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
        yield f"{path}.template", f"{kind} {name!r} has no template {template!r} (templates: {_listing(known)})"


def _find_cycle(graph: Mapping[str, Sequence[str]]) -> list[str] | None:
    """First dependency cycle found by iterative DFS, as [a, b, ..., a]; None if acyclic."""
    on_path, done = set(), set()
    for root in graph:
        if root in done:
            continue
        trail = [root]
        on_path.add(root)
        stack = [iter(graph[root])]
        while stack:
            for child in stack[-1]:
                if child in on_path:
                    return trail[trail.index(child) :] + [child]
                if child not in done:
                    trail.append(child)
                    on_path.add(child)
                    stack.append(iter(graph.get(child, ())))
                    break
            else:
                finished = trail.pop()
                on_path.discard(finished)
                done.add(finished)
                stack.pop()
    return None


def _cycle_text(cycle: list[str], shown: int = 6) -> str:
    """'a -> b -> a', eliding the middle of long cycles to keep the message one readable line."""
    if len(cycle) <= 2 * shown:
        return " -> ".join(cycle)
    elided = f" -> ... ({len(cycle) - 2 * shown} more) -> "
    return " -> ".join(cycle[:shown]) + elided + " -> ".join(cycle[-shown:])


def _references(node: YamlMap, path: str) -> Iterator[tuple[str, _Reference]]:
    tagged: list[tuple[tuple[str | int, ...], str]] = []
    _collect_tagged_strings(node, (), tagged)
    for parts, text in tagged:
        for tag in _TAG.finditer(text):
            for reference in _tag_references(tag.group(1)):
                yield _format_path(parts, path), reference


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


# ---------------------------------------------------------------------------------------------
# Small helpers


def _get(doc: YamlMap, keys: Sequence[str]) -> object:
    node: object = doc
    for key in keys:
        node = node.get(key) if isinstance(node, dict) else None
    return node


def _dict_items(value: object) -> Iterator[tuple[int, YamlMap]]:
    """(index, item) for the dict items of a list; anything else was already a schema error."""
    for i, item in _list_items(value):
        if isinstance(item, dict):
            yield i, item


def _list_items(value: object) -> Iterator[tuple[int, Any]]:
    return enumerate(value) if isinstance(value, list) else iter(())


def _names(items: object) -> frozenset[str]:
    """The string `name` fields of a list of dicts."""
    if not isinstance(items, list):
        return frozenset()
    return frozenset(item["name"] for item in items if isinstance(item, dict) and isinstance(item.get("name"), str))


def _listing(names: Iterable[str], limit: int = 12) -> str:
    ordered = sorted(names)
    if not ordered:
        return "none"
    more = f", ... ({len(ordered) - limit} more)" if len(ordered) > limit else ""
    return ", ".join(ordered[:limit]) + more


def _child(path: str, key: object) -> str:
    text = str(key)
    if _PLAIN_KEY.fullmatch(text):
        return f"{path}.{text}" if path else text
    return f"{path}[{text!r}]"


def _format_path(parts: Iterable[str | int], path: str = "") -> str:
    for part in parts:
        path = f"{path}[{part}]" if isinstance(part, int) else _child(path, part)
    return path


def _one_line(text: str) -> str:
    return " ".join(text.split())
