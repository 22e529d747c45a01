#!/bin/sh
# Install moeloop into an image that brings its own torch (and vLLM): the package's other dependencies with the
# pins of pyproject.toml, then the package itself without touching torch. Run from the directory holding it.
set -eu
python3 -c "import tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
print('\n'.join(d for d in deps if not d.startswith('torch')))" > /tmp/requirements.txt
python3 -m pip install -r /tmp/requirements.txt
python3 -m pip install --no-deps .
rm /tmp/requirements.txt
