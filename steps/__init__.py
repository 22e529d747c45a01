"""What each pod runs: small CLIs (`python -m steps.<name> --run URI --iteration I`) over pure functions."""
