#!/bin/sh
# Install moeloop into an image that brings its own torch (and vLLM): the package's other dependencies and those of
# the built-in verifiers' extras (the reward step runs here when reward models are configured) with the pins of
# pyproject.toml, then the package itself without touching torch. Run from the directory holding it.
set -eu
python3 -c "import tomllib; project = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
extras = project['optional-dependencies']; deps = project['dependencies'] + extras['math'] + extras['reasoning-gym']; \
print('\n'.join(d for d in deps if not d.startswith('torch')))" > /tmp/requirements.txt
python3 -m pip install -r /tmp/requirements.txt
python3 -m pip install --no-deps .
rm /tmp/requirements.txt
