"""Blocking S3 calls of the S3 tier: uploads, markers, listings, deletes, and injected S3 faults.

Everything here runs in worker threads (``agents/s3/tier.py`` owns the executor); boto3 is imported
lazily, so an agent without an S3 target never loads it. The object layout and the commit marker
are the contract in ``contracts/s3layout.py``; botocore adds a CRC32 to every request that carries
data, so a byte changed in transit fails the request.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections.abc import Iterator
from typing import IO, Any

from hyperpod_sim.agents.retry import Backoff
from hyperpod_sim.contracts.policy import S3Fault
from hyperpod_sim.contracts.s3layout import CHECKSUM_META, ShardObject, step_of_key
from hyperpod_sim.contracts.shards import checksum_of

log = logging.getLogger(__name__)

# Parts of a multipart upload: 8 and 16 MiB parts uploaded to moto equally fast, 32 MiB ones
# about 25 % slower (bench/s3_tier.py, part-size sweep); to SeaweedFS (serve's embedded S3) 8, 16,
# 32 and 64 MiB parts with 4 threads, and 16 MiB with 8, were within the noise of each other: it
# spends ~8 ms of CPU per MiB stored whatever the part size, ~5x what this side does. Four parts in
# flight per shard: the uploads run inside the agent, beside the saves it answers, and more
# threads only compete with those for the CPU (S3 on loopback is CPU-bound, not latency-bound).
PART_BYTES = 16 * 1024 * 1024
PART_THREADS = 4
UPLOAD_ATTEMPTS = 3


class S3Faults:
    """S3 faults the control plane injects (the node policy's ``faults.s3``; hyperpod_sim/domain/faults.py),
    applied to every request of this agent's S3 clients by a botocore ``before-send`` handler: it
    sleeps for the latency, and for errors and outages answers in S3's place with a 503 SlowDown,
    500 InternalError or 503 ServiceUnavailable and S3's XML error body. botocore then handles the
    answer as a real one: its retries, backoff and retry quota all run as they would against S3.
    A fault past its ``until`` (epoch seconds) is ignored, even before the control plane's next
    policy says it is over."""

    def __init__(self) -> None:
        self.fault: S3Fault | None = None
        self.injected_total = 0  # requests answered with an injected error

    def set(self, fault: S3Fault | None) -> None:
        self.fault = fault

    def active(self) -> S3Fault | None:
        fault = self.fault
        if fault is None or (fault.until is not None and time.time() >= fault.until):
            return None
        return fault

    def before_send(self, request: Any, **kwargs: Any) -> Any:
        fault = self.active()
        if fault is None:
            return None
        if fault.latency_ms is not None and fault.latency_ms > 0:
            time.sleep(fault.latency_ms / 1000)
        if fault.outage:
            return self._answer(request, 503, "ServiceUnavailable", "injected S3 outage")
        if fault.error_rate is not None and random.random() < fault.error_rate:
            if fault.error_kind == "InternalError":
                return self._answer(request, 500, "InternalError", "injected S3 error")
            return self._answer(request, 503, "SlowDown", "injected S3 throttling")
        return None

    def _answer(self, request: Any, status: int, code: str, message: str) -> Any:
        from botocore.awsrequest import AWSResponse

        self.injected_total += 1
        body = (
            b""
            if request.method == "HEAD"
            else (
                f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}'
                f"</Message><RequestId>hpsim-fault</RequestId></Error>"
            ).encode()
        )
        headers = {"Content-Type": "application/xml", "Content-Length": str(len(body))}
        return AWSResponse(request.url, status, headers, _Raw(body))


class _Raw:
    """The body of a synthetic answer, as botocore reads an urllib3 response's."""

    def __init__(self, body: bytes) -> None:
        self._body = body

    def stream(self, *args: Any, **kwargs: Any) -> Iterator[bytes]:
        yield self._body


class S3Unavailable(Exception):
    """An S3 call failed after botocore's own retries (the tier lags and tries again later)."""


class S3Objects:
    """One boto3 client for one endpoint and region, with the calls the tier needs.

    Throttling and 5xx answers are retried by botocore ("standard" mode: exponential backoff with
    jitter, 6 attempts); an upload is retried whole (from the first part) up to UPLOAD_ATTEMPTS
    times for what botocore does not retry, such as a connection dropped between parts.
    """

    def __init__(
        self,
        *,
        endpoint_url: str | None,
        region: str,
        max_attempts: int = 6,
        faults: S3Faults | None = None,
    ) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self._client = boto3.client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region,
            config=Config(
                retries={"max_attempts": max_attempts, "mode": "standard"},
                max_pool_connections=4 * PART_THREADS,
                connect_timeout=5,
                read_timeout=60,
                s3={"addressing_style": "path"} if endpoint_url else None,
            ),
        )
        if faults is not None:
            self._client.meta.events.register("before-send.s3", faults.before_send)
        self._transfer = TransferConfig(
            multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES, max_concurrency=PART_THREADS
        )
        self.retries_total = 0

    def close(self) -> None:
        self._client.close()

    def _error(self, what: str, exc: Exception) -> S3Unavailable:
        return S3Unavailable(f"{what}: {type(exc).__name__}: {exc}")

    def upload(self, key: str, body: IO[bytes], *, size: int, checksum: str, bucket: str) -> None:
        """Upload one shard (multipart above PART_BYTES) and check what S3 then holds. ``body``: an
        open file, not an in-memory stream: each attempt reads a duplicate of its descriptor (which
        shares its offset: one upload at a time per open file)."""
        from botocore.exceptions import BotoCoreError, ClientError

        last: Exception | None = None
        backoff = Backoff(initial_s=1.0, max_s=8.0, jitter=False)  # 1 s, then 2 s
        for attempt in range(UPLOAD_ATTEMPTS):
            if attempt:
                self.retries_total += 1
                time.sleep(backoff.next_delay())
            try:
                # Each attempt reads its own duplicate of the file: s3transfer closes the file
                # object it was given when an upload fails, and the next attempt must start over.
                with open(os.dup(body.fileno()), "rb") as attempt_body:
                    attempt_body.seek(0)
                    self._client.upload_fileobj(
                        attempt_body,
                        bucket,
                        key,
                        ExtraArgs={"Metadata": {CHECKSUM_META: checksum}},
                        Config=self._transfer,
                    )
                head = self.head(bucket, key)
            except (BotoCoreError, ClientError, S3Unavailable, OSError, ValueError) as exc:
                last = exc
                log.info("upload of %s failed (attempt %d): %s", key, attempt + 1, exc)
                continue
            if head == (size, checksum):
                return
            last = S3Unavailable(f"S3 holds {head} for {key} after the upload, not {(size, checksum)}")
        raise self._error(f"upload of {key} failed {UPLOAD_ATTEMPTS} times", last or Exception("?"))

    def head(self, bucket: str, key: str) -> tuple[int, str | None] | None:
        """(size, xxh3 checksum from the object's metadata) or None if there is no such object."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            answer = self._client.head_object(Bucket=bucket, Key=key)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise self._error(f"HEAD {key}", exc) from exc
        except BotoCoreError as exc:
            raise self._error(f"HEAD {key}", exc) from exc
        return int(answer["ContentLength"]), answer.get("Metadata", {}).get(CHECKSUM_META)

    def put_json(self, bucket: str, key: str, doc: dict[str, Any]) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._client.put_object(
                Bucket=bucket, Key=key, Body=json.dumps(doc).encode(), ContentType="application/json"
            )
        except (BotoCoreError, ClientError) as exc:
            raise self._error(f"PUT {key}", exc) from exc

    def get(self, bucket: str, key: str) -> bytes | None:
        """An object's bytes, or None if it does not exist."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            answer = self._client.get_object(Bucket=bucket, Key=key)
            return bytes(answer["Body"].read())
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise self._error(f"GET {key}", exc) from exc
        except (BotoCoreError, OSError) as exc:
            raise self._error(f"GET {key}", exc) from exc

    def get_verified(self, bucket: str, shard: ShardObject) -> bytes | None:
        """A shard's bytes if they match the marker's size and checksum; None if absent or not."""
        data = self.get(bucket, shard.key)
        if data is None:
            return None
        if len(data) != shard.size or checksum_of(data) != shard.checksum:
            log.error("S3 object %s does not match its commit marker; not served", shard.key)
            return None
        return data

    def keys(self, bucket: str, prefix: str) -> Iterator[str]:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
                for item in page.get("Contents", []):
                    yield str(item["Key"])
        except (BotoCoreError, ClientError) as exc:
            raise self._error(f"LIST {prefix}", exc) from exc

    def delete(self, bucket: str, keys: list[str]) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        for start in range(0, len(keys), 1000):
            batch = keys[start : start + 1000]
            try:
                self._client.delete_objects(
                    Bucket=bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
                )
            except (BotoCoreError, ClientError) as exc:
                raise self._error(f"DELETE {len(batch)} objects", exc) from exc

    def abort_uploads(self, bucket: str, prefix: str, *, steps: set[int]) -> int:
        """Abort the unfinished multipart uploads under ``prefix`` of the given steps."""
        from botocore.exceptions import BotoCoreError, ClientError

        aborted = 0
        try:
            pages = self._client.get_paginator("list_multipart_uploads").paginate(
                Bucket=bucket, Prefix=prefix
            )
            for page in pages:
                for upload in page.get("Uploads", []):
                    if step_of_key(upload["Key"]) in steps:
                        self._client.abort_multipart_upload(
                            Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                        )
                        aborted += 1
        except (BotoCoreError, ClientError) as exc:
            raise self._error(f"multipart cleanup under {prefix}", exc) from exc
        return aborted
