"""Argo's substitution of `{{...}}` tags into a resource template's manifest, as the controller does it: the manifest
is text, and a tag's value is pasted into it raw (`{{name}}`), or as the JSON that Go's encoder writes
(`{{=toJson(name)}}`), before the text is parsed as YAML (argo-workflows issue 3449: a quote in a value breaks it)."""

from __future__ import annotations

import json
import re

import yaml

TAG = re.compile(r"\{\{(.*?)\}\}")
TO_JSON = re.compile(r"=toJson\(([A-Za-z0-9_.-]+)\)")


def go_json(value: str) -> str:
    """json.Marshal of a Go string: UTF-8 kept, control characters, quotes and backslashes escaped, and <, >, & and
    the line and paragraph separators as \\u escapes (Go's HTML-safe encoder)."""
    text = json.dumps(value, ensure_ascii=False)
    for character in "<>&\u2028\u2029":
        text = text.replace(character, f"\\u{ord(character):04x}")
    return text


def variables(text: str) -> set[str]:
    """The Argo variables a manifest's tags name."""
    return {TO_JSON.fullmatch(tag)[1] if TO_JSON.fullmatch(tag) else tag.strip() for tag in TAG.findall(text)}


def substitute(text: str, values: dict[str, str]) -> str:
    """The manifest as Argo hands it to the API server, every tag filled from values (a tag not in values: KeyError)."""

    def fill(match: re.Match) -> str:
        as_json = TO_JSON.fullmatch(match[1])
        return go_json(values[as_json[1]]) if as_json else values[match[1].strip()]

    return TAG.sub(fill, text)


def read_back(text: str) -> object:
    """The manifest's object with each tag's variable as the plain `{{variable}}` string it stands for."""
    return yaml.safe_load(substitute(text, {name: f"{{{{{name}}}}}" for name in variables(text)}))


def expanded_tasks(tasks: list[dict]) -> dict[str, dict]:
    """A DAG's tasks by name as Argo's controller runs them (workflow/controller/dag.go, expandTask): a task with
    `withSequence` of count K is K tasks `<name>(i:i)` (operator.go, generateNodeName), its `{{item}}` i in each;
    a dependency on it is one on each of them."""
    items = {
        task["name"]: [f"{task['name']}({i}:{i})" for i in range(int(task["withSequence"]["count"]))]
        for task in tasks
        if "withSequence" in task
    }
    found = {}
    for task in tasks:
        plain = {key: value for key, value in task.items() if key != "withSequence"}
        plain["dependencies"] = [item for name in task.get("dependencies", ()) for item in items.get(name, [name])]
        for index, name in enumerate(items.get(task["name"], [task["name"]])):
            found[name] = {**json.loads(json.dumps(plain).replace("{{item}}", str(index))), "name": name}
    return found
