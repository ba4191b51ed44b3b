"""The reconciler's watch over nodes with agents: crashed agents started again (with a backoff, as
a kubelet restarts a daemon), agents that could not start tried again (with a backoff, a bounded
number of times: hyperpod_sim/domain/nodes/recovery.py), silent nodes failed, failed nodes replaced
(NodeRecovery: Automatic) unless their slot's replacements keep failing.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from hyperpod_sim.domain import events, faults
from hyperpod_sim.domain.clock import Ids
from hyperpod_sim.domain.events import Level
from hyperpod_sim.domain.lifecycle import LEAVING, GroupStatus, NodeStatus, bump_generation
from hyperpod_sim.domain.nodes import credentials, recovery
from hyperpod_sim.domain.nodes.node_set import NO_ADDRESSES, NodeAddresses, fail_node, new_node
from hyperpod_sim.domain.nodes.pacing import HeartbeatPacing
from hyperpod_sim.domain.outcome import Outcome
from hyperpod_sim.domain.provisioning import Provisioner
from hyperpod_sim.models import Cluster, Node

# A crashed agent is restarted at once; one that crashes again within RESTART_WINDOW_S of its last
# restart waits RESTART_BACKOFF_S, doubling with each such restart up to RESTART_BACKOFF_MAX_S.
RESTART_WINDOW_S = 60.0
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
# Nodes failed when their agent is silent past its deadline (a moved node's new agent has the
# launch timeout to register in its target cluster).
_HEARD = (NodeStatus.PENDING, NodeStatus.RUNNING, NodeStatus.ATTACH_IN_PROGRESS)


@dataclass(frozen=True)
class NodeHealth:
    ids: Ids
    provisioner: Provisioner
    pacing: HeartbeatPacing  # the heartbeat timeout, grown with the number of agents
    launch_timeout_s: float
    node_ready_delay_s: float
    restart_agents: bool
    # Failed starts of a node's agent before its node fails; replacements in a row of a slot's
    # nodes that failed before registering (hyperpod_sim/domain/nodes/recovery.py).
    start_attempts: int = 4
    replace_limit: int = 3
    addresses: NodeAddresses = NO_ADDRESSES

    def restart_crashed_agents(self, session: Session, cluster: Cluster, now: datetime) -> Outcome:
        """Start again the agent of a Pending or Running node whose agent process has gone (it
        registered before, so it did not just fail to start), unless the node was lost (a NodeLoss
        fault): the node keeps its id and its shared memory, and the agent finds its shards there."""
        outcome = Outcome()
        if not self.restart_agents:
            return outcome
        candidates = [
            n
            for n in cluster.nodes
            # A node being rebooted has its agent stopped on purpose
            # (domain/node_operations/reboot_replace.py).
            if n.status in (NodeStatus.PENDING, NodeStatus.RUNNING)
            and n.endpoint
            and n.pending_action is None
            # One whose restart could not be spawned waits for its next start (retry_starts).
            and n.next_start_at is None
        ]
        exited = self.provisioner.exited_agents([n.id for n in candidates])
        if exited is None:
            return outcome
        lost = faults.lost_nodes(cluster)
        for node in candidates:
            if node.id not in exited or node.id in lost:
                continue
            last = node.agent_restarted_at
            restarts = 1
            if last is not None and now - last < timedelta(seconds=RESTART_WINDOW_S):
                delay = timedelta(
                    seconds=min(RESTART_BACKOFF_S * 2 ** (node.agent_restarts - 1), RESTART_BACKOFF_MAX_S)
                )
                if now < last + delay:
                    outcome.note_due(last + delay)
                    outcome.restart_pending.add(node.id)
                    continue
                restarts = node.agent_restarts + 1
            node.agent_restarts = restarts
            node.agent_restarted_at = now
            events.node_event(
                session,
                node,
                f"The agent of node {node.id} exited unexpectedly; restarting it "
                f"(restart {restarts} in a row).",
                ids=self.ids,
                now=now,
                level=Level.WARN,
            )
            outcome.launches.append(node.id)
            outcome.changed = True
        return outcome

    def retry_starts(
        self, session: Session, cluster: Cluster, now: datetime, *, launching: Collection[str]
    ) -> Outcome:
        """Start again the agents whose last start failed, once their backoff is over; count an
        agent that exited before it registered as a failed start (hyperpod_sim/domain/nodes/recovery.py).
        ``launching``: the nodes whose agent this pass starts already (a rebooted node's old agent
        has exited, and that is no failed start). ``restart_pending``: the nodes waiting for their
        next attempt, not failed for their silence."""
        outcome = Outcome()
        unregistered = [
            n
            for n in cluster.nodes
            if n.status == NodeStatus.PENDING
            and n.endpoint is None
            and n.pending_action is None
            and n.next_start_at is None
            and n.id not in launching
        ]
        exited = self.provisioner.exited_agents([n.id for n in unregistered]) if unregistered else None
        lost = faults.lost_nodes(cluster)
        for node in unregistered:
            if exited is not None and node.id in exited and node.id not in lost:
                recovery.start_failed(
                    session, cluster, node, now, recovery.EXITED, ids=self.ids, attempts=self.start_attempts
                )
                outcome.changed = True
        for node in cluster.nodes:
            if node.next_start_at is None or node.status in (NodeStatus.FAILURE, *LEAVING):
                continue
            if node.id in launching:
                pass  # started by this pass already
            elif now >= node.next_start_at:
                outcome.launches.append(node.id)  # _launch_agents clears next_start_at once it starts
                outcome.changed = True
            else:
                outcome.note_due(node.next_start_at)
            outcome.restart_pending.add(node.id)
        return outcome

    def detect_failures(
        self,
        session: Session,
        cluster: Cluster,
        now: datetime,
        *,
        back: datetime,
        restart_pending: set[str],
        started_again_and_silent: Callable[[Node], bool],
    ) -> Outcome:
        """Fail the nodes whose agent is silent past its deadline, and replace the failed ones
        (NodeRecovery: Automatic). Silence while the control plane could not hear does not count:
        each deadline runs from ``back`` at the earliest (the control plane's start, the database's
        last outage). ``restart_pending``: nodes whose agent waits out its restart backoff."""
        outcome = Outcome()
        replaced = False
        for node in list(cluster.nodes):
            reason = None
            if node.status in _HEARD and node.id not in restart_pending:
                # (A node whose agent is being restarted, as in a kubelet's CrashLoopBackOff, stays
                # up through the backoff; the restarted agent then has the launch timeout.)
                reason = self._silence(node, now, back, started_again_and_silent(node), outcome)
            if reason is not None:
                fail_node(session, cluster, node, now, reason, ids=self.ids)
                outcome.changed = True
            if (
                node.status == NodeStatus.FAILURE
                and cluster.node_recovery == "Automatic"
                and not recovery.stopped(cluster, node)
            ):
                if recovery.past_limit(node, self.replace_limit) and recovery.stop(
                    session, cluster, node, now, ids=self.ids, limit=self.replace_limit
                ):
                    outcome.changed = True
                    continue
                self._replace(session, cluster, node, now, outcome)
                replaced = True
                outcome.changed = outcome.again = True
        if replaced:
            bump_generation(cluster)  # the ring changed: every node's replica peers may have
        return outcome

    def _silence(
        self, node: Node, now: datetime, back: datetime, started_again: bool, outcome: Outcome
    ) -> str | None:
        """Why a Pending or Running node fails for its agent's silence, or None (then when it is
        due to be looked at again is noted)."""
        timeout_s = self.pacing.timeout()
        heartbeat_timeout = timedelta(seconds=timeout_s)
        launch_timeout = timedelta(seconds=self.launch_timeout_s)
        restarted = node.agent_restarted_at
        last_heartbeat = node.last_heartbeat
        if last_heartbeat is not None and (
            (restarted is not None and restarted >= last_heartbeat) or started_again
        ):
            # A restarted agent (after a crash, or with the control plane) has as long to register
            # as a new one, counted from the last heartbeat: an agent that keeps crashing does not
            # keep its node alive.
            deadline = max(last_heartbeat, back) + heartbeat_timeout + launch_timeout
            why = "was started again with the control plane" if started_again else "crashed and was restarted"
            if node.status == NodeStatus.ATTACH_IN_PROGRESS:
                why = "was started on the node moved here (MoveClusterNodes)"
            reason = f"its agent {why}, but did not register within {self.launch_timeout_s:g} s"
        elif last_heartbeat is not None:
            deadline = max(last_heartbeat, back) + heartbeat_timeout
            reason = f"no heartbeat from its agent for {timeout_s:g} s"
        else:
            deadline = max(node.launch_time, back) + launch_timeout
            reason = f"its agent did not register within {self.launch_timeout_s:g} s"
        if now >= deadline:
            return reason
        outcome.note_due(deadline)
        return None

    def _replace(
        self, session: Session, cluster: Cluster, node: Node, now: datetime, outcome: Outcome
    ) -> None:
        """Shut a failed node down and launch its replacement in the same slot (which inherits the
        slot's failures in a row)."""
        group = next((g for g in cluster.instance_groups if g.name == node.group_name), None)
        events.move(session, node, NodeStatus.SHUTTING_DOWN, ids=self.ids, now=now)
        # Its credentials die with it: the replacement registers with a secret of its own.
        credentials.revoke(node)
        if group is None or group.status == GroupStatus.DELETING:
            return
        replacement = new_node(
            session,
            cluster,
            group,
            now,
            ids=self.ids,
            ready_delay_s=self.node_ready_delay_s,
            addresses=self.addresses,
            slot=node.slot,
            failed_in_a_row=node.failed_in_a_row,
        )
        outcome.launches.append(replacement.id)
        events.node_event(
            session,
            node,
            f"Node {node.id} is replaced by {replacement.id} (NodeRecovery: Automatic).",
            ids=self.ids,
            now=now,
            level=Level.WARN,
        )
