"""S3 for the storage backends: run URIs, the boto3 client, bulk transfers, and errors as one line.

Endpoint, region and credentials come only from botocore's standard chain: AWS_ENDPOINT_URL_S3 or
AWS_ENDPOINT_URL, AWS_REGION, the environment's keys, a profile, a web identity (IRSA), container
credentials (EKS Pod Identity) or the instance metadata. Nothing here takes a credential as an argument,
and no message built here contains one: errors name the object and the server's error code only.

Bulk transfers (checkpoint files, large Parquet objects) go through boto3 directly, because they need
what a single stream cannot give: a multipart upload whose parts go up in parallel, and ranged parts
fetched in parallel (steps/storage/run.py drives the reads through read_range). The commit protocol's digests
are per part (steps/storage/manifest.py), so each part is hashed by the worker thread that moves it, beside the
other parts' I/O.
"""

from __future__ import annotations

import os
import re
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import boto3
import botocore.config
import botocore.exceptions

from moeloop.steps.errors import MoeloopError
from moeloop.steps.storage.manifest import part_digest, part_offsets, part_size

WORKERS = 8
# Parts queued for the workers or not yet collected: keeps the workers busy while bounding the bookkeeping.
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


@dataclass(frozen=True)
class Uploaded:
    size: int
    part_size: int
    part_digests: list[bytes]  # part_digest of each part, in order


def upload(location: S3Location, sources: dict[str, Path | bytes]) -> dict[str, Uploaded]:
    """Put every source (a local file or bytes) at location/name, in parallel; returns each one's part digests.

    An object of one part is one PUT; a larger one is a multipart upload. Each part is read, hashed and sent
    by one worker thread (the hash releases the GIL, so hashing runs beside the other parts' I/O); at most
    WINDOW parts are queued, so at most WORKERS parts are in memory. On any failure the open multipart
    uploads are aborted, so no part is left behind.
    """
    s3 = client()
    in_flight: deque[Future] = deque()
    multiparts: list[tuple[str, str, str, list[Future]]] = []  # (key, uri, upload id, its parts)
    objects: dict[str, tuple[int, int, list[Future]]] = {}  # name -> (size, part size, its parts)

    def send(source: Path | bytes, offset: int, length: int, uri: str, **request: Any) -> tuple[bytes, str]:
        data = read_piece(source, offset, length, uri)
        digest = part_digest(data)
        operation = s3.upload_part if "UploadId" in request else s3.put_object
        return digest, call(operation, uri, Body=data, **request).get("ETag", "")

    try:
        for name, source in sources.items():
            uri = location.uri(name)
            request = {"Bucket": location.bucket, "Key": uri.removeprefix(f"s3://{location.bucket}/")}
            size = len(source) if isinstance(source, bytes) else source.stat().st_size
            step = part_size(size)
            if size > step:
                request["UploadId"] = call(s3.create_multipart_upload, uri, **request)["UploadId"]
            parts: list[Future] = []
            for number, offset in enumerate(part_offsets(size, step), start=1):
                while len(in_flight) >= WINDOW:
                    in_flight.popleft().result()
                numbered = {"PartNumber": number} if "UploadId" in request else {}
                future = pool().submit(send, source, offset, min(step, size - offset), uri, **request, **numbered)
                parts.append(future)
                in_flight.append(future)
            if "UploadId" in request:
                multiparts.append((request["Key"], uri, request["UploadId"], parts))
            objects[name] = (size, step, parts)
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
                    "Parts": [{"PartNumber": n, "ETag": f.result()[1]} for n, f in enumerate(parts, start=1)]
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
        for future in in_flight:
            future.cancel()
        for key, _, upload_id, parts in multiparts:
            for future in parts:
                if not future.cancelled():
                    future.exception()  # a part still being sent must end before its upload is aborted
            abort_multipart(location.bucket, key, upload_id)
    return {
        name: Uploaded(size, step, [future.result()[0] for future in parts])
        for name, (size, step, parts) in objects.items()
    }


def abort_multipart(bucket: str, key: str, upload_id: str) -> None:
    try:
        client().abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
    except S3_ERRORS:
        pass  # best effort: the bucket's lifecycle rule removes what is left (manifests/iam/README.md)


def read_piece(source: Path | bytes, offset: int, length: int, uri: str) -> bytes:
    """length bytes of source at offset: a file that changed size since it was measured is an error."""
    if isinstance(source, bytes):
        return source if length == len(source) else source[offset : offset + length]
    with open(source, "rb") as file:
        data = os.pread(file.fileno(), length, offset)
    if len(data) != length:
        raise MoeloopError(f"{source} changed while it was being uploaded to {uri}")
    return data


def read_range(location: S3Location, name: str, offset: int, length: int, size: int) -> bytes:
    """length bytes of location/name at offset, checking that the object is size bytes long in all."""
    uri = location.uri(name)
    request = {"Bucket": location.bucket, "Key": uri.removeprefix(f"s3://{location.bucket}/")}
    try:
        if length == 0:  # an empty object: no Range names zero bytes
            found, data = client().head_object(**request)["ContentLength"], b""
        else:
            response = client().get_object(**request, Range=f"bytes={offset}-{offset + length - 1}")
            found, data = int(response["ContentRange"].rsplit("/", 1)[1]), response["Body"].read()
    except S3_ERRORS as error:
        raise translated(error, uri) from None
    if found != size or len(data) != length:
        raise MoeloopError(f"object does not match its COMMIT (size {found}, the manifest says {size}): {uri}")
    return data


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
