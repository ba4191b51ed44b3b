"""AWS-shaped errors raised by the domain and the protocol layers.

One class per AWS error code. Each carries the code botocore looks up (``__type``), the message,
and the HTTP status the real service answers with. The API layer serializes them; nothing below
it builds HTTP responses.
"""

from __future__ import annotations


class AwsError(Exception):
    """Base of every error that reaches a client in the AWS shape."""

    code: str = "InternalFailure"
    status: int = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_body(self) -> dict[str, str]:
        return {"__type": self.code, "message": self.message}


class ValidationException(AwsError):
    code = "ValidationException"
    status = 400


class ResourceNotFound(AwsError):
    code = "ResourceNotFound"
    status = 400


class ResourceInUse(AwsError):
    code = "ResourceInUse"
    status = 400


class ConflictException(AwsError):
    code = "ConflictException"
    status = 400


class ResourceLimitExceeded(AwsError):
    code = "ResourceLimitExceeded"
    status = 400


class UnknownOperationException(AwsError):
    code = "UnknownOperationException"
    status = 400


class SerializationException(AwsError):
    code = "SerializationException"
    status = 400


class PayloadTooLarge(SerializationException):
    """A request body over the configured limit: AWS's code for a body it cannot take, with 413."""

    status = 413


class UnrecognizedClientException(AwsError):
    """An access key id (or bearer token) the service does not know."""

    code = "UnrecognizedClientException"
    status = 400


class InvalidSignatureException(AwsError):
    """A SigV4 signature that does not match, or a request date outside the 5-minute window."""

    code = "InvalidSignatureException"
    status = 400


class IncompleteSignature(AwsError):
    """An Authorization header that is not a well-formed SigV4 (or bearer) credential."""

    code = "IncompleteSignature"
    status = 400


class MissingAuthenticationToken(AwsError):
    """No credentials at all on a request that needs them."""

    code = "MissingAuthenticationToken"
    status = 403


class AccessDeniedException(AwsError):
    """Authenticated, but not allowed this action (faults need an admin credential)."""

    code = "AccessDeniedException"
    status = 403


class InternalFailure(AwsError):
    code = "InternalFailure"
    status = 500


class ServiceUnavailable(AwsError):
    code = "ServiceUnavailable"
    status = 503


ECHO_LIMIT = 200


def echo(value: object) -> str:
    """A value as an error message quotes it, cut to 200 characters ending in "..." so that a
    multi-megabyte value is never sent back whole."""
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= ECHO_LIMIT else text[: ECHO_LIMIT - 3] + "..."


def validation_error(errors: list[str]) -> ValidationException:
    """Build one ValidationException from constraint messages, in AWS's phrasing."""
    count = len(errors)
    noun = "error" if count == 1 else "errors"
    return ValidationException(f"{count} validation {noun} detected: " + "; ".join(errors))


class AgentProtocolError(Exception):
    """An agent <-> control plane call refused (docs/agent-protocol.md); not an AWS error."""

    def __init__(self, status: int, error: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.error = error
        self.message = message

    def to_body(self) -> dict[str, str]:
        return {"error": self.error, "message": self.message}
