"""Who is calling: SigV4 signatures and bearer tokens checked against the configured access keys
(``HPSIM_AUTH__CREDENTIALS``, ``HPSIM_AUTH__ADMIN_CREDENTIALS``; docs/security.md).

The expected signature is computed by botocore's own SigV4 signer over the request as it arrived
(method, raw path, raw query, the headers the client listed as signed, the body), so what boto3 and
the AWS CLI sign is what is checked, byte for byte. Refusals are AWS's: ``MissingAuthenticationToken``
(no credentials), ``IncompleteSignature`` (a malformed Authorization header),
``UnrecognizedClientException`` (an unknown access key id or bearer token),
``InvalidSignatureException`` (a wrong signature, a body that does not match its hash, or a date
more than 5 minutes away from the server's clock).

What must be signed: ``host`` always and, on the AWS JSON entry (``POST /``), ``content-type`` and
``x-amz-target`` too, as AWS requires: the target names the operation, so a signature that leaves
it out would let a captured DescribeCluster be resent as a DeleteCluster. boto3 and the AWS CLI
sign every header they send, these included.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest, HTTPHeaders
from botocore.credentials import Credentials

from hyperpod_sim.domain.errors import (
    IncompleteSignature,
    InvalidSignatureException,
    MissingAuthenticationToken,
    UnrecognizedClientException,
)
from hyperpod_sim.sdk.auth import BEARER_PREFIX, SERVICE, bearer_token
from hyperpod_sim.settings import AuthSettings

SIGV4 = "AWS4-HMAC-SHA256"
MAX_SKEW_S = 300  # AWS's 5 minutes
_AMZ_DATE = re.compile(r"^\d{8}T\d{6}Z$")
_ECHO_LIMIT = 200
# The headers an AWS JSON call must sign besides host: the operation and the body's media type.
AWS_JSON_SIGNED = (("content-type", "Content-Type"), ("x-amz-target", "X-Amz-Target"))
_INVALID_TOKEN = "The security token included in the request is invalid."
_BAD_SIGNATURE = (
    "The request signature we calculated does not match the signature you provided. Check your AWS "
    "Secret Access Key and signing method. Consult the service documentation for details."
)


@dataclass(frozen=True)
class Principal:
    """The authenticated caller."""

    access_key_id: str
    admin: bool
    method: str  # "sigv4" or "bearer"


@dataclass(frozen=True)
class IncomingRequest:
    """A request as it arrived, before any routing."""

    method: str
    raw_path: str
    query_string: str
    headers: list[tuple[str, str]]  # lower-case names, in order
    body: bytes
    aws_json: bool = False  # the AWS JSON entry (POST /): its operation is the X-Amz-Target header

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None


def _echo(value: str) -> str:
    return value if len(value) <= _ECHO_LIMIT else value[: _ECHO_LIMIT - 3] + "..."


def _amz_time(moment: float) -> str:
    return datetime.fromtimestamp(moment, tz=UTC).strftime("%Y%m%dT%H%M%SZ")


class _ExpectedSignature(SigV4Auth):  # type: ignore[misc]
    """botocore's signer, restricted to the headers the client says it signed."""

    def __init__(self, credentials: Credentials, region: str, signed: list[str]) -> None:
        super().__init__(credentials, SERVICE, region)
        self._signed = signed

    def headers_to_sign(self, request: AWSRequest) -> HTTPHeaders:
        chosen = HTTPHeaders()
        for name in self._signed:
            for value in request.headers.get_all(name) or []:
                chosen[name] = value
        return chosen


class Authenticator:
    def __init__(self, settings: AuthSettings, *, now: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.now = now

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    def authenticate(self, request: IncomingRequest) -> Principal:
        header = request.header("authorization")
        if header is None or not header.strip():
            raise MissingAuthenticationToken(
                "The request must contain either a valid (registered) AWS access key ID or X.509 certificate."
            )
        scheme, _, rest = header.strip().partition(" ")
        if scheme == SIGV4:
            return self._sigv4(request, header, rest)
        if scheme.lower() == "bearer":
            return self._bearer(rest.strip())
        raise IncompleteSignature(
            f"Unsupported Authorization type '{_echo(scheme)}': sign the request with SigV4 "
            f"({SIGV4}) or send a bearer token (Authorization: Bearer ...)."
        )

    # ------------------------------------------------------------------ bearer tokens

    def _bearer(self, token: str) -> Principal:
        prefix, _, rest = token.partition(".")
        access_key_id, _, _mac = rest.rpartition(".")
        found = self.settings.secret_for(access_key_id) if prefix == BEARER_PREFIX and access_key_id else None
        if found is None:
            raise UnrecognizedClientException(_INVALID_TOKEN)
        secret, admin = found
        if not hmac.compare_digest(bearer_token(access_key_id, secret).encode(), token.encode()):
            raise UnrecognizedClientException(_INVALID_TOKEN)
        return Principal(access_key_id, admin, "bearer")

    # ------------------------------------------------------------------ SigV4

    def _sigv4(self, request: IncomingRequest, header: str, rest: str) -> Principal:
        params: dict[str, str] = {}
        for part in rest.split(","):
            key, sep, value = part.strip().partition("=")
            if sep:
                params[key] = value
        missing = [name for name in ("Credential", "Signature", "SignedHeaders") if not params.get(name)]
        if missing:
            raise IncompleteSignature(
                " ".join(f"Authorization header requires '{name}' parameter." for name in missing)
                + f" Authorization={_echo(header)}"
            )
        scope = params["Credential"].split("/")
        if len(scope) != 5:
            raise IncompleteSignature(
                "Credential must have exactly 5 slash-delimited elements, e.g. "
                f"keyid/date/region/service/term, got '{_echo(params['Credential'])}'"
            )
        access_key_id, scope_date, region, service, terminator = scope
        signed = params["SignedHeaders"].split(";")
        if "host" not in signed:
            raise IncompleteSignature(
                "'Host' or ':authority' must be a 'SignedHeader' in the AWS Authorization."
            )
        unsigned = [shown for name, shown in AWS_JSON_SIGNED if request.aws_json and name not in signed]
        if unsigned:
            raise IncompleteSignature(
                " ".join(f"'{name}' must be a 'SignedHeader' in the AWS Authorization." for name in unsigned)
            )
        amz_date = request.header("x-amz-date")
        if amz_date is None:
            raise IncompleteSignature(
                "Authorization header requires existence of a 'X-Amz-Date' header. "
                f"Authorization={_echo(header)}"
            )
        if not _AMZ_DATE.match(amz_date):
            raise IncompleteSignature(
                f"Date must be in ISO-8601 'basic format'. Got '{_echo(amz_date)}'. "
                "See http://en.wikipedia.org/wiki/ISO_8601"
            )
        if terminator != "aws4_request":
            raise IncompleteSignature(
                "Credential should be scoped with a valid terminator: 'aws4_request', "
                f"not '{_echo(terminator)}'."
            )
        found = self.settings.secret_for(access_key_id)
        if found is None:
            raise UnrecognizedClientException(_INVALID_TOKEN)
        secret, admin = found
        self._check_time(amz_date)
        if service != SERVICE:
            raise InvalidSignatureException(f"Credential should be scoped to correct service: '{SERVICE}'. ")
        if scope_date != amz_date[:8]:
            raise InvalidSignatureException(
                f"Credential should be scoped to a valid date: '{amz_date[:8]}', not '{_echo(scope_date)}'."
            )
        content_hash = request.header("x-amz-content-sha256")
        if content_hash is not None and content_hash != hashlib.sha256(request.body).hexdigest():
            raise InvalidSignatureException(
                "The provided 'x-amz-content-sha256' header does not match what was computed."
            )
        expected = self._expected(request, Credentials(access_key_id, secret), region, signed, amz_date)
        if not hmac.compare_digest(expected.encode(), params["Signature"].encode()):
            raise InvalidSignatureException(_BAD_SIGNATURE)
        return Principal(access_key_id, admin, "sigv4")

    def _check_time(self, amz_date: str) -> None:
        try:
            signed_at = datetime.strptime(amz_date, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC).timestamp()
        except ValueError:
            raise IncompleteSignature(
                f"Date must be in ISO-8601 'basic format'. Got '{amz_date}'. "
                "See http://en.wikipedia.org/wiki/ISO_8601"
            ) from None
        now = self.now()
        if signed_at < now - MAX_SKEW_S:
            raise InvalidSignatureException(
                f"Signature expired: {amz_date} is now earlier than {_amz_time(now - MAX_SKEW_S)} "
                f"({_amz_time(now)} - 5 min.)"
            )
        if signed_at > now + MAX_SKEW_S:
            raise InvalidSignatureException(
                f"Signature not yet current: {amz_date} is still later than {_amz_time(now + MAX_SKEW_S)} "
                f"({_amz_time(now)} + 5 min.)"
            )

    @staticmethod
    def _expected(
        request: IncomingRequest, credentials: Credentials, region: str, signed: Iterable[str], amz_date: str
    ) -> str:
        headers = HTTPHeaders()
        for name, value in request.headers:
            headers[name] = value
        host = request.header("host") or "localhost"
        query = f"?{request.query_string}" if request.query_string else ""
        # http: botocore then always hashes the body into the canonical request.
        aws_request = AWSRequest(
            method=request.method, url=f"http://{host}{request.raw_path}{query}", data=request.body
        )
        aws_request.headers = headers
        aws_request.context["timestamp"] = amz_date
        signer = _ExpectedSignature(credentials, region, list(signed))
        canonical = signer.canonical_request(aws_request)
        signature: str = signer.signature(signer.string_to_sign(aws_request, canonical), aws_request)
        return signature
