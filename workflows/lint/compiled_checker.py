"""The compiled checker: lint's closed schema compiled into a plain-Python predicate that gives jsonschema's
verdict (roughly 10x faster), so only a rejected document goes through jsonschema, which says where it is wrong."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from moeloop.workflows.lint import argo_schema
from moeloop.workflows.lint.argo_schema import POD_ENUM_KEYWORD, RULES, RULES_KEYWORD, is_expression

Check = Callable[[object], bool]  # a compiled schema: does the value conform?


def rule_messages(names: Sequence[str], instance: object) -> Iterator[str]:
    """The messages of the CEL rules (argo_schema.RULES) that `instance` breaks."""
    if isinstance(instance, dict):
        for name in names:
            message = RULES[name](instance)
            if message:
                yield message


def pod_enum_check(allowed: Sequence[str]) -> Check:
    """A Kubernetes pod enum, where Argo also accepts a {{...}} expression."""
    values = frozenset(allowed)
    return lambda value: not isinstance(value, str) or value in values or is_expression(value)


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


class CheckCompiler:
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
            return lambda instance: next(rule_messages(value, instance), None) is None
        if keyword == POD_ENUM_KEYWORD:
            return pod_enum_check(value)
        raise ValueError(
            f"workflows/lint/compiled_checker.py cannot compile JSON Schema keyword {keyword!r}: {value!r:.80}"
        )

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

