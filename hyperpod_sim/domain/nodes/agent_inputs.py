"""What agents send that the control plane stores as it is, checked first: the endpoint an agent
registers (where the control plane will call it) and the ``s3`` status of its heartbeats."""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

from hyperpod_sim.contracts.agent_api import S3StatusProblem
from hyperpod_sim.contracts.agent_bodies import S3StatusError, S3TierStatus, parse_s3_status
from hyperpod_sim.contracts.limits import MAX_ENDPOINT
from hyperpod_sim.domain.errors import AgentProtocolError


def check_s3_status(status: S3TierStatus | S3StatusProblem | object) -> S3TierStatus | None:
    """The heartbeat's ``s3`` member as stored: None, or the S3TierStatus that came
    (``contracts.agent_bodies.parse_s3_status`` checks it; the route hands over its result).

    Refused (400 InvalidS3Status) when it is not an object or null, is over MAX_S3_STATUS_BYTES as
    JSON, or a known member has the wrong type: what is stored is shown in DescribeClusterNode as is.
    """
    if isinstance(status, S3StatusProblem):
        raise AgentProtocolError(400, "InvalidS3Status", status.message)
    try:
        parsed = parse_s3_status(status)
    except S3StatusError as exc:
        raise AgentProtocolError(400, "InvalidS3Status", str(exc)) from exc
    return parsed


_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$"
)


def _invalid_endpoint(endpoint: str, why: str) -> AgentProtocolError:
    shown = endpoint if len(endpoint) <= 100 else endpoint[:100] + "..."
    return AgentProtocolError(400, "InvalidEndpoint", f"endpoint {shown!r} is not valid: {why}.")


def endpoint_address(endpoint: str) -> str | None:
    """The IPv4 address that a checked endpoint names (an external agent's node's address, its
    PrivatePrimaryIp); None for a host name or an IPv6 address."""
    try:
        return str(ipaddress.IPv4Address(urlsplit(endpoint).hostname or ""))
    except ValueError:
        return None


def check_endpoint(endpoint: str, *, loopback_only: bool, node_subnet: str | None = None) -> str:
    """The endpoint an agent registered (or heartbeated) with, checked: ``http://HOST:PORT`` with
    a port 1..65535 and nothing after it. With ``loopback_only`` (local provisioner: its agents run
    on this machine) HOST is a loopback address or ``localhost``, or an address of ``node_subnet``
    (the namespaces node network: the host-internal bridge, infra/netns.py); otherwise a host name or an IP
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
        bridged = (
            node_subnet is not None
            and isinstance(address, ipaddress.IPv4Address)
            and address in ipaddress.IPv4Network(node_subnet)
        )
        if host != "localhost" and (address is None or not address.is_loopback) and not bridged:
            nodes = f", or an address of the nodes' subnet {node_subnet}" if node_subnet else ""
            raise _invalid_endpoint(
                endpoint,
                "agents of the local provisioner listen on this machine: the host must be a "
                f"loopback address (127.0.0.0/8, ::1) or localhost{nodes}",
            )
    elif address is not None:
        if address.is_unspecified or address.is_multicast or address.is_link_local:
            raise _invalid_endpoint(
                endpoint, "the host must not be an unspecified, multicast or link-local address"
            )
    elif not _HOSTNAME.match(host):
        raise _invalid_endpoint(endpoint, "the host is neither an IP address nor a valid host name")
    return endpoint.rstrip("/")
