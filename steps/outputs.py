"""A step's figures as Argo output parameters: each scalar of its report in a file of its own.

Argo pods set $MOELOOP_OUTPUTS; the step's template reads <dir>/<key> with `valueFrom.path` (a default
where a skipped step reported nothing). Locally the variable is unset and nothing is written.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

OUTPUTS_ENV = "MOELOOP_OUTPUTS"


def write_outputs(report: dict[str, Any]) -> None:
    directory = os.environ.get(OUTPUTS_ENV)
    if not directory:
        return
    os.makedirs(directory, exist_ok=True)
    for key, value in report.items():
        if isinstance(value, (str, int, float, bool)):
            descriptor, temporary = tempfile.mkstemp(dir=directory, prefix=f".{key}.")
            with os.fdopen(descriptor, "w") as stream:
                stream.write(value if isinstance(value, str) else json.dumps(value))
            os.replace(temporary, os.path.join(directory, key))
