"""finish: the exit handler of a chunk's Workflow on Argo, rendered where `observe.trackers` has mlflow.

Argo runs it however the Workflow ended. Where it did not succeed (Failed or Error: a step failed, or the Workflow
was stopped), the trackers' runs end FAILED; one that succeeded leaves them as they are: the target iteration's
evaluation has ended them FINISHED, or the next chunk carries on.

    python -m moeloop.steps.finish --run URI --status {{workflow.status}}
"""

from __future__ import annotations

from moeloop.steps.common import print_json
from moeloop.steps.errors import ArgumentParser, run_cli
from moeloop.steps.observe.trackers import end_trackers
from moeloop.steps.storage.run import open_run


def main() -> None:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--run", required=True, help="the run's folder URI (local path or s3://...)")
    parser.add_argument("--status", required=True, help="the Workflow's: Succeeded, Failed or Error")
    args = parser.parse_args()
    if args.status == "Succeeded":
        print_json({"skipped": "the Workflow succeeded"})
        return
    storage, config = open_run(args.run)
    end_trackers(storage, config, "FAILED")
    print_json({"ended": "FAILED"})


if __name__ == "__main__":
    run_cli(main)
