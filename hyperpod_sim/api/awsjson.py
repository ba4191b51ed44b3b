"""The AWS JSON 1.1 entry: ``POST /`` with ``X-Amz-Target: SageMaker.<Operation>``.

A plain ASGI layer in front of the FastAPI app. The hottest path of the service (every boto3 call)
skips FastAPI's routing and dependency resolution: measured with bench/control_plane.py, this
layer cut the server's CPU per DescribeCluster by about a third. Everything else falls through to
the FastAPI app. The OpenAPI document describes this entry (hyperpod_sim/api/openapi.py).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from hyperpod_sim.api.deps import AMZ_JSON, as_aws_error, parse_json
from hyperpod_sim.api.gate import whole_body
from hyperpod_sim.api.registry import dispatch
from hyperpod_sim.domain.errors import AwsError, UnknownOperationException

TARGET_PREFIX = "SageMaker."


class AwsJsonEntry:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        target = ""
        for key, value in scope["headers"]:
            if key == b"x-amz-target":
                target = value.decode("latin-1")
                break
        status, payload, error_code = await self._handle(scope, target, await whole_body(receive))
        headers = [
            (b"content-type", AMZ_JSON.encode()),
            (b"content-length", str(len(payload)).encode()),
            (b"x-amzn-requestid", str(uuid.uuid4()).encode()),
        ]
        if error_code:
            headers.append((b"x-amzn-errortype", error_code.encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})

    async def _handle(self, scope: Scope, target: str, raw: bytes) -> tuple[int, bytes, str | None]:
        try:
            if not target.startswith(TARGET_PREFIX):
                raise UnknownOperationException(
                    f"Missing or unknown X-Amz-Target '{target}'; expected 'SageMaker.<Operation>'."
                )
            body: Any = parse_json(raw)
            services = scope["app"].state.services
            operation = target[len(TARGET_PREFIX) :]
            result = await run_in_threadpool(dispatch, services, operation, body)
        except Exception as exc:  # every failure leaves in the AWS shape
            error: AwsError = as_aws_error(exc)
            return error.status, json.dumps(error.to_body()).encode(), error.code
        return 200, json.dumps(result).encode(), None
