"""A trainer's own read of a committed step's shard straight from S3, for when no agent has a good
copy (``TieredCheckpointConfig.s3_tier_base_path``).

The layout and the commit marker are the agents' (``contracts/s3layout.py``): a shard is read only
if its step has a marker, and used only if its size and checksum match what the marker lists. A
step with no marker that the trainer wrote through the library itself (``save_to_s3=True``) is
read when it is complete as the library decides (``s3layout.trainer_steps``, either layout); its objects carry
no checksum, so what guards them is the reader's allow-list decoding (``sdk/library_format.py``).
The endpoint and credentials come from the boto3 chain (``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from hyperpod_sim.contracts.s3layout import DEFAULT_REGION, CommitMarker, S3Target, trainer_steps
from hyperpod_sim.contracts.shards import checksum_of

log = logging.getLogger(__name__)

_ABSENT = ("404", "NoSuchKey", "NotFound")


def read_shard(
    base_uri: str,
    namespace: str,
    rank: int,
    step: int,
    *,
    world_size: int | None = None,
    checksum: str | None = None,
) -> bytes | None:
    """Rank ``rank``'s shard of ``step``, checked against the step's commit marker; None if there
    is no marker, it lists no such rank, or the object does not match it. Without a marker, with
    ``world_size`` (the job's ranks; the metadata is rank ``world_size``), the shard of a step the
    trainer wrote complete through the library; None if it is not complete. ``checksum``: only
    the shard with that checksum (the one the step's committed metadata names); None if S3 holds
    another save's. botocore's exceptions if S3 cannot be read (after its own retries)."""
    import boto3
    from botocore.config import Config

    target = S3Target.from_uri(base_uri)
    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=os.environ.get("AWS_DEFAULT_REGION", DEFAULT_REGION),
        config=Config(
            retries={"max_attempts": 6, "mode": "standard"},
            connect_timeout=5,
            read_timeout=60,
            s3={"addressing_style": "path"} if endpoint else None,
        ),
    )
    try:
        raw = _get(client, target.bucket, target.marker_key(namespace, step))
        if raw is None:
            written = _trainer_written(client, target, namespace, rank, step, world_size)
            return None if written is None or checksum not in (None, checksum_of(written)) else written
        shard = CommitMarker.shard_of(raw, rank)
        if shard is None or (checksum is not None and shard.checksum != checksum):
            return None
        data = _get(client, target.bucket, shard.key)
        if data is None:
            return None
        if len(data) != shard.size or checksum_of(data) != shard.checksum:
            log.error("S3 object %s does not match its commit marker; not used", shard.key)
            return None
        return data
    finally:
        client.close()


def _trainer_written(
    client: Any, target: S3Target, namespace: str, rank: int, step: int, world_size: int | None
) -> bytes | None:
    """A shard of a step the library wrote itself, if the step is complete on S3."""
    if world_size is None or not 0 <= rank <= world_size:
        return None
    prefix = target.namespace_prefix(namespace)
    keys = (
        str(item["Key"])
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=target.bucket, Prefix=prefix)
        for item in page.get("Contents", [])
    )
    layout = trainer_steps(keys, prefix, world_size).get(step)
    if layout is None:
        return None
    return _get(client, target.bucket, target.shard_key(namespace, rank, step, world_size + 1, layout=layout))


def _get(client: Any, bucket: str, key: str) -> bytes | None:
    """An object's bytes, or None if it does not exist."""
    from botocore.exceptions import ClientError

    try:
        answer = client.get_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in _ABSENT:
            return None
        raise
    return bytes(answer["Body"].read())
