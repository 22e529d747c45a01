"""User-facing errors: one line, a non-zero exit, nothing half-written."""

from __future__ import annotations

import sys
from collections.abc import Callable


class MoeloopError(Exception):
    """A problem with the user's input or stored data, reported as one line."""


EXIT_USER_ERROR = 2


def run_cli(main: Callable[[], None]) -> None:
    """Run a step's main, turning a MoeloopError into `error: ...` on stderr and exit code 2."""
    try:
        main()
    except MoeloopError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
