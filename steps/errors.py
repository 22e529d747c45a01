"""User-facing errors: one line, a non-zero exit, nothing half-written."""

from __future__ import annotations

import argparse
import errno
import sys
from collections.abc import Callable
from typing import NoReturn, TextIO


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


def print_line(text: str, stream: TextIO | None = None) -> None:
    """text and its newline in one write (to stream, default stdout). print writes them apart, and unbuffered
    (PYTHONUNBUFFERED, which the development machine sets) each is a write of its own: two torchrun ranks printing at
    once then ran their lines together (`...no-such-runerror: run does not exist ...`)."""
    stream = sys.stdout if stream is None else stream
    stream.write(text + "\n")
    stream.flush()


def run_cli(main: Callable[[], None]) -> None:
    """Run a step's main, turning a MoeloopError (or a full disk, an unwritable path) into `error: ...` on
    stderr and exit code 2."""
    try:
        main()
    except MoeloopError as error:
        print_line(f"error: {error}", sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    except OSError as error:
        if error.errno not in ENVIRONMENT_ERRNOS:
            raise
        where = f": {error.filename}" if error.filename else ""
        print_line(f"error: {error.strerror}{where}", sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    except KeyboardInterrupt as interrupt:  # a command may say what to do next in its own
        print_line(f"error: {str(interrupt) or 'interrupted'}", sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
