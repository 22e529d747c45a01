"""What runs where: the loop's DAG, its Argo render, the local runner and the `moeloop` CLI."""
