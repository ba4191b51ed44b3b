"""The one gate every HTTP request passes before any route: the body limit, authentication, the JSON
nesting limit (docs/security.md#the-control-plane).

A plain ASGI layer, outermost of the app's own layers, so that every route (the AWS JSON entry, the
REST routes, and any route added later) is covered without code of its own:

1. The body is read up to ``limits.max_body_bytes`` and no further: a ``Content-Length`` over it, or
   a chunked body that grows past it, is refused with 413 ``SerializationException`` at once.
2. With credentials configured (``HPSIM_AUTH__*``), every path but the agents' ``/agent/v1/*``
   (they authenticate with cluster tokens), ``/health`` and the API documentation needs a SigV4
   signature or a bearer token (hyperpod_sim/api/auth.py). The caller is put in the request's state as
   ``principal``; routes that need an admin read it (``api.deps.AdminDep``).
3. A body whose JSON nests deeper than ``limits.max_json_depth`` is refused with 400
   ``SerializationException`` before anything parses it.

The buffered body is then handed to the app as if it came from the socket.
"""

from __future__ import annotations

import json
import logging
import operator
import re
import uuid
from array import array
from itertools import accumulate
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hyperpod_sim.api.auth import Authenticator, IncomingRequest, Principal
from hyperpod_sim.domain.errors import (
    AwsError,
    InvalidSignatureException,
    MissingAuthenticationToken,
    PayloadTooLarge,
    SerializationException,
    UnrecognizedClientException,
)

log = logging.getLogger(__name__)

AMZ_JSON = "application/x-amz-json-1.1"
OPEN_PATHS = frozenset({"/health", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
AGENT_PREFIX = "/agent/"
# The web console's static files and the root page (hyperpod_sim/api/console_routes.py): no data, like /docs.
CONSOLE_PAGES = ("/", "/console")
# The documentation pages' own files (hyperpod_sim/api/docs_routes.py): no data either.
DOCS_ASSETS = "/docs/assets/"
# REST answers a missing or refused credential 401 (with a WWW-Authenticate challenge); the AWS JSON
# entry answers with AWS's own statuses.
_REST_UNAUTHORIZED = (MissingAuthenticationToken, UnrecognizedClientException, InvalidSignatureException)
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# Brackets to +1 / -1 (as signed bytes); every other byte deleted.
_STEPS = (bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff"), bytes(b for b in range(256) if b not in b"[]{}"))


def json_depth(raw: bytes) -> int:
    """How deep the arrays and objects of a JSON text nest (0 for a scalar), without parsing it:
    strings are dropped, the brackets turned into +1/-1 steps, and the deepest running sum taken.
    Every step runs in C: about 30 ms for a megabyte of nothing but brackets."""
    steps = array("b", _STRING.sub(b"", raw).translate(*_STEPS))
    return max(accumulate(steps, operator.add), default=0)


class RequestGate:
    def __init__(
        self, app: ASGIApp, *, authenticator: Authenticator, max_body_bytes: int, max_json_depth: int
    ) -> None:
        self.app = app
        self.authenticator = authenticator
        self.max_body_bytes = max_body_bytes
        self.max_json_depth = max_json_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        aws_json = path == "/" and scope["method"] == "POST"
        try:
            body = await self._read_body(scope, receive)
            principal = self._authenticate(scope, body)
            if body and json_depth(body) > self.max_json_depth:
                raise SerializationException(
                    f"The request body nests JSON deeper than {self.max_json_depth} levels."
                )
        except AwsError as error:
            client = scope.get("client") or ("?", 0)
            log.info("refused %s %s from %s: %s", scope["method"], path, client[0], error.code)
            await self._refuse(scope, send, error, aws_json=aws_json)
            return
        if principal is not None:
            scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, replay(body, receive), send)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.max_body_bytes
        for key, value in scope["headers"]:
            if key == b"content-length":
                if not value.isdigit() or len(value) > 19:
                    raise SerializationException("The Content-Length header is not a decimal byte count.")
                if int(value) > limit:
                    raise self._too_large(int(value))
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise self._too_large(None)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)

    def _too_large(self, size: int | None) -> PayloadTooLarge:
        told = f"is {size} bytes," if size is not None else "is"
        return PayloadTooLarge(
            f"The request body {told} over the limit of {self.max_body_bytes} bytes "
            "(HPSIM_LIMITS__MAX_BODY_BYTES)."
        )

    def _authenticate(self, scope: Scope, body: bytes) -> Principal | None:
        if not self.authenticator.enabled:
            return None
        path: str = scope["path"]
        if path in OPEN_PATHS or path.startswith(AGENT_PREFIX):
            return None
        if scope["method"] in ("GET", "HEAD") and (
            path in CONSOLE_PAGES or path.startswith(("/console/", DOCS_ASSETS))
        ):
            return None
        headers = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope["headers"]]
        request = IncomingRequest(
            method=scope["method"],
            raw_path=scope.get("raw_path", path.encode()).decode("latin-1"),
            query_string=scope.get("query_string", b"").decode("latin-1"),
            headers=headers,
            body=body,
            aws_json=path == "/" and scope["method"] == "POST",
        )
        return self.authenticator.authenticate(request)

    async def _refuse(self, scope: Scope, send: Send, error: AwsError, *, aws_json: bool) -> None:
        from hyperpod_sim.api.rest import status_for

        headers: list[tuple[bytes, bytes]] = [
            (b"x-amzn-requestid", str(uuid.uuid4()).encode()),
            (b"x-amzn-errortype", error.code.encode()),
        ]
        body: dict[str, Any]
        if scope["path"].startswith(AGENT_PREFIX):  # the agent protocol's own error shape
            status = error.status
            body = {"error": "InvalidRequest", "message": error.message}
            media_type = "application/json"
        elif aws_json:
            status, body, media_type = error.status, error.to_body(), AMZ_JSON
        else:
            status, body, media_type = status_for(error), error.to_body(), "application/json"
            if isinstance(error, _REST_UNAUTHORIZED):
                status = 401
                headers.append((b"www-authenticate", b'Bearer realm="hyperpod-sim", AWS4-HMAC-SHA256'))
        payload = json.dumps(body).encode()
        headers += [(b"content-type", media_type.encode()), (b"content-length", str(len(payload)).encode())]
        # Whatever of the body is still unread stays unread: the server closes the connection.
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the app behind a layer that read the body: that body, then what comes after."""
    replayed = False

    async def receive_again() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return receive_again


async def whole_body(receive: Receive) -> bytes:
    """The request body, every chunk of it (the gate has bounded its size already)."""
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)
