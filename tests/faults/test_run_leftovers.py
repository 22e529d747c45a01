"""What a fault leaves, and commands pointed at the wrong thing (issue 36): a writer SIGKILLed mid-write leaves its
temporary beside the object, and the next whole write of that object removes it (a live writer's stays); a lease
stamped by a host whose clock is ahead is refused as busy, saying so and naming the LEASE to remove;
`moeloop report --plot` and `moeloop sync` onto a file are one line, exit 2, before anything is printed."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from moeloop.steps.errors import MoeloopError
from moeloop.steps.storage.lease import LEASE, TTL_SECONDS, RunLease
from moeloop.steps.storage.manifest import TEMPORARY
from moeloop.steps.storage.run import RunStorage
from tests.conftest import REPO
from tests.processes import moeloop_cli, run_command

# A writer of the run's object killed between its temporary's last byte and the rename, through RunStorage: a single
# object (write_bytes), or a file of a commit (put_objects, manifest.copy_hashed).
KILLED_WRITER = """
import os, signal, sys
from pathlib import Path
from moeloop.steps.storage.run import RunStorage
run, name, kind = sys.argv[1:]
storage = RunStorage(run)
os.replace = lambda *_: os.kill(os.getpid(), signal.SIGKILL)
if kind == "bytes":
    storage.write_bytes(name, b"half of it")
source = Path(run).parent / "source"
source.write_bytes(b"x" * 50)
folder, _, file = name.rpartition("/")
storage.put_objects(folder, {file: source})
"""


def killed_writer(storage: RunStorage, name: str, kind: str) -> list[Path]:
    command = [sys.executable, "-c", KILLED_WRITER, storage.uri, name, kind]
    result = run_command(command)
    assert result.returncode == -signal.SIGKILL, result.stderr
    path = Path(storage.full(name))
    return sorted(path.parent.glob(f"{path.name}{TEMPORARY}*"))


@pytest.mark.parametrize("kind", ["bytes", "file"])
def test_a_killed_writers_temporary_is_removed_by_the_next_whole_write(tmp_path: Path, kind: str) -> None:
    storage = RunStorage(str(tmp_path / "run"))
    name = "checkpoints/iter-000001/model.safetensors"
    path = Path(storage.full(name))
    [leftover] = killed_writer(storage, name, kind)
    # A temporary of a writer alive right now (this process), racing the rerun, must stay.
    live = Path(f"{path}{TEMPORARY}{socket.gethostname()}.{os.getpid()}.{'0' * 32}")
    live.write_bytes(b"in progress")
    older = Path(f"{path}{TEMPORARY}{'1' * 32}")  # a moeloop from before temporaries named their writer
    older.write_bytes(b"old")
    if kind == "bytes":
        storage.write_bytes(name, b"whole")
    else:
        source = tmp_path / "policy" / "model.safetensors"
        source.parent.mkdir()
        source.write_bytes(b"whole file")
        storage.commit_folder("checkpoints/iter-000001", source.parent, extra={"iteration": 1})
    assert not leftover.exists() and not older.exists()
    assert live.exists()
    assert path.read_bytes() in (b"whole", b"whole file")


def holder(ahead: float) -> bytes:
    now = time.time() + ahead
    record = {"host": "elsewhere", "pid": 1, "since": now - 60, "expires_at": now + TTL_SECONDS, "token": "theirs"}
    return json.dumps(record).encode()


def test_a_lease_stamped_by_a_clock_ahead_says_so_and_names_the_lease(tmp_path: Path) -> None:
    run = tmp_path / "run"
    storage = RunStorage(str(run))
    storage.write_bytes(LEASE, holder(ahead=3600))
    with pytest.raises(MoeloopError) as refused:
        RunLease(str(run)).acquire()
    message = str(refused.value)
    assert message.startswith(f"run {run} is busy: another `moeloop run` holds its lease (host elsewhere, pid 1,")
    assert "the clock of elsewhere is ahead of this host's" in message and f"remove {run}/LEASE" in message
    # Within the skew the hosts may have, a lease is an ordinary one: busy, no word of clocks.
    storage.write_bytes(LEASE, holder(ahead=30))
    with pytest.raises(MoeloopError) as refused:
        RunLease(str(run)).acquire()
    assert "clock" not in str(refused.value)


def test_report_and_sync_onto_a_file_are_one_line_before_anything_is_printed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    storage = RunStorage(str(run))
    storage.write_bytes(RunStorage.CONFIG, (REPO / "configs" / "tiny.yaml").read_bytes())
    storage.write_json(RunStorage.metrics(1), {"iteration": 1, "eval_reward_mean": 0.5})
    existing = tmp_path / "existing.png"
    existing.write_bytes(b"not a folder")
    for args, flag in (
        (["report", str(run), "--plot", str(existing)], "--plot"),
        (["sync", str(run), str(existing)], "DIR"),
    ):
        result = moeloop_cli(*args, cwd=tmp_path)
        assert result.returncode == 2 and result.stdout == "", result.stderr
        assert result.stderr == f"error: {existing}: not a folder; {flag} names the folder to write into\n"
    assert existing.read_bytes() == b"not a folder"
