"""The NetworkPartition rule, seen from the agent: declared in ``contracts/partition.py`` (the
provisioner writes it, the agent reads it); kept importable here for the agent's modules."""

from __future__ import annotations

from contracts.agent_api import CONTROL_PLANE_AGENT
from contracts.partition import FILE_NAME, Partition, remove_rule, write_rule

__all__ = ["CONTROL_PLANE_AGENT", "FILE_NAME", "Partition", "remove_rule", "write_rule"]
