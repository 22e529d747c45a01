"""Lint's entry points: a document, several, or files and folders of YAML, each Argo document through the schema
checks (schema_checks.py), then the reference checks (references.py); templateRefs are checked against the
(Cluster)WorkflowTemplates linted alongside."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from moeloop.steps.errors import MoeloopError
from moeloop.steps.inputs import NotYaml, load_yaml_documents, read_limited
from moeloop.workflows.lint import argo_schema
from moeloop.workflows.lint.helpers import TemplateIndex, YamlMap, names_of
from moeloop.workflows.lint.references import reference_findings
from moeloop.workflows.lint.schema_checks import schema_findings

ARGO_KINDS = frozenset(argo_schema.KINDS)
STDIN, STDIN_SOURCE = "-", "<stdin>"  # the path that reads standard input, and how errors name it
# An Argo object is at most ~1.5 MB (etcd's request limit); a file of many is larger, but not this large.
MAX_MANIFEST_BYTES = 64 << 20
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


@dataclass(frozen=True)
class LintError:
    source: str  # file path or "<name>" given by caller
    document: str  # e.g. "Workflow/my-wf" (metadata.name or generateName)
    path: str  # dotted/bracketed location, e.g. "spec.templates[2].dag.tasks[0].dependencies"
    message: str  # one line

    def __str__(self) -> str:
        return ": ".join(part for part in (self.source, self.document, self.path, self.message) if part)


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
    """Lint files and directories (recursive *.yaml / *.yml), templateRefs checked across all of them; the path `-`
    is standard input (its errors name it <stdin>)."""
    loaded: list[tuple[str, list[object] | LintError]] = [
        (_source(path), _load_yaml(path)) if isinstance(path, Path) else (path.source, path)
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


def _lint(doc: object, source: str, index: TemplateIndex) -> list[LintError]:
    if not isinstance(doc, dict) or not is_argo_document(doc):
        return []
    document = document_label(doc)
    kind = doc.get("kind")
    if not isinstance(kind, str) or kind not in ARGO_KINDS:
        expected = ", ".join(sorted(ARGO_KINDS))
        message = f"unknown kind {kind!r} for apiVersion {doc['apiVersion']!r}; expected one of {expected}"
        return [LintError(source, document, "kind", message)]
    findings = [*schema_findings(doc, kind), *reference_findings(doc, kind, index)]
    return [LintError(source, document, path, message) for path, message in findings]


def document_label(doc: YamlMap) -> str:
    metadata = doc.get("metadata")
    metadata = metadata if isinstance(metadata, dict) else {}
    name = metadata.get("name") or metadata.get("generateName") or "<unnamed>"
    return f"{doc.get('kind') or '<no kind>'}/{name}"


def _source(path: Path) -> str:
    return STDIN_SOURCE if str(path) == STDIN else str(path)


def _expand_paths(paths: Iterable[str | Path]) -> Iterator[Path | LintError]:
    for raw in paths:
        path = Path(raw)
        if str(raw) == STDIN:
            yield path
        elif path.is_dir():
            files = sorted(file for file in path.rglob("*") if file.suffix in (".yaml", ".yml") and file.is_file())
            yield from files or [LintError(str(path), "", "", "no *.yaml or *.yml files in this folder")]
        elif path.exists():
            yield path
        elif path.is_symlink():
            yield LintError(str(path), "", "", "a symbolic link to nothing readable (missing, or a loop)")
        else:
            yield LintError(str(path), "", "", "path does not exist")


def _load_yaml(path: Path) -> list[object] | LintError:
    """The file's documents (`-`: standard input's), read as moeloop reads every YAML file it is handed
    (steps/inputs.py)."""
    source = _source(path)
    # Standard input through its descriptor, left open; errors name it <stdin>.
    open_file = (lambda _, mode: open(sys.stdin.fileno(), mode, closefd=False)) if str(path) == STDIN else open
    try:
        return load_yaml_documents(read_limited(source, "manifest file", MAX_MANIFEST_BYTES, open_file), source)
    except NotYaml as error:
        return LintError(source, "", "", error.reason)
    except MoeloopError as error:  # unreadable, too large, not UTF-8
        return LintError(source, "", "", str(error).removeprefix(f"{source}: "))


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
            index[key] = index.get(key, frozenset()) | names_of(spec.get("templates"))
    return index
