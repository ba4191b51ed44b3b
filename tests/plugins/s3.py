"""Fixtures of the tests of the agents' S3 tier: moto's S3 server (one a module), the proxy that
injects S3 faults in front of it, a client of it and a fresh bucket, and the agent settings that
send the agents' S3 through the proxy (a module overrides ``agent_settings`` with them)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from moto.server import ThreadedMotoServer

from tests.conftest import free_port
from tests.s3_checkpoints import s3_through_proxy
from tests.s3proxy import FaultyS3Proxy


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture
def proxy(moto_url: str) -> Iterator[FaultyS3Proxy]:
    with FaultyS3Proxy(moto_url) as running:
        yield running


@pytest.fixture
def s3(moto_url: str) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=moto_url,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


@pytest.fixture
def bucket(s3: Any) -> str:
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_agent_settings(proxy: FaultyS3Proxy, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Agent settings whose S3 goes through ``proxy``, with dummy credentials: a module's
    ``agent_settings`` returns them (conftest's own is the default for every module)."""
    return s3_through_proxy(proxy, monkeypatch)
