"""workflows/lint/argo_schema.py against Argo v4.1's full CRDs ($MOELOOP_SHARED/schemas/argo-crds): walked side by side,
every field the CRDs declare is in lint's schema with the same type, and every enum, pattern, format, bound,
required field and CEL rule the CRDs carry is in lint's schema at the same place. Also (no upstream files needed):
the schema builds from the installed Hera, is closed, and a fact naming a field Hera lacks fails the build."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.upstream import needs_upstream, upstream
from moeloop.workflows.lint import argo_schema
from moeloop.workflows.lint.argo_schema import POD_ENUM_KEYWORD, RULES, RULES_KEYWORD, definitions

CRD_KINDS = {"workflows": "Workflow", "workflowtemplates": "WorkflowTemplate", "cronworkflows": "CronWorkflow"}
FACT_KEYWORDS = ("enum", "pattern", "format", "minimum", "maximum", "minItems", "maxItems", "minLength", "maxLength")
# Where lint is knowingly stricter than the CRDs: metadata is an open object there (the API server checks it as
# ObjectMeta, as lint does), and inline templates and withItems are schema-less there.
LOOSER_IN_CRD = ("metadata", "inline", "withItems")
Schema = dict[str, Any]


def resolve(schema: Schema) -> tuple[Schema, str | None]:
    if "$ref" in schema:  # with the keywords beside it
        name = schema["$ref"].removeprefix("#/$defs/")
        return definitions()[name] | {k: v for k, v in schema.items() if k != "$ref"}, name
    return schema, None


def crd_type(crd: Schema) -> object:
    if crd.get("x-kubernetes-int-or-string"):
        return ["integer", "string"]
    return crd.get("type")


def differences(crd: Schema, lint: Schema, path: str, seen: set, inherited: frozenset = frozenset()) -> Iterator[str]:
    """Where lint's schema lacks what the CRD says at `path`. `inherited`: CEL rules the CRD puts on the list
    that holds this object (`templates`), which lint puts on each item."""
    lint, name = resolve(lint)
    if path.rsplit(".", 1)[-1] in LOOSER_IN_CRD:
        return
    if crd_type(crd) != lint.get("type"):
        yield f"{path}: type {lint.get('type')!r} in lint, {crd_type(crd)!r} in the CRD"
    for keyword in FACT_KEYWORDS:
        if crd.get(keyword) != lint.get(keyword):
            yield f"{path}: {keyword} {lint.get(keyword)!r} in lint, {crd.get(keyword)!r} in the CRD"
    if sorted(crd.get("required", [])) != sorted(lint.get("required", [])):
        yield f"{path}: required {lint.get('required')} in lint, {crd.get('required')} in the CRD"
    crd_rules = {rule["message"] for rule in crd.get("x-kubernetes-validations", ())}
    pushed = frozenset(crd_rules) if lint.get("type") == "array" else frozenset()
    # lint may hold a rule in more places than the CRD (templateDefaults is a Template too), never in fewer.
    if missing := ((crd_rules - pushed) | inherited) - set(lint.get(RULES_KEYWORD, ())):
        yield f"{path}: CEL rules {sorted(missing)} of the CRD missing in lint"
    key = (name, tuple(sorted(crd.get("properties", {}))))
    if name is not None and key in seen:
        return
    seen.add(key)
    crd_properties, lint_properties = crd.get("properties", {}), lint.get("properties", {})
    for field in sorted(crd_properties.keys() - lint_properties.keys()):
        yield f"{path}.{field}: in the CRD, not in lint"
    if crd_properties and lint.get("additionalProperties") is not False:
        yield f"{path}: not closed in lint"
    for field in sorted(crd_properties.keys() & lint_properties.keys()):
        yield from differences(crd_properties[field], lint_properties[field], f"{path}.{field}", seen)
    if isinstance(crd.get("items"), dict) and "items" in lint:
        yield from differences(crd["items"], lint["items"], f"{path}[]", seen, pushed)
    if isinstance(crd.get("additionalProperties"), dict) and isinstance(lint.get("additionalProperties"), dict):
        yield from differences(crd["additionalProperties"], lint["additionalProperties"], f"{path}{{}}", seen)


def crd_messages(schema: Any) -> Iterator[str]:
    if isinstance(schema, dict):
        for rule in schema.get("x-kubernetes-validations", ()):
            yield rule["message"]
        for value in schema.values():
            yield from crd_messages(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from crd_messages(value)


@needs_upstream
@pytest.mark.parametrize("crd", sorted(CRD_KINDS))
def test_lint_schema_carries_every_fact_of_the_crd(crd: str) -> None:
    document = yaml.load(
        upstream("schemas", "argo-crds", f"argoproj.io_{crd}.yaml").read_text(),
        Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader),
    )
    (version,) = document["spec"]["versions"]
    crd_schema = version["schema"]["openAPIV3Schema"]
    kind = CRD_KINDS[crd]
    # apiVersion, kind, metadata and spec: the top level is the kind's definition.
    found = list(differences(crd_schema, {"$ref": f"#/$defs/{kind}"}, kind, set()))
    # lint's top level requires nothing beyond what Hera's model does; the CRD requires metadata and spec.
    found = [line for line in found if not line.startswith(f"{kind}: required")]
    assert not found, "\n".join(found)
    assert set(crd_messages(crd_schema)) == set(RULES)


def test_every_rule_and_fact_is_attached_where_hera_has_the_field() -> None:
    defs = definitions()
    attached = {message for schema in defs.values() for message in schema.get(RULES_KEYWORD, ())}
    assert attached == set(RULES)
    for (name, field), values in argo_schema.POD_ENUMS.items():
        schema = defs[name]["properties"][field.removesuffix("[]")]
        assert (schema.get("items", schema) if field.endswith("[]") else schema)[POD_ENUM_KEYWORD] == list(values)


def closed_everywhere(schema: Any, path: str) -> Iterator[str]:
    if isinstance(schema, dict):
        if schema.get("properties") and schema.get("additionalProperties") is not False:
            yield path
        for key, value in schema.items():
            yield from closed_everywhere(value, f"{path}.{key}")
    elif isinstance(schema, list):
        for i, value in enumerate(schema):
            yield from closed_everywhere(value, f"{path}[{i}]")


def test_the_schema_is_closed_and_has_no_nulls() -> None:
    defs = definitions()
    assert set(argo_schema.KINDS) <= set(defs)
    assert list(closed_everywhere(defs, "$defs")) == []
    assert '"null"' not in repr(defs)


def test_a_fact_about_a_field_hera_lacks_fails_the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(argo_schema, "CRD_FIELD_FACTS", {("RetryStrategy", "retryPolicyy"): {"enum": ["Always"]}})
    with pytest.raises(KeyError, match="Hera's RetryStrategy has no field 'retryPolicyy'"):
        argo_schema._built()


def test_the_cached_schema_is_the_built_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOELOOP_CACHE", str(tmp_path))
    definitions.cache_clear()
    try:
        built = definitions()  # built, and written to the cache
        assert argo_schema.cache_path().parent == tmp_path
        definitions.cache_clear()
        assert json.loads(argo_schema.cache_path().read_text()) == built == definitions() == argo_schema._built()
    finally:
        definitions.cache_clear()
