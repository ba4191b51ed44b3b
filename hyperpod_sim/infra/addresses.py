"""The nodes' addresses on the loopback network: one of 127.77.0.0/16 per node, where its agent
listens at port 9200 (HyperPod's daemon port).

Every address of 127.0.0.0/8 reaches ``lo`` on Linux without any setup. The block stays clear of
127.0.0.0/24 (127.0.0.1's services, systemd-resolved's 127.0.0.53 and .54) and of 127.0.1.1 (the
host name on Debian and Ubuntu). A draw is unique among the nodes of this database (``taken``)
and, since the test suite and other control planes on this machine draw from the same block with
databases of their own, the drawn address's port 9200 must also be free to bind (SO_REUSEADDR off,
so that an address whose port was in use a moment ago, still in TIME_WAIT, is passed over too).
macOS configures 127.0.0.1 only: every other address needs an alias on lo0 (``sudo ifconfig lo0
alias 127.77.x.y``), or the shared network (``HPSIM_PROVISIONING__NODE_NETWORK=shared``); without
either, no draw binds and the node gets no address (a warning says so).
"""

from __future__ import annotations

import ipaddress
import logging
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

LOOPBACK_BLOCK = ipaddress.IPv4Network("127.77.0.0/16")
#: The port of HyperPod's node daemon, where every node's agent listens on the loopback network.
AGENT_PORT = 9200


def can_bind(address: str, port: int) -> bool:
    """Whether ``address:port`` can be bound now (no listener, nothing lingering in TIME_WAIT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
        try:
            sock.bind((address, port))
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class LoopbackAddresses:
    """Random draws from ``block`` (hosts .1 to .254 of each /24, so that none looks like a network
    or broadcast address), ``attempts`` of them before a node goes without an address."""

    block: ipaddress.IPv4Network = LOOPBACK_BLOCK
    port: int = AGENT_PORT
    attempts: int = 8

    def draw(self, taken: Callable[[str], bool]) -> str | None:
        for _ in range(self.attempts):
            index = secrets.randbelow(self.block.num_addresses)
            if index % 256 in (0, 255):
                continue
            address = str(self.block.network_address + index)
            if not taken(address) and can_bind(address, self.port):
                return address
        log.warning(
            "no free address of %s (port %d) in %d draws: the node's agent takes a free port of "
            "127.0.0.1 (on macOS, alias the addresses on lo0 or set HPSIM_PROVISIONING__NODE_NETWORK=shared)",
            self.block,
            self.port,
            self.attempts,
        )
        return None
