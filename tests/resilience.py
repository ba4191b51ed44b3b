"""The trainer and the cluster of the resilience tests (tests/test_resilience.py,
tests/test_resilience_nodeops.py): a job of world size 1 that checkpoints with ``dcp.save``
through ``TieredStorageWriter`` and resumes with ``load_latest``, and the cluster's nodes and
agents after a fault or a node operation."""

from __future__ import annotations

from torch.distributed.checkpoint import save

from hyperpod_sim.sdk.agent import discover_agent_url
from hyperpod_sim.sdk.checkpoint import Loaded, TieredCheckpointConfig, TieredStorageWriter, load_latest
from hyperpod_sim.sdk.client import HyperPodClient
from tests.conftest import ControlPlane
from tests.faults import answers
from tests.sdk_worker import same, training_state

NS = "job"
RANK = 0  # world size 1: the job's only rank
EVERY = 2  # the trainer's in-memory checkpoint interval (steps)


def config_for(agent: str) -> TieredCheckpointConfig:
    return TieredCheckpointConfig(namespace=NS, world_size=1, agent_url=agent)


def checkpoint(agent: str, step: int) -> None:
    """A save of the state at ``step`` (``dcp.save``, committed when it returns)."""
    save(training_state(step, RANK), storage_writer=TieredStorageWriter(config_for(agent), step=step))


def train(agent: str, steps: range, *, save_every: int) -> int:
    """Run ``steps``, saving to ``agent`` every ``save_every`` steps; the last step saved."""
    saved = 0
    for step in steps:
        if step % save_every == 0:
            checkpoint(agent, step)
            saved = step
    return saved


def start_save(agent: str, step: int) -> None:
    """The first half of an ``async_save``: the state staged into the agent's shared memory, not
    committed (the fault hits before the save's background half runs)."""
    TieredStorageWriter(config_for(agent), step=step).stage(training_state(step, RANK))


def resume(agent: str) -> Loaded:
    """What a restarted trainer does: ``load_latest`` into a state of the same shape. The state
    restored is exactly the one saved at the step it reports."""
    state = training_state(987, RANK)
    loaded = load_latest(state, config_for(agent))
    assert same(state, training_state(loaded.step, RANK)), f"step {loaded.step} came back altered"
    return loaded


def agent_of(plane: ControlPlane, name: str, node_id: str) -> str:
    """The agent a pod on ``node_id`` finds, from its environment (sdk.agent.discover_agent_url)."""
    return discover_agent_url(
        {"HPSIM_CONTROL_PLANE_URL": plane.url, "HPSIM_CLUSTER": name, "HPSIM_NODE_ID": node_id}
    )


def replaced(client: HyperPodClient, name: str, lost: set[str], count: int) -> list[str] | None:
    """The cluster's node ids once none of ``lost`` is left and ``count`` nodes run, each with an
    agent that answers; None before."""
    nodes = client.list_nodes(name)
    ids = {n["InstanceId"] for n in nodes}
    if ids & lost or len(nodes) != count or any(n["InstanceStatus"]["Status"] != "Running" for n in nodes):
        return None
    endpoints = [(n.get("AgentStatus") or {}).get("Endpoint") for n in nodes]
    if not all(endpoint and answers(endpoint) for endpoint in endpoints):
        return None
    return sorted(ids)


def restarted_agent(client: HyperPodClient, name: str, node_id: str, *, other_than: str) -> str | None:
    """The endpoint of the node's agent once it runs again (a new endpoint that answers)."""
    node = client.describe_node(name, node_id)
    endpoint = (node.get("AgentStatus") or {}).get("Endpoint")
    if (
        node["InstanceStatus"]["Status"] != "Running"
        or endpoint in (None, other_than)
        or not answers(endpoint)
    ):
        return None
    return str(endpoint)
