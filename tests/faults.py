"""What the fault tests read back through the SDK: a cluster's events (their order and times), a
node's status, whether an agent answers."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from hyperpod_sim.sdk.client import HyperPodClient


def descriptions(client: HyperPodClient, name: str) -> list[str]:
    """The cluster's event descriptions, oldest first."""
    return [e["Description"] for e in reversed(client.events(name))]


def when(client: HyperPodClient, name: str, prefix: str) -> datetime:
    """The time of the event whose description starts with ``prefix``."""
    found = [e["EventTime"] for e in client.events(name) if e["Description"].startswith(prefix)]
    assert len(found) == 1, (prefix, descriptions(client, name))
    event_time: datetime = found[0]
    return event_time


def node_loss_timeline(client: HyperPodClient, name: str, fault: dict[str, Any], *, replacement: str) -> None:
    """A NodeLoss's events in order: injected, the node failed, replaced (by a node id starting
    with ``replacement``), the fault ended; and the lost node's agent never restarted. Events of one
    transaction share a timestamp: they are ordered by time, not by position."""
    victim = fault["InstanceId"]
    texts = descriptions(client, name)
    injected = when(client, name, f"Fault {fault['FaultId']} injected: NodeLoss on node {victim}")
    failed = when(client, name, f"Node {victim} failed: no heartbeat from its agent for 3 s.")
    replaced = when(client, name, f"Node {victim} is replaced by {replacement}")
    ended = when(client, name, f"Fault {fault['FaultId']} ended: NodeLoss on node {victim}; the node is")
    assert injected < failed <= replaced <= ended, texts
    assert not any("exited unexpectedly" in t for t in texts), texts


def node_status(client: HyperPodClient, name: str, node_id: str) -> str | None:
    for node in client.list_nodes(name):
        if node["InstanceId"] == node_id:
            return str(node["InstanceStatus"]["Status"])
    return None


def answers(endpoint: str) -> bool:
    try:
        return httpx.get(f"{endpoint}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def restart_story(client: HyperPodClient, name: str, data_dir: Path, node_id: str) -> str:
    """What a wait for a restarted agent shows when it times out: the cluster's events and the
    end of the node's agent log (under the control plane's ``data_dir``)."""
    try:
        log = (Path(data_dir) / "agents" / node_id / "agent.log").read_text(errors="replace")[-3000:]
    except OSError as exc:
        log = f"(no agent log: {exc})"
    return f"events: {descriptions(client, name)}\nagent log:\n{log}"
