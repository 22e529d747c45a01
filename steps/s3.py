"""S3 for the storage module: run URIs, the boto3 client, bulk transfers, and errors as one line.

Endpoint, region and credentials come only from botocore's standard chain: AWS_ENDPOINT_URL_S3 or
AWS_ENDPOINT_URL, AWS_REGION, the environment's keys, a profile, a web identity (IRSA), container
credentials (EKS Pod Identity) or the instance metadata. Nothing here takes a credential as an argument,
and no message built here contains one: errors name the object and the server's error code only.

Bulk transfers (checkpoint files, large Parquet objects) go through boto3 directly, because they need
what a single stream cannot give: a multipart upload whose parts go up in parallel, and a download of
ranged parts in parallel. The sha256 the commit protocol needs is computed on the same pass, in order,
while the parts are in flight.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import boto3
import botocore.config
import botocore.exceptions

from steps.errors import MoeloopError

# Parts of 8 MiB: well above S3's 5 MiB minimum, and 10,000 of them (S3's maximum) cover 80 GB per object.
PART_SIZE = 8 << 20
MAX_PARTS = 10_000
WORKERS = 8
# Parts read or received but not yet sent or hashed: bounds the memory of a transfer to WINDOW x part size.
WINDOW = 2 * WORKERS

BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class S3Location:
    bucket: str
    key: str  # without leading or trailing '/'; "" for the bucket's top level

    def uri(self, relative: str = "") -> str:
        path = "/".join(p for p in (self.key, relative) if p)
        return f"s3://{self.bucket}/{path}" if path else f"s3://{self.bucket}"


def parse_s3_uri(uri: str) -> S3Location:
    """s3://bucket/prefix, strictly: no credentials, query, fragment, empty, '.' or '..' segments."""
    parts = urlsplit(uri)
    if "@" in parts.netloc:
        # Never echo the URI: whatever stands before '@' may be a secret.
        raise MoeloopError("credentials in an s3:// URI are refused: use the AWS chain (environment, profile, IRSA)")
    if parts.query or parts.fragment or "?" in uri or "#" in uri:
        raise MoeloopError(f"an s3:// URI takes no query or fragment: {uri}")
    if not parts.netloc:
        raise MoeloopError(f"an s3:// URI needs a bucket: {uri}")
    if not BUCKET_NAME.match(parts.netloc) or ".." in parts.netloc:
        raise MoeloopError(f"not a valid S3 bucket name: {parts.netloc!r} in {uri}")
    key = parts.path.strip("/")
    check_segments(key, uri)
    return S3Location(parts.netloc, key)


def check_segments(path: str, uri: str) -> None:
    """No '..' or '.' segments (a key would not mean what a reader of the path expects), no empty ones."""
    if not path:
        return
    for segment in path.split("/"):
        if segment in ("", ".", ".."):
            raise MoeloopError(f"a storage URI must not contain {segment or 'empty'!r} path segments: {uri}")


# -- the client --------------------------------------------------------------------------------------

_client_lock = threading.Lock()
_clients: dict[int, Any] = {}


def client() -> Any:
    """This process's S3 client (boto3 clients are thread-safe); rebuilt in a forked child."""
    with _client_lock:
        if os.getpid() not in _clients:
            config = botocore.config.Config(
                max_pool_connections=WORKERS + 2, retries={"mode": "standard", "max_attempts": 5}
            )
            _clients[os.getpid()] = boto3.session.Session().client("s3", config=config)
        return _clients[os.getpid()]


def endpoint() -> str:
    return client().meta.endpoint_url


_pool_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}


def pool() -> ThreadPoolExecutor:
    with _pool_lock:
        if os.getpid() not in _pools:
            _pools[os.getpid()] = ThreadPoolExecutor(WORKERS, thread_name_prefix="moeloop-s3")
        return _pools[os.getpid()]


# -- errors ----------------------------------------------------------------------------------------

# What boto3 and botocore raise (s3fs wraps these in OSErrors, with the original as the cause).
S3_ERRORS = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError)
CREDENTIAL_ERRORS = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
    "TokenRefreshRequired",
}


def error_code(error: BaseException) -> str | None:
    """The S3 error code of a botocore error, or of one wrapped by s3fs (as the exception's cause)."""
    for candidate in (error, error.__cause__, error.__context__):
        if isinstance(candidate, botocore.exceptions.ClientError):
            return str(candidate.response.get("Error", {}).get("Code") or "")
    return None


def is_precondition_failure(error: BaseException) -> bool:
    return error_code(error) in ("PreconditionFailed", "412")


def describe(error: BaseException, uri: str) -> MoeloopError | None:
    """A one-line MoeloopError naming the object for an S3 failure; None for errors that are not S3's."""
    code = error_code(error)
    if isinstance(error, botocore.exceptions.NoCredentialsError | botocore.exceptions.PartialCredentialsError):
        return MoeloopError(f"no AWS credentials found for {uri} (set them in the environment, a profile, or IRSA)")
    if isinstance(error, botocore.exceptions.EndpointConnectionError | botocore.exceptions.ConnectionClosedError):
        return MoeloopError(f"cannot reach the S3 endpoint {endpoint()} for {uri}")
    if isinstance(error, botocore.exceptions.ReadTimeoutError | botocore.exceptions.ConnectTimeoutError):
        return MoeloopError(f"the S3 endpoint {endpoint()} timed out for {uri}")
    if code is None:
        return None
    if code == "NoSuchBucket":
        return MoeloopError(f"bucket does not exist: s3://{urlsplit(uri).netloc} (for {uri})")
    if code in ("NoSuchKey", "404", "NotFound"):
        return MoeloopError(f"missing object: {uri}")
    if code in CREDENTIAL_ERRORS:
        return MoeloopError(f"S3 rejected the credentials ({code}) for {uri}")
    if code in ("AccessDenied", "403", "Forbidden", "AllAccessDisabled"):
        return MoeloopError(f"access denied ({code}) to {uri}")
    return MoeloopError(f"S3 error {code} for {uri}")


def translated(error: BaseException, uri: str) -> BaseException:
    return describe(error, uri) or error


# -- transfers ------------------------------------------------------------------------------------


def part_size(size: int) -> int:
    return max(PART_SIZE, -(-size // MAX_PARTS))


@dataclass(frozen=True)
class Uploaded:
    size: int
    sha256: str


def upload(location: S3Location, sources: dict[str, Path | bytes]) -> dict[str, Uploaded]:
    """Put every source (a local file or bytes) at location/name, in parallel; returns sizes and sha256.

    Small objects are one PUT each. A large one is a multipart upload whose parts are read and hashed in
    order here, and sent by the worker threads, at most WINDOW parts ahead. On any failure the open
    multipart uploads are aborted, so no part is left behind.
    """
    in_flight: deque[Future] = deque()
    multiparts: list[tuple[str, str, str, list[Future]]] = []  # (key, uri, upload id, parts)
    results: dict[str, Uploaded] = {}
    s3 = client()

    def throttle() -> None:
        while len(in_flight) >= WINDOW:
            in_flight.popleft().result()

    try:
        for name, source in sources.items():
            uri = location.uri(name)
            key = uri.removeprefix(f"s3://{location.bucket}/")
            digest = hashlib.sha256()
            size = len(source) if isinstance(source, bytes) else source.stat().st_size
            step = part_size(size)
            if size <= step:
                data = source if isinstance(source, bytes) else source.read_bytes()
                digest.update(data)
                throttle()
                in_flight.append(pool().submit(call, s3.put_object, uri, Bucket=location.bucket, Key=key, Body=data))
            else:
                upload_id = call(s3.create_multipart_upload, uri, Bucket=location.bucket, Key=key)["UploadId"]
                parts: list[Future] = []
                multiparts.append((key, uri, upload_id, parts))
                for number, data in enumerate(read_parts(source, step), start=1):
                    digest.update(data)
                    throttle()
                    future = pool().submit(
                        call,
                        s3.upload_part,
                        uri,
                        Bucket=location.bucket,
                        Key=key,
                        UploadId=upload_id,
                        PartNumber=number,
                        Body=data,
                    )
                    parts.append(future)
                    in_flight.append(future)
            results[name] = Uploaded(size, digest.hexdigest())
        for future in in_flight:
            future.result()
        completions = [
            pool().submit(
                call,
                s3.complete_multipart_upload,
                uri,
                Bucket=location.bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={
                    "Parts": [{"PartNumber": n, "ETag": f.result()["ETag"]} for n, f in enumerate(parts, 1)]
                },
            )
            for key, uri, upload_id, parts in multiparts
        ]
        for future in completions:
            future.result()
        multiparts.clear()
    except S3_ERRORS as error:
        raise translated(error, location.uri()) from None
    finally:
        for key, _, upload_id, _ in multiparts:
            abort_multipart(location.bucket, key, upload_id)
    return results


def abort_multipart(bucket: str, key: str, upload_id: str) -> None:
    try:
        client().abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
    except S3_ERRORS:
        pass  # best effort: the bucket's lifecycle rule removes what is left (manifests/iam/README.md)


def read_parts(source: Path | bytes, step: int) -> Iterator[bytes]:
    if isinstance(source, bytes):
        view = memoryview(source)
        for offset in range(0, len(source), step):
            yield bytes(view[offset : offset + step])
        return
    with open(source, "rb") as file:
        while data := file.read(step):
            yield data


@dataclass(frozen=True)
class Download:
    name: str
    size: int  # what the manifest says: the object must be exactly this long
    sink: Path | None  # a local file to write, or None to keep the bytes in memory


def download(location: S3Location, items: list[Download]) -> dict[str, tuple[str, bytes | None]]:
    """Fetch every object in ranged parts, in parallel; returns {name: (sha256, its bytes or None)}.

    The worker threads write each part to its file at its offset; this thread hashes the parts in order
    as they arrive (and joins those of an object kept in memory), at most WINDOW parts behind the newest
    request. An object whose length differs from the manifest's size is an error naming it.
    """
    s3 = client()
    results: dict[str, tuple[str, bytes | None]] = {}
    pending: deque[tuple[Download, Future, bool]] = deque()  # (item, one part, whether it is the last)
    digests: dict[str, Any] = {}
    buffers: dict[str, list[bytes]] = {}  # name -> its parts so far, in order, for an object kept in memory
    files: dict[str, int] = {}  # name -> open file descriptor, closed once its last part is hashed

    def fetch(item: Download, key: str, offset: int, length: int) -> bytes:
        response = call(
            s3.get_object,
            location.uri(item.name),
            Bucket=location.bucket,
            Key=key,
            Range=f"bytes={offset}-{offset + length - 1}",
        )
        total = int(response["ContentRange"].rsplit("/", 1)[1])
        data = response["Body"].read()
        if total != item.size or len(data) != length:
            raise MoeloopError(
                f"object does not match its COMMIT (size {total}, the manifest says {item.size}):"
                f" {location.uri(item.name)}"
            )
        if item.sink is not None:
            os.pwrite(files[item.name], data, offset)
        return data

    def finish_oldest() -> None:
        item, future, last = pending.popleft()
        data = future.result()
        digests[item.name].update(data)
        if item.sink is None:
            buffers[item.name].append(data)
        if last:
            if item.name in files:
                os.close(files.pop(item.name))
            parts = buffers.pop(item.name, None)
            results[item.name] = (digests[item.name].hexdigest(), b"".join(parts) if parts is not None else None)

    try:
        for item in items:
            key = location.uri(item.name).removeprefix(f"s3://{location.bucket}/")
            digests[item.name] = hashlib.sha256()
            if item.sink is None:
                buffers[item.name] = []
            else:
                item.sink.parent.mkdir(parents=True, exist_ok=True)
                files[item.name] = os.open(item.sink, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            if item.size == 0:
                check_empty(location, key, item)
                pending.append((item, completed(b""), True))
                continue
            step = part_size(item.size)
            offsets = range(0, item.size, step)
            for offset in offsets:
                while len(pending) >= WINDOW:
                    finish_oldest()
                future = pool().submit(fetch, item, key, offset, min(step, item.size - offset))
                pending.append((item, future, offset == offsets[-1]))
        while pending:
            finish_oldest()
    except S3_ERRORS as error:
        raise translated(error, location.uri()) from None
    finally:
        for _, future, _ in pending:
            future.cancel()
        for _, future, _ in pending:
            if not future.cancelled():
                future.exception()  # a part still running must end before its file is closed
        for fd in files.values():
            os.close(fd)
    return results


def check_empty(location: S3Location, key: str, item: Download) -> None:
    size = call(client().head_object, location.uri(item.name), Bucket=location.bucket, Key=key)["ContentLength"]
    if size != 0:
        raise MoeloopError(
            f"object does not match its COMMIT (size {size}, the manifest says 0): {location.uri(item.name)}"
        )


def completed(value: bytes) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def probe(location: S3Location) -> None:
    """One cheap request that fails with the bucket's real problem: missing, credentials, access, endpoint."""
    prefix = f"{location.key}/" if location.key else ""
    try:
        client().list_objects_v2(Bucket=location.bucket, Prefix=prefix, MaxKeys=1)
    except S3_ERRORS as error:
        raise translated(error, location.uri()) from None


def call(function: Callable[..., Any], uri: str, **kwargs: Any) -> Any:
    """One boto3 call whose failure becomes a one-line error naming uri."""
    try:
        return function(**kwargs)
    except S3_ERRORS as error:
        raise translated(error, uri) from None
