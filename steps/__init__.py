"""What each pod runs: small CLIs (`python -m moeloop.steps.<name> --run URI --iteration I`) over pure functions."""
