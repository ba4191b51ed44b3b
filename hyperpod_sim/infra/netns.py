"""The ``namespaces`` node network: every node a Linux network namespace, joined to one bridge by a
veth pair, as Mininet builds its hosts (root or CAP_NET_ADMIN + CAP_SYS_ADMIN; docs/nodes.md,
"Namespaces").

- **The bridge** (``hpsbr`` and 8 hex digits of the subnet's hash, so that control planes on other
  subnets have their own) holds the subnet's first host address, the *gateway*, where the control
  plane listens too (hyperpod_sim/serve/node_network.py), and its second, the *services* address,
  where the host's services that nodes need (the embedded S3) are relayed. The host reaches every
  node at its address through it, and nodes reach each other through it.
- **A node** is the namespace ``hpsim-<node id>`` (``ip netns`` sees it: its file is under
  /run/netns). Its end of the veth pair is ``eth0`` inside, the host's end ``hpv`` and 12 hex digits
  of the node id's hash (IFNAMSIZ allows 15 characters), enslaved to the bridge, with the
  namespace's name as its alias (how :func:`leftovers` and :func:`remove_network` find a bridge's
  nodes). Inside: ``lo`` up, the node's address on ``eth0``, the default route via the gateway.
  ``/etc/netns/<namespace>/hosts`` (which ``ip netns exec`` and hyperpod_sim/infra/netns_exec.py
  mount over /etc/hosts) maps HyperPod's daemon service name to the node's own address, so that
  the real checkpointing library's default ``base_url`` reaches the node's agent.
- **A partition** is a blackhole route to the gateway inside the namespace: the node's packets to
  the control plane are dropped in the kernel, the control plane's to the node get no answer (the
  reply is dropped); the services address, the other nodes and the node itself stay reachable.
- **A link rate** (optional): a ``tbf`` qdisc on the host's end of the veth (traffic towards the
  node) and on ``eth0`` (traffic from it).

Everything is created idempotently (an existing namespace, link, address or route is kept), so a
restarted control plane rebuilds what is missing with the same addresses. pyroute2 does the
netlink, never a shell command.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import ipaddress
import logging
import os
import secrets
import shutil
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hyperpod_sim.settings import Settings

log = logging.getLogger(__name__)

#: HyperPod's node daemon's Service name, which the amzn-sagemaker-checkpointing library's default
#: config calls (``http://ai-toolkit-gossip-headless.aws-hyperpod.svc.cluster.local:9200``).
GOSSIP_SERVICE = "ai-toolkit-gossip-headless.aws-hyperpod.svc.cluster.local"
DEFAULT_SUBNET = "198.18.0.0/16"
NAMESPACE_PREFIX = "hpsim-"
VETH_PREFIX = "hpv"
BRIDGE_PREFIX = "hpsbr"
NETNS_RUN_DIR = Path("/var/run/netns")  # where pyroute2 and `ip netns` keep them
NETNS_ETC_DIR = Path("/etc/netns")
INNER_IFNAME = "eth0"
IFNAMSIZ = 16  # the kernel's limit, its terminating NUL included


class NamespaceError(OSError):
    """A namespace, link or route could not be made or removed (the message says which). An
    OSError: to the local provisioner, a start that failed (tried again later)."""


def namespace_name(node_id: str) -> str:
    return NAMESPACE_PREFIX + node_id


def veth_name(node_id: str) -> str:
    """The host's end of the node's veth pair: 15 characters whatever the node id's length."""
    return VETH_PREFIX + hashlib.sha256(node_id.encode()).hexdigest()[:12]


def hosts_path(namespace: str) -> Path:
    return NETNS_ETC_DIR / namespace / "hosts"


@dataclass(frozen=True)
class NodeNetwork:
    """One control plane's node network: its subnet, bridge and optional per-node link rate."""

    subnet: ipaddress.IPv4Network
    link_rate_mbit: float | None = None

    @classmethod
    def of(cls, subnet: str, link_rate_mbit: float | None = None) -> NodeNetwork:
        return cls(ipaddress.IPv4Network(subnet), link_rate_mbit)

    @property
    def gateway(self) -> str:
        """The bridge's address: the nodes' default route, where the control plane listens."""
        return str(self.subnet.network_address + 1)

    @property
    def services(self) -> str:
        """The bridge's second address: the host's services that nodes reach (the embedded S3),
        outside a partition's blackhole."""
        return str(self.subnet.network_address + 2)

    @property
    def bridge(self) -> str:
        return BRIDGE_PREFIX + hashlib.sha256(str(self.subnet).encode()).hexdigest()[:8]

    def draw(self, taken: Callable[[str], bool], attempts: int = 16) -> str | None:
        """A node's address (domain/nodes/node_set.py's NodeAddresses): a random host address of
        the subnet, never the gateway's nor the services', nor one that ``taken`` says a node has."""
        reserved = {self.gateway, self.services}
        hosts = self.subnet.num_addresses - 2
        for _ in range(attempts):
            address = str(self.subnet.network_address + 1 + secrets.randbelow(hosts))
            if address not in reserved and not taken(address):
                return address
        log.warning("no free address of %s in %d draws: the node gets none", self.subnet, attempts)
        return None


def node_network(settings: Settings) -> NodeNetwork | None:
    """The namespaces node network of a local (or simulated: addresses only) control plane; None:
    another network."""
    provisioning = settings.provisioning
    if provisioning.node_network != "namespaces" or provisioning.mode == "external":
        return None
    return NodeNetwork.of(provisioning.node_subnet, provisioning.node_link_rate_mbit)


# ---- privileges ----------------------------------------------------------------------------

CAP_SYS_ADMIN = 21
CAP_NET_ADMIN = 12


def _effective_capabilities() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def missing_privileges() -> list[str]:
    """What this process lacks to build the namespaces network, each in words; empty: nothing."""
    missing: list[str] = []
    if not Path("/proc/self/ns/net").exists():
        return ["network namespaces (the kernel has no /proc/self/ns/net: CONFIG_NET_NS)"]
    try:
        caps = _effective_capabilities()
    except OSError:
        caps = 0
    if not caps >> CAP_NET_ADMIN & 1:
        missing.append("CAP_NET_ADMIN (namespaces, veth pairs, the bridge, routes: run serve as root)")
    if not caps >> CAP_SYS_ADMIN & 1:
        missing.append("CAP_SYS_ADMIN (entering a namespace and mounting its hosts file: run serve as root)")
    try:
        import pyroute2  # noqa: F401
    except ImportError:
        missing.append("the pyroute2 package (pip install 'hyperpod-sim[server]')")
    return missing


# ---- netlink ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _host() -> Iterator[Any]:
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        yield ipr


@contextlib.contextmanager
def _inside(namespace: str) -> Iterator[Any]:
    from pyroute2 import NetNS

    with NetNS(namespace) as ns:
        yield ns


def _index(ipr: Any, ifname: str) -> int | None:
    found = ipr.link_lookup(ifname=ifname)
    return int(found[0]) if found else None


def _tolerate(exc: Exception, *codes: int) -> bool:
    code = getattr(exc, "code", None) or getattr(exc, "errno", None)
    return code in codes


def _has_address(ipr: Any, index: int, address: str) -> bool:
    return any(a.get_attr("IFA_ADDRESS") == address for a in ipr.get_addr(index=index, family=2))


def ensure_bridge(network: NodeNetwork) -> None:
    """The bridge, up, with the gateway and services addresses (and so the host's route to the
    subnet). Idempotent."""
    prefix = network.subnet.prefixlen
    with _host() as ipr:
        index = _index(ipr, network.bridge)
        if index is None:
            try:
                ipr.link("add", ifname=network.bridge, kind="bridge")
            except Exception as exc:
                if not _tolerate(exc, errno.EEXIST):
                    raise NamespaceError(f"cannot create the bridge {network.bridge}: {exc}") from exc
            index = _index(ipr, network.bridge)
            assert index is not None
        for address in (network.gateway, network.services):
            if not _has_address(ipr, index, address):
                try:
                    ipr.addr("add", index=index, address=address, prefixlen=prefix)
                except Exception as exc:
                    if not _tolerate(exc, errno.EEXIST):
                        raise NamespaceError(f"cannot address the bridge {network.bridge}: {exc}") from exc
        ipr.link("set", index=index, state="up")


def bridge_exists(network: NodeNetwork) -> bool:
    with _host() as ipr:
        return _index(ipr, network.bridge) is not None


def remove_bridge(network: NodeNetwork) -> bool:
    """Remove the bridge (and with it the host's route to the subnet); whether it was there."""
    with _host() as ipr:
        if _index(ipr, network.bridge) is None:
            return False
        try:
            ipr.link("del", ifname=network.bridge)
        except Exception as exc:
            if not _tolerate(exc, errno.ENODEV):
                raise NamespaceError(f"cannot remove the bridge {network.bridge}: {exc}") from exc
    return True


def namespace_exists(namespace: str) -> bool:
    return (NETNS_RUN_DIR / namespace).exists()


def _create_namespace(namespace: str) -> None:
    from pyroute2 import netns

    if namespace_exists(namespace):
        return
    with contextlib.suppress(FileExistsError):  # made meanwhile
        netns.create(namespace)


def write_hosts(namespace: str, address: str, *, host_hosts: Path = Path("/etc/hosts")) -> Path:
    """The namespace's /etc/hosts: HyperPod's daemon service name at the node's own address, then
    the host's own entries (so the names the host resolves still resolve)."""
    path = hosts_path(namespace)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        host_lines = host_hosts.read_text()
    except OSError:
        host_lines = "127.0.0.1\tlocalhost\n::1\tlocalhost\n"
    text = (
        f"# {namespace}: written by hyperpod-sim (the node's network namespace)\n"
        f"{address}\t{GOSSIP_SERVICE}\n"
        f"{host_lines}"
    )
    temporary = path.with_name(".hosts.tmp")
    temporary.write_text(text)
    temporary.chmod(0o644)
    os.replace(temporary, path)
    return path


def ensure_node(network: NodeNetwork, node_id: str, address: str) -> str:
    """The node's namespace, veth pair, addresses, routes, hosts file and link rate; the
    namespace's name. Idempotent: what exists is kept, what is missing is made."""
    namespace = namespace_name(node_id)
    host_end = veth_name(node_id)
    ensure_bridge(network)
    _create_namespace(namespace)
    try:
        with _host() as ipr:
            bridge = _index(ipr, network.bridge)
            index = _index(ipr, host_end)
            if index is None:
                ipr.link(
                    "add", ifname=host_end, kind="veth", peer={"ifname": INNER_IFNAME, "net_ns_fd": namespace}
                )
                index = _index(ipr, host_end)
                assert index is not None
            ipr.link("set", index=index, master=bridge, ifalias=namespace, state="up")
            if network.link_rate_mbit is not None:
                _set_rate(ipr, index, network.link_rate_mbit)
        with _inside(namespace) as ns:
            lo = _index(ns, "lo")
            ns.link("set", index=lo, state="up")
            inner = _index(ns, INNER_IFNAME)
            if inner is None:
                raise NamespaceError(
                    f"namespace {namespace} has no {INNER_IFNAME}, though {host_end} exists: remove the "
                    f"node's network (a veth end moved elsewhere?)"
                )
            if not _has_address(ns, inner, address):
                ns.addr("add", index=inner, address=address, prefixlen=network.subnet.prefixlen)
            ns.link("set", index=inner, state="up")
            if not _default_route(ns):
                try:
                    ns.route("add", dst="0.0.0.0/0", gateway=network.gateway)
                except Exception as exc:
                    if not _tolerate(exc, errno.EEXIST):
                        raise
            if network.link_rate_mbit is not None:
                _set_rate(ns, inner, network.link_rate_mbit)
    except NamespaceError:
        raise
    except Exception as exc:
        raise NamespaceError(f"cannot build the network of node {node_id} ({namespace}): {exc}") from exc
    write_hosts(namespace, address)
    return namespace


def _default_route(ns: Any) -> bool:
    return any(
        r.get("dst_len") == 0 and r.get_attr("RTA_GATEWAY") for r in ns.get_routes(family=2, table=254)
    )


def _set_rate(ipr: Any, index: int, rate_mbit: float) -> None:
    """A token bucket of ``rate_mbit`` on the interface (replacing its root qdisc): a burst of
    the larger of 64 KiB and 1 ms at the rate, at most 50 ms of queue."""
    rate_bytes = rate_mbit * 1_000_000 / 8
    burst = max(64 * 1024, int(rate_bytes / 1000))
    ipr.tc("replace", "tbf", index, rate=f"{rate_mbit:g}mbit", burst=burst, latency="50ms")


def node_address(node_id: str) -> str | None:
    """The address on the node's ``eth0``; None without its namespace."""
    namespace = namespace_name(node_id)
    if not namespace_exists(namespace):
        return None
    with _inside(namespace) as ns:
        inner = _index(ns, INNER_IFNAME)
        if inner is None:
            return None
        for entry in ns.get_addr(index=inner, family=2):
            return str(entry.get_attr("IFA_ADDRESS"))
    return None


def remove_node(node_id: str) -> bool:
    """Remove everything of the node's network: its veth pair (its end inside goes with it), its
    namespace and its /etc/netns directory. Whether anything was there. Idempotent;
    NamespaceError when the kernel refuses."""
    namespace = namespace_name(node_id)
    found = False
    try:
        with _host() as ipr:
            if _index(ipr, veth_name(node_id)) is not None:
                found = True
                try:
                    ipr.link("del", ifname=veth_name(node_id))
                except Exception as exc:
                    if not _tolerate(exc, errno.ENODEV):
                        raise
        if namespace_exists(namespace):
            from pyroute2 import netns

            found = True
            with contextlib.suppress(FileNotFoundError):
                netns.remove(namespace)
    except Exception as exc:
        raise NamespaceError(f"cannot remove the network of node {node_id} ({namespace}): {exc}") from exc
    etc = NETNS_ETC_DIR / namespace
    if etc.exists():
        found = True
        shutil.rmtree(etc, ignore_errors=True)
    return found


def _blackhole(ns: Any, gateway: str) -> list[Any]:
    return [
        r
        for r in ns.get_routes(family=2, table=254)
        if r.get("type") == 6 and r.get("dst_len") == 32 and r.get_attr("RTA_DST") == gateway
    ]


def set_partition(network: NodeNetwork, node_id: str, *, cut: bool) -> bool:
    """Cut (``cut``) or heal the node's traffic with the control plane: a blackhole route to the
    gateway inside its namespace. Whether that changed anything (False without the namespace)."""
    namespace = namespace_name(node_id)
    if not namespace_exists(namespace):
        return False
    try:
        with _inside(namespace) as ns:
            present = bool(_blackhole(ns, network.gateway))
            if cut and not present:
                ns.route("add", dst=f"{network.gateway}/32", type="blackhole")
                return True
            if not cut and present:
                ns.route("del", dst=f"{network.gateway}/32", type="blackhole")
                return True
    except Exception as exc:
        action = "cut" if cut else "heal"
        raise NamespaceError(f"cannot {action} the partition of node {node_id} ({namespace}): {exc}") from exc
    return False


def partitioned(network: NodeNetwork, node_id: str) -> bool:
    namespace = namespace_name(node_id)
    if not namespace_exists(namespace):
        return False
    with _inside(namespace) as ns:
        return bool(_blackhole(ns, network.gateway))


def link_rate_mbit(node_id: str) -> float | None:
    """The tbf rate on the host's end of the node's veth, in Mbit/s; None: none."""
    with _host() as ipr:
        index = _index(ipr, veth_name(node_id))
        if index is None:
            return None
        for qdisc in ipr.get_qdiscs(index):
            if qdisc.get_attr("TCA_KIND") == "tbf":
                params = qdisc.get_attr("TCA_OPTIONS").get_attr("TCA_TBF_PARMS")
                return float(params["rate"]) * 8 / 1_000_000
    return None


# ---- what is there ---------------------------------------------------------------------------


def bridge_namespaces(network: NodeNetwork) -> list[str]:
    """The namespaces whose veth is enslaved to the network's bridge (by the veths' aliases)."""
    with _host() as ipr:
        bridge = _index(ipr, network.bridge)
        if bridge is None:
            return []
        return sorted(
            str(link.get_attr("IFLA_IFALIAS"))
            for link in ipr.get_links()
            if link.get_attr("IFLA_MASTER") == bridge and link.get_attr("IFLA_IFALIAS")
        )


def leftovers(*, node_ids: Collection[str] | None = None, network: NodeNetwork | None = None) -> list[str]:
    """What of these nodes' networks (default: any of ours) and of ``network`` (its bridge, a host
    route into its subnet) exists: empty when everything is gone. For tests and ``serve``'s log."""
    found: list[str] = []
    if node_ids is None:
        namespaces = (
            sorted(e.name for e in os.scandir(NETNS_RUN_DIR) if e.name.startswith(NAMESPACE_PREFIX))
            if NETNS_RUN_DIR.is_dir()
            else []
        )
        etc = (
            sorted(e.name for e in os.scandir(NETNS_ETC_DIR) if e.name.startswith(NAMESPACE_PREFIX))
            if NETNS_ETC_DIR.is_dir()
            else []
        )
        wanted_veths: set[str] | None = None
    else:
        namespaces = [namespace_name(n) for n in node_ids if namespace_exists(namespace_name(n))]
        etc = [namespace_name(n) for n in node_ids if (NETNS_ETC_DIR / namespace_name(n)).exists()]
        wanted_veths = {veth_name(n) for n in node_ids}
    found += [f"namespace {n}" for n in namespaces]
    found += [f"hosts dir /etc/netns/{n}" for n in etc]
    with _host() as ipr:
        for link in ipr.get_links():
            name = str(link.get_attr("IFLA_IFNAME"))
            if (
                name.startswith(VETH_PREFIX)
                and len(name) == IFNAMSIZ - 1
                and (wanted_veths is None or name in wanted_veths)
            ):
                found.append(f"veth {name}")
        if network is not None:
            if _index(ipr, network.bridge) is not None:
                found.append(f"bridge {network.bridge}")
            for route in ipr.get_routes(family=2, table=254):
                dst = route.get_attr("RTA_DST")
                if dst is not None and ipaddress.IPv4Address(dst) in network.subnet:
                    found.append(f"route {dst}/{route.get('dst_len')}")
    return found


def network_namespaces(network: NodeNetwork) -> list[str]:
    """The namespaces of the network's nodes: those on its bridge, and those whose hosts file
    gives an address of its subnet (one whose veth is gone, or was never made)."""
    found = set(bridge_namespaces(network))
    if NETNS_ETC_DIR.is_dir():
        for entry in os.scandir(NETNS_ETC_DIR):
            if not entry.name.startswith(NAMESPACE_PREFIX):
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                lines = (Path(entry.path) / "hosts").read_text().splitlines()
                if ipaddress.IPv4Address(lines[1].split()[0]) in network.subnet:
                    found.add(entry.name)
    return sorted(found)


def remove_network(network: NodeNetwork, *, node_ids: Collection[str] = ()) -> None:
    """Remove the network's bridge and every node on it (and ``node_ids``' networks, bridged or
    not): what a test's finalizer and an operator's clean-up call."""
    namespaces = set(network_namespaces(network))
    for node_id in {*node_ids, *(n.removeprefix(NAMESPACE_PREFIX) for n in namespaces)}:
        remove_node(node_id)
    remove_bridge(network)
