"""The local runner, the embedded default (`moeloop run`): the loop's DAG run on this machine, step by step, as
processes. `runner.run_local` is its entry; see "The local runner" in workflows/README.md for its rooms."""
