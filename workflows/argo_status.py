"""What `moeloop status` and `moeloop logs` read from an Argo Workflow: its summary (phase, progress, times, failed
steps) as data for `-o json|yaml` and as the lines the table prints, and the pods behind a task of its DAG."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hera.workflows import models as m

from moeloop.steps.errors import MoeloopError
from moeloop.workflows.argo import one_line, timestamp
from moeloop.workflows.render.chunk import node_name

FAILED_PHASES = frozenset({"Failed", "Error"})
FINISHED_PHASES = FAILED_PHASES | {"Succeeded"}
# Argo's pod names (workflow/util/pod_name.go, GeneratePodName): v2 unless the workflow's annotation says v1.
POD_NAME_ANNOTATION = "workflows.argoproj.io/pod-name-format"
POD_NAME_PREFIX_CHARS = 253 - 10 - 1  # the longest Kubernetes name, less the hash and its dash


def has_failed(workflow: m.Workflow) -> bool:
    return workflow.status is not None and workflow.status.phase in FAILED_PHASES


def has_finished(workflow: m.Workflow) -> bool:
    return workflow.status is not None and workflow.status.phase in FINISHED_PHASES


def workflow_summary(workflow: m.Workflow, with_steps: bool = True) -> dict[str, Any]:
    """The workflow's name, phase, progress, times and message, and (with_steps) each failed step with its message:
    what `moeloop status` prints, as data."""
    status = workflow.status or m.WorkflowStatus()
    summary: dict[str, Any] = {
        "name": workflow.metadata.name,
        "phase": status.phase or "Pending",
        "progress": status.progress,
        "started": timestamp(status.started_at) if status.started_at else None,
        "finished": timestamp(status.finished_at) if status.finished_at else None,
        "message": one_line(status.message) if status.message else None,
    }
    if with_steps:
        summary["failed"] = [
            {"step": node.display_name or node.name, "phase": node.phase, "message": one_line(node.message or "")}
            for node in _failed_steps(status.nodes or {})
        ]
    return summary


def status_lines(summary: Mapping[str, Any]) -> list[str]:
    """A workflow's summary, one line each: name, phase, progress, times, message, failed steps."""
    lines = [
        f"name      {summary['name']}",
        f"phase     {summary['phase']}",
        f"progress  {summary['progress'] or '-'}",
        f"started   {summary['started'] or '-'}",
        f"finished  {summary['finished'] or '-'}",
    ]
    if summary["message"]:
        lines.append(f"message   {summary['message']}")
    for step in summary.get("failed", ()):
        lines.append(f"failed    {step['step']}: {step['phase']}: {step['message'] or '-'}")
    return lines


def _failed_steps(nodes: Mapping[str, m.NodeStatus]) -> list[m.NodeStatus]:
    """Failed leaves (pods, resource steps) not recovered by a retry, in the order they started.
    Their DAG and retry parents fail with "child ... failed", which says nothing more."""
    parent_of = {child: node for node in nodes.values() for child in node.children or ()}
    failed = [
        node
        for node_id, node in nodes.items()
        if node.phase in FAILED_PHASES
        and not node.children
        and not (node_id in parent_of and parent_of[node_id].phase == "Succeeded")
    ]
    return sorted(failed, key=lambda node: timestamp(node.started_at))


def run_table(summaries: list[Mapping[str, Any]]) -> list[str]:
    """One line per workflow of a run: name, phase, progress, start, finish, message."""
    rows = [("NAME", "PHASE", "PROGRESS", "STARTED", "FINISHED", "MESSAGE")]
    for s in summaries:
        cells = (s["name"], s["phase"], s["progress"], s["started"], s["finished"])
        rows.append((*(cell or "-" for cell in cells), s["message"] or ""))
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]) - 1)]
    return ["  ".join([*(cell.ljust(width) for cell, width in zip(row, widths)), row[-1]]).rstrip() for row in rows]


def task_pods(workflow: m.Workflow, task: str | None) -> list[tuple[str, str]]:
    """(step, pod name) of every pod the task ran, in the order they started: the task's own pod, each retry's,
    or the pods of the template it calls; every pod of the workflow when task is None.

    `task` is a node's display name: a chunk task's (slot3-rollout: every shard's pods), an item's (slot3-rollout(2:2):
    shard 2's), or dag.py's name for a shard (slot3-rollout-2), which finds its item (render/chunk.py's node_name)."""
    nodes = (workflow.status.nodes if workflow.status else None) or {}
    if task is None:
        chosen = list(nodes.values())
    else:
        names = {task, node_name(task)}
        roots = [node for node in nodes.values() if node.display_name in names]
        if not roots:
            raise MoeloopError(f"Workflow {workflow.metadata.name} has no task {task!r} (yet)")
        chosen, pending = [], list(roots)
        while pending:
            node = pending.pop()
            chosen.append(node)
            pending += [nodes[child] for child in node.children or () if child in nodes]
    pods = sorted((node for node in chosen if node.type == "Pod"), key=lambda node: timestamp(node.started_at))
    return [(node.display_name or node.name, pod_name(workflow, node)) for node in pods]


def pod_name(workflow: m.Workflow, node: m.NodeStatus) -> str:
    """The name Argo gave the node's pod (GeneratePodName; the UI's getPodName computes it the same way)."""
    name = workflow.metadata.name
    if (workflow.metadata.annotations or {}).get(POD_NAME_ANNOTATION) == "v1":
        return node.id
    if node.name == name:
        return name
    template = node.template_name or (node.template_ref.template if node.template_ref else "")
    prefix = (f"{name}-{template}" if template else name)[:POD_NAME_PREFIX_CHARS]
    return f"{prefix}-{fnv32a(node.name)}"


def fnv32a(text: str) -> int:
    """The 32-bit FNV-1a hash of text's UTF-8 bytes (Go's hash/fnv New32a)."""
    value = 0x811C9DC5
    for byte in text.encode():
        value = ((value ^ byte) * 0x01000193) & 0xFFFFFFFF
    return value
