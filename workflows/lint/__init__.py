"""Offline lint of Argo Workflows manifests.

Two layers:
- the closed JSON Schema of argo_schema.py: Hera's models with the facts of Argo's full CRDs (enums,
  patterns, formats, bounds, CEL rules) and Kubernetes' pod enums; a misspelled key fails (schema_checks.py);
- reference checks the schema cannot express: entrypoint/template/onExit/hook names, DAG
  dependencies (names, ``depends`` syntax and results, cycles) and ``{{...}}`` parameter/task/step refs
  (references.py, dependencies.py).

Validation is cached per kind. Valid documents are accepted by a predicate compiled from the same
closed schema (compiled_checker.py, roughly 10x faster than jsonschema); only rejected documents go through
jsonschema, which is the authority for whether and where a document is wrong. The entry points are in
documents.py.
"""

from moeloop.workflows.lint.documents import LintError, is_argo_document, lint_document, lint_documents, lint_paths

__all__ = ["LintError", "is_argo_document", "lint_document", "lint_documents", "lint_paths"]
