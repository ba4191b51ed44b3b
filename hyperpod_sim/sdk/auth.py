"""Credentials for the control plane (docs/security.md#the-control-plane), shared by the SDK and the
server: the bearer token derived from an access key, and SigV4 signing of plain HTTP requests.

The control plane accepts, on every route but the agents' ``/agent/v1/*`` and ``/health``, either a
SigV4 signature made with one of its configured access keys (what boto3 and the AWS CLI send), or
that access key's bearer token::

    Authorization: Bearer hpsim1.<access key id>.<mac>
    mac = base64url(HMAC-SHA256(secret, "hyperpod-sim bearer v1:" + access key id)), unpadded

The token is derived, not stored: anyone holding the secret can compute it (:func:`bearer_token`,
``hyperpod-sim auth-token``), the server recomputes it to check it, and rotating the secret revokes
it. It does not reveal the secret, but it is a credential of its own: it does not expire and it is
not bound to one request, so send it over loopback or TLS only.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Generator
from dataclasses import dataclass

import httpx

BEARER_PREFIX = "hpsim1"
_BEARER_CONTEXT = b"hyperpod-sim bearer v1:"
SERVICE = "sagemaker"


def bearer_token(access_key_id: str, secret_access_key: str) -> str:
    """The bearer token of an access key (see the module's docstring)."""
    mac = hmac.new(
        secret_access_key.encode(), _BEARER_CONTEXT + access_key_id.encode(), hashlib.sha256
    ).digest()
    return f"{BEARER_PREFIX}.{access_key_id}.{base64.urlsafe_b64encode(mac).decode().rstrip('=')}"


@dataclass(frozen=True)
class AccessKey:
    access_key_id: str
    secret_access_key: str
    session_token: str | None = None


def resolve_access_key(
    *,
    access_key_id: str | None = None,
    secret_access_key: str | None = None,
    profile: str | None = None,
) -> AccessKey | None:
    """The explicit key if given, else the usual boto3 chain (``AWS_ACCESS_KEY_ID`` /
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE`` or ``profile``, the shared files, SSO, assumed
    roles) but for the EC2 instance metadata service, which a simulator's client has no use for
    and which costs seconds of timeouts where there is none; None when there is none."""
    if access_key_id and secret_access_key:
        return AccessKey(access_key_id, secret_access_key)
    import botocore.session
    from botocore.credentials import create_credential_resolver

    session = botocore.session.Session(profile=profile)
    resolver = create_credential_resolver(session)
    resolver.remove("iam-role")
    found = resolver.load_credentials()
    if found is None:
        return None
    frozen = found.get_frozen_credentials()
    if not frozen.access_key or not frozen.secret_key:
        return None
    return AccessKey(frozen.access_key, frozen.secret_key, frozen.token)


class SigV4Auth(httpx.Auth):
    """httpx authentication that signs each request with SigV4 for ``sagemaker`` in ``region``,
    with botocore's own signer (the host, the date, the body, and the content type and
    ``X-Amz-Target`` when the request has them: the control plane refuses an AWS JSON call whose
    signature leaves either out)."""

    requires_request_body = True

    def __init__(self, key: AccessKey, region: str) -> None:
        self.key = key
        self.region = region

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        from botocore.auth import SigV4Auth as BotocoreSigV4
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials

        headers = {"host": request.headers["host"]}
        for name in ("content-type", "x-amz-target"):
            if name in request.headers:
                headers[name] = request.headers[name]
        signed = AWSRequest(
            method=request.method, url=str(request.url), data=request.content, headers=headers
        )
        credentials = Credentials(self.key.access_key_id, self.key.secret_access_key, self.key.session_token)
        BotocoreSigV4(credentials, SERVICE, self.region).add_auth(signed)
        for name in ("Authorization", "X-Amz-Date", "X-Amz-Security-Token"):
            if name in signed.headers:
                request.headers[name] = signed.headers[name]
        yield request


class BearerAuth(httpx.Auth):
    def __init__(self, token: str) -> None:
        self.token = token

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers["Authorization"] = f"Bearer {self.token}"
        yield request
