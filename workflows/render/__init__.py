"""Render the loop for Argo: a WorkflowTemplate holding one chunk of the run, a Workflow and a CronWorkflow
that run it, and (multi-node training) the JobSet the train task creates.

A run of any length is a chain of Workflows of `cluster.chunk_iterations` iterations each, so no object
grows with the run (etcd keeps about 1 MB per object; Argo's recursion depth is 100). The template's DAG:

    start -> plan -+-> eval-latest                      (LATEST's evaluation, if it is missing)
                   +-> label                            (the Workflow's first/last-iteration labels)
                   +-> slot1-rollout -> ... -> slotC-eval -> next-chunk

`plan` (steps/chunk.py) reads LATEST after start has adopted the submitted `iterations`: slot j runs
iteration LATEST + j when j <= its `count`; `next-chunk` creates the next Workflow from the same template when
iterations remain and `chain` is true. An iteration's K rollout shards are one task of K items (Argo's
`withSequence`), which Argo runs as a node a shard, `slot<j>-rollout(k:k)`, each retried on its own: an iteration
is 5 tasks at any shard count (`chunk.fan_out`). The ad-hoc Workflow and the CronWorkflow refer to the template, so
every submission, resubmission or scheduled tick continues from LATEST. Every task, dependency and pod
command comes from workflows/dag.py (`iteration_tasks`, `STEPS`); this package adds placement by role from
`config.cluster`, security contexts, output parameters and the chaining.

The objects are Hera objects (`build` returns them: a WorkflowTemplate whose chunk is a DAG of Tasks over Container
and Resource templates, a Workflow, a CronWorkflow); what `moeloop render` writes is Hera's own serialization of
them, linted first. The modules, from the bottom up: `placement` (by role, pod security), `portable_paths`,
`step_templates`, `jobset` (multi-node training), `parameters` (the run's), `chunk` (the DAG, label and next-chunk
templates), `loop` (`Loop`, `build`, `render`), `files` (`write_rendered`).
"""

from moeloop.workflows.render.files import write_rendered
from moeloop.workflows.render.loop import Loop, build, render

__all__ = ["Loop", "build", "render", "write_rendered"]
