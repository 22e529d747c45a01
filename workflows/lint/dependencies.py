"""A DAG task's dependencies: the tasks it names in `dependencies` and `depends`, the syntax of a `depends`
expression, and dependency cycles."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from moeloop.workflows.lint.helpers import YamlMap, list_items

# What a `depends` term may name after its task (task.Result).
DEPENDS_RESULTS = frozenset(
    {"Succeeded", "Failed", "Errored", "Skipped", "Omitted", "Daemoned", "AnySucceeded", "AllFailed"}
)
# Argo's task term in `depends` (workflow/common/ancestry.go): a task name, optionally with .Result.
_DEPENDS_TERM = re.compile(r"([a-zA-Z0-9][-a-zA-Z0-9]*)(?:\.([A-Za-z]+))?")
_DEPENDS_OPERATOR = re.compile(r"&&|\|\||!|\(|\)")


def upstream_references(task: YamlMap) -> list[tuple[str, str, str]]:
    """(field, task name, result or "") for each task named in `dependencies` or the `depends` expression."""
    references = [
        (f"dependencies[{j}]", name, "") for j, name in list_items(task.get("dependencies")) if isinstance(name, str)
    ]
    depends = task.get("depends")
    if isinstance(depends, str):
        references += [("depends", name, result) for name, result in _DEPENDS_TERM.findall(depends)]
    return references


def depends_syntax_error(depends: str) -> str | None:
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


def find_cycle(graph: Mapping[str, Sequence[str]]) -> list[str] | None:
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


def cycle_text(cycle: list[str], shown: int = 6) -> str:
    """'a -> b -> a', eliding the middle of long cycles to keep the message one readable line."""
    if len(cycle) <= 2 * shown:
        return " -> ".join(cycle)
    elided = f" -> ... ({len(cycle) - 2 * shown} more) -> "
    return " -> ".join(cycle[:shown]) + elided + " -> ".join(cycle[-shown:])
