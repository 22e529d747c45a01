#!/bin/sh
# Install rollout.environment's package into an image: the first argument, the build argument ENVIRONMENT_PACKAGE
# (`moeloop images` passes it; empty: nothing to install), with the verifiers release that pyproject.toml's
# [environments] extra pins, holding the image's torch and vLLM to the versions it has. Run from the directory
# holding pyproject.toml.
set -eu
[ -n "${1:-}" ] || exit 0
work=$(mktemp -d)
python3 -m pip freeze | grep -iE '^(torch|vllm)==' > "$work/installed.txt" || true
python3 -c "import tomllib; \
print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['environments']))" \
  > "$work/environments.txt"
python3 -m pip install --constraint "$work/installed.txt" --requirement "$work/environments.txt" "$1"
rm -r "$work"
