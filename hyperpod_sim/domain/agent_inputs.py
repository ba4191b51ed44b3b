"""What agents send that the control plane stores as it is, checked first: the endpoint an agent
registers (where the control plane will call it) and the ``s3`` status of its heartbeats."""

from __future__ import annotations

import ipaddress
import json
import math
import re
from typing import Any
from urllib.parse import urlsplit

from hyperpod_sim.contracts.limits import MAX_ENDPOINT, MAX_S3_STATUS_BYTES
from hyperpod_sim.domain.errors import AgentProtocolError

# The heartbeat's `s3` member is stored with the node on every heartbeat: keep it small.
# Members of the heartbeat's `s3` object, by the JSON type each must have; others are ignored
# (a newer agent may report more than this control plane shows).
S3_STATUS_COUNTERS = ("pending_steps", "persisted_steps_total", "failures_total")


def _s3_problem(status: dict[str, Any]) -> str | None:
    """What is wrong with a heartbeat's ``s3`` object, or None."""
    for member in S3_STATUS_COUNTERS:
        value = status.get(member)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            return f"s3.{member} must be a non-negative integer, got {value!r}"
    lag = status.get("lag_seconds")
    if lag is not None and (
        isinstance(lag, bool) or not isinstance(lag, int | float) or not math.isfinite(lag) or lag < 0
    ):
        return f"s3.lag_seconds must be a non-negative number, got {lag!r}"
    persisted = status.get("last_persisted")
    if persisted is not None:
        if not isinstance(persisted, dict):
            return f"s3.last_persisted must be an object of namespace -> step, got {persisted!r}"
        for namespace, step in persisted.items():
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                return f"s3.last_persisted[{namespace!r}] must be a non-negative integer, got {step!r}"
    error = status.get("last_error")
    if error is not None and not isinstance(error, str):
        return f"s3.last_error must be a string or null, got {error!r}"
    return None


def check_s3_status(status: object) -> dict[str, Any] | None:
    """The heartbeat's ``s3`` member as stored: None, or the object with its known members.

    Refused (400) when it is not an object or null, is over MAX_S3_STATUS_BYTES as JSON, or a
    known member has the wrong type: what is stored is shown in DescribeClusterNode as is.
    """
    if status is None:
        return None
    if not isinstance(status, dict):
        raise AgentProtocolError(
            400, "InvalidS3Status", f"s3 must be an object or null, got {type(status).__name__}."
        )
    size = len(json.dumps(status, separators=(",", ":")).encode())
    if size > MAX_S3_STATUS_BYTES:
        raise AgentProtocolError(
            400, "InvalidS3Status", f"s3 is {size} bytes of JSON; at most {MAX_S3_STATUS_BYTES} are accepted."
        )
    problem = _s3_problem(status)
    if problem is not None:
        raise AgentProtocolError(400, "InvalidS3Status", problem + ".")
    known = (*S3_STATUS_COUNTERS, "lag_seconds", "last_persisted", "last_error")
    return {member: status[member] for member in known if member in status}


_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$"
)


def _invalid_endpoint(endpoint: str, why: str) -> AgentProtocolError:
    shown = endpoint if len(endpoint) <= 100 else endpoint[:100] + "..."
    return AgentProtocolError(400, "InvalidEndpoint", f"endpoint {shown!r} is not valid: {why}.")


def check_endpoint(endpoint: str, *, loopback_only: bool) -> str:
    """The endpoint an agent registered (or heartbeated) with, checked: ``http://HOST:PORT`` with
    a port 1..65535 and nothing after it. With ``loopback_only`` (local provisioner: its agents run
    on this machine) HOST is a loopback address or ``localhost``; otherwise a host name or an IP
    address that is not unspecified (0.0.0.0, ::), multicast or link-local (169.254.0.0/16, where
    cloud metadata services answer). The control plane connects to it for every policy push."""
    if len(endpoint) > MAX_ENDPOINT:
        raise _invalid_endpoint(
            endpoint, f"it is {len(endpoint)} characters long, at most {MAX_ENDPOINT} are allowed"
        )
    try:
        url = urlsplit(endpoint)
        port = url.port
    except ValueError as exc:
        raise _invalid_endpoint(endpoint, f"{exc}; the port must be 1 to 65535") from None
    if url.scheme != "http":
        raise _invalid_endpoint(endpoint, "the scheme must be http")
    if url.username is not None or url.password is not None:
        raise _invalid_endpoint(endpoint, "it must not carry credentials")
    if url.path not in ("", "/") or url.query or url.fragment:
        raise _invalid_endpoint(endpoint, "it must be http://HOST:PORT, without a path, query or fragment")
    host = (url.hostname or "").lower()
    if not host:
        raise _invalid_endpoint(endpoint, "it has no host")
    if port is None or not 1 <= port <= 65535:
        raise _invalid_endpoint(endpoint, "the port must be given, 1 to 65535")
    try:
        address: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if loopback_only:
        if host != "localhost" and (address is None or not address.is_loopback):
            raise _invalid_endpoint(
                endpoint,
                "agents of the local provisioner listen on this machine: the host must be a "
                "loopback address (127.0.0.0/8, ::1) or localhost",
            )
    elif address is not None:
        if address.is_unspecified or address.is_multicast or address.is_link_local:
            raise _invalid_endpoint(
                endpoint, "the host must not be an unspecified, multicast or link-local address"
            )
    elif not _HOSTNAME.match(host):
        raise _invalid_endpoint(endpoint, "the host is neither an IP address nor a valid host name")
    return endpoint.rstrip("/")
