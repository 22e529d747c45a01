"""The capacity planner behind `moeloop plan`: see README.md in this folder."""
