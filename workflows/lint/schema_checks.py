"""The schema checks: a document against lint's closed schema (argo_schema.py), accepted by the compiled checker
when valid; a rejected one goes through jsonschema, the authority for whether and where it is wrong."""

from __future__ import annotations

import reprlib
from collections.abc import Iterator
from functools import cache, lru_cache
from typing import Any

from jsonschema import Draft202012Validator, FormatChecker, validators
from jsonschema.exceptions import ValidationError

from moeloop.workflows.lint import argo_schema
from moeloop.workflows.lint.argo_schema import POD_ENUM_KEYWORD, RULES_KEYWORD
from moeloop.workflows.lint.compiled_checker import Check, CheckCompiler, pod_enum_check, rule_messages
from moeloop.workflows.lint.helpers import Finding, YamlMap, format_path, one_line


def _rules(validator: Any, names: list[str], instance: object, schema: Any) -> Iterator[ValidationError]:
    """The CRDs' CEL rules (argo_schema.RULES) on the object they are attached to."""
    for message in rule_messages(names, instance):
        yield ValidationError(message)


def _pod_enum(validator: Any, allowed: list[str], instance: object, schema: Any) -> Iterator[ValidationError]:
    if not pod_enum_check(allowed)(instance):
        yield ValidationError(f"{instance!r} is not one of {allowed!r} (or a {{{{...}}}} expression)")


def _format_checker() -> FormatChecker:
    checker = FormatChecker(formats=())
    for name, check in argo_schema.FORMATS.items():
        checker.checks(name)(check)
    return checker


_Validator = validators.extend(Draft202012Validator, {RULES_KEYWORD: _rules, POD_ENUM_KEYWORD: _pod_enum})


@cache
def schema_validator(definition: str) -> Any:
    """jsonschema's validator for a kind (or any definition) of argo_schema."""
    root = {"$ref": f"#/$defs/{definition}", "$defs": argo_schema.definitions()}
    return _Validator(root, format_checker=_format_checker())


@cache
def schema_check(kind: str) -> Check:
    return _check_compiler().compile({"$ref": f"#/$defs/{kind}"})


@lru_cache(maxsize=1)
def _check_compiler() -> CheckCompiler:
    return CheckCompiler(argo_schema.definitions())


def schema_findings(doc: YamlMap, kind: str) -> Iterator[Finding]:
    if schema_check(kind)(doc):
        return
    for error in schema_validator(kind).iter_errors(doc):
        yield format_path(error.absolute_path), _schema_message(error)


def _schema_message(error: ValidationError) -> str:
    instance = reprlib.repr(error.instance)
    if error.validator == "pattern" and error.validator_value in argo_schema.PATTERN_NAMES:
        return one_line(f"{instance} is not {argo_schema.PATTERN_NAMES[error.validator_value]}")
    if error.validator == "format":
        return one_line(f"{instance} is not a valid {error.validator_value}")
    if error.validator == "maxItems":
        return f"{len(error.instance)} items, more than the {error.validator_value} allowed"
    # jsonschema starts most messages with repr(instance), which can be a whole template.
    message, instance_repr = error.message, repr(error.instance)
    if message.startswith(instance_repr):
        message = instance + message[len(instance_repr) :]
    return one_line(message)
