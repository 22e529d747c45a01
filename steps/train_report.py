"""train-report: the figures of a multi-node train step, for Argo.

With `cluster.train_nodes` > 1 the trainer runs in a JobSet's pods, which Argo does not see. This pod runs after the
JobSet, in the train task's template (workflows/render/jobset.py): it prints the iteration's committed train report
as the step's report, so its scalars become the template's output parameters and Prometheus gauges
(moeloop_train_*), as a single-node train pod's do.

    python -m moeloop.steps.train_report --run URI --iteration I
"""

from __future__ import annotations

from moeloop.steps.common import open_iteration, print_json, step_parser
from moeloop.steps.errors import MoeloopError, run_cli


def main() -> None:
    args = step_parser(__doc__).parse_args()
    storage, _ = open_iteration(args.run, args.iteration)
    report = storage.report(args.iteration, "train")
    if not storage.exists(report):
        raise MoeloopError(f"iteration {args.iteration} has no train report: {storage.display(report)}")
    print_json(storage.read_json(report))


if __name__ == "__main__":
    run_cli(main)
