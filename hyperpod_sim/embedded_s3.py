"""The embedded S3 endpoint of ``hyperpod-sim serve``: moto's S3 server on a loopback port.

It is there so that a checkpoint policy with ``S3BaseUri: s3://hpsim-checkpoints/...`` works
with nothing else installed or running. It is **not durable**: moto keeps every object in the
memory of this process, so whatever the agents persisted is gone when serve stops. To keep
checkpoints, point ``HPSIM_S3__ENDPOINT_URL`` at MinIO or S3 instead.

moto is imported here, when the server starts, and nowhere else: it is a server-only dependency
(the ``server`` extra), and importing it costs a second that a serve without it need not pay.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from hyperpod_sim.settings import S3Settings

# moto checks no signatures, but botocore will not send a request without credentials.
DUMMY_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


def agent_credentials(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The credentials the agents of an embedded endpoint need in their environment: the dummy
    ones, unless the control plane's own environment names credentials (then the agents inherit
    those, and a partial pair is not completed behind the user's back)."""
    environ = os.environ if environ is None else environ
    if any(name in environ for name in DUMMY_CREDENTIALS):
        return {}
    return dict(DUMMY_CREDENTIALS)


@dataclass
class EmbeddedS3:
    """A running embedded S3 server; stop it with :meth:`stop` (or use it as a context manager)."""

    endpoint_url: str
    bucket: str
    _server: Any

    def agent_env(self) -> dict[str, str]:
        """Environment variables the agents need to reach this endpoint (see agent_credentials)."""
        return agent_credentials()

    def stop(self) -> None:
        self._server.stop()

    def __enter__(self) -> EmbeddedS3:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def start_embedded_s3(settings: S3Settings, *, host: str = "127.0.0.1", port: int = 0) -> EmbeddedS3:
    """Start moto's S3 server on ``host:port`` (0: a free port) and create ``settings.bucket`` in it.

    ``settings.endpoint_url`` is not read or changed: the caller decides whether the embedded
    server is wanted and makes its ``endpoint_url`` the effective one. moto's state is global to
    the process, so two servers in one process (tests) share their buckets; creating the bucket
    again is then a no-op.
    """
    import boto3
    from botocore.config import Config
    from moto.server import ThreadedMotoServer

    # werkzeug logs every request at INFO on a handler of its own unless its logger has a level.
    werkzeug_log = logging.getLogger("werkzeug")
    if werkzeug_log.level == logging.NOTSET:
        werkzeug_log.setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address=host, port=port, verbose=False)
    server.start()
    bound_host, bound_port = server.get_host_and_port()
    endpoint_url = f"http://{bound_host}:{bound_port}"
    try:
        client = boto3.client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=settings.region,
            aws_access_key_id=DUMMY_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=DUMMY_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2}),
        )
        create: dict[str, Any] = {"Bucket": settings.bucket}
        if settings.region != "us-east-1":  # us-east-1 takes no location constraint
            create["CreateBucketConfiguration"] = {"LocationConstraint": settings.region}
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(**create)
    except BaseException:
        server.stop()
        raise
    return EmbeddedS3(endpoint_url=endpoint_url, bucket=settings.bucket, _server=server)
