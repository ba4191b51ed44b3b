"""What ``serve`` does for the namespaces node network (hyperpod_sim/infra/netns.py; docs/nodes.md,
"Namespaces"): check the privileges first, make the bridge, listen on its gateway address too (the
nodes' only way to the control plane), relay the embedded S3 to the bridge's services address
(nodes cannot reach the host's 127.0.0.1), and keep the gateway listener to the nodes' subnet.

**Auth on the bridge.** The bridge is a host-internal network: no interface of the outside joins
it. But Linux accepts a packet for any of its addresses on any interface, so a machine on the LAN
with a route to the subnet via this host could reach the gateway. So the gateway listener answers
only connections from the subnet (403 AccessDeniedException to others; a forged source address
never completes the handshake: the answer goes to the bridge). Within the subnet the rules are
those of the loopback address: with auth off (the default) every process on a node may call the
control plane, as every local process may on 127.0.0.1; with auth on, the same credentials, cluster
tokens and launch secrets as anywhere (docs/security.md).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import socket
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from hyperpod_sim.infra import netns
from hyperpod_sim.settings import Settings

log = logging.getLogger(__name__)


class NodeNetworkUnavailable(Exception):
    """The namespaces network cannot be built here: the message names what is missing."""


def with_network(settings: Settings, node_network: str) -> Settings:
    """``settings`` with ``serve --node-network`` over HPSIM_PROVISIONING__NODE_NETWORK."""
    provisioning = settings.provisioning.model_copy(update={"node_network": node_network})
    return settings.model_copy(update={"provisioning": provisioning})


def prepare(settings: Settings) -> netns.NodeNetwork | None:
    """The namespaces network with its bridge up; None on another network (or not local mode).
    NodeNetworkUnavailable, naming what is missing, when this process cannot build it."""
    network = netns.node_network(settings)
    if network is None or settings.provisioning.mode != "local":
        return None
    missing = netns.missing_privileges()
    if missing:
        raise NodeNetworkUnavailable(
            "the namespaces node network (HPSIM_PROVISIONING__NODE_NETWORK=namespaces) needs "
            + "; ".join(missing)
            + ". Run serve as root (CI does), or use the loopback network (the default)."
        )
    try:
        netns.ensure_bridge(network)
    except OSError as exc:
        raise NodeNetworkUnavailable(f"cannot build the nodes' bridge: {exc}") from exc
    return network


@contextlib.contextmanager
def gateway_listener(network: netns.NodeNetwork | None, port: int) -> Iterator[list[socket.socket]]:
    """The listening socket on the bridge's gateway address (the main listener's port), as a
    list of extra listeners: empty on another network."""
    if network is None:
        yield []
        return
    from hyperpod_sim.serve.process import bind

    with bind(network.gateway, port) as listener:
        yield [listener]


class SubnetGuard:
    """ASGI: on the gateway listener, only clients from the nodes' subnet (the module's docstring)."""

    def __init__(self, app: Any, network: netns.NodeNetwork) -> None:
        self.app = app
        self.network = network
        self.state = getattr(app, "state", None)

    def __getattr__(self, name: str) -> Any:  # app.state and the like, for serve's own uses
        return getattr(self.app, name)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket") and not self._allowed(scope):
            body = json.dumps(
                {
                    "__type": "AccessDeniedException",
                    "message": f"The control plane's address {self.network.gateway} answers the nodes' "
                    f"subnet {self.network.subnet} only; call it at its own host address.",
                }
            ).encode()
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            await send(
                {
                    "type": "http.response.start",
                    "status": 403,
                    "headers": [
                        (b"content-type", b"application/x-amz-json-1.1"),
                        (b"content-length", str(len(body)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)

    def _allowed(self, scope: Any) -> bool:
        server, client = scope.get("server"), scope.get("client")
        if not server or server[0] != self.network.gateway:
            return True
        try:
            return client is not None and ipaddress.ip_address(client[0]) in self.network.subnet
        except ValueError:
            return False


class Relay:
    """A TCP relay from ``listen`` to ``target``: the embedded S3 (on the host's 127.0.0.1) at the
    bridge's services address, for the clients of ``subnet`` only (others are closed at once). A
    thread per connection direction; bytes as they come (SigV4 signs the Host header the client
    sent, which goes through unchanged)."""

    def __init__(
        self, listen: tuple[str, int], target: tuple[str, int], subnet: ipaddress.IPv4Network
    ) -> None:
        self.target = target
        self.subnet = subnet
        self._listener = socket.create_server(listen, reuse_port=False)
        self._listener.settimeout(0.5)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="s3-relay", daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._listener.getsockname()[:2]
        return host, port

    def _serve(self) -> None:
        while not self._stopped.is_set():
            try:
                client, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if ipaddress.ip_address(peer[0]) not in self.subnet:
                client.close()
                continue
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=10)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        client.settimeout(None)
        threading.Thread(target=_pipe, args=(upstream, client), daemon=True).start()
        _pipe(client, upstream)

    def stop(self) -> None:
        self._stopped.set()
        self._listener.close()
        self._thread.join(timeout=5)


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while chunk := source.recv(65536):
            sink.sendall(chunk)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)
        with contextlib.suppress(OSError):
            source.shutdown(socket.SHUT_RD)


def relay_s3(network: netns.NodeNetwork, endpoint_url: str) -> tuple[Relay, str]:
    """The embedded S3 at ``endpoint_url`` relayed to the services address: the relay and the
    endpoint URL everyone (the nodes, this host) uses from now on."""
    parts = urlsplit(endpoint_url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    relay = Relay((network.services, port), (host, port), network.subnet)
    return relay, f"{parts.scheme}://{network.services}:{port}"


def banner(network: netns.NodeNetwork, port: int) -> str:
    return (
        f"node network: namespaces on bridge {network.bridge} ({network.subnet}); nodes reach the "
        f"control plane at http://{network.gateway}:{port}"
    )
