"""The run lease: one `moeloop run` drives a run at a time.

The lease is one object in the run's folder, `<run>/LEASE`, a JSON record of its holder: host, pid, when it
took the lease, when the lease expires, and a random token that tells the holder its own lease from another's.
The driver takes it before it runs any step, renews it while it runs (every RENEW_SECONDS, to TTL_SECONDS from
then) and removes it when it ends. A second driver finds it held and stops with an error naming the holder,
before it writes anything, logs included. A lease whose holder died is stale and is taken over: once it has
expired (another host's driver), or at once when its holder was a process of this host that is gone.

Every change is a compare-and-swap of the backend (backends.py), so two drivers racing for a free or a stale
lease cannot both win: on S3 a PutObject with If-None-Match: * creates it, PutObject and DeleteObject with
If-Match: <the ETag read> renew, take over and remove it (S3 honours these on general purpose buckets, as does
SeaweedFS); locally the lock file is read and replaced under an exclusive flock of the run's folder.
Expiry compares the holder's clock with the reader's: hosts whose clocks differ by much less than TTL_SECONDS. A
lease stamped by a clock ahead by more than CLOCK_SKEW_SECONDS is refused as busy like any other (the holder may be
alive), with the LEASE to remove once no driver holds it.

On Argo the chunks of a run are serialised by the Workflow-level mutex `moeloop-run-<run>` instead (see the
render): Argo holds it for a Workflow's life and releases it when it ends, however it ends. The two do not see
each other: a Workflow never takes this lease, and `moeloop run` cannot see the mutex. The plan step, which
opens every chunk, refuses to run while a `moeloop run` holds the lease (check_free), so a chunk does not
start under a local driver; drive one run from one of the two.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from moeloop.steps.errors import MoeloopError
from moeloop.steps.storage.manifest import process_alive
from moeloop.steps.storage.run import RunStorage

LEASE = "LEASE"
TTL_SECONDS = 120.0
RENEW_SECONDS = 30.0
# How far apart the hosts' clocks may be. A lease's expiry is at most TTL_SECONDS after its holder's last renewal, so
# one further from now than that by more than this was stamped by a clock ahead of this host's (or written by hand):
# no wait here tells when it really expires, and the refusal says so.
CLOCK_SKEW_SECONDS = 60.0


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    since: float  # Unix seconds
    expires_at: float
    token: str

    def describe(self) -> str:
        return f"host {self.host}, pid {self.pid}, since {_utc(self.since)}"

    def clock_ahead(self, now: float) -> float:
        """At least how far the holder's clock is ahead of now's (0 when its expiry is within reach)."""
        return max(0.0, self.expires_at - now - TTL_SECONDS)

    def is_stale(self, now: float) -> bool:
        if now > self.expires_at:
            return True
        return self.host == socket.gethostname() and not process_alive(self.pid)

    def record(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()


def _utc(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def parse_holder(raw: bytes, source: str) -> Holder:
    try:
        record = json.loads(raw)
        holder = Holder(**{name: record[name] for name in Holder.__dataclass_fields__})
        if isinstance(holder.pid, int) and all(isinstance(v, int | float) for v in (holder.since, holder.expires_at)):
            return holder
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        pass
    raise MoeloopError(f"not a lease: {source} (foreign data; remove it if no `moeloop run` drives this run)")


class RunLease:
    """The lease of one run, held by this process between acquire() and release() (or as a context manager)."""

    def __init__(self, run_uri: str, ttl: float = TTL_SECONDS, renew_every: float = RENEW_SECONDS):
        self.storage = RunStorage(run_uri)
        self.ttl, self.renew_every = ttl, renew_every
        self.holder: Holder | None = None
        self.renewed_at = 0.0
        self.created: list[Path] = []  # local folders made to hold the lock file, removed again if left empty

    def acquire(self) -> None:
        if not self.storage.uri.startswith("s3://"):
            self._make_folder()  # the lock file's folder, and the flock's
        now = time.time()
        ours = Holder(socket.gethostname(), os.getpid(), now, now + self.ttl, uuid.uuid4().hex)
        busy: list[Holder] = []

        def take(current: bytes | None) -> bytes | None:
            busy.clear()
            if current is not None:
                holder = parse_holder(current, self.storage.display(LEASE))
                if not holder.is_stale(time.time()):
                    busy.append(holder)
                    return None
            return ours.record()

        try:
            self.storage.backend.compare_and_swap(LEASE, take)
        except MoeloopError:
            self._remove_made_folders()
            raise
        if busy:
            self._remove_made_folders()
            raise MoeloopError(
                f"run {self.storage.uri} is busy: another `moeloop run` holds its lease ({busy[0].describe()},"
                f" expires {_utc(busy[0].expires_at)} unless renewed); wait for it to end or stop it"
                + skew_advice(busy[0], self.storage)
            )
        self.holder, self.renewed_at = ours, now

    def renew_if_due(self) -> None:
        """Extend the lease once RENEW_SECONDS have passed; an error if another driver took it meanwhile (this
        process stalled past its expiry): this driver must stop."""
        now = time.time()
        if self.holder is None or now - self.renewed_at < self.renew_every:
            return
        renewed, kept = replace(self.holder, expires_at=now + self.ttl), []

        def extend(current: bytes | None) -> bytes | None:
            kept[:] = [self._ours(current)]
            return renewed.record() if kept[0] else None

        self.storage.backend.compare_and_swap(LEASE, extend)
        if not kept[0]:
            self.holder = None
            raise MoeloopError(
                f"lost the lease of run {self.storage.uri}: another driver took it over after it expired; stopping"
            )
        self.holder, self.renewed_at = renewed, now

    def release(self) -> None:
        if self.holder is not None:
            self.storage.backend.delete_if(LEASE, self._ours)  # not ours: another driver took it over
            self.holder = None
        self._remove_made_folders()

    def _ours(self, current: bytes | None) -> bool:
        if current is None or self.holder is None:
            return False
        try:
            return parse_holder(current, self.storage.display(LEASE)).token == self.holder.token
        except MoeloopError:
            return False

    def __enter__(self) -> RunLease:
        self.acquire()
        return self

    def __exit__(self, *_: object) -> None:
        self.release()

    def _make_folder(self) -> None:
        folder = Path(self.storage.root)
        missing = [folder, *(p for p in folder.parents if not p.exists())] if not folder.exists() else []
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise MoeloopError(f"cannot create the run's folder {folder}: {error.strerror or error}") from None
        self.created = sorted(missing, key=lambda p: len(p.parts), reverse=True)

    def _remove_made_folders(self) -> None:
        for folder in self.created:  # deepest first; a folder that holds anything now stays
            try:
                folder.rmdir()
            except OSError:
                break
        self.created = []


def check_free(storage: RunStorage) -> None:
    """Refuse to go on while a live `moeloop run` holds the run's lease (the Argo side of the lease)."""
    if not storage.exists(LEASE):
        return  # no lease: nobody drives the run locally
    holder = parse_holder(storage.read_bytes(LEASE), storage.display(LEASE))
    if not holder.is_stale(time.time()):
        raise MoeloopError(
            f"run {storage.uri} is driven by a `moeloop run` ({holder.describe()}): refusing to run a chunk beside it"
            + skew_advice(holder, storage)
        )


def skew_advice(holder: Holder, storage: RunStorage) -> str:
    """What a refusal adds when the holder's clock is ahead of this host's by more than CLOCK_SKEW_SECONDS."""
    ahead = holder.clock_ahead(time.time())
    if ahead <= CLOCK_SKEW_SECONDS:
        return ""
    return (
        f"; but its expiry is {ahead:.0f} s further away than a lease runs, so the clock of {holder.host} is ahead"
        f" of this host's: if no `moeloop run` drives this run any more, remove {storage.display(LEASE)}"
    )
