"""The NetworkPartition rule between a node and the control plane, as the local provisioner writes
it and the node's agent reads it (the ``NetworkPartition`` fault).

The local provisioner cuts a node off by writing ``network-partition.json`` into the node's data
directory, as a chaos tool installs a firewall rule on a real node: ``{"fault_id": ..., "until":
<epoch seconds>}``. While it is in force the agent behaves as behind a REJECT rule both ways:

- its calls to the control plane (registration, heartbeats, policy pulls, namespace lookups,
  events) fail at once with a connection error, before a byte is sent;
- requests from the control plane (policy pushes, the checkpoint catalog's queries; they say so in
  their ``User-Agent``, ``CONTROL_PLANE_AGENT``) have their connection closed without an answer.

Trainers, peer agents and S3 are not the control plane: saves, reads, replication and S3
persistence go on. The rule ends when the file is removed (the fault is cleared, ends, or its
node is replaced) or at ``until``, whichever comes first, so a rule outlives neither its fault nor
a control plane that went away.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from hyperpod_sim.contracts.agent_api import CONTROL_PLANE_AGENT

FILE_NAME = "network-partition.json"


def write_rule(data_dir: Path, *, fault_id: str, until: float) -> None:
    """Put a node behind the partition (atomically: the agent never reads half a rule)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    temporary = data_dir / f".{FILE_NAME}.tmp"
    temporary.write_text(json.dumps({"fault_id": fault_id, "until": until}))
    os.replace(temporary, data_dir / FILE_NAME)


def remove_rule(data_dir: Path) -> bool:
    """Heal the partition; whether there was one."""
    try:
        (data_dir / FILE_NAME).unlink()
    except FileNotFoundError:
        return False
    return True


class Partition:
    """This agent's view of the rule: one ``stat`` per check, the file read only when it changes."""

    def __init__(self, data_dir: Path | None) -> None:
        self._path = data_dir / FILE_NAME if data_dir is not None else None
        self._seen: tuple[int, int] | None = None
        self._until = 0.0
        self.fault_id: str | None = None

    def active(self) -> bool:
        if self._path is None:
            return False
        try:
            stat = self._path.stat()
        except FileNotFoundError:
            self._seen, self._until, self.fault_id = None, 0.0, None
            return False
        key = (stat.st_mtime_ns, stat.st_ino)
        if key != self._seen:
            try:
                rule = json.loads(self._path.read_text())
                self._until, self.fault_id = float(rule["until"]), str(rule["fault_id"])
            except (OSError, ValueError, KeyError, TypeError):
                return False  # being replaced: the next check reads the new rule
            self._seen = key
        return time.time() < self._until

    def blocks(self, user_agent: str) -> bool:
        """Whether a request with this ``User-Agent`` is cut off (it comes from the control plane)."""
        return user_agent.startswith(CONTROL_PLANE_AGENT) and self.active()
