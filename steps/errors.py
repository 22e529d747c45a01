"""User-facing errors: one line, a non-zero exit, nothing half-written."""

from __future__ import annotations

import argparse
import errno
import sys
from collections.abc import Callable
from typing import NoReturn


class MoeloopError(Exception):
    """A problem with the user's input or stored data, reported as one line."""


EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # the shell's code for a process stopped by Ctrl-C
# Failures of the machine's files rather than of moeloop: a full disk, a path that cannot be written. Whatever
# wrote raised them without naming the run's object; the file they name is the one line worth printing.
ENVIRONMENT_ERRNOS = {
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EROFS,
    errno.EACCES,
    errno.EPERM,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.ELOOP,
    errno.ENAMETOOLONG,
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are the one `error: ...` line, exit 2, like every other user error."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, f"error: {self.prog}: {message} (see --help)\n")


def run_cli(main: Callable[[], None]) -> None:
    """Run a step's main, turning a MoeloopError (or a full disk, an unwritable path) into `error: ...` on
    stderr and exit code 2."""
    try:
        main()
    except MoeloopError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    except OSError as error:
        if error.errno not in ENVIRONMENT_ERRNOS:
            raise
        where = f": {error.filename}" if error.filename else ""
        print(f"error: {error.strerror}{where}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
