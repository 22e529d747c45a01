"""Commands to a run's long-lived processes (`lifetime: chunk`: the chunk's trainer, steps/trainer.py; each shard's
rollout engine, steps/rollout_engine.py), through the run's storage, so that nothing but the storage joins a step's
pod to the process it asks, wherever either runs.

A step asks by creating its command object once (commands/iter-N-<what>.json) and waits until its output is
committed; the process takes its commands in iteration order, and while it lives it writes its heartbeat
(commands/<process>.json) every few seconds. A step whose process has not been heard from for SILENT_SECONDS fails
with a line that says so; a process started again (its Job's next pod) finds the commands it has not served.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable

from moeloop.steps.errors import MoeloopError
from moeloop.steps.storage.run import RunStorage

POLL_SECONDS = 0.25
HEARTBEAT_SECONDS = 5.0
# A process started again beats as soon as it starts, but its pod may first wait minutes for a node (a Spot GPU).
SILENT_SECONDS = 900.0


def ask(storage: RunStorage, command: str, done: Callable[[], bool], heartbeat: str, what: str) -> None:
    """Create the command (once: a re-run finds it) and wait until done(). Fails when the process that serves it has
    not been heard from (heartbeat) for SILENT_SECONDS since the later of its last beat and the ask."""
    storage.create_bytes(command, json.dumps({"asked_at": time.time()}).encode())
    wait_while_heard(storage, done, heartbeat, f"{storage.display(command)} asked {what}")


def wait_while_heard(storage: RunStorage, done: Callable[[], bool], heartbeat: str, waiter: str) -> None:
    """Wait until done(), failing once the process that will make it so has not been heard from (heartbeat) for
    SILENT_SECONDS since the later of its last beat and the wait's start. waiter: who waits, for the error."""
    began = time.time()
    while not done():
        heard = storage.read_json(heartbeat)["at"] if storage.exists(heartbeat) else 0.0
        if time.time() - max(heard, began) > SILENT_SECONDS:
            since = f"since {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(heard))} UTC" if heard else "at all"
            raise MoeloopError(
                f"{waiter}, which has not been heard from {since} ({storage.display(heartbeat)}): is its pod (or"
                " local process) running?"
            )
        time.sleep(POLL_SECONDS)


def wait_for_command(storage: RunStorage, command: str) -> None:
    while not storage.exists(command):
        time.sleep(POLL_SECONDS)


class Heartbeat:
    """A thread writing the heartbeat object (when, host, pid, what it holds) every HEARTBEAT_SECONDS until stopped."""

    def __init__(self, storage: RunStorage, path: str) -> None:
        self.storage, self.path, self.holds, self.stopped = storage, path, 0, threading.Event()
        self.thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        while True:
            beat = {"at": time.time(), "host": socket.gethostname(), "pid": os.getpid(), "holds": self.holds}
            self.storage.write_bytes(self.path, json.dumps(beat).encode())
            if self.stopped.wait(HEARTBEAT_SECONDS):
                return

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()
